"""The registry shipped for SGLang's DeepSeek multi-head latent attention: `w_kc` and `w_vc`,
the per-head up-projections SGLang's `post_load_weights` splits out of `kv_b_proj.weight`."""

from __future__ import annotations

import importlib

import torch
from torch import Tensor, nn

from graphsafe._declare.registry import Registry

DEEPSEEK_MLA = "graphsafe.integrations.sglang:deepseek_mla_registry"
"""The name of `deepseek_mla_registry` for `enable()` (`GRAPHSAFE_SGLANG_REGISTRIES`)."""

_QUANTIZED = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.int8)


def _plain(module: nn.Module) -> bool:
    """Whether `module` splits `w_kc`/`w_vc` straight out of its `kv_b_proj.weight` (an
    unquantized weight, no DeepGEMM batched matmul): the layouts this registry makes."""
    proj = getattr(module, "kv_b_proj", None)
    weight = getattr(proj, "weight", None)
    return (
        isinstance(weight, Tensor)
        and weight.dtype not in _QUANTIZED
        and not hasattr(proj, "qweight")
        and not getattr(module, "use_deep_gemm_bmm", False)
    )


def _split(module: nn.Module, kv_b: Tensor) -> tuple[Tensor, Tensor]:
    dn = int(getattr(module, "qk_nope_head_dim"))  # noqa: B009 (SGLang's attribute)
    dv = int(getattr(module, "v_head_dim"))  # noqa: B009
    kv = kv_b.reshape(-1, dn + dv, kv_b.shape[-1])  # [H, dn + dv, r], a view
    return kv[:, :dn], kv[:, dn:].transpose(1, 2)  # [H, dn, r], [H, r, dv]


def mla_split(
    module: nn.Module, kv_b: Tensor, *, out: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """`w_kc` `[H, qk_nope_head_dim, kv_lora_rank]` and `w_vc` `[H, kv_lora_rank,
    v_head_dim]` from `kv_b_proj.weight`, in the layouts SGLang's `post_load_weights`
    gives them (both transposed views of contiguous storage), so that the tensors SGLang
    bound at its first load are adopted and refreshed in place.

    Args:
        module: SGLang's `DeepseekV2AttentionMLA` layer.
        kv_b: Its `kv_b_proj.weight`, `[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
        out: The buffers to write into (a refresh).

    Returns:
        `(w_kc, w_vc)`: `out`, written, or new tensors.
    """
    w_kc, w_vc = _split(module, kv_b)
    if out is None:
        return (
            w_kc.transpose(1, 2).contiguous().transpose(1, 2),
            w_vc.transpose(1, 2).contiguous().transpose(1, 2),
        )
    out[0].copy_(w_kc)
    out[1].copy_(w_vc)
    return out


def deepseek_mla_registry() -> Registry:
    """The registry of SGLang's DeepSeek MLA derived buffers (`DEEPSEEK_MLA` names it).

    `w_kc` and `w_vc` of each `DeepseekV2AttentionMLA` layer (DeepSeek V2, V3 and the
    models built on its attention) are declared as one derivation from
    `kv_b_proj.weight`, for layers whose weight is unquantized (`when`): every weight
    update that writes `kv_b_proj.weight` refreshes them in place at its end, whichever of
    SGLang's entry points made it.

    Returns:
        A new registry (SGLang's model classes are imported here, not when graphsafe is).
    """
    mla = importlib.import_module("sglang.srt.models.deepseek_v2").DeepseekV2AttentionMLA
    reg = Registry()
    reg.derive(mla, ("w_kc", "w_vc"), inputs=["kv_b_proj.weight"],
               when=_plain)(mla_split)
    return reg
