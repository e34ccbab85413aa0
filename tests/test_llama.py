"""Llama reference model: Hugging Face's logits, FP8 error bound, transient checkpoint
projections, refits under a graph.

Every "it works" test has a control that the same check catches: the Meta rotary layout,
a wrong grouping of query heads, an untied head, ignored RoPE scaling, FP8 blocks
quantized per projection instead of fused, a coarser FP8 format, resident projections,
a projection half written when the update ends, the naive rebinding model, a mistyped
checkpoint entry.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor

import graphsafe as gs
from graphsafe import recipes
from graphsafe.cli import main
from graphsafe.models.llama import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    NaiveLlamaForCausalLM,
    random_checkpoint,
    verify_target,
)

TOL = 1e-5  # |ours - transformers| in float32
E4M3 = torch.finfo(torch.float8_e4m3fn)

HF_SIZES = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}
CASES: dict[str, dict[str, Any]] = {
    "gqa": {},
    "tied": {"tie_word_embeddings": True},
    "llama3-rope": {"rope_parameters": LLAMA3_ROPE},
    "mqa-wide-heads": {"num_key_value_heads": 1, "head_dim": 24},
}
IDS = torch.randint(128, (12,), generator=torch.Generator().manual_seed(0))  # [T]

Checkpoint = list[tuple[str, Tensor]]


def hf_model(case: str, seed: int = 0) -> transformers.LlamaForCausalLM:
    """transformers' Llama, eager fp32, with weights of order one (random_checkpoint's)."""
    config = transformers.LlamaConfig(**{**HF_SIZES, **CASES[case]},
                                      attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = dict(random_checkpoint(LlamaConfig.from_hf(config), seed))
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: it is the embedding
    return hf


def hf_logits(hf: transformers.LlamaForCausalLM, sd: dict[str, Tensor] | None = None) -> Tensor:
    if sd is not None:
        hf = transformers.LlamaForCausalLM(hf.config).eval()
        hf.load_state_dict(sd)
    with torch.no_grad():
        return hf(IDS[None]).logits[0]  # [T, vocab]


def ours(config: LlamaConfig, checkpoint: Checkpoint) -> Tensor:
    model = LlamaForCausalLM(config)
    model.load_weights(checkpoint)
    with torch.no_grad():
        return model(IDS)


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request: pytest.FixtureRequest) -> tuple[str, transformers.LlamaForCausalLM]:
    return request.param, hf_model(request.param)


# -----------------------------------------------------------------------------
# Hugging Face's logits


def test_logits_equal_transformers(hf_case: tuple[str, transformers.LlamaForCausalLM]) -> None:
    _, hf = hf_case
    want = hf_logits(hf)
    got = ours(LlamaConfig.from_hf(hf.config), list(hf.state_dict().items()))
    assert want.std() > 0.5  # logits of order one: a wrong layout cannot hide under TOL
    assert (got - want).abs().max().item() <= TOL


def _meta_rotary_layout(w: Tensor, heads: int) -> Tensor:
    """Undo Hugging Face's permutation of q/k rows: Meta's interleaved RoPE pairs."""
    D = w.shape[0] // heads
    return w.view(heads, 2, D // 2, -1).transpose(1, 2).reshape(w.shape)


def _swap_kv_heads(w: Tensor, kv_heads: int) -> Tensor:
    return w.view(kv_heads, -1, w.shape[-1]).flip(0).reshape(w.shape)


def _perturb(sd: dict[str, Tensor], suffix: str, fn: Callable[[Tensor], Tensor]) -> Checkpoint:
    return [(n, fn(w) if n.endswith(suffix) else w) for n, w in sd.items()]


CONTROLS: dict[str, tuple[str, Callable[[LlamaConfig, dict[str, Tensor]], tuple[
    LlamaConfig, Checkpoint]]]] = {
    "meta rotary layout of q and k": ("gqa", lambda c, sd: (c, _perturb(
        sd, "q_proj.weight", lambda w: _meta_rotary_layout(w, c.num_attention_heads)))),
    "query heads served by the wrong kv head": ("gqa", lambda c, sd: (c, _perturb(
        sd, "k_proj.weight", lambda w: _swap_kv_heads(w, c.num_key_value_heads)))),
    "head left untied": ("tied", lambda c, sd: (  # a saved tied checkpoint has no head
        c.model_copy(update={"tie_word_embeddings": False}),
        [(n, w) for n, w in sd.items() if n != "lm_head.weight"])),
    "llama3 rope scaling ignored": ("llama3-rope", lambda c, sd: (
        c.model_copy(update={"rope_scaling": None}), list(sd.items()))),
}


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_control_the_comparison_catches_a_wrong_model(control: str) -> None:
    case, wrong = CONTROLS[control]
    hf = hf_model(case)
    config, checkpoint = wrong(LlamaConfig.from_hf(hf.config), dict(hf.state_dict()))
    assert (ours(config, checkpoint) - hf_logits(hf)).abs().max().item() > 100 * TOL


def test_checkpoint_names_are_transformers_names() -> None:
    hf = hf_model("gqa")
    assert {n for n, _ in random_checkpoint(LlamaConfig.from_hf(hf.config), 0)} == set(
        hf.state_dict()
    )


# -----------------------------------------------------------------------------
# FP8
#
# The bound. e4m3 keeps 3 mantissa bits: a weight rounds to within half a step,
# |w_hat - w| <= E_w = eps/2 * max(|w|, s * tiny) with eps = 2^-3, tiny = 2^-6 and s its
# block's scale (test_recipes checks this per element). To first order a logit moves by
# sum_w J_w (w_hat - w), J_w its derivative by w. Taking rounding errors as independent,
# zero-mean and uniform within +-(half a step) <= +-E_w (the standard probabilistic model
# of rounding), E[dlogit^2] <= sum_w J_w^2 E_w^2 / 3. The sum is E[dlogit^2] when every
# weight moves by exactly +-E_w with a random sign, which the test measures (4 draws), so:
#
#     RMS over logits (fp8 - fp32) <= RMS over logits and draws (+-E_w moves) / sqrt(3).
#
# On this model the FP8 error is 0.6 to 0.7 of the bound (seeds 0 to 3); e5m2 (2 mantissa
# bits, twice the step) is 1.1 to 1.5 times the bound and fails it.

FP8_CONFIG = LlamaConfig.preset("tiny-fp8")  # blocks (24, 24): ragged edges everywhere
FUSED = (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         ("self_attn.o_proj.weight",), ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
         ("mlp.down_proj.weight",))


def _fused_groups(config: LlamaConfig) -> list[tuple[str, ...]]:
    return [tuple(f"model.layers.{i}.{n}" for n in g)
            for i in range(config.num_hidden_layers) for g in FUSED]


def _block_scales(w: Tensor, block: tuple[int, int], fp8: torch.dtype) -> Tensor:
    """Plain torch: each element's block scale amax / finfo.max (1 / max for zeros)."""
    (M, N), (bm, bn) = w.shape, block
    fmax = torch.finfo(fp8).max
    padded = torch.zeros(math.ceil(M / bm) * bm, math.ceil(N / bn) * bn)
    padded[:M, :N] = w.abs()
    s = padded.view(padded.shape[0] // bm, bm, -1, bn).amax(dim=(1, 3)) / fmax
    s = torch.where(s > 0, s, 1 / fmax)
    return s.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:M, :N]  # [M, N]


