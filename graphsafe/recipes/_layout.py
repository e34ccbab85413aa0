"""Layout recipes: fused (concatenated) and transposed weights."""

from __future__ import annotations

import torch
from torch import Tensor

from graphsafe.recipes._recipe import Recipe, check_fits, named

__all__ = ["concat", "transpose"]


def concat(dim: int = 0) -> Recipe:
    """Concatenate the inputs along `dim`: fused QKV, fused gate-up.

    Args:
        dim: The dimension to concatenate along.

    Returns:
        `fn(module, *tensors, out=None) -> Tensor`; with `out`, `torch.cat(..., out=out)`.
    """
    name = f"concat(dim={dim})"

    def fn(module: object, *tensors: Tensor, out: Tensor | None = None) -> Tensor:
        if out is None:
            return torch.cat(tensors, dim=dim)
        shape = list(tensors[0].shape)
        d = dim % len(shape)
        shape[d] = sum(t.shape[d] for t in tensors)
        check_fits(name, module, "the concatenation", out, shape)
        return torch.cat(tensors, dim=dim, out=out)

    return named(fn, name)


def transpose(dim0: int = 0, dim1: int = 1) -> Recipe:
    """Swap two dimensions into a contiguous copy: `[out, in]` weights for `x @ w`.

    Args:
        dim0: First dimension.
        dim1: Second dimension.

    Returns:
        `fn(module, weight, out=None) -> Tensor`, contiguous; with `out`, a copy into it.
    """
    name = f"transpose(dim0={dim0}, dim1={dim1})"

    def fn(module: object, weight: Tensor, *, out: Tensor | None = None) -> Tensor:
        t = weight.transpose(dim0, dim1)
        if out is None:
            # clone, not contiguous(): a transpose over a size-1 dim is already
            # contiguous, and contiguous() would return a view of the weight.
            return t.clone(memory_format=torch.contiguous_format)
        check_fits(name, module, "the transpose", out, t.shape)
        return out.copy_(t)

    return named(fn, name)
