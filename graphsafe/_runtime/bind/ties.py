"""Ties: weights of one model held at several paths over one memory (an LM head tied to
the embedding), recorded when the model is first bound, and the loads that break them.

A checkpoint of a tied model carries the shared tensor once, under one of its names. A
load that unties it (binds one side to a new tensor, or repacks the weights into a flat
buffer where the head owns a copy) leaves the other side to be written by nobody, so the
next sync that sends the one name leaves the other stale. graphsafe refuses, naming both
paths: the load that breaks a tie, and, once a tie is broken (by a load, or outside any
load), every load that writes a side and leaves the sides different (writes are seen by
storage, so the values tell which sides were all written: a tie's sides hold the same
values). The refusal stands, and every freshness check (a guarded replay,
`assert_fresh`) repeats it, until a load leaves every side equal or the sides share
their memory again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Any

import torch
from torch import nn

from graphsafe._errors import GraphSafetyError, StaleError
from graphsafe._memory.snapshot import PLAIN
from graphsafe._memory.walk import module_prefixes, storage_key, storage_keys

__all__ = ["Ties"]

_Region = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _region(t: torch.Tensor) -> _Region | None:
    """The memory `t` covers: storage, offset, shape, stride, dtype (None: no bytes)."""
    key = storage_key(t)
    if not key:
        return None
    return key, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype


def _at(model: nn.Module, path: str) -> torch.Tensor | None:
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


class Ties:
    """The ties of one model, and the ones loads broke (what is refused until healed).

    Build it with `Ties.record(model)` before the first load. `refused` is written by
    `judge` alone.

    Examples:
        >>> m = nn.ModuleDict({"emb": nn.Embedding(4, 2), "head": nn.Linear(2, 4)})
        >>> m.head.weight = m.emb.weight
        >>> Ties.record(m).groups
        (('emb.weight', 'head.weight'),)
    """

    __slots__ = ("groups", "refused")

    def __init__(self, groups: tuple[tuple[str, ...], ...]) -> None:
        self.groups = groups
        """Each tie: the paths of the weights over one memory, in tree order."""
        self.refused: dict[tuple[str, ...], str] = {}
        """Tie -> why the last load that touched it was refused (until healed)."""

    @classmethod
    def record(cls, model: nn.Module) -> Ties:
        """The ties of `model` now: parameters and persistent buffers at several paths
        over the same memory (the same object, or views of one region); weights that only
        share a storage at other offsets (a flat buffer of many weights) are no tie."""
        if not _shares_storage(_unshared(model)):
            return cls(())  # most models: no two weights over one storage, no path made
        found: dict[_Region, list[str]] = {}
        # `named_parameters` then the persistent `named_buffers`, both without removing
        # duplicates (a shared module's weights at each of its paths), in one pass; the
        # paths made only for tensors that share a storage (most models share none).
        prefixes = module_prefixes(model)
        tables: list[tuple[str, Mapping[str, torch.Tensor | None]]] = [
            (head, m._parameters) for head, m in prefixes]
        tables += [(head, {name: t for name, t in m._buffers.items()
                           if name not in m._non_persistent_buffers_set})
                   for head, m in prefixes if m._buffers]
        tensors = [t for _, table in tables for t in table.values() if t is not None]
        keys = _keys(tensors)
        if _distinct(keys):
            return cls(())
        with PLAIN():  # metadata reads: no subclass __torch_function__ (vLLM's)
            # Some share a storage: their paths, in the same order as `tensors`.
            held = [(head, name, t) for head, table in tables
                    for name, t in table.items() if t is not None]
            by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
            for (head, name, t), key in zip(held, keys, strict=True):
                if key:
                    by_storage.setdefault(key, []).append((head + name, t))
            for shared in by_storage.values():  # a tie shares a storage: only those read
                if len(shared) > 1:
                    for path, t in shared:
                        region = _region(t)
                        if region is not None:
                            found.setdefault(region, []).append(path)
        return cls(tuple(tuple(paths) for paths in found.values() if len(paths) > 1))

    def untie(self, path: str, model_class: str) -> tuple[str, ...]:
        """Take `path` out of its tie for good (a model meant to be untied: its loads
        write every side apart); what that tie's refusal said is dropped. Returns the tie
        as it was.

        Raises:
            GraphSafetyError: `path` is in no tie recorded at bind.
        """
        for i, group in enumerate(self.groups):
            if path in group:
                self.refused.pop(group, None)
                rest = tuple(p for p in group if p != path)
                self.groups = (*self.groups[:i], *((rest,) if len(rest) > 1 else ()),
                               *self.groups[i + 1:])
                return group
        raise GraphSafetyError(
            f"{path} of {model_class} is in no tie",
            module_class=model_class,
            path=path,
            expected="a path of a tie recorded when the model was bound: "
            + ("; ".join(" and ".join(g) for g in self.groups) or "none"),
            got=path,
            fix="name one of the paths above (the state_dict name of a tied weight)",
        )

    def broken(self, model: nn.Module) -> frozenset[tuple[str, ...]]:
        """The ties whose sides no longer cover one memory."""
        out = []
        with PLAIN():
            for group in self.groups:
                regions = {_region(t) if (t := _at(model, p)) is not None else None
                           for p in group}
                if len(regions) > 1 or None in regions:
                    out.append(group)
        return frozenset(out)

    def judge(
        self,
        model: nn.Module,
        before: frozenset[tuple[str, ...]],
        written: Set[int],
        keys_before: Mapping[str, int],
        what: str,
    ) -> StaleError | None:
        """What a load that ended did to the ties: the error refusing it, or None.

        Args:
            model: The root module.
            before: `broken(model)` when the load began.
            written: The storage keys the load wrote.
            keys_before: The storage key of each path when the load began (a side bound
                to another tensor since counts as written).
            what: The load, for messages (`Model.load_weights`).
        """
        if not self.groups:
            return None
        now = self.broken(model)
        for group in self.groups:
            if group not in now:
                self.refused.pop(group, None)  # one memory again
                continue
            tensors = {p: _at(model, p) for p in group}
            sides = [p for p, t in tensors.items() if t is not None and (
                storage_key(t) in written or keys_before.get(p) != storage_key(t))]
            if group not in before:
                self.refused[group] = f"{what} broke the tie: " + _apart(tensors)
            elif sides and not _equal(tensors.values()):
                # Writes are seen by storage: both sides of a flat buffer count as written.
                self.refused[group] = (f"{what} wrote {', '.join(sides)}, untied since the "
                                       f"model was bound, and the sides now differ")
            elif sides:
                self.refused.pop(group, None)  # every side holds what the load wrote
        return self.error(type(model).__name__)

    def error(self, model_class: str) -> StaleError | None:
        """The refusal of every tie broken and not healed, or None."""
        if not self.refused:
            return None
        groups = list(self.refused)
        paths = tuple(p for g in groups for p in g)
        return StaleError(
            f"{len(groups)} tie(s) of {model_class} broken: "
            + "; ".join(" and ".join(g) for g in groups),
            paths=paths,
            module_class=model_class,
            path=", ".join(paths),
            expected="tied weights over one memory, as when the model was bound (a "
            "checkpoint carries the shared tensor once)",
            got="; ".join(self.refused.values()),
            fix="write every side of a broken tie in the same load, or re-tie them (bind "
            "the same parameter at both paths, e.g. `model.lm_head.weight = "
            "model.embed_tokens.weight`) and load again; for a model meant to be untied, "
            f"`gs.runtime(model).untie({paths[-1]!r})` once",
        )


def _equal(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether every side holds the same values (a tie's invariant)."""
    first, *rest = tensors
    try:
        return first is not None and all(t is not None and torch.equal(first, t) for t in rest)
    except RuntimeError:  # other devices, dtypes or shapes: they differ
        return False