def _requantized(
    sd: dict[str, Tensor], groups: list[tuple[str, ...]], block: tuple[int, int],
    fp8: torch.dtype = torch.float8_e4m3fn,
) -> dict[str, Tensor]:
    """The checkpoint with each group of weights fused, rounded to FP8 and split back."""
    fmax = torch.finfo(fp8).max
    out = dict(sd)
    for names in groups:
        w = torch.cat([sd[n] for n in names])
        s = _block_scales(w, block, fp8)
        w_hat = (w / s).clamp(-fmax, fmax).to(fp8).float() * s
        out.update(zip(names, w_hat.split([sd[n].shape[0] for n in names])))
    return out


def test_fp8_logits_equal_transformers_on_the_fp8_weights() -> None:
    sd = dict(random_checkpoint(FP8_CONFIG, seed=0))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **HF_SIZES, attn_implementation="eager")).eval()
    got = ours(FP8_CONFIG, list(sd.items()))
    want = hf_logits(hf, _requantized(sd, _fused_groups(FP8_CONFIG), FP8_CONFIG.fp8_block))
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("control", ["unquantized", "blocks per projection, not fused"])
def test_control_other_weights_give_other_logits(control: str) -> None:
    sd = dict(random_checkpoint(FP8_CONFIG, seed=0))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **HF_SIZES, attn_implementation="eager")).eval()
    if control == "unquantized":
        other = sd
    else:  # q (64 rows) ends inside a 24-row block of the fused QKV weight
        other = _requantized(sd, [(n,) for g in _fused_groups(FP8_CONFIG) for n in g],
                             FP8_CONFIG.fp8_block)
    got = ours(FP8_CONFIG, list(sd.items()))
    assert (got - hf_logits(hf, other)).abs().max().item() > 100 * TOL


