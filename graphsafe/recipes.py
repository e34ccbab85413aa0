"""Recipes: derivations that turn checkpoint weights into the layouts kernels read.

Each factory returns a derivation function `fn(module, *inputs, out=None)`: fused
projections, transposes, FP8 block quantization with DeepSeek's `weight_scale_inv`
layout, MLA's absorbed up-projections, merged LoRA weights and DeepSeek V4's folded mHC
projection. Without `out` a recipe returns new tensors that own their memory; with `out`
(a tensor, or a tuple for the recipes with several outputs) it writes into it and returns
it, allocating nothing beyond what its arithmetic needs, so graphsafe refreshes it on the
fast path. A recipe checks that `out` fits before writing anything and raises
`gs.DerivationDriftError` otherwise.

A recipe goes wherever a derivation function does:

    gs.Derivation(outputs="wqkv", inputs=["wq", "wk", "wv"], fn=recipes.concat(0))
    registry.register(Attention, that_derivation)
    registry.derive(Attention, "wqkv", inputs=[...])(recipes.concat(0))

and in the body of a `gs.graphsafe` class, through `recipes.derive`:

    @gs.graphsafe
    class Attention(nn.Module):
        _wqkv = recipes.derive("wqkv", inputs=["wq.weight", "wk.weight", "wv.weight"],
                               fn=recipes.concat(0))

A recipe whose parameters depend on the instance (a block size from its config) is
called from a marked method: `return self.quantize(self, w, out=out)`.

Examples:
    >>> import torch
    >>> fuse = concat(0)
    >>> fuse(None, torch.ones(2, 3), torch.zeros(1, 3)).shape
    torch.Size([3, 3])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from graphsafe._declare.decorators import derive as _derive
from graphsafe._errors import DerivationDriftError

__all__ = [
    "Recipe",
    "concat",
    "dequantize_fp8",
    "derive",
    "fold_streams",
    "fp8_quantize",
    "lora_merge",
    "mla_absorb",
    "transpose",
]

Recipe = Callable[..., Any]
"""A derivation function `fn(module, *inputs, out=None)`."""

# Elements of float32 scratch per chunk of FP8 quantization (4 MiB per tensor; a row of
# blocks is cut into column chunks of whole blocks near this size).
_CHUNK = 1 << 18


def _named(fn: Recipe, name: str) -> Recipe:
    """Give a recipe the name reports and errors show, e.g. `concat(dim=0)`."""
    fn.__name__ = name.partition("(")[0]
    fn.__qualname__ = name
    fn.__module__ = __name__
    return fn


def _fits(recipe: str, module: object, what: str, out: Tensor, shape: Sequence[int],
          dtype: torch.dtype | None = None) -> None:
    """Refuse an `out` buffer that the result would not fit, before writing anything.

    `copy_` broadcasts and torch resizes `out=` tensors; either would hide a drift.
    """
    want = tuple(shape)
    if tuple(out.shape) == want and (dtype is None or out.dtype == dtype):
        return
    expected = f"shape {want}" + (f", dtype {dtype}" if dtype is not None else "")
    raise DerivationDriftError(
        f"{recipe}: the out= buffer for {what} does not fit the result",
        module_class=type(module).__name__,
        derivation=recipe,
        expected=expected,
        got=f"shape {tuple(out.shape)}, dtype {out.dtype}",
        fix="check that the inputs kept the shapes they had when the buffers were "
        "materialized, or refresh without out= to make new buffers",
    )


def concat(dim: int = 0) -> Recipe:
    """Concatenate the inputs along `dim`: fused QKV, fused gate-up.

    Args:
        dim: The dimension to concatenate along.

    Returns:
        `fn(module, *tensors, out=None) -> Tensor`; with `out`, `torch.cat(..., out=out)`.

    Examples:
        >>> import torch
        >>> concat(1)(None, torch.ones(2, 1), torch.zeros(2, 2)).tolist()
        [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    """
    name = f"concat(dim={dim})"

    def fn(module: object, *tensors: Tensor, out: Tensor | None = None) -> Tensor:
        if out is None:
            return torch.cat(tensors, dim=dim)
        shape = list(tensors[0].shape)
        d = dim % len(shape)
        shape[d] = sum(t.shape[d] for t in tensors)
        _fits(name, module, "the concatenation", out, shape)
        return torch.cat(tensors, dim=dim, out=out)

    return _named(fn, name)


def transpose(dim0: int = 0, dim1: int = 1) -> Recipe:
    """Swap two dimensions into a contiguous copy: `[out, in]` weights for `x @ w`.

    Args:
        dim0: First dimension.
        dim1: Second dimension.

    Returns:
        `fn(module, weight, out=None) -> Tensor`, contiguous; with `out`,
        `out.copy_(weight.transpose(dim0, dim1))`.

    Examples:
        >>> import torch
        >>> t = transpose()(None, torch.arange(6.0).view(2, 3))
        >>> t.shape, t.is_contiguous()
        (torch.Size([3, 2]), True)
    """
    name = f"transpose(dim0={dim0}, dim1={dim1})"

    def fn(module: object, weight: Tensor, *, out: Tensor | None = None) -> Tensor:
        t = weight.transpose(dim0, dim1)
        if out is None:
            # clone, not contiguous(): a transpose over a size-1 dim is already
            # contiguous, and contiguous() would return a view of the weight.
            return t.clone(memory_format=torch.contiguous_format)
        _fits(name, module, "the transpose", out, t.shape)
        return out.copy_(t)

    return _named(fn, name)


def fold_streams(hc_mult: int, hidden_size: int) -> Recipe:
    """DeepSeek V4's mHC projection for `n` identical streams: `hc_fn.view(mix, n, C).sum(1)`.

    With `xf = [x, ..., x]` (`n` copies), `linear(xf, hc_fn) = linear(x, folded)`.

    Args:
        hc_mult: `n`, the number of residual streams.
        hidden_size: `C`, the width of one stream.

    Returns:
        `fn(module, hc_fn [mix, n*C], out=None) -> [mix, C]`; with `out`,
        `torch.sum(..., out=out)`.

    Examples:
        >>> import torch
        >>> fold_streams(4, 8)(None, torch.ones(24, 32))[0, 0]
        tensor(4.)
    """
    name = f"fold_streams(hc_mult={hc_mult}, hidden_size={hidden_size})"

    def fn(module: object, hc_fn: Tensor, *, out: Tensor | None = None) -> Tensor:
        streams = hc_fn.reshape(-1, hc_mult, hidden_size)  # [mix, n, C], a view if it can
        if out is not None:
            _fits(name, module, "the folded projection", out, (streams.shape[0], hidden_size))
        return torch.sum(streams, dim=1, out=out)  # [mix, C]

    return _named(fn, name)


def lora_merge(*, scaling: float) -> Recipe:
    """A LoRA adapter merged into its base weight: `base + scaling * lora_b @ lora_a`.

    Args:
        scaling: The adapter's scale (`lora_alpha / r` in PEFT).

    Returns:
        `fn(module, base [O, I], lora_a [r, I], lora_b [O, r], out=None) -> [O, I]`;
        with `out`, `torch.addmm(base, lora_b, lora_a, alpha=scaling, out=out)`.

    Examples:
        >>> import torch
        >>> lora_merge(scaling=0.5)(None, torch.zeros(2, 2), torch.ones(1, 2),
        ...                         torch.ones(2, 1)).tolist()
        [[0.5, 0.5], [0.5, 0.5]]
    """
    name = f"lora_merge(scaling={scaling})"

    def fn(
        module: object, base: Tensor, lora_a: Tensor, lora_b: Tensor, *,
        out: Tensor | None = None,
    ) -> Tensor:
        if out is not None:
            _fits(name, module, "the merged weight", out, base.shape)
        return torch.addmm(base, lora_b, lora_a, alpha=scaling, out=out)  # [O, I]

    return _named(fn, name)


def mla_absorb(*, num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> Recipe:
    """MLA's per-head up-projections, split out of `kv_b_proj.weight` for absorption.

    `kv = w.view(H, dn + dv, r)`; `w_uk = kv[:, :dn, :]` absorbs into the queries
    (`q_nope @ w_uk` gives a query in the latent space) and `w_uv = kv[:, dn:, :]`
    transposed to `[H, r, dv]` maps attention over latents back to values.

    Args:
        num_heads: `H`.
        qk_nope_head_dim: `dn`, the non-RoPE part of a query/key head.
        v_head_dim: `dv`, a value head.

    Returns:
        `fn(module, kv_b_weight [H*(dn+dv), r], out=None) -> (w_uk [H, dn, r],
        w_uv [H, r, dv])`, both contiguous; with `out=(w_uk, w_uv)`, copies into them.

    Raises:
        ValueError: A size is not positive (here), or the weight's rows are not
            `H * (dn + dv)` (when called).

    Examples:
        >>> import torch
        >>> w_uk, w_uv = mla_absorb(num_heads=2, qk_nope_head_dim=3, v_head_dim=4)(
        ...     None, torch.randn(2 * 7, 5))
        >>> tuple(w_uk.shape), tuple(w_uv.shape)
        ((2, 3, 5), (2, 5, 4))
    """
    H, dn, dv = num_heads, qk_nope_head_dim, v_head_dim
    for label, value in (("num_heads", H), ("qk_nope_head_dim", dn), ("v_head_dim", dv)):
        if value < 1:
            raise ValueError(f"mla_absorb: {label} must be at least 1, got {value}")
    name = f"mla_absorb(num_heads={H}, qk_nope_head_dim={dn}, v_head_dim={dv})"

    def fn(
        module: object, kv_b_weight: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != H * (dn + dv):
            raise ValueError(
                f"{name}: kv_b_proj.weight must be [num_heads * (qk_nope_head_dim + "
                f"v_head_dim), kv_lora_rank] = [{H * (dn + dv)}, r], got "
                f"{list(kv_b_weight.shape)}"
            )
        r = kv_b_weight.shape[1]
        kv = kv_b_weight.reshape(H, dn + dv, r)  # [H, dn+dv, r], a view when contiguous
        w_uk = kv[:, :dn, :]  # [H, dn, r]
        w_uv = kv[:, dn:, :].transpose(1, 2)  # [H, r, dv]
        if out is None:
            return (
                w_uk.clone(memory_format=torch.contiguous_format),
                w_uv.clone(memory_format=torch.contiguous_format),
            )
        uk, uv = out
        _fits(name, module, "w_uk", uk, w_uk.shape)
        _fits(name, module, "w_uv", uv, w_uv.shape)
        uk.copy_(w_uk)
        uv.copy_(w_uv)
        return out

    return _named(fn, name)


def _scale_shape(shape: Sequence[int], block: tuple[int, int] | None) -> tuple[int, ...]:
    if block is None:
        return (1,)
    (M, N), (bm, bn) = shape, block
    return (-(-M // bm), -(-N // bn))


def _finish_scales(amax: Tensor, fmax: float) -> None:
    """`amax / fmax` in place; a block whose scale is zero (all zeros, or an amax so
    small that the division underflows) gets `1 / fmax`, so it quantizes to zeros."""
    amax.div_(fmax)
    amax.masked_fill_(amax == 0, 1.0 / fmax)


def _abs_max(t: Tensor, dim: tuple[int, ...] | None = None) -> Tensor:
    """`max |t|` (over `dim`, or all of it), exact, without the `|t|` temporary:
    `max(amax, -amin)`, two reductions that run faster on CPUs than
    `vector_norm(ord=inf)` over non-adjacent dims."""
    if dim is None:
        return torch.maximum(t.amax(), t.amin().neg_())
    return torch.maximum(t.amax(dim=dim), t.amin(dim=dim).neg_())


def _gather_rows(
    pieces: Sequence[Tensor], start: int, stop: int, into: Tensor, cols: slice = slice(None)
) -> None:
    """Copy rows `[start, stop)` (columns `cols`) of the row concatenation of `pieces`
    into `into`."""
    at = 0  # first row of the current piece
    for p in pieces:
        lo, hi = max(start, at), min(stop, at + p.shape[0])
        if lo < hi:
            into[lo - start : hi - start].copy_(p[lo - at : hi - at, cols])
        at += p.shape[0]
        if at >= stop:
            return


def _quantize_into(
    pieces: Sequence[Tensor], q: Tensor, scales: Tensor, block: tuple[int, int] | None,
    fmax: float,
) -> None:
    """Quantize the row concatenation of `pieces` into `q` and its `scales`, through
    float32 scratch of one row of blocks (or one row chunk, per tensor) at a time."""
    if q.numel() == 0:
        scales.fill_(1.0 / fmax)
        return
    if block is None:
        amax = torch.stack([_abs_max(p) for p in pieces if p.numel()]).amax()
        scales.copy_(amax.reshape(1))
        _finish_scales(scales, fmax)
        at = 0
        for p in pieces:
            step = max(1, _CHUNK // max(1, p[0].numel())) if p.shape[0] else 1
            for i in range(0, p.shape[0], step):
                t = p[i : i + step].to(torch.float32, copy=True)
                t.div_(scales).clamp_(-fmax, fmax)
                q[at + i : at + i + t.shape[0]].copy_(t)
            at += p.shape[0]
        return
    bm, bn = block
    M, N = q.shape
    # Column chunks of whole blocks, so that the scratch stays near _CHUNK elements
    # however wide the weight is (a layer's memory bound has room for little more).
    width = max(1, _CHUNK // (bm * bn)) * bn
    scratch = torch.empty(min(bm, M), min(width, N), dtype=torch.float32, device=q.device)
    for i in range(scales.shape[0]):
        start, stop = i * bm, min((i + 1) * bm, M)
        r = stop - start
        for c0 in range(0, N, width):
            c1 = min(c0 + width, N)
            t = scratch[:r, : c1 - c0]  # [r, c1 - c0]
            _gather_rows(pieces, start, stop, t, slice(c0, c1))
            w = c1 - c0
            nf = w // bn  # full column blocks in this chunk
            K = nf * bn
            srow = scales[i, c0 // bn : c0 // bn + nf + (w > K)]
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
            q[start:stop, c0:c1].copy_(t)


def fp8_quantize(
    *, block: tuple[int, int] | None = None, dtype: torch.dtype = torch.float8_e4m3fn
) -> Recipe:
    """FP8 weights with float32 `weight_scale_inv` scales, per tensor or per block.

    The scale of a block is `amax(|block|) / finfo(dtype).max` (DeepSeek's
    `weight_scale_inv`), so the block's largest element maps to the format's largest
    value and `weight_q.float() * scale` (each scale over its block) approximates the
    weight within half an FP8 step: `|w_hat - w| <= eps / 2 * max(|w|, scale * tiny)`
    with `eps`, `tiny` of `torch.finfo(dtype)`. An all-zero block gets the finite scale
    `1 / finfo(dtype).max` and zeros.

    Args:
        block: `None` for one scale (shape `[1]`, any weight shape), or `(bm, bn)` for a
            2-D weight `[M, N]`: scales `[ceil(M / bm), ceil(N / bn)]`, the last row and
            column of blocks possibly smaller.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.

    Returns:
        `fn(module, weight, out=None) -> (weight_q, scale_inv)`; with
        `out=(weight_q, scale_inv)`, writes into them through float32 scratch of one row
        of blocks at a time. Given several weights, `fn(module, wq, wk, wv, out=...)`
        quantizes their concatenation along dim 0 (a fused QKV weight, blocks straddling
        the seams) without materializing it.

    Raises:
        ValueError: A bad block or dtype (here), or (when called) a block-quantized
            weight that is not 2-D, or weights whose shapes past dim 0 differ.

    Examples:
        >>> import torch
        >>> q, s = fp8_quantize(block=(2, 2))(None, torch.tensor([[1.0, -2.0, 3.0]]))
        >>> q.dtype, s.shape
        (torch.float8_e4m3fn, torch.Size([1, 2]))
        >>> dequantize_fp8(q, s, block=(2, 2))
        tensor([[ 1., -2.,  3.]])
        >>> wq, wk = torch.ones(1, 3), torch.full((2, 3), 4.0)  # a block straddles the seam
        >>> q, s = fp8_quantize(block=(2, 2))(None, wq, wk)
        >>> q.shape, s[0, 0] * torch.finfo(torch.float8_e4m3fn).max
        (torch.Size([3, 3]), tensor(4.))
    """
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"fp8_quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        )
    if block is not None:
        if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
            raise ValueError(f"fp8_quantize: block must be two positive ints, got {block!r}")
        block = (block[0], block[1])
    fmax = float(torch.finfo(dtype).max)
    where = f"block={block}" if block is not None else "per tensor"
    name = f"fp8_quantize({where}, dtype={dtype})"

    def fn(
        module: object, *weights: Tensor, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
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
        shape = (sum(w.shape[0] for w in weights), *first.shape[1:])
        scale_shape = _scale_shape(shape, block)
        if out is None:
            q = torch.empty(shape, dtype=dtype, device=first.device)
            scales = torch.empty(scale_shape, dtype=torch.float32, device=first.device)
        else:
            q, scales = out
            _fits(name, module, "weight_q", q, shape, dtype)
            _fits(name, module, "scale_inv", scales, scale_shape, torch.float32)
        with torch.no_grad():
            _quantize_into(weights, q, scales, block, fmax)
        return (q, scales) if out is None else out

    return _named(fn, name)


def dequantize_fp8(
    weight_q: Tensor,
    scale_inv: Tensor,
    *,
    block: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The weight that `fp8_quantize` results stand for: `weight_q * scale_inv` by block.

    Only views, a type conversion and one multiply, so it can run inside a captured
    forward.

    Args:
        weight_q: FP8 weight `[M, N]` (any shape when `block` is None).
        scale_inv: `[1]`, or `[ceil(M / bm), ceil(N / bn)]` for `block=(bm, bn)`.
        block: The block the weight was quantized with.
        dtype: The result's dtype.

    Returns:
        The dequantized weight, shaped like `weight_q`.

    Examples:
        >>> import torch
        >>> q = torch.ones(3, 3).to(torch.float8_e4m3fn)
        >>> dequantize_fp8(q, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), block=(2, 2))
        tensor([[1., 1., 2.],
                [1., 1., 2.],
                [3., 3., 4.]])
    """
    if block is None:
        return weight_q.to(dtype) * scale_inv.to(dtype)
    (M, N), (bm, bn) = weight_q.shape, block
    Mb, Nb = scale_inv.shape
    s = scale_inv.to(dtype)[:, None, :, None].expand(Mb, bm, Nb, bn)  # [Mb, bm, Nb, bn]
    return weight_q.to(dtype) * s.reshape(Mb * bm, Nb * bn)[:M, :N]  # [M, N]


def derive(
    outputs: str | Sequence[str],
    *,
    inputs: Sequence[str],
    fn: Recipe,
    when: Callable[[Any], bool] | None = None,
) -> Recipe:
    """Declare a recipe as a derivation of a `gs.graphsafe` class, in its body.

    `name = recipes.derive(outputs, inputs=..., fn=recipe)` is
    `gs.derive(outputs, inputs=...)` on a method that calls `recipe(self, *inputs,
    out=out)`. Each call marks a fresh wrapper, so one recipe object can serve several
    declarations.

    Args:
        outputs: The buffer name, or a tuple of names for a recipe with several outputs.
        inputs: Dotted paths relative to the module, in the recipe's argument order.
        fn: The recipe (any `fn(module, *inputs, out=None)`).
        when: As for `gs.derive`.

    Returns:
        The marked method; bind it to a name in the class body.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import graphsafe as gs
        >>> @gs.graphsafe
        ... class Attention(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.wq, self.wk = nn.Linear(4, 4), nn.Linear(4, 2)
        ...     _wqk = derive("wqk", inputs=["wq.weight", "wk.weight"], fn=concat(0))
        >>> attn = Attention()
        >>> _ = gs.runtime(attn).refresh()
        >>> attn.wqk.shape
        torch.Size([6, 4])
    """

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    return _derive(outputs, inputs=inputs, when=when)(method)
