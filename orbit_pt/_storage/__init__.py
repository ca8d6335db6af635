"""The root folder: step names, durable file operations, and the store that commits, lists
and deletes steps.

Private: nothing here is API. Layers import only downward (docs/architecture.md).
"""