def _rms(t: Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def check_fp8_error_bound(fp8_logits: Tensor, sd: dict[str, Tensor], config: LlamaConfig,
                          samples: int = 4) -> None:
    """RMS(fp8 - fp32 logits) <= RMS(logits under +-E_w random-sign moves) / sqrt(3)."""
    base = ours(config.model_copy(update={"fp8": False}), list(sd.items()))
    envelope = {}
    for names in _fused_groups(config):
        w = torch.cat([sd[n] for n in names])
        e = E4M3.eps / 2 * torch.maximum(w.abs(), _block_scales(w, config.fp8_block,
                                                                torch.float8_e4m3fn) * E4M3.tiny)
        envelope.update(zip(names, e.split([sd[n].shape[0] for n in names])))
    g = torch.Generator().manual_seed(1234)
    mean_square = 0.0
    for _ in range(samples):
        moved = [(n, w + envelope[n] * (2 * torch.randint(0, 2, w.shape, generator=g) - 1)
                  if n in envelope else w) for n, w in sd.items()]
        mean_square += _rms(ours(config.model_copy(update={"fp8": False}), moved) - base) ** 2
    bound = math.sqrt(mean_square / samples / 3)
    assert _rms(fp8_logits - base) <= bound, (_rms(fp8_logits - base), bound)


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_logit_error_is_within_the_rounding_bound(seed: int) -> None:
    sd = dict(random_checkpoint(FP8_CONFIG, seed))
    check_fp8_error_bound(ours(FP8_CONFIG, list(sd.items())), sd, FP8_CONFIG)


@pytest.mark.parametrize("seed", [0, 1])
def test_control_a_coarser_fp8_format_exceeds_the_bound(seed: int) -> None:
    sd = dict(random_checkpoint(FP8_CONFIG, seed))
    e5m2 = _requantized(sd, _fused_groups(FP8_CONFIG), FP8_CONFIG.fp8_block,
                        torch.float8_e5m2)
    logits = ours(FP8_CONFIG.model_copy(update={"fp8": False}), list(e5m2.items()))
    with pytest.raises(AssertionError):
        check_fp8_error_bound(logits, sd, FP8_CONFIG)


def test_fp8_buffers_have_deepseek_layout() -> None:
    model = LlamaForCausalLM(FP8_CONFIG)
    model.load_weights(random_checkpoint(FP8_CONFIG, 0))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_weight_fp8.dtype == torch.float8_e4m3fn
    assert attn.qkv_weight_fp8.shape == (128, 64) and attn.qkv_weight_scale_inv.shape == (6, 3)
    assert mlp.down_weight_fp8.shape == (64, 96) and mlp.down_weight_scale_inv.shape == (3, 4)
    assert attn.qkv_weight_scale_inv.dtype == torch.float32
    assert attn.qkv_weight is None and mlp.gate_up_weight is None  # no float fused copy


def test_control_the_float_model_keeps_its_fused_weights() -> None:
    model = LlamaForCausalLM(LlamaConfig())
    model.load_weights(random_checkpoint(model.config, 0))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_weight.shape == (128, 64) and mlp.gate_up_weight.shape == (192, 64)
    assert attn.qkv_weight_fp8 is None


@pytest.mark.parametrize("block", [(24, 24), None], ids=["blocks", "per-tensor"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "control-per-projection"])
def test_fp8_weights_are_the_quantized_concatenation(block: tuple[int, int] | None,
                                                     fused: bool) -> None:
    # Blocks of 24 straddle the q/k/v seams (rows 64 and 96) and the gate/up seam (row
    # 100); per tensor, one scale covers all.
    config = LlamaConfig(fp8=True, fp8_block=block, intermediate_size=100)
    sd = dict(random_checkpoint(config, 0))
    model = LlamaForCausalLM(config)
    model.load_weights(list(sd.items()))
    quantize = recipes.fp8_quantize(block=block)
    layer = model.model.layers[1]
    for got, names in (
        ((layer.self_attn.qkv_weight_fp8, layer.self_attn.qkv_weight_scale_inv), FUSED[0]),
        ((layer.mlp.gate_up_weight_fp8, layer.mlp.gate_up_weight_scale_inv), FUSED[2]),
    ):
        ws = [sd[f"model.layers.1.{n}"] for n in names]
        if fused:
            want = quantize(None, torch.cat(ws))
        else:
            parts = [quantize(None, w) for w in ws]
            want = (torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))
        same = (torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                and got[1].shape == want[1].shape and torch.equal(got[1], want[1]))
        assert same is fused


