"""What one write defines of the tensor it writes: the region of a `Coverage`.

An overwrite (`copy_`, `fill_`, `zero_`, the random initializers, an `out=` op, c10d's
broadcasts and receives) defines every element of the view it writes, whatever the
view held. An indexed write (`index_copy_`, `index_put_` without `accumulate`,
`index_fill_`, `scatter_` without `reduce`, `masked_fill_`, `masked_scatter_`) defines
what its index (or mask) tensors name, which are read here only when they are on the
host: reading a device's would synchronize with it. Anything else defines nothing: it
reads what it updates (`add_`, `mul_`, an accumulating `index_put_`, `allreduce_`), or
it is an op graphsafe does not follow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from typing import Any, NamedTuple

import torch

__all__ = ["WHOLE", "Readable", "Region", "on_host", "ranges", "region", "sources"]

RUNS = 1 << 16
"""The most runs of consecutive offsets `ranges` lists for one write (beyond: a mask)."""

_OVERWRITES = frozenset({
    "aten::copy_", "aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_",
    "aten::random_", "aten::bernoulli_", "aten::exponential_", "aten::geometric_",
    "aten::log_normal_", "aten::cauchy_", "aten::_foreach_copy_", "aten::_foreach_zero_",
})
_C10D_READS = ("c10d::allreduce", "c10d::reduce_")  # they combine what the tensor holds

Readable = Callable[[torch.Tensor], bool]


def on_host(t: torch.Tensor) -> bool:
    """Whether graphsafe may read `t`'s values (an index) without synchronizing."""
    return t.device.type == "cpu"


class Region(NamedTuple):
    """What a write into a view `t` defines: slices at storage `offsets` (in `t`'s
    elements), each of geometry `size` and `stride`; or, with `offsets` None, what `mark`
    marks on a boolean tensor shaped as `t` (None too: all of `t`, `WHOLE`)."""

    offsets: torch.Tensor | None
    size: tuple[int, ...]
    stride: tuple[int, ...]
    mark: Callable[[torch.Tensor], object] | None


WHOLE = Region(None, (), (), None)
"""All of the written view."""


def region(
    t: torch.Tensor, func: Any, args: Sequence[Any], kwargs: dict[str, Any], readable: Readable
) -> Region | str:
    """What op `func` (`args`, `kwargs`) defines of `t`, the argument it writes, or why it
    defines nothing.

    Raises:
        RuntimeError, IndexError: The op's indices are out of range, or do not fit `t`
            (the op fails on them too).
    """
    name = func._schema.name
    if not _overwrites(func, name, args, kwargs):
        return (f"{name} updates values it reads, or writes what graphsafe does not follow; "
                "only overwrites and host-indexed writes count")
    indexed = _INDEXED.get(name)
    if indexed is None:
        return WHOLE
    for index in _indices(name, args, kwargs):
        if not readable(index):
            return (f"{name} wrote it with indices on {index.device}, which graphsafe does not "
                    "read (that would synchronize); index with host (CPU) tensors, or copy_ "
                    "whole slices")
    found = indexed(t, args, kwargs)
    return f"{name} wrote it in a form graphsafe does not follow" if found is None else found


