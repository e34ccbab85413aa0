"""SGLang's real model classes, built in this process on the CPU: tiny configs, Hugging
Face checkpoints of them, and SGLang's runner-level `WeightUpdater` around a model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HEADS, NOPE, ROPE, V, RANK = 2, 8, 4, 8, 8  # the tiny DeepSeek V3's MLA sizes


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, torch_dtype="float32",
    )


def deepseek_config(*, moe: bool = True) -> Any:
    """A tiny DeepSeek V3: MLA in both layers; layer 1 a fused-MoE layer with a shared
    expert (`moe`), or dense. SGLang's CPU path needs YaRN rope."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=None, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1 if moe else 2, moe_layer_freq=1, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1,
        topk_group=1, max_position_embeddings=128, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        torch_dtype="float32",
    )


def config(kind: str) -> Any:
    """A new config of `kind` (SGLang's classes edit the config they are built with):
    "llama", "deepseek" (MoE) or "deepseek_dense"."""
    if kind == "llama":
        return llama_config()
    return deepseek_config(moe=kind == "deepseek")


def hf_model(kind: str, seed: int) -> nn.Module:
    """Hugging Face's model of `config(kind)`, with random weights from `seed`."""
    import transformers

    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.DeepseekV3ForCausalLM
    model = cls(config(kind)).eval()
    with torch.no_grad():
        for p in model.parameters():  # not HF's near-zero init: every weight matters
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def checkpoint(kind: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The weights of `hf_model(kind, seed)` by name, as a checkpoint holds them."""
    return [(k, v.clone()) for k, v in hf_model(kind, seed).state_dict().items()]


def sglang_model(kind: str) -> nn.Module:
    """SGLang's class for `config(kind)`, built on the CPU (weights not loaded)."""
    if kind == "llama":
        from sglang.srt.models.llama import LlamaForCausalLM as Cls
    else:
        from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM as Cls
    return Cls(config=config(kind), quant_config=None)


def updater(model: nn.Module, **custom: Any) -> Any:
    """SGLang's runner-level `WeightUpdater` around `model` (what `ModelRunner` builds)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=custom,
        get_model=lambda: model, update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None, get_model_runner=lambda: None,
    )


def mla_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def expected_mla(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """`(w_kc, w_vc)` as `kv_b_proj.weight` gives them now."""
    kv = attn.kv_b_proj.weight.detach().view(HEADS, NOPE + V, RANK)
    return kv[:, :NOPE], kv[:, NOPE:].transpose(1, 2)


def mla_fresh(model: nn.Module) -> bool:
    """Whether every layer's `w_kc`/`w_vc` equals what its `kv_b_proj.weight` gives."""
    return all(
        torch.equal(a.w_kc, kc) and torch.equal(a.w_vc, vc)
        for a in mla_layers(model)
        for kc, vc in [expected_mla(a)]
    )


def mla_addresses(model: nn.Module) -> list[int]:
    return [t.data_ptr() for a in mla_layers(model) for t in (a.w_kc, a.w_vc)]


def custom_loader(model: nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A custom weight loader (`custom_weight_loader=["sglang_models.custom_loader"]`,
    then `load_format="sglang_models.custom_loader"`): SGLang calls it in the process that
    holds the model."""
    model.load_weights(named_tensors)