# -----------------------------------------------------------------------------
# transient checkpoint projections
#
# With fp8 the FP8 weights are quantized straight from the checkpoint's projections,
# declared transient: between loads those live on the meta device. The forward reads only
# derived buffers (and the resident embeddings, norms and head), so eager after a load
# is the reference a replay must equal.

PROJECTIONS = tuple(n for g in FUSED for n in g)


def _projections(model: LlamaForCausalLM) -> dict[str, Tensor]:
    return {n: p for n, p in model.named_parameters() if n.endswith(PROJECTIONS)}


def _layer_buckets(checkpoint: Checkpoint, config: LlamaConfig) -> list[Checkpoint]:
    """The embeddings, final norm and head, then one bucket per decoder layer."""
    layers = [[e for e in checkpoint if e[0].startswith(f"model.layers.{i}.")]
              for i in range(config.num_hidden_layers)]
    return [[e for e in checkpoint if not e[0].startswith("model.layers.")], *layers]


@pytest.mark.parametrize("transient", [True, False], ids=["transient", "control-resident"])
def test_fp8_projections_are_released_after_a_load(transient: bool) -> None:
    config = LlamaConfig.preset("tiny-fp8", transient=transient)
    model = LlamaForCausalLM(config)
    sd = random_checkpoint(config, 0)
    assert model.load_weights(sd) == {n for n, _ in sd}
    projections = _projections(model)
    assert len(projections) == 7 * config.num_hidden_layers
    assert {p.device.type for p in projections.values()} == {"meta" if transient else "cpu"}
    assert model.model.norm.weight.device.type == "cpu"  # what the forward reads stays
    assert set(projections).isdisjoint(model.state_dict()) is transient


def test_fp8_logits_do_not_depend_on_where_the_projections_live() -> None:
    sd = random_checkpoint(FP8_CONFIG, 0)
    resident = ours(FP8_CONFIG.model_copy(update={"transient": False}), sd)
    assert torch.equal(ours(FP8_CONFIG, sd), resident)


def _captured(config: LlamaConfig) -> tuple[LlamaForCausalLM, gs.Graph, Tensor]:
    model = LlamaForCausalLM(config)
    model.load_weights(random_checkpoint(config, 0))
    graph = gs.Graph(backend="cpu", guard=model)
    with torch.no_grad(), graph.capture(warmup=lambda: model(IDS)):
        out = model(IDS)
    return model, graph, out


