"""The state of a training loop beyond model and optimizer: counters, RNG and stateful helpers.

Both classes are ordinary stateful objects (``state_dict()``/``load_state_dict()``), so they are
saved by the state handler like any other item -- no handler of their own::

    recipe = RecipeState(step=0, epoch=0, rng=RNGState(), dataloader=loader, scheduler=sched)
    mgr.save(step, {"model": model, "optimizer": opt, "recipe": recipe})
    ...
    mgr.restore(None, {"model": model, "optimizer": opt, "recipe": recipe})
    start = recipe.step + 1

RNG and dataloader positions differ per rank; under torch.distributed the state handler saves
the item per rank. ``state_dict()`` records the class of each stateful field under ``"_kinds"``,
so that a restore into a ``RecipeState`` that lacks a field restores an RNG state anyway and
refuses, by name, a data loader or scheduler it has nowhere to put.

Each field can be left out of a restore (``exclude=("recipe.dataloader",)``): it keeps its live
value. On another number of ranks than it was saved on, the per-rank fields (RNG, data loader)
must be left out; the others restore everywhere (docs/elastic.md).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Mapping
from typing import Any

import torch

from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, StateMismatchError
from orbit_pt.handlers._codec import has_state_dict
from orbit_pt.handlers._mismatch import class_name, same_class

logger = logging.getLogger(__name__)

# The key of RecipeState.state_dict() that records the class of each stateful field (field
# names cannot start with "_", so it never collides with one).
KINDS_KEY = "_kinds"
# The generators RNGState.state_dict() captures: what a step saved before KINDS_KEY existed
# holds for an RNGState field.
_RNG_KEYS = frozenset({"python", "torch", "numpy", "cuda"})


class RNGState:
    """The global random number generators of this process, as a stateful object.

    ``state_dict()`` captures python's ``random``, numpy's global generator (when numpy is
    installed), torch's CPU generator and, when CUDA is available, the generator of every CUDA
    device. ``load_state_dict()`` puts them back, so the random numbers drawn after a restore are
    the ones the interrupted run would have drawn.

    The object holds nothing itself: the state is read from and written to the global
    generators at the moment of each call.
    """

    def state_dict(self) -> dict[str, Any]:
        """The current state of every global generator."""
        state: dict[str, Any] = {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
        }
        numpy = _numpy()
        if numpy is not None:
            state["numpy"] = numpy.random.get_state(legacy=False)
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the generators from ``state`` (as returned by :meth:`state_dict`).

        A generator captured on a machine that had it but missing here (numpy, CUDA) is skipped
        with a warning; a generator missing from ``state`` is left as it is, with a warning.
        """
        if not isinstance(state, Mapping):
            raise CheckpointTypeError(
                f"RNGState.load_state_dict needs a mapping, got {type(state).__name__}"
            )
        try:
            random.setstate(_as_python_state(state["python"]))
            torch.set_rng_state(state["torch"])
        except KeyError as exc:
            raise StateMismatchError(
                f"the saved RNG state lacks the {exc.args[0]!r} generator; it was not written "
                "by RNGState.state_dict()"
            ) from None
        self._load_numpy(state.get("numpy"))
        self._load_cuda(state.get("cuda"))

    @staticmethod
    def _load_numpy(saved: Any) -> None:
        numpy = _numpy()
        if saved is None:
            if numpy is not None:
                logger.warning("the saved RNG state has no numpy state; numpy's RNG is unchanged")
            return
        if numpy is None:
            logger.warning("the saved RNG state includes numpy, which is not installed; skipped")
            return
        numpy.random.set_state(saved)

    @staticmethod
    def _load_cuda(saved: Any) -> None:
        available = torch.cuda.is_available()
        if saved is None:
            if available:
                logger.warning("the saved RNG state has no CUDA state; CUDA RNGs are unchanged")
            return
        if not available:
            logger.warning(
                "the saved RNG state includes %d CUDA generator(s) but CUDA is not available; "
                "they were not restored",
                len(saved),
            )
            return
        count = torch.cuda.device_count()
        if len(saved) != count:
            logger.warning(
                "the saved RNG state has %d CUDA generator(s), this process sees %d devices; "
                "restoring the first %d",
                len(saved),
                count,
                min(len(saved), count),
            )
        for device, tensor in enumerate(list(saved)[:count]):
            torch.cuda.set_rng_state(tensor, device)