def sources(t: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments of an op besides `t` (and besides a written list holding it)."""
    out = []
    for a in (*args, *kwargs.values()):
        if a is t:
            continue
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)) and not any(x is t for x in a):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def ranges(
    offsets: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    esize: int,
    into: int,
    base: int,
    span: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ranges `[starts, ends)` of elements of a tensor (`into` bytes each, at storage
    offset `base`, `span` elements long) wholly covered by slices of geometry `size` and
    `stride` (in elements of `esize` bytes) at storage `offsets`; None beyond `RUNS` runs."""
    if 0 in size:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    dims = sorted((s, n) for n, s in zip(size, stride) if n != 1 and s != 0)
    run = 1
    while dims and dims[0][0] == run:  # the innermost contiguous dims make one run
        run *= dims.pop(0)[1]
    if offsets.numel() * prod(n for _, n in dims) > RUNS:
        return None
    at = offsets.reshape(-1)
    for s, n in dims:
        at = (at[:, None] + torch.arange(n) * s).reshape(-1)
    first = at * esize - base * into  # in bytes from the tensor's first element
    starts = (first + into - 1).div(into, rounding_mode="floor").clamp(0, span)
    ends = (first + run * esize).div(into, rounding_mode="floor").clamp(0, span)
    keep = ends > starts
    return starts[keep], ends[keep]


# -- the ops ------------------------------------------------------------------------


def _overwrites(func: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether `func` overwrites what it writes (not reading it first)."""
    if name in _OVERWRITES:
        return True
    if name in _INDEXED:
        if func._overloadname in ("reduce", "value_reduce"):  # scatter_ with reduce=
            return False
        return not (name.endswith("index_put_") and _arg(args, kwargs, 3, "accumulate", False))
    if name.startswith("c10d::"):
        return not name.startswith(_C10D_READS)
    # An `out=` overload writes its result into `out` whatever it held.
    return not name.endswith("_") and "out" in func._overloadname


def _arg(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if i < len(args) else kwargs.get(name, default)


def _indices(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The index (or mask) tensors of an indexed write."""
    if name.endswith("index_put_"):
        return [i for i in _arg(args, kwargs, 1, "indices", ()) if isinstance(i, torch.Tensor)]
    found = _arg(args, kwargs, 1, "mask", None) if "masked_" in name else _arg(
        args, kwargs, 2, "index", None)
    return [found] if isinstance(found, torch.Tensor) else []


def _checked(index: torch.Tensor, n: int) -> torch.Tensor:
    """`index` as int64 in `[0, n)` (negative ones wrapped); raises where the op would."""
    index = index.to(torch.int64)
    if index.numel() and (int(index.min()) < -n or int(index.max()) >= n):
        raise IndexError("index out of range")
    return index % n if n else index


def _along(t: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> Region:
    """`index_copy_(dim, index, source)`, `index_fill_(dim, index, value)`: whole slices
    of `t` along `dim`."""
    if t.dim() == 0:
        return WHOLE
    dim = _arg(args, kwargs, 1, "dim", 0) % t.dim()
    index = _checked(_arg(args, kwargs, 2, "index", None), t.size(dim)).reshape(-1)
    size, stride = list(t.size()), list(t.stride())
    del size[dim], stride[dim]
    return Region(int(t.storage_offset()) + index * t.stride(dim), tuple(size), tuple(stride),
                  lambda m: m.index_fill_(dim, index, True))


def _put(t: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> Region | None:
    """`index_put_(indices, values)` (`t[i, j] = v`): the positions the index tensors name
    (broadcast together), with every element of the dims they leave out."""
    indices = list(_arg(args, kwargs, 1, "indices", ()))
    picked: list[torch.Tensor] = []
    dims: list[int] = []
    d = 0
    for i, ix in enumerate(indices):
        if ix is None:
            d += 1
        elif ix.dtype in (torch.bool, torch.uint8):  # a mask over the next ix.dim() dims
            ix = indices[i] = ix.to(torch.bool)
            found = ix.nonzero()
            picked.extend(found[:, k] for k in range(ix.dim()))
            dims.extend(range(d, d + ix.dim()))
            d += ix.dim()
        else:
            picked.append(_checked(ix, t.size(d)))
            dims.append(d)
            d += 1
    if d > t.dim():
        return None
    offsets = torch.tensor([int(t.storage_offset())])
    if picked:
        together = torch.broadcast_tensors(*picked)  # type: ignore[no-untyped-call]
        offsets = offsets + sum(ix.reshape(-1) * t.stride(k) for ix, k in zip(together, dims))
    rest = [k for k in range(t.dim()) if k not in dims]
    true = torch.ones((), dtype=torch.bool)
    return Region(offsets, tuple(t.size(k) for k in rest), tuple(t.stride(k) for k in rest),
                  lambda m: torch.ops.aten.index_put_.default(m, indices, true))


def _scatter(t: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> Region:
    """`scatter_(dim, index, src or value)`: the element each index entry names."""
    dim = _arg(args, kwargs, 1, "dim", 0) % max(t.dim(), 1)
    index = _arg(args, kwargs, 2, "index", None)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= t.size(dim)):
        raise IndexError("index out of range")
    return Region(None, (), (), lambda m: m.scatter_(dim, index, True))


def _masked(t: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> Region:
    """`masked_fill_(mask, value)`, `masked_scatter_(mask, source)`: where `mask` is set."""
    mask = _arg(args, kwargs, 1, "mask", None)
    return Region(None, (), (), lambda m: m.masked_fill_(mask, True))


_INDEXED: dict[str, Callable[[torch.Tensor, Sequence[Any], dict[str, Any]], Region | None]] = {
    "aten::index_copy_": _along,
    "aten::index_fill_": _along,
    "aten::index_put_": _put,
    "aten::_index_put_impl_": _put,
    "aten::scatter_": _scatter,
    "aten::masked_fill_": _masked,
    "aten::masked_scatter_": _masked,
}
