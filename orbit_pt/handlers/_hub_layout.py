"""The Hub layout of a transformers model: the names and tensors ``save_pretrained`` writes.

transformers 5 keeps some weights in memory in another shape than on the Hub. A Mixtral layer
holds its experts fused, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj``
``[E, H, I]``, where the Hub files (and vLLM, llama.cpp's converters, every tool that reads
them) have ``block_sparse_moe.experts.{e}.w1/w2/w3.weight``. ``save_pretrained`` converts back
with the model's *weight conversions* (``transformers.conversion_mapping``);
``from_pretrained`` converts forward. orbit_pt uses those same conversions -- no table per
architecture -- so a step's ``model/`` folder holds exactly the keys and tensors
``save_pretrained`` would write.

Under FSDP2 a rank holds a block of rows (dim 0) of each tensor and no rank gathers. So the
layout is worked out once, on meta tensors, for each in-memory tensor:

- **renamed**: it converts to one Hub tensor of the same shape (most weights, under the same
  name or another): a rank writes and reads its own rows of it, as for any tensor;
- **by rows**: each row converts on its own to whole Hub tensors whose names carry the row
  number (MoE experts: row ``e`` of ``gate_up_proj`` is experts ``e``'s ``w1`` and ``w3``). The
  rank holding row ``e`` converts its rows with transformers' own conversion and writes those
  Hub tensors whole; a restore reads the Hub tensors of its rows and converts them forward;
- **joint**: any other conversion (one that mixes rows, or several in-memory tensors). Such a
  tensor is converted whole: a DTensor is gathered with ``full_tensor()`` (logged), so these are
  the only tensors a sharded save gathers. No model transformers ships today needs this for its
  weights under FSDP2's dim-0 sharding, but custom conversions may.

Checkpoints written before this layout existed (in-memory names) still restore: a name found in
the folder as it is in memory is read as it is.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from orbit_pt._format import layouts as _layouts
from orbit_pt._format.sharding import Piece, is_dtensor, piece_of, row_block
from orbit_pt.errors import CorruptCheckpointError
from orbit_pt.handlers._wrappers import unwrap

logger = logging.getLogger(__name__)

_MAX_CACHED = 8


@dataclass(frozen=True)
class RowTemplate:
    """One Hub tensor made from each row of an in-memory tensor.

    Attributes:
        parts: the Hub name made from row 0, split at its dots.
        position: which part is the row number.
        shape: the shape of the Hub tensor made from one row.
    """

    parts: tuple[str, ...]
    position: int
    shape: tuple[int, ...]

    def name(self, row: int) -> str:
        parts = list(self.parts)
        parts[self.position] = str(row)
        return ".".join(parts)


@dataclass(frozen=True)
class HubLayout:
    """How each in-memory tensor of one model maps to its Hub tensors (see the module doc).

    Attributes:
        renamed: in-memory name -> the Hub name of the same tensor (often the same name).
        rows: in-memory name -> the Hub tensors each of its rows makes, and its row count.
        joint: in-memory names converted only whole, all together.
        shapes: every Hub name -> its shape.
        sources: every Hub name -> the in-memory name it comes from (for joint ones, one of
            them), whose dtype it has.
    """

    model: Any
    renamed: Mapping[str, str]
    rows: Mapping[str, tuple[tuple[RowTemplate, ...], int]]
    joint: frozenset[str]
    shapes: Mapping[str, tuple[int, ...]]
    sources: Mapping[str, str]

    def hub_names(self, key: str) -> list[str]:
        """The Hub names made from in-memory tensor ``key`` (a joint one: the whole group's)."""
        if key in self.renamed:
            return [self.renamed[key]]
        if key in self.rows:
            templates, count = self.rows[key]
            return [t.name(row) for row in range(count) for t in templates]
        return sorted(n for n, source in self.sources.items() if source in self.joint)

    # ----------------------------------------------------------------------- conversions

    def to_hub(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole in-memory tensors -> their Hub tensors (what ``save_pretrained`` does)."""
        return _revert(self.model, tensors)

    def rows_to_hub(self, key: str, local: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
        """Rows ``first..`` of ``key`` (``local``) -> the whole Hub tensors they make."""
        templates, _ = self.rows[key]
        converted = _revert(self.model, {key: local})
        out: dict[str, torch.Tensor] = {}
        for offset in range(local.shape[0]):
            for template in templates:
                out[template.name(first + offset)] = converted.pop(template.name(offset))
        if converted:  # the analysis on meta tensors said this cannot happen
            raise AssertionError(f"unplaced Hub tensors converting {key}: {sorted(converted)}")
        return out

    def rows_from_hub(
        self, key: str, read: Callable[[str], torch.Tensor], first: int, count: int
    ) -> torch.Tensor:
        """Rows ``first..first+count`` of ``key``, made from the Hub tensors ``read`` returns."""
        templates, _ = self.rows[key]
        local = {
            template.name(offset): read(template.name(first + offset))
            for offset in range(count)
            for template in templates
        }
        return self._from_hub(local, [key])[key]

    def joint_from_hub(self, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every joint in-memory tensor, whole, made from all of their Hub tensors."""
        names = self.hub_names(next(iter(self.joint)))
        return self._from_hub({name: read(name) for name in names}, sorted(self.joint))

    def _from_hub(
        self, hub: Mapping[str, torch.Tensor], expected: list[str]
    ) -> dict[str, torch.Tensor]:
        converted = _revert(_Forward(self.model), hub)
        if sorted(converted) != sorted(expected):
            raise CorruptCheckpointError(
                f"converting the Hub tensors {sorted(hub)[:4]}... forward with transformers' "
                f"weight conversions made {sorted(converted)[:4]}, not {expected[:4]}; the "
                "folder does not fit this model's layout"
            )
        return converted


def hub_layout(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> HubLayout | None:
    """``module``'s Hub layout for the tensors ``state`` (names as saved), or None.

    None when the module is not a transformers model, when transformers has no weight
    conversions (before 5.0), or when they change nothing for this model (most dense models):
    then the in-memory names are the Hub names.
    """
    model = unwrap(module)
    transformers = sys.modules.get("transformers")  # never imported here: only if in use
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401
    except ImportError:  # transformers 4: no conversions, the names are the Hub's
        return None
    signature = _signature(model, state)
    with _cache_lock:
        found = signature in _cache
        cached = _cache.get(signature)
    if not found:
        cached = _analyse(model, state)
        with _cache_lock:
            if len(_cache) >= _MAX_CACHED:
                _cache.pop(next(iter(_cache)))
            # Cached without the model, so that the cache never keeps a model alive.
            _cache[signature] = None if cached is None else replace(cached, model=None)
    return None if cached is None else replace(cached, model=model)


_cache: dict[tuple[Any, ...], HubLayout | None] = {}
_cache_lock = threading.Lock()


def _signature(model: Any, state: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    try:
        config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    except (TypeError, ValueError, AttributeError):
        config = str(id(model))
    shapes = tuple((n, tuple(t.shape), t.dtype) for n, t in state.items())
    conversions = getattr(model, "_weight_conversions", None)
    return (type(model), config, shapes, None if conversions is None else id(conversions))


def _analyse(model: Any, state: Mapping[str, torch.Tensor]) -> HubLayout | None:
    meta = {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for n, t in state.items()}
    try:
        full = _revert(model, meta)
    except Exception as exc:  # a conversion that cannot run on shapes alone
        logger.warning(
            "cannot work out the Hub layout of this %s from its weight conversions (%s: %s); "
            "saving the weights under their in-memory names, which transformers reloads but "
            "other tools reading Hub files may not",
            type(model).__name__,
            type(exc).__name__,
            exc,
        )
        return None
    if {n: tuple(t.shape) for n, t in full.items()} == {n: tuple(t.shape) for n, t in meta.items()}:
        return None
    shapes = {n: tuple(t.shape) for n, t in full.items()}
    renamed: dict[str, str] = {}
    rows: dict[str, tuple[tuple[RowTemplate, ...], int]] = {}
    sources: dict[str, str] = {}
    joint: set[str] = set()
    for key, tensor in meta.items():
        alone = {n: tuple(t.shape) for n, t in _revert(model, {key: tensor}).items()}
        if any(shapes.get(n) != s or n in sources for n, s in alone.items()):
            joint.add(key)  # its conversion needs other tensors too
            continue
        if len(alone) == 1 and next(iter(alone.values())) == tuple(tensor.shape):
            renamed[key] = next(iter(alone))
        else:
            templates = _row_templates(model, key, tensor, alone)
            if templates is None:
                joint.add(key)
                continue
            rows[key] = (templates, tensor.shape[0])
        sources.update(dict.fromkeys(alone, key))
    unclaimed = set(shapes) - set(sources)  # what the joint tensors make together
    if unclaimed and not joint:  # no tensor makes them: the conversions are not understood
        return None
    sources.update(dict.fromkeys(unclaimed, min(joint, default="")))
    if joint:
        logger.info(
            "the Hub layout of %s converts %d tensor(s) only whole (e.g. %s): a sharded save "
            "gathers them",
            type(model).__name__,
            len(joint),
            sorted(joint)[:3],
        )
    return HubLayout(model, renamed, rows, frozenset(joint), shapes, sources)


def _row_templates(
    model: Any, key: str, tensor: torch.Tensor, alone: Mapping[str, tuple[int, ...]]
) -> tuple[RowTemplate, ...] | None:
    """How each row of ``key`` names its Hub tensors, if every row converts on its own."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return None
    count = tensor.shape[0]
    templates: list[RowTemplate] = []
    for name, one in _revert(model, {key: tensor[:1]}).items():
        parts = tuple(name.split("."))
        shape = tuple(one.shape)
        fits = [
            position
            for position, part in enumerate(parts)
            if part == "0"
            and all(
                alone.get(RowTemplate(parts, position, shape).name(r)) == shape
                for r in range(count)
            )
        ]
        if len(fits) != 1:
            return None
        templates.append(RowTemplate(parts, fits[0], shape))
    made = {t.name(r) for t in templates for r in range(count)}
    if made != set(alone) or len(made) != len(templates) * count:
        return None
    if count > 1:  # a block of rows names its tensors by offset within the block
        two = _revert(model, {key: tensor[:2]})
        if set(two) != {t.name(r) for t in templates for r in range(2)}:
            return None
    return tuple(templates)


def hub_pieces(
    layout: HubLayout, state: Mapping[str, torch.Tensor], *, rank: int
) -> dict[str, Piece]:
    """This rank's :class:`Piece` of every Hub tensor of ``state`` (saved names -> tensors).

    Every rank returns the same names and shapes. Collective when a DTensor must be gathered (a
    joint conversion, or a layout that is not row blocks): call it on every rank, for the same
    tensors in the same order.
    """
    pieces: dict[str, Piece] = {}
    whole: dict[str, torch.Tensor] = {}  # converted whole, by rank 0
    for key, tensor in state.items():
        if key in layout.renamed:
            name = layout.renamed[key]
            pieces[name] = piece_of(name, tensor, rank=rank)
            continue
        if key in layout.rows and is_dtensor(tensor):
            pieces.update(_row_pieces(layout, key, tensor))
            continue
        if is_dtensor(tensor):
            logger.info(
                "tensor %r converts to the Hub layout only whole; gathering it with "
                "full_tensor() to convert and write it from rank 0",
                key,
            )
            tensor = tensor.full_tensor()  # type: ignore[attr-defined]
        whole[key] = tensor.detach()
    if whole:
        made = layout.to_hub(whole) if rank == 0 else {}
        for key in whole:
            for name in layout.hub_names(key):
                dtype = state[layout.sources[name]].dtype
                pieces[name] = Piece(layout.shapes[name], dtype, made.get(name))
    return pieces


def _row_pieces(layout: HubLayout, key: str, tensor: Any) -> dict[str, Piece]:
    """The Hub tensors that the rows of the DTensor ``tensor`` convert to, by row.

    Whole rows (experts sharded on dim 0, expert parallelism's usual layout) convert at once;
    any other layout (experts also sharded by tensor parallelism) is first moved to an even
    share of whole rows in its replica group, when the pieces are settled.
    """
    names = layout.hub_names(key)
    shard = _layouts.layout_of(tensor)
    if shard is None:
        return {name: Piece(layout.shapes[name], tensor.dtype, None) for name in names}
    holder = shard.mesh_ranks
    local = tensor.to_local().detach()
    if not shard.writes:
        return {name: Piece(layout.shapes[name], tensor.dtype, None, 0, holder) for name in names}
    block = row_block(tensor)
    if block is not None:
        first, count, _ = block
        made = layout.rows_to_hub(key, local, first) if count else {}
        return {
            name: Piece(layout.shapes[name], tensor.dtype, made.get(name), 0, holder)
            for name in names
        }
    converted: dict[str, torch.Tensor] = {}

    def convert() -> None:
        if not converted:
            box, rows = _layouts.to_rows(shard, local)
            made = layout.rows_to_hub(key, rows, box.offset[0]) if rows.numel() else {}
            empty = torch.empty(0, dtype=tensor.dtype)
            converted.update({name: made.get(name, empty) for name in names})

    def pending(name: str) -> Callable[[], tuple[int, torch.Tensor]]:
        def run() -> tuple[int, torch.Tensor]:
            convert()  # the first name of the key moves the rows; the others reuse them
            return 0, converted.pop(name)

        return run

    return {
        name: Piece(layout.shapes[name], tensor.dtype, None, 0, holder, pending(name))
        for name in names
    }


# ------------------------------------------------------------------ transformers' conversions


def _revert(model: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` converted the way ``save_pretrained`` converts a state dict."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(tensors)))


class _Forward:
    """Stands for the model in ``revert_weight_conversion`` so that it converts *forward*.

    ``revert_weight_conversion(m, sd)`` applies ``[t.reverse_transform() for t in
    m._weight_conversions[::-1]]``. Handing it the reversed transforms in reversed order makes it
    apply the load-time transforms themselves, in their order: ``from_pretrained``'s conversion
    on a state dict, without loading it into a model.
    """

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self._weight_conversions = [t.reverse_transform() for t in _conversions(model)][::-1]

    def __getattr__(self, name: str) -> Any:  # pragma: no cover - conversions read only config
        raise AttributeError(name)


def _conversions(model: Any) -> list[Any]:
    """The transforms ``from_pretrained`` applies to load into ``model`` (as revert picks them)."""
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is not None:
        return list(conversions)
    from transformers.conversion_mapping import get_model_conversion_mapping

    return [
        t
        for t in get_model_conversion_mapping(model, add_legacy=False)
        if not isinstance(t, PrefixChange)
    ]
