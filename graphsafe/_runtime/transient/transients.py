"""Transient inputs: checkpoint-format weights held only while a load writes them.

A derivation may declare some of its inputs transient (an FP8 weight quantized from a
bf16 checkpoint keeps only the FP8 tensor and its scales). Between updates they live on
the meta device: the tensor object, its class, shape, stride, dtype and place in the
module stay (`torch.utils.swap_tensors`), so loaders find what they expect and a stray
read fails loudly instead of reading freed memory. The write tracker gives one real
memory just before a load's first write into it lands, sends the write there, and notes
which elements the write defines (`Coverage`: a re-sent bucket defines nothing new, an
`index_copy_` of one expert defines that expert). A derivation whose transient inputs
are all completely written refreshes at once, in the middle of a bucketed update, and
they are released again: the extra memory of an update is bounded by the layers in
flight. One with a partly written input when the update ends is stale, and the guard
refuses to replay it, saying what was written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from graphsafe._runtime.bind.binding import BoundDerivation
from graphsafe._runtime.bind.inputs import Input
from graphsafe._runtime.transient.coverage import Coverage

__all__ = ["Transient", "Transients"]


class Transient:
    """One transient input `inp`: where it lives, and what the current update wrote of it."""

    __slots__ = ("_other", "coverage", "device", "held", "input", "meta_base", "meta_sid",
                 "numel", "real_base", "real_sid")

    def __init__(self, inp: Input) -> None:
        t = inp.tensor
        assert t is not None
        self.input = inp
        self.device = t.device
        self.numel = t.numel()
        self.held = t.device.type != "meta"
        self.coverage = Coverage(t)
        """The elements the current update wrote."""
        self._other: torch.Tensor | None = None  # the swapped-out half, kept alive
        sid = id(t.untyped_storage())
        self.real_sid: int | None = sid if self.held else None
        self.meta_sid: int | None = None if self.held else sid
        # The input's storage offset in each storage (0 in those `hold`/`release` make).
        self.real_base = self.meta_base = int(t.storage_offset())

    @property
    def tensor(self) -> torch.Tensor:
        """The input tensor (the same object whether held or released)."""
        t = self.input.tensor
        assert t is not None
        return t

    @property
    def sids(self) -> tuple[int, ...]:
        """Ids of the live storages a write into this input goes through: the real one
        while held, and the meta one that views taken while released still alias."""
        return tuple(s for s in (self.real_sid, self.meta_sid) if s is not None)

    @property
    def complete(self) -> bool:
        """Whether the current update wrote every element of the input."""
        return self.coverage.complete

    def hold(self) -> None:
        """Give the input real memory (its values are undefined until written)."""
        if self.held:
            return
        t = self.tensor
        self._swap(torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=self.device))
        self.real_sid = id(t.untyped_storage())  # the meta half stays alive in _other
        self.real_base = 0
        self.held = True

    def release(self) -> None:
        """Move the input to the meta device, freeing its memory; it keeps its identity."""
        if self.held:
            t = self.tensor
            self._swap(torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta"))
            self._other = None  # frees the real memory
            self.real_sid = None
            self.meta_sid = id(t.untyped_storage())
            self.meta_base = 0
            self.held = False
        self.coverage.reset()

    def _swap(self, data: torch.Tensor) -> None:
        t = self.tensor
        if isinstance(t, torch.nn.Parameter):
            data = torch.nn.Parameter(data, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, data)  # type: ignore[no-untyped-call]
        self._other = data


class Transients:
    """The transient inputs of one binding (`bound`: its derivations, topologically)."""

    __slots__ = ("_by_input", "_by_storage", "_lock", "readers")

    def __init__(self, bound: list[BoundDerivation]) -> None:
        self._by_input: dict[int, Transient] = {}
        self.readers: dict[int, list[int]] = {}
        """id(Transient) -> indices of the derivations reading it."""
        for b in bound:
            for inp in b.transient_inputs:
                tr = self._by_input.get(id(inp))
                if tr is None:
                    tr = self._by_input[id(inp)] = Transient(inp)
                self.readers.setdefault(id(tr), []).append(b.index)
        self._by_storage: dict[int, Transient] = {}
        for tr in self._by_input.values():
            self._reindex(tr, ())
        # Worker threads of a load write through trackers of their own, maybe into one
        # input: each holds it and notes its write alone.
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._by_input)

    def __iter__(self) -> Iterator[Transient]:
        return iter(self._by_input.values())

    def of(self, b: BoundDerivation) -> list[Transient]:
        """The transient inputs `b` reads."""
        return [self._by_input[id(inp)] for inp in b.transient_inputs]

    def on_write(
        self, t: torch.Tensor, func: Any, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[Transient | None, torch.Tensor | None]:
        """Before op `func` (`args`, `kwargs`) writes into `t`: if `t` is a view of a
        transient input (often `.data`, maybe taken while it was on meta), hold the input
        and note the elements the op defines. Returns the input (or None), and the real
        tensor to write instead of a meta `t`."""
        sid = id(t.untyped_storage())
        tr = self._by_storage.get(sid)
        if tr is None:
            return None, None
        with self._lock:
            base = tr.meta_base if sid == tr.meta_sid else tr.real_base
            tr.coverage.write(t, base, func, args, kwargs)
            before = tr.sids
            tr.hold()
            self._reindex(tr, before)
        if t.device.type != "meta":
            return tr, None
        real = tr.tensor.detach()
        # The same elements of the real storage (`t` may view it as another dtype).
        shift = (tr.real_base - base) * real.element_size() // t.element_size()
        at = t.storage_offset() + shift
        if t.dtype == real.dtype:
            return tr, real.as_strided(t.size(), t.stride(), at)
        view = torch.empty(0, dtype=t.dtype, device=real.device)
        return tr, view.set_(real.untyped_storage(), at, t.size(), t.stride())

    def blocked(self, b: BoundDerivation) -> Transient | None:
        """A transient input of `b` that is released, so `b` cannot be computed now."""
        for tr in self.of(b):
            if not tr.held:
                return tr
        return None

    def ready(self, candidates: Iterable[int], bound: list[BoundDerivation]) -> list[int]:
        """Of `candidates`, the sorted indices of those whose transient inputs are all written."""
        return sorted(
            i for i in candidates if (trs := self.of(bound[i])) and all(t.complete for t in trs)
        )

    def unblocked(
        self,
        plan: Sequence[int],
        bound: list[BoundDerivation],
        stale: set[int],
        *,
        skip: bool,
    ) -> tuple[list[int], dict[int, str]]:
        """Split `plan` (topological) into what can run and, with why, what cannot (a
        transient input of its own, or of what it reads, is released). `skip`: a full
        refresh of a fresh model, where one that cannot run and is not in `stale` is left as
        it is (not returned as blocked), and what reads it still runs."""
        out: list[int] = []
        cut: set[int] = set()
        why_blocked: dict[int, str] = {}
        for i in plan:
            b = bound[i]
            tr = self.blocked(b)
            if tr is None and b.deps.isdisjoint(cut):
                out.append(i)
                continue
            cut.add(i)
            if skip and i not in stale:
                continue
            why_blocked[i] = (
                f"its transient input {tr.input.path} is released: it is recomputed only by "
                "a load that writes that input completely"
                if tr is not None
                else "it reads a derivation that could not be recomputed"
            )
        if skip:  # what reads a skipped derivation's (unchanged) buffers can still run
            return [i for i in plan if self.blocked(bound[i]) is None], why_blocked
        return out, why_blocked

    def release(self, which: Iterable[Transient] | None = None) -> None:
        """Release the transient inputs `which` (all by default)."""
        for tr in list(self if which is None else which):
            before = tr.sids
            tr.release()
            self._reindex(tr, before)

    def hold_whole(self, tr: Transient) -> None:
        """Hold `tr`, counted as written whole (a `load_state_dict` about to copy into it)."""
        before = tr.sids
        tr.hold()
        self._reindex(tr, before)
        tr.coverage.whole()

    def _reindex(self, tr: Transient, before: tuple[int, ...]) -> None:
        for sid in before:
            if self._by_storage.get(sid) is tr:
                del self._by_storage[sid]
        for sid in tr.sids:
            self._by_storage[sid] = tr