class RecipeState:
    """Step, epoch and any other fields of a training loop, saved and restored as one item.

    Fields are attributes. A field whose value has ``state_dict()``/``load_state_dict()`` (an
    :class:`RNGState`, a ``StatefulDataLoader``, an LR scheduler) is saved through them and
    restored in place; any other value (numbers, strings, lists, dicts, tensors) is saved as it
    is and replaced on restore.

    Args:
        step: the last completed training step.
        epoch: the current epoch.
        **fields: any other fields.

    Example::

        recipe = RecipeState(step=0, epoch=0, rng=RNGState(), dataloader=loader)
        recipe.step = step  # before each save
    """

    def __init__(self, *, step: int = 0, epoch: int = 0, **fields: Any) -> None:
        self.step = step
        self.epoch = epoch
        for name, value in fields.items():
            if name.startswith("_"):
                raise CheckpointValueError(
                    f"RecipeState field names cannot start with '_', got {name!r}"
                )
            setattr(self, name, value)

    def fields(self) -> dict[str, Any]:
        """Every field by name, ``step`` and ``epoch`` first."""
        return {name: value for name, value in vars(self).items() if not name.startswith("_")}

    def state_dict(self) -> dict[str, Any]:
        """Plain fields as they are, stateful fields as their ``state_dict()``.

        Under ``"_kinds"`` it records the class of each stateful field, so that a restore can
        tell an RNG state from a data loader's when the live field is missing.
        """
        fields = self.fields()
        state = {
            name: _state_of(name, value) if has_state_dict(value) else value
            for name, value in fields.items()
        }
        state[KINDS_KEY] = {
            name: class_name(type(value)) for name, value in fields.items() if has_state_dict(value)
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore every saved field: stateful ones in place, plain ones by assignment.

        A field saved from an :class:`RNGState` is restored into the generators even when this
        object has no such field (or holds a plain value there): a new ``RNGState`` is put in
        the field. Any other stateful field (a data loader, a scheduler) must be here, holding
        the live object of the class it was saved from, to be restored in place.

        :class:`RNGState` fields are restored last, after every other field has been loaded
        and asked for its ``state_dict()`` once (so that lazy set-up, such as the resumed
        iterator of a ``StatefulDataLoader``, draws its random numbers before the generators
        are put back).

        Raises:
            StateMismatchError: a stateful field of this object was not saved, a stateful field
                was saved from another class than the live one, or is not here to restore into;
                or an object rejected its saved state. Checked before anything is loaded.
                Plain fields saved but absent here are added.
        """
        self.load_state_dict_excluding(state, ())

    def load_state_dict_excluding(
        self, state: Mapping[str, Any], excluded: Collection[str]
    ) -> None:
        """:meth:`load_state_dict`, leaving the fields named in ``excluded`` as they are.

        What ``restore(..., exclude=("recipe.rng", "recipe.dataloader"))`` calls: an excluded
        field is neither checked nor loaded nor touched, whether or not ``state`` holds it --
        so an RNG keeps its live seeds and a data loader starts its data over.

        Raises:
            StateMismatchError: as :meth:`load_state_dict`, for the fields not excluded.
        """
        if not isinstance(state, Mapping):
            raise CheckpointTypeError(
                f"RecipeState.load_state_dict needs a mapping, got {type(state).__name__}"
            )
        skipped = set(excluded)
        current = {name: value for name, value in self.fields().items() if name not in skipped}
        saved = {
            name: value
            for name, value in state.items()
            if name != KINDS_KEY and name not in skipped
        }
        missing = [n for n, v in current.items() if has_state_dict(v) and n not in saved]
        if missing:
            raise StateMismatchError(
                f"the saved recipe state has no field(s) {missing}; it holds {sorted(saved)}. "
                "Build the RecipeState with the fields it was saved with"
            )
        kinds = _saved_kinds(state.get(KINDS_KEY), saved)
        problems = [
            problem
            for name in saved
            if (problem := _field_problem(name, kinds.get(name), current)) is not None
        ]
        if problems:
            raise StateMismatchError(
                "the saved recipe state does not fit this RecipeState:\n  "
                + "\n  ".join(problems)
                + "\nBuild the RecipeState with each stateful field holding its live object "
                "(e.g. RecipeState(..., dataloader=loader, scheduler=scheduler)) so that it is "
                "restored in place, or restore the item without a target to read the saved "
                "state as plain values"
            )
        rngs = []
        for name, value in saved.items():
            live = current.get(name)
            if not has_state_dict(live) and kinds.get(name) is RNGState:
                live = RNGState()  # restores the generators, and is saved as one again
                setattr(self, str(name), live)
                current[name] = live
            if isinstance(live, RNGState):
                rngs.append((live, value))
            elif live is not None and has_state_dict(live):
                _load_into(live, value)
            else:
                setattr(self, str(name), value)
        if rngs:
            # Objects may draw random numbers lazily after a load: a StatefulDataLoader builds
            # its resumed iterator on first use, drawing a seed from torch's global generator
            # -- a draw the interrupted run never made. state_dict() makes them build now, and
            # the generators are restored after that, so the streams continue exactly where the
            # interrupted run left them.
            for name in saved:
                live = current.get(name)
                if live is not None and not isinstance(live, RNGState) and has_state_dict(live):
                    _build_now(live)
            for rng, value in rngs:
                rng.load_state_dict(value)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that do not exist; typed Any so that user fields type-check.
        raise AttributeError(
            f"RecipeState has no field {name!r}; its fields are {sorted(self.fields())}"
        )

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.fields().items())
        return f"RecipeState({shown})"


def _saved_kinds(recorded: Any, saved: Mapping[str, Any]) -> dict[str, type | str]:
    """The class each stateful field was saved from: ``RNGState`` itself, or a class name.

    Steps saved before the classes were recorded hold no ``"_kinds"``; a field there counts as
    an RNG state when it holds exactly what :meth:`RNGState.state_dict` captures.
    """
    if not isinstance(recorded, Mapping):
        return {
            name: RNGState
            for name, value in saved.items()
            if isinstance(value, Mapping) and {"python", "torch"} <= set(value) <= _RNG_KEYS
        }
    return {
        str(name): RNGState if same_class(kind, RNGState) else kind
        for name, kind in recorded.items()
        if isinstance(kind, str)
    }


def _field_problem(name: str, kind: type | str | None, current: Mapping[str, Any]) -> str | None:
    """Why saved field ``name`` (saved from ``kind``; None: a plain value) cannot be restored."""
    live = current.get(name)
    if kind is None or (kind is RNGState and not has_state_dict(live)):
        return None
    saved_from = kind.__name__ if isinstance(kind, type) else kind
    if not has_state_dict(live):
        here = "missing here" if name not in current else f"a {type(live).__name__} here"
        return f"{name}: saved from a {saved_from}'s state_dict(), but the field is {here}"
    if isinstance(kind, str) and not same_class(kind, type(live)):
        return f"{name}: saved from a {kind}, but the field holds a {class_name(type(live))}"
    if kind is RNGState and not isinstance(live, RNGState):
        return f"{name}: saved from an RNGState, but the field holds a {class_name(type(live))}"
    return None


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _as_python_state(saved: Any) -> tuple[Any, ...]:
    # random.setstate insists on tuples; a state that went through lists is converted back.
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)


# Where loader wrappers keep the loader they wrap: Accelerate's prepared loaders
# (``DataLoaderShard``, ``DataLoaderDispatcher``) hold it as ``base_dataloader``.
_WRAPPED_LOADER_ATTRS = ("base_dataloader",)


def _wrapped(live: Any) -> Any:
    """The loader ``live`` wraps (see _WRAPPED_LOADER_ATTRS), or None."""
    for attr in _WRAPPED_LOADER_ATTRS:
        inner = live.__dict__.get(attr) if hasattr(live, "__dict__") else None
        if inner is not None and inner is not live:
            return inner
    return None


def _state_of(name: str, value: Any) -> Any:
    inner = _wrapped(value)
    if inner is not None and not has_state_dict(inner):
        # Accelerate's wrapper has state_dict() either way; over a plain DataLoader it fails
        # with an AttributeError about its own internals.
        raise CheckpointTypeError(
            f"recipe field {name!r} is a data loader prepared by Accelerate around a plain "
            f"{class_name(type(inner))}, which has no state to save: build the Accelerator "
            "with dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True) so "
            "that the loader resumes at its position, or leave the loader out of the "
            "RecipeState (a resumed run then starts its data over)"
        )
    state = value.state_dict()
    epoch = _wrapper_epoch(value, state) if inner is not None else None
    if epoch is not None:
        state = {**state, WRAPPER_EPOCH_KEY: epoch}
    return state


# Accelerate's prepared loaders count their epochs in ``iteration`` and seed each epoch's
# shuffle from it when distributed (``set_epoch(iteration)`` at every ``iter()``), but leave
# it out of ``state_dict()``: resumed, they would shuffle every later epoch as the first one.
# orbit_pt saves, beside the loader's state, the epoch that its next ``iter()`` will use.
WRAPPER_EPOCH_KEY = "_orbit_wrapper_epoch"


def _wrapper_epoch(wrapper: Any, state: Any) -> int | None:
    """The epoch ``wrapper``'s next ``iter()`` starts, or None if it counts none."""
    iteration = wrapper.__dict__.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool):
        return None
    # Saved after the last batch of an epoch, inside the loop: the epoch's iterator has not
    # yet returned, so it has not counted the epoch; the next iter() starts the one after.
    finished = isinstance(state, Mapping) and state.get("_iterator_finished") is True
    active = getattr(getattr(wrapper, "gradient_state", None), "dataloader_references", ())
    in_epoch = any(loader is wrapper for loader in active or ())
    return iteration + 1 if finished and in_epoch else iteration


def _load_into(live: Any, saved: Any) -> None:
    """``live.load_state_dict(saved)``, and a loader wrapper's epoch (see WRAPPER_EPOCH_KEY)."""
    if isinstance(saved, Mapping) and WRAPPER_EPOCH_KEY in saved:
        saved = dict(saved)
        epoch = int(saved.pop(WRAPPER_EPOCH_KEY))
        if _wrapped(live) is not None:  # a bare loader restored from a wrapper's state has none
            live.iteration = epoch
    live.load_state_dict(saved)


def _build_now(live: Any) -> None:
    """Ask ``live`` (and any loader it wraps) for its state, so that lazy set-up happens now.

    A wrapper may answer ``state_dict()`` from a copy it cached (Accelerate's prepared loaders
    do), never reaching the ``StatefulDataLoader`` inside, whose resumed iterator would then
    draw its seed after the generators are restored; so the wrapped loader is asked too.
    """
    live.state_dict()
    inner = _wrapped(live)
    if inner is not None and has_state_dict(inner):
        _build_now(inner)
