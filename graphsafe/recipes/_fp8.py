"""The FP8 recipe: weights quantized per tensor or per block, with their scales."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from graphsafe.recipes._recipe import Recipe, check_fits, named

__all__ = ["dequantize_fp8", "fp8_quantize"]

# Elements of float32 scratch per chunk of FP8 quantization (4 MiB per tensor; a row of
# blocks is cut into column chunks of whole blocks near this size).
_CHUNK = 1 << 18

Block = tuple[int, int] | None


def fp8_quantize(*, block: Block = None, dtype: torch.dtype = torch.float8_e4m3fn) -> Recipe:
    """FP8 weights with float32 `weight_scale_inv` scales, per tensor or per block.

    A block's scale is `amax(|block|) / finfo(dtype).max`, so `w_hat = weight_q.float() *
    scale` is within half an FP8 step: `|w_hat - w| <= eps / 2 * max(|w|, scale * tiny)`
    (`torch.finfo(dtype)`). An all-zero block gets the scale `1 / finfo(dtype).max`.

    Args:
        block: `None` for one scale `[1]` (any weight shape), or `(bm, bn)` for a 2-D
            weight `[M, N]`: scales `[ceil(M / bm), ceil(N / bn)]`.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.

    Returns:
        `fn(module, *weights, out=None) -> (weight_q, scale_inv)`, of the weights'
        concatenation along dim 0 (a fused QKV) without materializing it.

    Raises:
        ValueError: A bad block or dtype (here), or (when called) a block-quantized
            weight that is not 2-D, or weights whose shapes past dim 0 differ.

    Examples:
        >>> q, s = fp8_quantize(block=(2, 2))(None, torch.tensor([[1.0, -2.0, 3.0]]))
        >>> dequantize_fp8(q, s, block=(2, 2))
        tensor([[ 1., -2.,  3.]])
    """
    _check_dtype(dtype)
    block = _checked_block(block)
    fmax = float(torch.finfo(dtype).max)
    where = f"block={block}" if block is not None else "per tensor"
    name = f"fp8_quantize({where}, dtype={dtype})"

    def fn(
        module: object, *weights: Tensor, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        shape = _concatenated_shape(name, weights, block)
        q, scales = _outputs(name, module, shape, block, dtype, weights[0].device, out)
        with torch.no_grad():
            _quantize_into(weights, q, scales, block, fmax)
        return (q, scales) if out is None else out

    return named(fn, name)


def dequantize_fp8(
    weight_q: Tensor,
    scale_inv: Tensor,
    *,
    block: Block = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The weight that `fp8_quantize` results stand for: `weight_q * scale_inv` by block.

    Views, a cast and one multiply: it can run inside a captured forward.

    Args:
        weight_q: FP8 weight `[M, N]` (any shape when `block` is None).
        scale_inv: `[1]`, or `[ceil(M / bm), ceil(N / bn)]` for `block=(bm, bn)`.
        block: The block the weight was quantized with.
        dtype: The result's dtype.

    Returns:
        The dequantized weight, shaped like `weight_q`.
    """
    if block is None:
        return weight_q.to(dtype) * scale_inv.to(dtype)
    (M, N), (bm, bn) = weight_q.shape, block
    Mb, Nb = scale_inv.shape
    s = scale_inv.to(dtype)[:, None, :, None].expand(Mb, bm, Nb, bn)  # [Mb, bm, Nb, bn]
    return weight_q.to(dtype) * s.reshape(Mb * bm, Nb * bn)[:M, :N]  # [M, N]


# -----------------------------------------------------------------------------
# checks and buffers


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"fp8_quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        )


def _checked_block(block: Block) -> Block:
    if block is None:
        return None
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"fp8_quantize: block must be two positive ints, got {block!r}")
    return (block[0], block[1])


def _concatenated_shape(name: str, weights: Sequence[Tensor], block: Block) -> tuple[int, ...]:
    """The shape of the weights' concatenation along dim 0, which they must allow."""
    if not weights:
        raise ValueError(f"{name}: expected at least one weight, got none")
    first = weights[0]
    if first.dim() < 1 or (block is not None and first.dim() != 2):
        raise ValueError(
            f"{name}: expected a 2-D weight [M, N]"
            + (" (or any shape, per tensor)" if block is None else "")
            + f", got shape {list(first.shape)}"
        )
    for i, w in enumerate(weights[1:], 1):
        if w.dim() != first.dim() or w.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"{name}: weights are quantized as their concatenation along dim 0, "
                f"so they must agree past it: weight 0 has shape {list(first.shape)}, "
                f"weight {i} has shape {list(w.shape)}"
            )
    return (sum(w.shape[0] for w in weights), *first.shape[1:])


def _outputs(
    name: str, module: object, shape: tuple[int, ...], block: Block, dtype: torch.dtype,
    device: torch.device, out: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor]:
    """New `(weight_q, scale_inv)`, or the `out` pair once it is known to fit."""
    scale_shape = (1,) if block is None else tuple(-(-m // b) for m, b in zip(shape, block))
    if out is None:
        return (torch.empty(shape, dtype=dtype, device=device),
                torch.empty(scale_shape, dtype=torch.float32, device=device))
    q, scales = out
    check_fits(name, module, "weight_q", q, shape, dtype)
    check_fits(name, module, "scale_inv", scales, scale_shape, torch.float32)
    return q, scales


# -----------------------------------------------------------------------------
# quantizing


def _quantize_into(
    pieces: Sequence[Tensor], q: Tensor, scales: Tensor, block: Block, fmax: float
) -> None:
    """Quantize the row concatenation of `pieces` into `q` and its `scales`."""
    if q.numel() == 0:
        scales.fill_(1.0 / fmax)
    elif block is None:
        _quantize_per_tensor(pieces, q, scales, fmax)
    else:
        _quantize_by_block(pieces, q, scales, block, fmax)


def _quantize_per_tensor(pieces: Sequence[Tensor], q: Tensor, scales: Tensor,
                         fmax: float) -> None:
    """One scale; float32 scratch of about `_CHUNK` elements (whole rows) at a time."""
    amax = torch.stack([_abs_max(p) for p in pieces if p.numel()]).amax()
    scales.copy_(amax.reshape(1))
    _finish_scales(scales, fmax)
    at = 0  # first row of the current piece
    for p in pieces:
        step = max(1, _CHUNK // max(1, p[0].numel())) if p.shape[0] else 1
        for i in range(0, p.shape[0], step):
            t = p[i : i + step].to(torch.float32, copy=True)
            t.div_(scales).clamp_(-fmax, fmax)
            q[at + i : at + i + t.shape[0]].copy_(t)
        at += p.shape[0]


def _quantize_by_block(pieces: Sequence[Tensor], q: Tensor, scales: Tensor,
                       block: tuple[int, int], fmax: float) -> None:
    """A scale per block; float32 scratch of one row of blocks, in column chunks."""
    bm, bn = block
    M, N = q.shape
    # Column chunks of whole blocks, so that the scratch stays near _CHUNK elements
    # however wide the weight is (a layer's memory bound has room for little more).
    width = max(1, _CHUNK // (bm * bn)) * bn
    scratch = torch.empty(min(bm, M), min(width, N), dtype=torch.float32, device=q.device)
    for i in range(scales.shape[0]):
        start, stop = i * bm, min((i + 1) * bm, M)
        for c0 in range(0, N, width):
            c1 = min(c0 + width, N)
            t = scratch[: stop - start, : c1 - c0]  # [rows, c1 - c0]
            _gather_rows(pieces, start, stop, t, slice(c0, c1))
            _scale_chunk(t, scales[i, c0 // bn : -(-c1 // bn)], bn, fmax)
            q[start:stop, c0:c1].copy_(t)


def _scale_chunk(t: Tensor, srow: Tensor, bn: int, fmax: float) -> None:
    """Scale a chunk of whole column blocks in place (the last may be ragged): the
    blocks' scales into `srow`, then `t / scale`, clamped to the format's range."""
    r, w = t.shape
    nf = w // bn  # full column blocks in this chunk
    K = nf * bn
    if nf:
        srow[:nf].copy_(_abs_max(t[:, :K].view(r, nf, bn), dim=(0, 2)))  # [nf]
    if w > K:  # the ragged last column block
        srow[nf:].copy_(_abs_max(t[:, K:]).reshape(1))
    _finish_scales(srow, fmax)
    if nf:
        t[:, :K].view(r, nf, bn).div_(srow[:nf, None])
    if w > K:
        t[:, K:].div_(srow[nf:])
    t.clamp_(-fmax, fmax)


def _finish_scales(amax: Tensor, fmax: float) -> None:
    """`amax / fmax` in place; a zero scale (all zeros, or underflow) gets `1 / fmax`."""
    amax.div_(fmax)
    amax.masked_fill_(amax == 0, 1.0 / fmax)


def _abs_max(t: Tensor, dim: tuple[int, ...] | None = None) -> Tensor:
    """`max |t|` (over `dim`, or all of it), exact, without the `|t|` temporary."""
    # max(amax, -amin): two reductions, faster on CPUs than vector_norm(ord=inf) over
    # non-adjacent dims.
    if dim is None:
        return torch.maximum(t.amax(), t.amin().neg_())
    return torch.maximum(t.amax(dim=dim), t.amin(dim=dim).neg_())


def _gather_rows(
    pieces: Sequence[Tensor], start: int, stop: int, into: Tensor, cols: slice = slice(None)
) -> None:
    """Copy rows `[start, stop)` (columns `cols`) of the pieces' row concatenation."""
    at = 0  # first row of the current piece
    for p in pieces:
        lo, hi = max(start, at), min(stop, at + p.shape[0])
        if lo < hi:
            into[lo - start : hi - start].copy_(p[lo - at : hi - at, cols])
        at += p.shape[0]
        if at >= stop:
            return
