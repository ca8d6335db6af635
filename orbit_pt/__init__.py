"""orbit_pt: a checkpoint manager for PyTorch training.

    from orbit_pt import CheckpointManager, CheckpointManagerOptions

Nothing happens at import time; see README.md and docs/ for the guide.
"""

from orbit_pt._version import __version__
from orbit_pt.errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointSaveError,
    CheckpointTypeError,
    CheckpointValueError,
    CorruptCheckpointError,
    ItemNotFoundError,
    PreemptionExit,
    ReadOnlyError,
    StateMismatchError,
    StepAlreadyExistsError,
    StepNotDurableError,
    StepNotFoundError,
)
from orbit_pt.manager import CheckpointManager, RestoreInfo
from orbit_pt.metadata import FileMetadata, ItemMetadata, StepMetadata
from orbit_pt.options import CheckpointManagerOptions, LocalTierOptions
from orbit_pt.policies import (
    AnyOf,
    AnySavePolicy,
    CheckpointInfo,
    EveryNSteps,
    KeepBestN,
    KeepEveryKSteps,
    KeepLastN,
    KeepSteps,
    KeepTimeInterval,
    OnPreemption,
    OnSteps,
    RetentionPolicy,
    SavePolicy,
)
from orbit_pt.pretrained import load_pretrained
from orbit_pt.recipe import RecipeState, RNGState
from orbit_pt.retention import RetentionDecision

__all__ = [
    "AnyOf",
    "AnySavePolicy",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointManagerOptions",
    "CheckpointSaveError",
    "CheckpointTypeError",
    "CheckpointValueError",
    "CorruptCheckpointError",
    "EveryNSteps",
    "FileMetadata",
    "ItemMetadata",
    "ItemNotFoundError",
    "KeepBestN",
    "KeepEveryKSteps",
    "KeepLastN",
    "KeepSteps",
    "KeepTimeInterval",
    "LocalTierOptions",
    "OnPreemption",
    "OnSteps",
    "PreemptionExit",
    "RNGState",
    "ReadOnlyError",
    "RecipeState",
    "RestoreInfo",
    "RetentionDecision",
    "RetentionPolicy",
    "SavePolicy",
    "StateMismatchError",
    "StepAlreadyExistsError",
    "StepMetadata",
    "StepNotDurableError",
    "StepNotFoundError",
    "__version__",
    "load_pretrained",
]
