"""A ready-made registry: DeepSeek V4's mHC broadcast weight on vLLM's own decoder layer
class, which vLLM's code binds itself (graphsafe adopts that tensor and keeps it fresh)."""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

from graphsafe import recipes
from graphsafe._declare.registry import Registry
from graphsafe._errors import GraphSafetyError


def deepseek_v4_registry() -> Registry:
    """DeepSeek V4's first-layer broadcast weight on vLLM's own decoder layer class.

    `hc_attn_fn_broadcast = hc_attn_fn.view(mix, hc_mult, hidden).sum(1)`
    (`graphsafe.recipes.fold_streams`), on the layer where vLLM's
    `finalize_mhc_broadcast_weights` bound it (the first layer of the first pipeline
    rank): attach after vLLM's first load. The buffer keeps vLLM's storage.

    Returns:
        A registry for the DeepSeek V4 decoder layer class of the current platform.
    """
    classes = _deepseek_v4_layer_classes()
    reg = Registry()

    def bound_by_vllm(layer: nn.Module) -> bool:
        have = layer.__dict__.get("hc_attn_fn_broadcast")
        if have is None:
            have = layer._buffers.get("hc_attn_fn_broadcast")
        return isinstance(have, torch.Tensor)

    def broadcast(
        layer: nn.Module, hc_attn_fn: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        hc_mult: int = getattr(layer, "hc_mult")  # noqa: B009
        hidden: int = getattr(layer, "hidden_size")  # noqa: B009
        folded: torch.Tensor = recipes.fold_streams(hc_mult, hidden)(layer, hc_attn_fn, out=out)
        return folded

    for cls in classes:
        reg.derive(cls, "hc_attn_fn_broadcast", inputs=["hc_attn_fn"], when=bound_by_vllm)(
            broadcast
        )
    return reg


def _deepseek_v4_layer_classes() -> list[type]:
    from vllm.platforms import current_platform

    out: list[type] = []
    # The CPU build runs the NVIDIA class (its own CPU class has no broadcast weight).
    vendor = "amd" if current_platform.is_rocm() else "nvidia"
    for mod in (f"vllm.models.deepseek_v4.{vendor}.model",):
        try:
            cls = importlib.import_module(mod).DeepseekV4DecoderLayer
        except (ImportError, AttributeError):
            continue
        if "hc_attn_fn_broadcast" in _init_source(cls):
            out.append(cls)
    if not out:
        raise GraphSafetyError(
            "no vLLM DeepSeek V4 decoder layer with an mHC broadcast weight was found",
            expected="vllm.models.deepseek_v4.{nvidia,amd}.model.DeepseekV4DecoderLayer",
            got="neither imports, or neither binds hc_attn_fn_broadcast",
            fix="install the vLLM release graphsafe is tested with (pip install "
            "'graphsafe[vllm]')",
        )
    return out


def _init_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""
