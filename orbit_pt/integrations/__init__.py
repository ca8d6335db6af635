"""orbit_pt inside the training frameworks people already use.

Each submodule is the glue for one framework and imports it only when it is itself imported;
importing ``orbit_pt`` or ``orbit_pt.integrations`` imports no framework.

- :mod:`orbit_pt.integrations.accelerate`: ``save_state`` / ``load_state`` for an
  ``accelerate.Accelerator`` (versions tested: ``accelerate>=1.0``).
- :mod:`orbit_pt.integrations.hf`: ``OrbitTrainer`` / ``OrbitTrainerMixin`` for the Hugging
  Face ``Trainer`` (tested: transformers 5.24 and 5.25).
- :mod:`orbit_pt.integrations.lightning`: ``OrbitCheckpointIO`` and its callback, and
  ``OrbitModelParallelStrategy`` for gather-free FSDP2 (tested: pytorch-lightning 2.6).
"""