def _apart(tensors: Mapping[str, torch.Tensor | None]) -> str:
    """Where each side of a broken tie lives now."""
    parts = []
    for path, t in tensors.items():
        if t is None:
            parts.append(f"{path} holds no tensor")
        else:
            parts.append(f"{path} at storage 0x{storage_key(t):x} offset {t.storage_offset()}")
    return ", ".join(parts)


def _unshared(model: nn.Module) -> list[nn.Module] | None:
    """Every module of the tree, or None where one is bound at more than one place (a
    shared module: its weights are at each of its paths) or inside itself."""
    modules = [model]
    seen = {id(model)}
    for module in modules:  # grows as it is read
        for child in module._modules.values():
            if child is not None:
                if id(child) in seen:
                    return None
                seen.add(id(child))
                modules.append(child)
    return modules


def _shares_storage(modules: list[nn.Module] | None) -> bool:
    """Whether two of the parameters and persistent buffers of `modules` (each bound
    once) share a storage; True where that is not known (`modules` None: shared ones)."""
    if modules is None:
        return True
    tensors: list[torch.Tensor] = [
        t for m in modules for t in m._parameters.values() if t is not None]
    tensors += [t for m in modules if m._buffers for name, t in m._buffers.items()
                if t is not None and name not in m._non_persistent_buffers_set]
    return not _distinct(_keys(tensors))


def _keys(tensors: list[torch.Tensor]) -> list[int]:
    """The storage key of each of `tensors` (0: no bytes)."""
    with PLAIN():  # metadata reads: no subclass __torch_function__ (vLLM's)
        keys = storage_keys(tensors)  # one compiled call, where the checks are built
        return list(map(storage_key, tensors)) if keys is None else keys


def _distinct(keys: list[int]) -> bool:
    """Whether no two of `keys` with bytes are the same storage."""
    some = [k for k in keys if k]
    return len(set(some)) == len(some)
