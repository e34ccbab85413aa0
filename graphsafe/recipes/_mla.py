"""The MLA recipe: per-head up-projections split out of `kv_b_proj` for absorption."""

from __future__ import annotations

import torch
from torch import Tensor

from graphsafe.recipes._recipe import Recipe, check_fits, named

__all__ = ["mla_absorb"]


def mla_absorb(*, num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> Recipe:
    """MLA's per-head up-projections, split out of `kv_b_proj.weight` for absorption.

    With `kv = w.view(H, dn + dv, r)`, `w_uk = kv[:, :dn]` absorbs into the queries and
    `w_uv = kv[:, dn:].transpose(1, 2)` maps attention over latents to values.

    Args:
        num_heads: `H`.
        qk_nope_head_dim: `dn`, the non-RoPE part of a query/key head.
        v_head_dim: `dv`, a value head.

    Returns:
        `fn(module, kv_b_weight [H*(dn+dv), r], out=None) -> (w_uk [H, dn, r],
        w_uv [H, r, dv])`, both contiguous; with `out=(w_uk, w_uv)`, copies into them.

    Raises:
        ValueError: A size below 1 (here), or a weight not `[H * (dn + dv), r]` (when called).
    """
    H, dn, dv = num_heads, qk_nope_head_dim, v_head_dim
    for label, value in (("num_heads", H), ("qk_nope_head_dim", dn), ("v_head_dim", dv)):
        if value < 1:
            raise ValueError(f"mla_absorb: {label} must be at least 1, got {value}")
    name = f"mla_absorb(num_heads={H}, qk_nope_head_dim={dn}, v_head_dim={dv})"

    def fn(
        module: object, kv_b_weight: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        _check_kv_b(name, kv_b_weight, H * (dn + dv))
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
        check_fits(name, module, "w_uk", uk, w_uk.shape)
        check_fits(name, module, "w_uv", uv, w_uv.shape)
        uk.copy_(w_uk)
        uv.copy_(w_uv)
        return out

    return named(fn, name)


def _check_kv_b(name: str, kv_b_weight: Tensor, rows: int) -> None:
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != rows:
        raise ValueError(
            f"{name}: kv_b_proj.weight must be [num_heads * (qk_nope_head_dim + "
            f"v_head_dim), kv_lora_rank] = [{rows}, r], got {list(kv_b_weight.shape)}"
        )
