"""The state handler, through ``CheckpointManager``: plain nested state and stateful objects.

Round trips are properties over arbitrary nested states: tensors come back bitwise equal (same
dtype and shape, NaN payloads and -0.0 included), Python values come back with their types (a
tuple stays a tuple, an int key stays an int). In-place restores load into the very tensor
objects of the target, or refuse -- listing every problem -- and leave the target untouched.
"""

from __future__ import annotations

import itertools
import struct
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointSaveError,
    CheckpointTypeError,
    StateMismatchError,
)

TORCH_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
NUMPY_DTYPES = [
    np.float64,
    np.float32,
    np.float16,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
]
INT64 = st.integers(-(2**63), 2**63 - 1)

_roots = itertools.count()


def fresh_root(tmp_path: Path) -> Path:
    """A new root per hypothesis example (``tmp_path`` is shared by all examples of a test)."""
    return tmp_path / f"root{next(_roots)}"


# ------------------------------------------------------------------------------- comparisons


def tensor_bits(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` in row-major order (bitwise: NaN payloads and -0.0 count)."""
    if t.numel() == 0:
        return b""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # standard strides
    return bytes(dense.reshape(-1).view(torch.uint8).numpy())


def assert_same(restored: Any, expected: Any, path: str = "<root>") -> None:
    """``restored`` equals ``expected`` bitwise, with the same types all the way down."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(restored, torch.Tensor), path
        assert restored.dtype == expected.dtype, path
        assert restored.shape == expected.shape, path
        assert restored.device.type == "cpu", path
        assert tensor_bits(restored) == tensor_bits(expected), path
    elif isinstance(expected, np.ndarray):
        assert isinstance(restored, np.ndarray), path
        assert restored.dtype == expected.dtype, path
        assert restored.shape == expected.shape, path
        assert restored.tobytes() == expected.tobytes(), path
    elif isinstance(expected, np.generic):
        # numpy scalars come back as the Python scalar they hold (documented in docs/format.md).
        assert_same(restored, expected.item(), path)
    elif isinstance(expected, float):
        assert type(restored) is float, path
        assert struct.pack("<d", restored) == struct.pack("<d", expected), path
    elif isinstance(expected, dict):
        assert type(restored) is dict, path
        assert [(type(k), k) for k in restored] == [(type(k), k) for k in expected], path
        for key, value in expected.items():
            assert_same(restored[key], value, f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(restored) is (tuple if isinstance(expected, tuple) else list), path
        assert len(restored) == len(expected), path
        for i, (r, e) in enumerate(zip(restored, expected, strict=True)):
            assert_same(r, e, f"{path}/{i}")
    else:
        assert type(restored) is type(expected), path
        assert restored == expected, path


# -------------------------------------------------------------------------------- strategies


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Tensors of every storable dtype with arbitrary bits: 0-dim, empty, and strided views."""
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "offset"]))
    if layout == "transposed" and len(shape) >= 2:
        base_shape = (shape[1], shape[0], *shape[2:])
    elif layout in ("strided", "offset") and shape:
        base_shape = (2 * shape[0] + 1, *shape[1:])
    else:
        base_shape, layout = shape, "contiguous"
    numel = int(np.prod(base_shape, dtype=np.int64))
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    base = base.to(torch.uint8).view(dtype).reshape(base_shape)
    if layout == "transposed":
        return base.transpose(0, 1)
    if layout == "strided":
        return base[1::2]
    if layout == "offset":
        return base[base_shape[0] - shape[0] :]
    return base


@st.composite
def numpy_arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    numel = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        array = np.array(draw(st.lists(st.booleans(), min_size=numel, max_size=numel)), dtype)
    else:
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
        array = np.frombuffer(raw, dtype=dtype).copy()
    array = array.reshape(shape)
    if array.ndim >= 2 and draw(st.booleans()):
        array = array.T  # not C-contiguous
    return array


numpy_scalars = st.one_of(
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    INT64.map(np.int64),
    st.integers(-128, 127).map(np.int8),
    st.booleans().map(np.bool_),
)
leaves = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0]),
    st.booleans(),
    st.text(),
    st.binary(),
    st.none(),
    tensors(),
    numpy_arrays(),
    numpy_scalars,
)
keys = st.one_of(st.text(), INT64)


def nested(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
        ),
        max_leaves=16,
    )


states = st.dictionaries(keys, nested(leaves), max_size=6)
tensor_states = st.dictionaries(
    keys, nested(st.one_of(tensors(), INT64, st.text(), st.none())), max_size=6
)


def save_and_restore(root: Path, item: Any, target: Any = None) -> Any:
    with CheckpointManager(root) as mgr:
        assert mgr.save(3, {"state": item}) is True
        restored = mgr.restore(3, None if target is None else {"state": target})
    assert list(restored) == ["state"]
    return restored["state"]


# -------------------------------------------------------------------------------- round trips


@given(state=states)
def test_plain_round_trip_is_exact(tmp_path: Path, state: dict) -> None:
    assert_same(save_and_restore(fresh_root(tmp_path), state), state)


@given(state=nested(leaves).filter(lambda s: isinstance(s, (list, tuple))))
def test_top_level_list_or_tuple_round_trips(tmp_path: Path, state: list | tuple) -> None:
    assert_same(save_and_restore(fresh_root(tmp_path), state), state)


def mirror(state: Any) -> Any:
    """A target shaped like ``state``: fresh zeroed tensors, other values replaced by None."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: mirror(v) for k, v in state.items()}
    if isinstance(state, list):
        return [mirror(v) for v in state]
    if isinstance(state, tuple):
        return tuple(mirror(v) for v in state)
    return None


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensor_leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensor_leaves(v)]
    return []


@given(state=tensor_states)
def test_in_place_round_trip_loads_into_the_target_tensors(tmp_path: Path, state: dict) -> None:
    target = mirror(state)
    live = tensor_leaves(target)
    restored = save_and_restore(fresh_root(tmp_path), state, target)
    assert restored is target
    assert_same(target, state)
    # The very same tensor objects were filled, none replaced (a model's parameters stay bound).
    assert [id(t) for t in tensor_leaves(target)] == [id(t) for t in live]


def test_in_place_into_non_contiguous_views_writes_through(tmp_path: Path) -> None:
    saved = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(4)}
    base_a, base_b = torch.zeros(3, 2), torch.zeros(8, dtype=torch.int64)
    target = {"a": base_a.t(), "b": base_b[::2]}
    save_and_restore(tmp_path / "root", saved, target)
    assert torch.equal(base_a.t(), saved["a"])
    assert base_b.tolist() == [0, 0, 1, 0, 2, 0, 3, 0]


def test_in_place_adds_saved_keys_the_target_lacks(tmp_path: Path) -> None:
    saved = {"a": torch.ones(2), "extra": {"n": 5, "t": torch.zeros(1)}}
    target: dict[str, Any] = {"a": torch.zeros(2)}
    save_and_restore(tmp_path / "root", saved, target)
    assert_same(target, saved)


def test_in_place_replaces_plain_values_with_the_saved_ones(tmp_path: Path) -> None:
    saved = {"t": torch.ones(2), "n": 7, "history": [1.0, 2.0, 3.0], "name": "run"}
    target: dict[str, Any] = {"t": torch.zeros(2), "n": 0, "history": [], "name": None}
    save_and_restore(tmp_path / "root", saved, target)
    assert_same(target, saved)


def test_tensors_inside_tuples_are_loaded_in_place(tmp_path: Path) -> None:
    saved = {"pair": (torch.ones(3), 4)}
    inner = torch.zeros(3)
    target: dict[str, Any] = {"pair": (inner, 0)}
    save_and_restore(tmp_path / "root", saved, target)
    assert_same(target, saved)
    assert target["pair"][0] is inner


def test_keys_of_every_allowed_type_keep_their_type(tmp_path: Path) -> None:
    state = {7: "int", -(2**63): "min", 2.5: "float", True: "bool", None: "none", "7": "str"}
    assert_same(save_and_restore(tmp_path / "root", state), state)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(np.array(3.5), id="0-dim-float"),
        pytest.param(np.array(True), id="0-dim-bool"),
        pytest.param(np.zeros((0, 3), dtype=np.int16), id="empty"),
        pytest.param(np.arange(12, dtype=np.uint32).reshape(3, 4)[:, ::2], id="strided"),
    ],
)
def test_numpy_arrays_keep_shape_and_dtype(tmp_path: Path, value: np.ndarray) -> None:
    assert_same(save_and_restore(tmp_path / "root", {"x": value}), {"x": value})


def test_tensor_named_like_the_safetensors_metadata_key_round_trips(tmp_path: Path) -> None:
    # "__metadata__" is the reserved key of a safetensors header; a state key of that name must
    # not clash with it.
    state = {"__metadata__": torch.ones(2), "a": {"__metadata__": torch.zeros(1)}}
    assert_same(save_and_restore(tmp_path / "root", state), state)


def test_keys_that_join_to_the_same_tensor_path_stay_apart(tmp_path: Path) -> None:
    state = {
        "a/b": torch.tensor([1]),
        "a": {"b": torch.tensor([2]), "b#1": torch.tensor([3])},
        "a/b#1": torch.tensor([4]),
        1: torch.tensor([5]),
        "1": torch.tensor([6]),
        "": torch.tensor([7]),
        "<root>": torch.tensor([8]),
    }
    assert_same(save_and_restore(tmp_path / "root", state), state)


def test_same_tensor_twice_is_restored_twice(tmp_path: Path) -> None:
    t = torch.arange(3)
    restored = save_and_restore(tmp_path / "root", {"a": t, "b": [t]})
    assert_same(restored, {"a": t, "b": [t]})


def test_tensor_with_grad_is_saved_detached(tmp_path: Path) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    restored = save_and_restore(tmp_path / "root", {"p": p})
    assert type(restored["p"]) is torch.Tensor
    assert not restored["p"].requires_grad
    assert torch.equal(restored["p"], p.detach())


def test_torch_dtype_values_round_trip(tmp_path: Path) -> None:
    state = {"dtypes": [torch.float32, torch.bfloat16, torch.int8, torch.bool]}
    assert save_and_restore(tmp_path / "root", state) == state


@given(state=states)
def test_written_safetensors_file_is_standard(tmp_path: Path, state: dict) -> None:
    root = fresh_root(tmp_path)
    save_and_restore(root, state)
    path = root / "step_00000003" / "state" / "tensors.safetensors"
    loaded = safetensors.torch.load_file(path)
    expected = tensor_leaves(state)
    expected += [
        torch.from_numpy(np.ascontiguousarray(a).reshape(a.shape)) for a in numpy_leaves(state)
    ]
    assert len(loaded) == len(expected)
    got = sorted((str(t.dtype), tuple(t.shape), tensor_bits(t)) for t in loaded.values())
    want = sorted((str(t.dtype), tuple(t.shape), tensor_bits(t)) for t in expected)
    assert got == want


def numpy_leaves(value: Any) -> list[np.ndarray]:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for v in value.values() for a in numpy_leaves(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in numpy_leaves(v)]
    return []


# --------------------------------------------------------------------------- stateful objects


class Counter:
    """A user object with state_dict()/load_state_dict(), as a training loop would have."""

    def __init__(self) -> None:
        self.count = 0
        self.weights = torch.zeros(4)
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "weights": self.weights, "tags": ("a", 1)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state
        self.count = state["count"]
        self.weights.copy_(state["weights"])


def test_object_with_state_dict_round_trips_plain_and_in_place(tmp_path: Path) -> None:
    saved = Counter()
    saved.count, saved.weights = 41, torch.arange(4, dtype=torch.float32)
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"counter": saved})
        assert mgr.metadata(1).items["counter"].handler == "state"
        plain = mgr.restore(1)["counter"]
        assert_same(plain, saved.state_dict())
        fresh = Counter()
        out = mgr.restore(1, {"counter": fresh})
    assert out["counter"] is fresh
    assert fresh.count == 41
    assert torch.equal(fresh.weights, saved.weights)
    assert fresh.loaded is not None
    assert type(fresh.loaded["tags"]) is tuple


def test_lr_scheduler_round_trips(tmp_path: Path) -> None:
    def scheduler() -> torch.optim.lr_scheduler.StepLR:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    sched = scheduler()
    for _ in range(5):
        sched.optimizer.step()
        sched.step()
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(5, {"scheduler": sched})
        resumed = scheduler()
        mgr.restore(5, {"scheduler": resumed})
    assert resumed.state_dict() == sched.state_dict()
    assert resumed.get_last_lr() == sched.get_last_lr()


def test_object_shape_mismatch_is_caught_before_load_state_dict(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"counter": Counter()})
        small = Counter()
        small.weights = torch.zeros(2)
        with pytest.raises(StateMismatchError, match=r"weights"):
            mgr.restore(1, {"counter": small})
    assert small.loaded is None


def test_load_state_dict_rejection_becomes_state_mismatch(tmp_path: Path) -> None:
    class Picky(Counter):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise KeyError("unexpected key 'tags'")

    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"counter": Counter()})
        with pytest.raises(StateMismatchError, match=r"Picky.*unexpected key") as info:
            mgr.restore(1, {"counter": Picky()})
    assert isinstance(info.value.__cause__, KeyError)


# ----------------------------------------------------------------------- unsupported values


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "where"),
    [
        pytest.param({"a": {"b": lambda: 0}}, "a/b", id="lambda"),
        pytest.param({"a": [1, Opaque()]}, "a/1", id="custom-object"),
        pytest.param({"a": {"b": {1, 2}}}, "a/b", id="set"),
        pytest.param({"a": frozenset()}, "a", id="frozenset"),
        pytest.param({"a": (1, 2j)}, "a/1", id="complex"),
        pytest.param({"x": [types.SimpleNamespace()]}, "x/0", id="namespace"),
        pytest.param({"a": {"big": 2**64}}, "a/big", id="int-over-64-bits"),
        pytest.param({"a": {"neg": -(2**63) - 1}}, "a/neg", id="int-under-64-bits"),
        pytest.param({"a": {2**64: 1}}, "a", id="int-key-over-64-bits"),
        pytest.param({"a": {(1, 2): 1}}, "a", id="tuple-key"),
        pytest.param({"a": [torch.ones(2, dtype=torch.complex64)]}, "a/0", id="complex-tensor"),
        pytest.param({"a": np.ones(2, dtype=np.complex64)}, "a", id="complex-ndarray"),
        pytest.param({"a": np.array(["x"], dtype=object)}, "a", id="object-ndarray"),
        pytest.param({"a": np.ones(2, dtype=">i4")}, "a", id="big-endian-ndarray"),
        pytest.param({"a": np.datetime64("2024-01-01")}, "a", id="numpy-datetime"),
        pytest.param({"a": torch.ones(2).to_sparse()}, "a", id="sparse-tensor"),
    ],
)
def test_unsupported_values_are_refused_at_save_with_their_path(
    tmp_path: Path, state: dict, where: str
) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"ok": {"x": 1}})
        with pytest.raises(CheckpointSaveError) as info:
            mgr.save(2, {"item": state})
        assert mgr.all_steps() == [1]
    cause = info.value.__cause__
    assert isinstance(cause, CheckpointTypeError), repr(cause)
    assert f"at {where} " in str(cause) or f"{where!r}" in str(cause), str(cause)
    assert str(cause) in str(info.value)
    assert sorted(p.name for p in root.iterdir()) == [".orbit.lock", "step_00000001"]


@pytest.mark.parametrize(
    "item",
    [
        pytest.param(lambda: 0, id="lambda"),
        pytest.param(Opaque(), id="custom-object"),
        pytest.param({1, 2}, id="set"),
        pytest.param(3, id="int"),
    ],
)
def test_items_without_a_handler_are_refused_naming_the_item(tmp_path: Path, item: Any) -> None:
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointTypeError, match=r"item 'thing' is a .*handlers="):
            mgr.save(1, {"ok": {"x": 1}, "thing": item})
        assert mgr.all_steps() == []
    assert sorted(p.name for p in root.iterdir()) == [".orbit.lock"]


def test_state_dict_that_raises_fails_the_save_and_keeps_earlier_steps(tmp_path: Path) -> None:
    class Broken(Counter):
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("cuda device lost")

    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"counter": Counter()})
        with pytest.raises(CheckpointSaveError, match="cuda device lost") as info:
            mgr.save(2, {"counter": Broken()})
        assert isinstance(info.value.__cause__, RuntimeError)
        assert mgr.all_steps() == [1]
        assert_same(mgr.restore(1)["counter"], Counter().state_dict())


# ------------------------------------------------------------------------- in-place mismatches


def snapshot(target: Any) -> Any:
    """A deep copy of ``target`` (tensors cloned), to prove it was left untouched."""
    if isinstance(target, torch.Tensor):
        return target.clone()
    if isinstance(target, dict):
        return {k: snapshot(v) for k, v in target.items()}
    if isinstance(target, (list, tuple)):
        return type(target)(snapshot(v) for v in target)
    return target


MismatchCase = Callable[[], tuple[dict[str, Any], dict[str, Any], list[str]]]


def test_every_mismatch_is_listed_and_the_target_is_untouched(tmp_path: Path) -> None:
    saved = {
        "w": torch.ones(2, 3),
        "b": torch.ones(3, dtype=torch.float16),
        "nested": {"ok": torch.ones(1), "deep": [torch.ones(4)]},
        "n": 5,
    }
    target: dict[str, Any] = {
        "w": torch.zeros(3, 2),  # shape
        "b": torch.zeros(3, dtype=torch.bfloat16),  # dtype
        "nested": {"ok": torch.zeros(1), "deep": [torch.zeros(5)], "new": torch.zeros(1)},
        "n": 0,
        "extra": torch.zeros(2),  # not in the checkpoint
    }
    before = snapshot(target)
    ids = {k: id(v) for k, v in target.items()}
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"state": saved})
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(1, {"state": target})
    message = str(info.value)
    assert "5 problem(s)" in message
    for line in (
        "w: saved torch.float32 [2, 3], target torch.float32 [3, 2]",
        "b: saved torch.float16 [3], target torch.bfloat16 [3]",
        "nested/deep/0: saved torch.float32 [4], target torch.float32 [5]",
        "nested/new: in the target but not in the checkpoint",
        "extra: in the target but not in the checkpoint",
    ):
        assert line in message
    assert "Restore without a target" in message
    assert isinstance(info.value, (CheckpointError, ValueError))
    assert_same(target, before)
    assert {k: id(v) for k, v in target.items()} == ids


@pytest.mark.parametrize(
    ("saved", "target", "where"),
    [
        pytest.param({"t": 3}, {"t": torch.zeros(1)}, "t", id="int-saved-tensor-target"),
        pytest.param({"t": {"x": 1}}, {"t": torch.zeros(1)}, "t", id="dict-saved-tensor-target"),
        pytest.param(
            {"t": torch.ones(1)}, {"t": {"x": torch.zeros(1)}}, "t", id="tensor-saved-dict-target"
        ),
        pytest.param(
            {"t": [torch.ones(1)]},
            {"t": [torch.zeros(1), torch.zeros(1)]},
            "t",
            id="list-length",
        ),
        pytest.param(
            {"t": (torch.ones(2), 1)}, {"t": (torch.zeros(3), 1)}, "t/0", id="tensor-in-tuple"
        ),
        pytest.param(
            {"t": np.ones(2, dtype=np.float32)}, {"t": torch.zeros(2)}, "t", id="ndarray-saved"
        ),
    ],
)
def test_a_target_tensor_is_never_silently_replaced(
    tmp_path: Path, saved: dict, target: dict, where: str
) -> None:
    before = snapshot(target)
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"state": saved})
        with pytest.raises(StateMismatchError, match=rf"\n  {where}: "):
            mgr.restore(1, {"state": target})
    assert_same(target, before)