@pytest.mark.parametrize("transient", [True, False], ids=["transient", "resident"])
def test_fp8_refit_one_bucket_per_layer_replays_equal_to_eager(transient: bool) -> None:
    config = LlamaConfig.preset("tiny-fp8", transient=transient)
    model, graph, out = _captured(config)
    before = out.clone()
    held = []
    with gs.weight_update(model):
        for bucket in _layer_buckets(random_checkpoint(config, 1), config):
            model.load_weights(bucket)
            held.append(sum(p.device.type != "meta" for p in _projections(model).values()))
    # Transient: each layer's projections were quantized and released with its bucket.
    assert held == [0 if transient else 7 * config.num_hidden_layers] * len(held)
    graph.replay()
    with torch.no_grad():
        eager = model(IDS)
    assert torch.equal(out, eager)
    assert (out - before).abs().max() > 0.1  # the refit changed the output
    check_fp8_error_bound(out, dict(random_checkpoint(config, 1)), config)


@pytest.mark.parametrize("complete", [False, True], ids=["half-written", "control-complete"])
def test_fp8_projection_half_written_when_the_update_ends_is_stale(complete: bool) -> None:
    config = FP8_CONFIG
    model, graph, out = _captured(config)
    name = "model.layers.1.mlp.up_proj.weight"
    sd = random_checkpoint(config, 1)
    new = dict(sd)[name]
    half = new.shape[0] // 2
    with gs.weight_update(model):
        for bucket in _layer_buckets([e for e in sd if e[0] != name], config):
            model.load_weights(bucket)
        with torch.no_grad():  # rows split across buckets: only the first half arrives
            model.get_parameter(name).data[:half].copy_(new[:half])
            if complete:
                model.get_parameter(name).data[half:].copy_(new[half:])
    assert model.get_parameter(name).device.type == "meta"  # released all the same
    if not complete:
        with pytest.raises(gs.StaleError, match=rf"{re.escape(name)} was only partly written"):
            graph.replay()
        return
    graph.replay()
    with torch.no_grad():
        assert torch.equal(out, model(IDS))


# -----------------------------------------------------------------------------
# refits under a guarded graph


def _buckets(checkpoint: Checkpoint, rng: random.Random) -> list[Checkpoint]:
    """Shuffled buckets; the fused weights' last inputs come in the last one."""
    late = [e for e in checkpoint if e[0].endswith(verify_target.critical)]
    rest = [e for e in checkpoint if e not in late]
    rng.shuffle(rest)
    cut = rng.randint(1, len(rest) - 1)
    return [rest[:cut], rest[cut:], late]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_refits_replay_equal_to_eager_in_place(preset: str) -> None:
    config = LlamaConfig.preset(preset)
    model = LlamaForCausalLM(config)
    model.load_weights(random_checkpoint(config, 0))
    derived = {name: t for name, t in model.named_buffers() if "weight" in name}
    ptrs = {name: t.data_ptr() for name, t in derived.items()}
    graph = gs.Graph(backend="cpu", guard=model)
    with torch.no_grad():
        with graph.capture(warmup=lambda: model(IDS)):
            out = model(IDS)
        previous = model(IDS).clone()
        rng = random.Random(0)
        for seed in (1, 2, 3):
            # With transient inputs, derivations refresh bucket by bucket; the update's
            # report covers all of them.
            with gs.weight_update(model):
                for bucket in _buckets(random_checkpoint(config, seed), rng):
                    model.load_weights(bucket)
            report = gs.runtime(model).last_report
            graph.replay()
            eager = model(IDS)
            assert torch.equal(out, eager)
            assert (eager - previous).abs().max() > 0.1  # the refit changed the output
            previous = eager.clone()
            assert report is not None and report.slow_path == ()
            assert sorted(report.refreshed) == sorted(
                d.outputs[0] for d in gs.runtime(model).derivations
            )
    assert {name: t.data_ptr() for name, t in model.named_buffers() if name in derived} == ptrs


def test_control_naive_refit_replays_stale_weights_and_the_guard_refuses() -> None:
    config = LlamaConfig.preset("tiny")
    model = NaiveLlamaForCausalLM(config)
    model.load_weights(random_checkpoint(config, 0))
    plain, guarded = gs.Graph(backend="cpu"), gs.Graph(backend="cpu", guard=model)
    with torch.no_grad():
        with plain.capture(warmup=lambda: model(IDS)):
            out = model(IDS)
        with guarded.capture(warmup=lambda: model(IDS)):
            model(IDS)
        model.load_weights(random_checkpoint(config, 1))
        plain.replay()
        assert (out - model(IDS)).abs().max() > 0.1  # the stale read
        with pytest.raises(gs.StorageMovedError, match="pinned tensors moved"):
            guarded.replay()


