"""Numbers and handles a load that was not recorded made from the model's weights.

A later load is not recorded; its write tracker follows what it computes from the weights
(`Taints`), and notes, besides tensors, each number taken from what the weights reach
(`aten::_local_scalar_dense`: `.item()`, `float()`, `int()`, `bool()`) and each handle an
op other than aten's made of it (a `ScriptObject`, an int): `Taken`. Where the model keeps
one in a new place, it is discovered with those weights as its sources (`find_taken`): a
number by value, since the object the caller keeps never reaches the dispatcher, told new
against the numbers the model kept when it was last walked for them (`LaterValues`); a
handle by its kind. Their ops are not known: they cannot be recomputed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container, Mapping, Sequence

import torch
from torch import nn

from graphsafe._lineage.entries import AFTER_CAPTURE, Entry, ref_to
from graphsafe._lineage.record.recorder import ambiguous
from graphsafe._lineage.resolve import COMPUTED, NOTHING, Found, Source, sources_of
from graphsafe._memory.snapshot import PLAIN
from graphsafe._memory.walk import ValueSite, storage_key, walk_values

__all__ = ["LaterValues", "Taken", "find_taken", "gives", "numbers_of", "taken_again"]


Taken = tuple[bool, object, tuple[int, ...], str]
"""A number a load that was not recorded took from what the weights reach, or a handle
an op made from it (the write trackers' `Taken`): (whether a handle, the number, or the
handle's class name or int; the weights' storage keys; the op)."""

_NUMBERS = (int, float, bool)


def numbers_of(model: nn.Module, held: Sequence[ValueSite] | None = None) -> dict[str, object]:
    """Every Python number `model` keeps where the walk reaches, by path (what a later
    load's numbers are told new against); `held`: the values a walk of it just found,
    numbers among them (None: walked for them)."""
    if held is None:
        with PLAIN():
            held = walk_values(model, _number)
    return {s.path: s.value for s in held if type(s.value) in _NUMBERS}


def _number(value: object) -> bool:
    return type(value) in _NUMBERS


def gives(value: object, number: object) -> bool:
    """Whether `value`, kept by the model, is what `.item()`, `float()`, `int()` or
    `bool()` make of the number a tensor held (`number`, as the dispatcher returned it).
    An `int` only from an integer tensor: `int()` of a float one, truncated, would match
    too many counters and sizes."""
    if not isinstance(number, (int, float)):  # a bool is an int
        return False
    if type(value) is float:
        made = float(number)
        return bool(value == made or (value != value and made != made))
    if type(value) is int:
        return isinstance(number, int) and value == int(number)
    if type(value) is bool:
        return bool(value == bool(number))
    return False


def find_taken(
    model: nn.Module, sources: dict[int, Source], taken: Sequence[Taken],
    known: Container[str], before: Mapping[str, object],
) -> list[Found]:
    """The numbers and handles `model` keeps where the walk reaches, at paths not `known`,
    that a load that was not recorded made from the weights (`taken`): a number by value
    (equal to one taken, where `before` held another object, or, for a `bool` or small
    `int`, another value), a handle by identity of kind (a `ScriptObject` of the class an
    op made, an int an op returned). Their sources are those of every taken value they
    match; their ops are not known."""
    with PLAIN():
        by_key = {storage_key(t): s for s in sources.values()
                  if isinstance(t := s.holder.get(s.key), torch.Tensor)}
    numbers = [t for t in taken if not t[0]]
    handles = [t for t in taken if t[0]]
    classes = {t[1] for t in handles if isinstance(t[1], str)}

    def wanted(v: object) -> bool:
        if type(v) in _NUMBERS:
            return True
        return bool(classes) and isinstance(v, torch.ScriptObject) and (
            v._type().qualified_name() in classes)

    out: list[Found] = []
    for site in walk_values(model, wanted):
        if site.path in known:
            continue
        v = site.value
        if isinstance(v, torch.ScriptObject):
            name = v._type().qualified_name()
            made = [t for t in handles if t[1] == name]
        else:
            was = before.get(site.path, NOTHING)
            if was is v or (ambiguous(v) and type(was) is type(v) and was == v):
                continue  # held so before the load
            made = [t for t in handles if type(v) is int and t[1] == v and not ambiguous(v)]
            if not made:
                made = [t for t in numbers if gives(v, t[1])]
        srcs = tuple({by_key[k].path: by_key[k] for t in made for k in t[2]
                      if k in by_key}.values())
        if srcs:
            chain = (srcs[0].path, "...", made[-1][3].replace("::", "."))
            out.append(Found(site, srcs, chain, made[-1][0], None))
    return out


def taken_again(e: Entry, now: object, taken: Sequence[Taken]) -> bool:
    """Whether a load took from `e`'s sources a number that gives what it holds now (a
    number found without its ops holds so); for a number the bring-up computed in Python
    from the numbers it took (`COMPUTED`), any number taken from them: the post-load step
    that computes it ran again."""
    keys = e.source_keys()
    if e.chain.endswith(COMPUTED):
        return any(not t[0] and not keys.isdisjoint(t[2]) for t in taken)
    return any(not t[0] and gives(now, t[1]) and not keys.isdisjoint(t[2]) for t in taken)


class LaterValues:
    """The numbers one model kept when it was last walked for them (its recorded load's
    end, its first pin, a later load that took numbers while no graph held it), and
    whether a graph holds the model: what a later load's numbers and handles are told new
    against, and held at."""

    def __init__(self) -> None:
        self._model: weakref.ref[nn.Module] | None = None
        self._numbers: dict[str, object] = {}
        self._pinned = False

    def walked(self, model: nn.Module,
               held: Callable[[], Sequence[ValueSite] | None] = lambda: None) -> None:
        """A recorded load of `model` ended: its numbers now are what it kept (`held()`:
        the values a walk of it just found, numbers among them; None: walked for them)."""
        self._model = weakref.ref(model)
        if not self._pinned:
            self._numbers = numbers_of(model, held())

    def found(self, model: nn.Module, taken: Sequence[Taken], known: Container[str]
              ) -> list[Entry]:
        """A later load of `model` took numbers or made handles from its weights
        (`taken`): an entry for each the model keeps in a new place (not `known`).
        Found while a graph holds the model, each is held at what its place held at the
        capture (a place that held no number then: not what the graph read)."""
        self._model = weakref.ref(model)
        fresh = Entry.many(find_taken(model, sources_of(model), taken, known, self._numbers))
        if self._pinned:
            for e in fresh:
                was = self._numbers.get(e.path, AFTER_CAPTURE) if e.kind == "scalar" \
                    else AFTER_CAPTURE
                e.pinned = ref_to(was)
        else:
            self._numbers = numbers_of(model)
        return fresh

    @property
    def pinned(self) -> bool:
        """Whether a graph holds the model."""
        return self._pinned

    def pin(self) -> None:
        """A graph holds the model from now on: what its numbers are now is what the
        graph baked."""
        model = None if self._model is None else self._model()
        if not self._pinned and model is not None:
            self._numbers = numbers_of(model)
        self._pinned = True

    def unpin(self) -> None:
        """No graph holds the model any more."""
        self._pinned = False
