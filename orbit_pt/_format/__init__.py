"""Bytes on disk: safetensors files, which rank writes which bytes, the O_DIRECT writer,
checksums, staging buffers, progress.

Private: nothing here is API. Layers import only downward (docs/architecture.md).
"""