# -----------------------------------------------------------------------------
# loading


def test_load_returns_entries_and_skips_derived_and_tied_names() -> None:
    tied = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    entries = [("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.zeros(128, 64)),
               ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))]
    assert tied.load_weights(entries) == {"model.norm.weight"}
    assert tied.model.embed_tokens.weight.abs().sum() > 0  # the head did not overwrite it
    untied = LlamaForCausalLM(LlamaConfig())
    assert untied.load_weights(entries) == {"model.norm.weight", "lm_head.weight"}
    assert untied.lm_head.weight.abs().sum() == 0


@pytest.mark.parametrize(
    ("entry", "tensor", "match"),
    [
        ("model.layers.2.mlp.up_proj.weight", torch.ones(96, 64),
         r"unknown checkpoint entry 'model.layers.2.mlp.up_proj.weight'"),
        ("model.layers.0.self_attn.k_proj.weight", torch.ones(64, 64),
         r"'model.layers.0.self_attn.k_proj.weight' has the wrong shape(.|\n)*"
         r"expected: +shape \(32, 64\)(.|\n)*got: +shape \(64, 64\)"),
        ("model.norm.weight", torch.ones(64, dtype=torch.int64),
         r"'model.norm.weight' has the wrong dtype"),
    ],
)
def test_bad_entry_is_named_and_leaves_the_parameter_alone(entry: str, tensor: Tensor,
                                                           match: str) -> None:
    model = LlamaForCausalLM(LlamaConfig())
    model.load_weights(random_checkpoint(model.config, 0))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(gs.WeightLoadError, match=match) as info:
        model.load_weights([(entry, tensor)])
    assert info.value.name == entry
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_control_a_good_entry_is_written() -> None:
    model = LlamaForCausalLM(LlamaConfig())
    model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.ones(32, 64))])
    assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, torch.ones(32, 64))


def test_bfloat16_entries_are_converted() -> None:
    model = LlamaForCausalLM(LlamaConfig())
    model.load_weights([("model.norm.weight", torch.full((64,), 1.5, dtype=torch.bfloat16))])
    assert model.model.norm.weight.dtype == torch.float32
    assert torch.equal(model.model.norm.weight, torch.full((64,), 1.5))


# -----------------------------------------------------------------------------
# config


def test_from_hf_reads_sizes_rope_and_options() -> None:
    hf = transformers.LlamaConfig(**HF_SIZES, rope_parameters=LLAMA3_ROPE, head_dim=24)
    config = LlamaConfig.from_hf(hf, fp8=True, fp8_block=(64, 64))
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (64, 2, 24)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    assert config.fp8 and config.fp8_block == (64, 64)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
         "rope_type 'linear' is not supported"),
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    ],
)
def test_from_hf_refuses_what_it_does_not_implement(fields: dict[str, Any], match: str) -> None:
    hf = transformers.LlamaConfig(**HF_SIZES)
    for key, value in fields.items():
        setattr(hf, key, value)
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(hf)


# -----------------------------------------------------------------------------
# graphsafe verify --model llama


def test_llama_is_an_installed_verify_target() -> None:
    targets = {ep.name: ep for ep in entry_points(group="graphsafe.targets")}
    assert targets["llama"].load() is verify_target


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_verify_model_llama_passes(preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--model", "llama", "--preset", preset, "--refits", "2",
                 "--backend", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == "llama" and report["ok"]
    assert [r["verdict"] for r in report["refits"]] == ["exact", "exact"]
    assert report["control"]["stale_read"] and report["control"]["caught"]


def test_recipes_drive_the_fused_weights() -> None:
    model = LlamaForCausalLM(LlamaConfig())
    model.load_weights(random_checkpoint(model.config, 0))
    attn = model.model.layers[1].self_attn
    fused = recipes.concat(0)(attn, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    assert torch.equal(attn.qkv_weight, fused)
