"""Which elements of a transient input the writes of a load defined.

A transient input's memory is undefined when a load gives it back (`Transient.hold`),
so its derivations may run only once every element was overwritten. `Coverage` keeps
the elements written, as storage offsets relative to the input's own, from the region
each write defines (`regions.region`): a bucket sent twice defines nothing new the
second time, an `index_copy_` of one expert defines that expert, an `add_` nothing. A
write that defines nothing new is remembered (`note`), so that a load that ends with
the input incomplete says why; it never makes the input complete.

The common writes (the whole tensor, row slices, `narrow(0, ...)`, one expert of an
`[E, ...]` weight) are runs of consecutive offsets, kept as a sorted list of merged
ranges: a few Python integers per write, none per element.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any

import torch

from graphsafe._runtime.transient.regions import (
    WHOLE,
    Readable,
    Region,
    on_host,
    ranges,
    region,
    sources,
)

__all__ = ["Coverage"]

_RANGES = 1 << 12  # the most disjoint ranges kept (beyond: the mask)


class Coverage:
    """The elements of one tensor `t` (of its layout) written since the last `reset`.

    Ranges of storage offsets while that is cheap; past `_RANGES` ranges, or for a write
    that is no few runs (a scatter, a mask, cells of a one-column slice), a boolean mask
    over the input's storage span, on the host: one byte per element of the input (a
    quarter of a float32 weight's own memory), allocated at the first such write and
    dropped at `reset`. It lives on the host whatever the input's device: marking a write
    reads only shapes and host indices, never the input's values, and never synchronizes.
    """

    __slots__ = ("_count", "_ends", "_mask", "_starts", "dense", "esize", "note", "numel",
                 "size", "span", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride = tuple(t.size()), tuple(t.stride())
        self.numel = t.numel()
        self.esize = t.element_size()
        extent = sum((n - 1) * s for n, s in zip(self.size, self.stride))
        self.span = 1 + extent if self.numel else 0
        self.dense = self.span == self.numel  # its elements are every offset of its span
        self.reset()

    def reset(self) -> None:
        """Nothing written (a new update, or the input released)."""
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._mask: torch.Tensor | None = None
        self._count = 0
        self.note: str | None = None
        """Why a write defined nothing new (the first such write)."""

    def whole(self) -> None:
        """Everything written (`load_state_dict` copies whole tensors)."""
        self.reset()
        self._starts, self._ends, self._count = [0], [self.span], self.numel

    @property
    def complete(self) -> bool:
        """Whether every element was written."""
        return self._count >= self.numel

    @property
    def written(self) -> int:
        """How many elements were written."""
        return min(self._count, self.numel)

    def write(
        self,
        t: torch.Tensor,
        base: int,
        func: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        *,
        readable: Readable = on_host,
    ) -> None:
        """Note what op `func` (`args`, `kwargs`), about to run, defines of `t`.

        Args:
            t: The written argument (or one of a written list), a view of the input's
                storage, maybe as another dtype.
            base: The input's storage offset in that storage, in its own elements.
            func: The aten (or c10d) op overload.
            args: Its positional arguments.
            kwargs: Its keyword arguments.
            readable: Whether an index tensor's values may be read (it is on the host).
        """
        try:
            found = region(t, func, args, kwargs, readable)
            if isinstance(found, str):
                self._nothing(found)
                return
            others = sources(t, args, kwargs)
            sid = id(t.untyped_storage()) if others else 0
            for src in others:
                if id(src.untyped_storage()) == sid and not self._covers(src, base):
                    self._nothing(f"{func._schema.name} copied into it from its own "
                                  "unwritten elements")
                    return
            self._add(t, base, found)
        except (RuntimeError, IndexError):
            # Indices the op itself refuses: it fails, and defines nothing.
            if self._mask is not None:
                self._recount()

    def describe(self) -> str:
        """How much is written ("4096 of 8192 elements written; first unwritten element at
        offset 4096, index (4, 0)"), and why a write defined nothing, if one did."""
        text = f"{self.written} of {self.numel} elements written"
        first = self._first_unwritten()
        if first is not None:
            text += f"; first unwritten element at offset {first[0]}, index {first[1]}"
        return text if self.note is None else f"{text}; {self.note}"

    def _add(self, t: torch.Tensor, base: int, found: Region) -> None:
        """Add what a write into `t` defines (`found`)."""
        same = t.element_size() == self.esize
        ranged = self._mask is None and self.dense
        if ranged and found is WHOLE and same and t.is_contiguous():
            start = int(t.storage_offset()) - base  # one run: the common case
            if start >= 0 and start + t.numel() <= self.span:
                if t.numel():
                    self._insert(start, start + t.numel())
                return
        offsets = found.offsets
        if found is WHOLE:
            offsets = torch.tensor([int(t.storage_offset())])
            found = Region(offsets, tuple(t.size()), tuple(t.stride()), None)
        if ranged and offsets is not None:
            runs = ranges(offsets, found.size, found.stride, t.element_size(), self.esize,
                          base, self.span)
            if runs is not None and self._merge(*runs):
                return
        view = self._view_of_mask(t, base) if same else None
        if view is None:
            self._nothing(f"a write through a {t.dtype} view of it was no few runs of whole "
                          "elements of the input")
            return
        if found.mark is None and self.dense and _no_overlap(view):
            self._count += view.numel() - int(view.sum())
            view.fill_(True)
            return
        if found.mark is None:
            view.fill_(True)
        else:
            found.mark(view)
        self._recount()

    # -- ranges -------------------------------------------------------------------

    def _insert(self, s: int, e: int) -> None:
        starts, ends = self._starts, self._ends
        i, j = bisect_left(ends, s), bisect_right(starts, e)  # those it touches merge
        removed = 0
        if i < j:
            removed = sum(ends[k] - starts[k] for k in range(i, j))
            s, e = min(s, starts[i]), max(e, ends[j - 1])
        starts[i:j], ends[i:j] = [s], [e]
        self._count += e - s - removed

    def _merge(self, s: torch.Tensor, e: torch.Tensor) -> bool:
        """Merge ranges `[s, e)` into the list (vectorized); False if too many remain."""
        s = torch.cat([torch.tensor(self._starts, dtype=torch.int64), s])
        e = torch.cat([torch.tensor(self._ends, dtype=torch.int64), e])
        order = torch.argsort(s)
        s, e = s[order], e[order]
        reach = torch.cummax(e, 0).values
        first = torch.ones_like(s, dtype=torch.bool)
        first[1:] = s[1:] > reach[:-1]  # a range that starts past all before it
        last = torch.ones_like(first)
        last[:-1] = first[1:]
        s, e = s[first], reach[last]
        if s.numel() > _RANGES:
            return False
        self._starts, self._ends = s.tolist(), e.tolist()
        self._count = int((e - s).sum())
        return True

    def _covers(self, t: torch.Tensor, base: int) -> bool:
        """Whether every element `t` (a view of the input's storage) reaches is written."""
        if self.complete:
            return True
        if t.element_size() != self.esize:
            return False
        if self._mask is None and self.dense:
            found = ranges(torch.tensor([int(t.storage_offset())]), t.size(), t.stride(),
                           self.esize, self.esize, base, self.span)
            if found is None:
                return False
            starts, ends = self._starts, self._ends
            for s, e in zip(found[0].tolist(), found[1].tolist()):
                i = bisect_right(starts, s) - 1
                if i < 0 or ends[i] < e:
                    return False
            return True
        view = self._view_of_mask(t, base)
        return view is not None and bool(view.all())

    # -- the mask -------------------------------------------------------------------

    def _view_of_mask(self, t: torch.Tensor, base: int) -> torch.Tensor | None:
        """The mask, viewed as `t` is (None where `t` reaches outside the input's span)."""
        start = int(t.storage_offset()) - base
        end = start + sum((n - 1) * s for n, s in zip(t.size(), t.stride()))
        if start < 0 or (t.numel() and end >= self.span):
            return None
        if self._mask is None:
            self._mask = torch.zeros(self.span, dtype=torch.bool)
            for s, e in zip(self._starts, self._ends):
                self._mask[s:e] = True
            self._starts, self._ends = [], []
        return self._mask.as_strided(t.size(), t.stride(), start)

    def _recount(self) -> None:
        assert self._mask is not None
        mask = self._mask if self.dense else self._mask.as_strided(self.size, self.stride)
        self._count = int(mask.sum())

    def _nothing(self, why: str) -> None:
        if self.note is None:
            self.note = why

    def _first_unwritten(self) -> tuple[int, tuple[int, ...]] | None:
        """The storage offset and index of the first element not written, if any."""
        if self.complete:
            return None
        if self._mask is None and self.dense:
            offset = 0 if not self._starts or self._starts[0] > 0 else self._ends[0]
            return offset, _unravel(offset, self.size, self.stride)
        if self._mask is None:  # a non-dense input with nothing written yet
            return 0, tuple(0 for _ in self.size)
        left = ~self._mask.as_strided(self.size, self.stride)
        index = tuple(int(i) for i in left.nonzero()[0])
        return sum(i * s for i, s in zip(index, self.stride)), index


def _no_overlap(t: torch.Tensor) -> bool:
    """Whether no two elements of `t` share an offset (a sufficient test)."""
    reach = 1
    for s, n in sorted((s, n) for n, s in zip(t.size(), t.stride()) if n != 1):
        if s < reach:
            return False
        reach = s * n
    return True


def _unravel(offset: int, size: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The index of the element at `offset` of a dense layout."""
    index = [0] * len(size)
    for k in sorted(range(len(size)), key=lambda k: -stride[k]):
        if size[k] > 1:
            index[k], offset = divmod(offset, stride[k])
    return tuple(index)
