"""Comparing a recomputed tensor with the one a model holds: bitwise, or within a
tolerance, without allocating anything of their size.

Contiguous host memory is compared in place with the C library's `memcmp` (equal bits
are equal bytes; torch's `eq` and `all` run at a fraction of memory speed on the CPU);
anything else (a GPU, strided layouts, a tolerance) in cache-sized pieces of flat views,
with one piece's scratch. What differs, and by how much, is worked out only on a
mismatch, for the error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable, Iterator

import torch

__all__ = ["compare"]

_PIECE_BYTES = {"cuda": 1 << 24}
"""Bytes of each operand compared at once, per device type: a piece and its scratch stay
in the CPU's cache; on a GPU fewer, larger pieces save launches."""
_CPU_PIECE_BYTES = 1 << 20


def compare(r: torch.Tensor, held: torch.Tensor, *, atol: float, rtol: float) -> str | None:
    """None if `r` equals `held` (bitwise, or within `atol` + `rtol` * |held|, NaN equal
    to NaN), else what differs, for the error.

    Contiguous host memory is compared in place with `memcmp`; anything else in
    cache-sized pieces of flat views, one piece's scratch being all it allocates. What
    differs, and by how much, is computed (in pieces too) only on a mismatch.
    """
    r, held = r.detach(), held.detach()
    if r.shape != held.shape or r.dtype != held.dtype or r.device != held.device:
        return (f"recomputed: shape {tuple(r.shape)}, {r.dtype} on {r.device}; held: shape "
                f"{tuple(held.shape)}, {held.dtype} on {held.device}")
    if r.numel() == 0:
        return None
    tolerant = (atol > 0.0 or rtol > 0.0) and (held.is_floating_point() or held.is_complex())
    if r.layout != torch.strided or held.layout != torch.strided:
        same = bool(torch.equal(r, held)) if not tolerant else bool(
            torch.allclose(r.to_dense(), held.to_dense(), rtol=rtol, atol=atol, equal_nan=True))
    else:
        same = _same(r, held, atol, rtol, tolerant)
    return None if same else _difference(r, held, atol, rtol, tolerant)


def _same(r: torch.Tensor, held: torch.Tensor, atol: float, rtol: float, tolerant: bool) -> bool:
    if tolerant:
        return _close(r, held, atol, rtol)
    if r.device.type == "cpu" and _MEMCMP is not None and _dense_same(r, held):
        # Host memory of the same layout: equal bits are equal bytes, compared in place.
        return _MEMCMP(r.data_ptr(), held.data_ptr(), r.nbytes) == 0
    a, b = _bits(r), _bits(held)
    if a is None or b is None:  # no integer type of its width: torch's own equality
        return bool(torch.equal(r, held))
    n = _piece(a)
    scratch = torch.empty(n, dtype=a.dtype, device=a.device)
    differ = torch.zeros((), dtype=torch.int64, device=a.device)
    for pa, pb in _pieces(a, b, n):
        # Equal bits xor to zero; xor and a count are vectorized where `eq` and `all`
        # are not.
        x = torch.bitwise_xor(pa, pb, out=scratch[: pa.numel()].view(pa.shape))
        differ += torch.count_nonzero(x)
    return not bool(differ)  # one synchronization per tensor on a GPU


def _close(r: torch.Tensor, held: torch.Tensor, atol: float, rtol: float) -> bool:
    """Whether |r - held| <= atol + rtol * |held| everywhere (NaN equal to NaN), as
    `torch.isclose`, piece by piece."""
    differ = torch.zeros((), dtype=torch.int64, device=r.device)
    for pa, pb in _pieces(r, held, _piece(r)):
        differ += torch.count_nonzero(~torch.isclose(pa, pb, rtol=rtol, atol=atol,
                                                     equal_nan=True))
    return not bool(differ)


def _dense_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are both contiguous, so that their bytes line up."""
    return a.is_contiguous() and b.is_contiguous() and not (a.is_conj() or b.is_conj()
                                                            or a.is_neg() or b.is_neg())


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's `memcmp`, or None where ctypes cannot find it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.memcmp
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _libc_memcmp()
"""Bitwise comparison of host memory at memory speed (torch's `eq` and `all` on the CPU
run at a fraction of it); the tensor pieces are the fallback."""


def _difference(r: torch.Tensor, held: torch.Tensor, atol: float, rtol: float,
                tolerant: bool) -> str:
    """How `r` differs from `held`: the elements that differ and the largest difference."""
    if r.layout != torch.strided or held.layout != torch.strided:
        r, held = r.to_dense(), held.to_dense()
    numeric = r.is_floating_point() or r.is_complex() or r.dtype != torch.bool
    count, worst = 0, 0.0
    a, b = (_bits(r), _bits(held)) if not tolerant else (r, held)
    if a is None or b is None or a.shape != r.shape:  # complex128: compared as itself
        a, b = r, held
    n = _piece(r)
    for (pa, pb), (pr, ph) in zip(_pieces(a, b, n), _pieces(r, held, n)):
        if tolerant:
            differ = ~torch.isclose(pa, pb, rtol=rtol, atol=atol, equal_nan=True)
        else:
            differ = torch.ne(pa, pb)
        count += int(differ.sum())
        if numeric:
            d = (pr.to(torch.complex128 if pr.is_complex() else torch.float64)
                 - ph.to(torch.complex128 if ph.is_complex() else torch.float64)).abs()
            d = torch.where(differ, d, torch.zeros((), dtype=d.dtype, device=d.device))
            piece_worst = float(d.max())
            worst = piece_worst if math.isnan(piece_worst) else max(worst, piece_worst)
    total = r.numel()
    how = "bitwise" if not tolerant else f"beyond atol={atol:g}, rtol={rtol:g}"
    if not numeric:
        return f"{count} of {total} elements differ ({how})"
    return f"{count} of {total} elements differ ({how}), max abs difference {worst:.6g}"


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """`t` viewed as integers of its width (equal views: equal bits), or None."""
    if t.is_quantized:
        return None
    if t.dtype == torch.complex128:
        t = torch.view_as_real(t)
    width = _INT_OF_WIDTH.get(t.element_size())
    if width is None:
        return None
    try:
        return t.view(width)
    except RuntimeError:  # a layout the dtype view does not take
        return None


def _piece(t: torch.Tensor) -> int:
    """Elements of `t` compared at once."""
    per = _PIECE_BYTES.get(t.device.type, _CPU_PIECE_BYTES)
    return max(1, min(t.numel(), per // max(1, t.element_size())))


def _pieces(
    a: torch.Tensor, b: torch.Tensor, n: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Matching pieces of `a` and `b` of about `n` elements: of flat views where both are
    contiguous, else of whole rows along the first dimension."""
    if a.is_contiguous() and b.is_contiguous():
        fa, fb = a.reshape(-1), b.reshape(-1)
        for i in range(0, fa.numel(), n):
            yield fa[i : i + n], fb[i : i + n]
        return
    if a.dim() == 0:
        yield a, b
        return
    rows = max(1, n // max(1, a[0].numel()))
    for i in range(0, a.shape[0], rows):
        yield a[i : i + rows], b[i : i + rows]
