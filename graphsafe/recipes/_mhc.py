"""DeepSeek V4's mHC recipe: the projection of `n` residual streams folded into one."""

from __future__ import annotations

import torch
from torch import Tensor

from graphsafe.recipes._recipe import Recipe, check_fits, named

__all__ = ["fold_streams"]


def fold_streams(hc_mult: int, hidden_size: int) -> Recipe:
    """DeepSeek V4's mHC projection for `n` identical streams: `hc_fn.view(mix, n, C).sum(1)`.

    With `xf = [x, ..., x]` (`n` copies), `linear(xf, hc_fn) = linear(x, folded)`.

    Args:
        hc_mult: `n`, the number of residual streams.
        hidden_size: `C`, the width of one stream.

    Returns:
        `fn(module, hc_fn [mix, n*C], out=None) -> [mix, C]`.
    """
    name = f"fold_streams(hc_mult={hc_mult}, hidden_size={hidden_size})"

    def fn(module: object, hc_fn: Tensor, *, out: Tensor | None = None) -> Tensor:
        streams = hc_fn.reshape(-1, hc_mult, hidden_size)  # [mix, n, C], a view if it can
        if out is not None:
            check_fits(name, module, "the folded projection", out,
                       (streams.shape[0], hidden_size))
        return torch.sum(streams, dim=1, out=out)  # [mix, C]

    return named(fn, name)
