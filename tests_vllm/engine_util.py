"""A tiny random Llama (Hugging Face format) served by vLLM's offline engine on a CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

PROMPT = list(range(3, 43))  # token ids: more than one 32-token KV block
N_NEW = 8


def hf_model(path: Path, seed: int) -> LlamaForCausalLM:
    """Random weights saved with `save_pretrained`; head_dim 64 (CPU attention needs it)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.1,
        torch_dtype="float32",
    )
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(path)
    return m


def w8a8_model(path: Path, seed: int, *, keep: tuple[str, ...] = ()) -> LlamaForCausalLM:
    """`hf_model`, saved as a compressed-tensors W8A8 checkpoint: the decoder's linear
    weights int8 per output channel, the activations quantized per token, asymmetric
    (dynamic); `keep`: prefixes of linear layers left unquantized (and the LM head)."""
    m = hf_model(path, seed)
    tensors: dict[str, torch.Tensor] = {}
    ignore = ["lm_head"]
    for name, t in m.state_dict().items():
        t = t.detach().clone().contiguous()
        if not name.endswith("_proj.weight"):
            tensors[name] = t
        elif name.startswith(keep):
            tensors[name] = t
            ignore.append(name.removesuffix(".weight"))
        else:
            scale = t.abs().amax(dim=1, keepdim=True) / 127  # [out, 1]
            tensors[name] = torch.round(t / scale).clamp(-128, 127).to(torch.int8)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                            "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": False,
                                      "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ignore,
    }
    (path / "config.json").write_text(json.dumps(config))
    return m


def hf_greedy(m: LlamaForCausalLM) -> list[int]:
    gc = GenerationConfig(
        max_new_tokens=N_NEW,
        min_new_tokens=N_NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        out = m.generate(torch.tensor([PROMPT]), generation_config=gc)
    return out[0, len(PROMPT) :].tolist()


def qkv_weight_t(m: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """What the derived buffer must hold: the fused [q; k; v] weight, transposed."""
    sd = m.state_dict()
    return {
        f"model.layers.{i}.self_attn.qkv_proj": torch.cat(
            [sd[f"model.layers.{i}.self_attn.{k}_proj.weight"] for k in "qkv"]
        ).t()
        for i in range(m.config.num_hidden_layers)
    }


def weights(m: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in m.state_dict().items()]


def default_run() -> str:
    """How `engine` runs the model unless told: "eager" (op by op, no graphs), except on a
    GPU with GRAPHSAFE_VLLM_CUDA_GRAPHS=1 (scripts/gpu-check): "compiled", where vLLM
    captures its own CUDA graphs."""
    cuda = os.environ.get("GRAPHSAFE_VLLM_CUDA_GRAPHS") == "1" and torch.cuda.is_available()
    return "compiled" if cuda else "eager"


def engine(path: Path, *, run: str | None = None, dtype: str = "float32", **kw: Any) -> Any:
    """vLLM's offline engine, as small and fast to start as it goes on a CPU.

    `run`: "eager" (no torch.compile, no graphs), "compiled" (vLLM's default compilation,
    and its graphs where the platform has them), "dynamo" (torch.compile's dynamo with its
    eager backend, as vLLM's CPU CI runs it: compiled, and fast to start), or None:
    `default_run()`. `dtype`: what vLLM casts the checkpoint to.
    """
    from vllm import LLM

    run = run or default_run()
    compilation: dict[str, Any] = {
        "eager": {"mode": 0},
        "compiled": {},
        "dynamo": {"mode": 2, "backend": "eager"},  # CompilationMode.DYNAMO_TRACE_ONCE
    }[run]
    return LLM(
        model=str(path),
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=run == "eager",
        compilation_config=compilation,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=128,
        kv_cache_memory_bytes=16 << 20,
        block_size=32,
        seed=0,
        worker_extension_cls="vllm_ext.Extension",
        **kw,
    )


def hold_graphs(monkeypatch: Any) -> None:
    """Tell graphsafe's vLLM integration that engines started from now on (in this
    process) capture graphs that read the model by address, as vLLM's CUDA graphs do: a
    moved tensor is then a fault, refused. vLLM's CPU engine captures none, so without
    this its moves are followed."""
    from graphsafe.integrations.vllm import _worker

    monkeypatch.setattr(_worker, "captures_graphs", lambda worker: True)


def generate(llm: Any) -> list[int]:
    from vllm import SamplingParams

    llm.reset_prefix_cache()  # new weights: cached KV blocks of the prompt are stale
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, detokenize=False, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
