"""The O_DIRECT range writer: exact bytes at any offset, the right checksum, a lazy stream."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orbit_pt import _checksum
from orbit_pt._direct_io import ALIGN, RangeWriter
from orbit_pt._safetensors import tensor_bytes

MB = 1 << 20


def _views() -> list[memoryview]:
    torch.manual_seed(0)
    # Sizes that straddle the aligned body: tiny, odd, several bounce buffers' worth.
    tensors = [torch.randn(n) for n in (3, 1_250_001, 9 * MB // 4, 7, 5 * MB)]
    return [memoryview(b"header!" * 177), *(tensor_bytes(t) for t in tensors)]


@pytest.mark.parametrize("offset", [0, 1, ALIGN - 1, ALIGN, 3 * ALIGN + 17])
def test_bytes_and_checksum_at_any_offset(tmp_path: Path, offset: int) -> None:
    views = _views()
    expected = b"".join(bytes(v) for v in views)
    path = tmp_path / "f"
    prefix = b"\xab" * offset  # a neighbour's bytes before the range must survive
    path.write_bytes(prefix + b"\0" * len(expected) + b"tail")
    checksum = _checksum.Checksum()
    writer = RangeWriter(path)
    try:
        writer.write(offset, views, checksum)
    finally:
        writer.close()
    data = path.read_bytes()
    assert data[:offset] == prefix
    assert data[offset : offset + len(expected)] == expected
    assert data[offset + len(expected) :] == b"tail"
    assert checksum.value() == _checksum.of_bytes(expected)


def test_lazy_stream_with_size(tmp_path: Path) -> None:
    views = _views()
    size = sum(len(v) for v in views)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * size)
    writer = RangeWriter(path)
    try:
        writer.write(0, iter(views), size=size)
    finally:
        writer.close()
    assert path.read_bytes() == b"".join(bytes(v) for v in views)


def test_a_short_stream_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 100)
    writer = RangeWriter(path)
    try:
        with pytest.raises(ValueError, match="short"):
            writer.write(0, iter([memoryview(b"abc")]), size=10)
    finally:
        writer.close()


def test_direct_io_is_used_where_the_filesystem_allows(tmp_path: Path) -> None:
    import os

    path = tmp_path / "f"
    path.write_bytes(b"")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_DIRECT))
        supported = True
    except (OSError, AttributeError):
        supported = False
    writer = RangeWriter(path)
    writer.close()
    assert writer.uses_direct_io == supported
    fallback = RangeWriter(path, direct=False)
    fallback.close()
    assert not fallback.uses_direct_io
