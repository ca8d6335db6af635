"""The control plane: how ranks agree (collective), the background save thread, preemption
signals.

Private: nothing here is API. Layers import only downward (docs/architecture.md).
"""
