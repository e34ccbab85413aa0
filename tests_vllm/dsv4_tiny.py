"""vLLM's own DeepSeek V4 class (the NVIDIA implementation) built on a CPU, tiny and random.

No DeepSeek V4 forward runs on this CPU build (its mHC ops are missing), so the tests
build the class and load it through vLLM's own `load_weights`, which ends with
`finalize_mhc_broadcast_weights`. Building it on a CPU takes three stubs, used only while
the constructor runs: `torch.cuda.Event` and `torch.cuda.Stream` (the attention layers and
the model create them), and FlashMLA's FP8 recipe lookup (it asks for a CUDA device's
capability).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile

import torch

from graphsafe import recipes

# --------------------------------------------------------------------------
# tiny config
# --------------------------------------------------------------------------
TINY_HF = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    torch_dtype="bfloat16",
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_lora_rank=32,
    o_groups=1,
    sliding_window=16,
    compress_ratios=[0],  # 0 -> compress_ratio 1: no compressor, no indexer
    index_n_heads=2,
    index_head_dim=32,
    index_topk=8,
    n_routed_experts=2,
    num_experts_per_tok=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    num_hash_layers=0,
    num_nextn_predict_layers=0,
    hc_mult=4,
    hc_sinkhorn_iters=2,
    hc_eps=1e-6,
    routed_scaling_factor=1.5,
    norm_topk_prob=True,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    swiglu_limit=10.0,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)
MAX_MODEL_LEN = 128
MAX_BATCHED_TOKENS = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# CUDA stubs (construction only)
# --------------------------------------------------------------------------
class _DummyEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _DummyStream:
    def __init__(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@contextlib.contextmanager
def cpu_stubs():
    """Temporarily stub what the NVIDIA DSv4 constructors touch on CPU."""
    import vllm.models.deepseek_v4.nvidia.flashmla as flashmla

    saved = (torch.cuda.Event, torch.cuda.Stream, flashmla.compute_fp8_einsum_recipe)
    torch.cuda.Event = _DummyEvent  # DeepseekV4Attention.ln_events
    torch.cuda.Stream = _DummyStream  # DeepseekV4Model aux_stream_list
    # FlashMLA attention asks the GPU arch for its fp8 o_proj recipe
    # (asserts a CUDA device capability). SM90 values.
    flashmla.compute_fp8_einsum_recipe = lambda block_size=128: ((1, 128, 128), False)
    try:
        yield
    finally:
        torch.cuda.Event, torch.cuda.Stream, flashmla.compute_fp8_einsum_recipe = saved


# --------------------------------------------------------------------------
# vLLM config + distributed state
# --------------------------------------------------------------------------
@contextlib.contextmanager
def _inprocess_registry():
    """ModelConfig asks the registry about the architecture; uncached, vLLM
    inspects the class in a *subprocess* (~11 s cold on 2 cores). Point the
    entry at the already-imported NVIDIA class for the duration instead."""
    from vllm.model_executor.models.registry import ModelRegistry, _RegisteredModel
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

    arch = "DeepseekV4ForCausalLM"
    saved = ModelRegistry.models.get(arch)
    ModelRegistry.models[arch] = _RegisteredModel.from_model_cls(DeepseekV4ForCausalLM)
    try:
        yield
    finally:
        if saved is None:
            ModelRegistry.models.pop(arch, None)
        else:
            ModelRegistry.models[arch] = saved


def make_vllm_config(**overrides):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    hf = dict(TINY_HF)
    hf.update(overrides)
    n = hf["num_hidden_layers"]
    if len(hf["compress_ratios"]) < n:
        hf["compress_ratios"] = list(hf["compress_ratios"]) + [0] * (
            n - len(hf["compress_ratios"])
        )
    with tempfile.TemporaryDirectory(prefix="dsv4_tiny_") as tmp, _inprocess_registry():
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f)
        model_config = ModelConfig(
            model=tmp,
            tokenizer=tmp,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
        )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            max_num_seqs=4,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(),
    )


def tiny_env(vllm_config=None):
    """Initialise (once) a single-rank gloo world + TP/PP groups."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    if vllm_config is None:
        vllm_config = make_vllm_config()
    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        ps.initialize_model_parallel(1, 1)


def close_env():
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


@contextlib.contextmanager
def tiny_world():
    tiny_env()
    try:
        yield
    finally:
        close_env()


def build_tiny(**overrides):
    """Construct vllm.models.deepseek_v4.nvidia.model.DeepseekV4ForCausalLM on CPU.

    ``overrides`` are HF-config fields (e.g. num_hidden_layers=2, hc_mult=2,
    num_hash_layers=1).  Compressed layers (compress_ratios 4/128) need
    head_dim=512, qk_rope_head_dim=64, index_head_dim=128 (DeepseekCompressor
    only supports head_dim 512/128).  Leaves the single-rank
    distributed state up (load_weights needs it); call close_env() or use
    tiny_world() to tear it down.
    """
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = make_vllm_config(**overrides)
    tiny_env(vllm_config)
    with (
        cpu_stubs(),
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device("cpu"),
    ):
        model = DeepseekV4ForCausalLM(vllm_config=vllm_config, prefix="")
    model.vllm_config = vllm_config
    return model.eval()


def load(model, ckpt):
    """model.load_weights(ckpt) inside the model's vLLM config context."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config), torch.no_grad():
        return model.load_weights(iter(ckpt))


# --------------------------------------------------------------------------
# checkpoint <-> vLLM parameter correspondence
# --------------------------------------------------------------------------
def _param_pieces(model, name, param):
    """How vLLM parameter ``name`` is assembled from DeepSeek checkpoint tensors.

    Returns (pieces, n_loaded) where pieces is a list of
    (ckpt_name, index) -- ``param.data[index]`` receives the tensor -- and
    n_loaded is None or the number of leading elements written (attn_sink).
    """
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight",
    }
    if name in top:
        return [(top[name], ...)], None
    if name.startswith("model.hc_head_"):
        return [(name[len("model.") :], ...)], None
    assert name.startswith("model.layers."), name
    ck = name[len("model.") :]  # "layers.<i>.<rest>"
    mod = model.get_submodule(name.rsplit(".", 1)[0])

    if ck.endswith(".attn_sink"):
        n = model.config.num_attention_heads  # TP=1: all heads local
        return [(ck, slice(0, n))], n
    if ck.endswith("fused_wqa_wkv.weight") or ck.endswith("fused_wkv_wgate.weight"):
        a, b = (
            ("wq_a", "wkv") if "fused_wqa_wkv" in ck else ("wkv", "wgate")
        )
        fused = "fused_wqa_wkv" if "fused_wqa_wkv" in ck else "fused_wkv_wgate"
        s0, s1 = mod.output_sizes
        return [
            (ck.replace(fused, a), slice(0, s0)),
            (ck.replace(fused, b), slice(s0, s0 + s1)),
        ], None
    if ck.endswith("shared_experts.gate_up_proj.weight"):
        i = param.shape[0] // 2
        return [
            (ck.replace("gate_up_proj", "w1"), slice(0, i)),
            (ck.replace("gate_up_proj", "w3"), slice(i, 2 * i)),
        ], None
    if ck.endswith("shared_experts.down_proj.weight"):
        return [(ck.replace("down_proj", "w2"), ...)], None
    if ".ffn.experts." in ck and ck.endswith("w13_weight"):
        base = ck.split(".ffn.experts.")[0] + ".ffn.experts"
        i = param.shape[1] // 2
        out = []
        for e in range(param.shape[0]):
            out.append((f"{base}.{e}.w1.weight", (e, slice(0, i))))
            out.append((f"{base}.{e}.w3.weight", (e, slice(i, 2 * i))))
        return out, None
    if ".ffn.experts." in ck and ck.endswith("w2_weight"):
        base = ck.split(".ffn.experts.")[0] + ".ffn.experts"
        return [(f"{base}.{e}.w2.weight", e) for e in range(param.shape[0])], None
    if ck.endswith(".ffn.gate.e_score_correction_bias"):
        return [(ck.replace("e_score_correction_bias", "bias"), ...)], None
    return [(ck, ...)], None


def random_checkpoint(model, seed):
    """Random DeepSeek-V4-format checkpoint covering every model parameter.

    Names are the original DeepSeek ones (``embed.weight``, ``layers.0.attn.wq_a.weight``,
    ``layers.0.ffn.experts.1.w3.weight``, ``head.weight``, ``hc_head_fn`` ...), i.e.
    what ``DeepseekV4ForCausalLM.hf_to_vllm_mapper`` + ``DeepseekV4Model.load_weights``
    expect. Dtypes follow the parameters (bf16 weights, fp32 hc_*/sink/bias, int32 tid2eid).
    """
    g = torch.Generator().manual_seed(seed)
    n_exp = model.config.n_routed_experts
    out = []
    for name, p in model.named_parameters():
        for ck, idx in _param_pieces(model, name, p)[0]:
            shape = p.data[idx].shape
            if p.dtype.is_floating_point:
                t = torch.randn(shape, generator=g, dtype=torch.float32).to(p.dtype)
            else:  # tid2eid hash table
                t = torch.randint(0, n_exp, shape, generator=g).to(p.dtype)
            out.append((ck, t))
    return out


def prefix_finalize(self: torch.nn.Module) -> None:
    """`finalize_mhc_broadcast_weights` as it shipped: a new tensor on every load."""
    layer = self.layers[self.start_layer]
    layer.hc_attn_fn_broadcast = (
        layer.hc_attn_fn.detach().view(-1, layer.hc_mult, layer.hidden_size).sum(dim=1)
    )


def folded(layer: torch.nn.Module) -> torch.Tensor:
    return recipes.fold_streams(layer.hc_mult, layer.hidden_size)(layer, layer.hc_attn_fn)
