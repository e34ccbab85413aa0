"""The flagship's mHC against a third party: Hugging Face transformers' DeepSeek V4.

transformers implements mHC in `DeepseekV4HyperConnection` (pre-mixing with Sinkhorn:
the collapsed input, `post` and `comb`), in `DeepseekV4DecoderLayer.forward` (post-mixing)
and in `DeepseekV4HyperHead` (the head). Its decoder layer also runs a compressed
attention and a MoE, which the flagship does not have; to compare the mixing around the
sublayers, the transformers layer runs the flagship's own attention and FFN through
small adapters, so both sides apply the same sublayer to the same collapsed input.

The weights are the flagship's (`random_checkpoint`), copied into the transformers
modules under their names (`HF_LAYER_NAMES`, `HF_HEAD_NAMES`). Everything runs in
float32 and agrees within `TOL`; each comparison has a control, a plausible wrong
variant of the flagship's math that fails the same check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (
    DeepseekV4Config as HFConfig,
)
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer as HFDecoderLayer,
)
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

from graphsafe.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4Model,
    NaiveDeepseekV4Model,
    fold_streams,
    hc_head,
    hc_pre,
    hc_pre_broadcast,
    hc_split,
    random_checkpoint,
)
from graphsafe.models.deepseek_v4 import model as dsv4

# Largest |flagship - transformers| allowed, float32. The two differ only by float
# reassociation (transformers normalises before the projection, the flagship scales
# after it). Over 200 random draws of the properties below the worst was 9.5e-7 on the
# mixing weights and collapsed input, 1.9e-6 on a decoder layer's output; every control
# below misses by more than 1e-3.
TOL = 1e-5

Triple: TypeAlias = tuple[Tensor, Tensor, Tensor]
"""`(y, post, comb)` of a pre-mixing."""
AnyModel: TypeAlias = DeepseekV4Model | NaiveDeepseekV4Model
"""The managed flagship or its pre-fix control."""

# Flagship parameter name (within a decoder layer) -> transformers' name within its
# `DeepseekV4DecoderLayer`.
HF_LAYER_NAMES = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Flagship model-level mHC head -> transformers' `DeepseekV4HyperHead`.
HF_HEAD_NAMES = {"hc_head_fn": "hc_fn", "hc_head_base": "hc_base", "hc_head_scale": "hc_scale"}


def max_err(a: Tensor, b: Tensor) -> float:
    """Largest absolute difference of two tensors of the same shape."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def hf_config(config: DeepseekV4Config) -> HFConfig:
    """transformers' config with the flagship's mHC sizes; its attention and MoE, never
    run here, are shrunk so that building a decoder layer is cheap."""
    # transformers uses one epsilon for the weightless mHC RMS and the weighted norms.
    assert config.rms_eps == config.norm_eps, "the oracle needs rms_eps == norm_eps"
    L = config.num_layers
    return HFConfig(
        hidden_size=config.hidden_size,
        hc_mult=config.hc_mult,
        hc_sinkhorn_iters=config.sinkhorn_iters,
        hc_eps=config.hc_eps,
        rms_norm_eps=config.rms_eps,
        num_hidden_layers=L,
        vocab_size=config.vocab_size,
        layer_types=["sliding_attention"] * L,
        mlp_layer_types=["moe"] * L,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=8,
        o_groups=1,
        o_lora_rank=8,
        n_routed_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        sliding_window=8,
    )


def mhc_weights(config: DeepseekV4Config, seed: int, layer: int = 0) -> dict[str, Tensor]:
    """The flagship's random weights of one layer, by parameter name within the layer."""
    prefix = f"layers.{layer}."
    return {
        name.removeprefix(prefix): w
        for name, w in random_checkpoint(config, seed)
        if name.startswith(prefix)
    }


def hf_hyper_connection(
    config: DeepseekV4Config, weights: dict[str, Tensor], which: str
) -> DeepseekV4HyperConnection:
    """transformers' `DeepseekV4HyperConnection` holding the flagship's `hc_{which}_*`."""
    hc = DeepseekV4HyperConnection(hf_config(config)).requires_grad_(False)
    hc.load_state_dict({k: weights[f"hc_{which}_{k}"] for k in ("fn", "base", "scale")})
    return hc


def streams(config: DeepseekV4Config, T: int, seed: int) -> Tensor:
    """Random residual streams `[T, n, C]`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, config.hc_mult, config.hidden_size, generator=g)


def small_config(n: int, C: int, iters: int, num_layers: int = 1) -> DeepseekV4Config:
    """A flagship config of `n` streams of width `C` and `iters` Sinkhorn iterations."""
    return DeepseekV4Config(
        hidden_size=C, hc_mult=n, sinkhorn_iters=iters, num_layers=num_layers, vocab_size=32
    )


shapes = st.fixed_dictionaries(
    {
        "n": st.integers(1, 4),
        "C": st.sampled_from([8, 16, 64]),
        "T": st.integers(1, 8),
        "iters": st.sampled_from([1, 2, 3, 20]),
        "seed": st.integers(0, 2**16),
    }
)


# -----------------------------------------------------------------------------
# (a) pre-mixing with Sinkhorn: collapsed input, post, comb


def flagship_pre(config: DeepseekV4Config, w: dict[str, Tensor], X: Tensor, **over: int) -> Triple:
    """The flagship's `hc_pre` on the attention mHC weights `w`; `over` replaces kwargs."""
    kw = {"sinkhorn_iters": config.sinkhorn_iters, **over}
    return hc_pre(
        X,
        w["hc_attn_fn"],
        w["hc_attn_scale"],
        w["hc_attn_base"],
        rms_eps=config.rms_eps,
        hc_eps=config.hc_eps,
        **kw,
    )


@given(shapes)
def test_pre_mixing_matches_transformers(s: dict[str, int]) -> None:
    config = small_config(s["n"], s["C"], s["iters"])
    w = mhc_weights(config, s["seed"])
    X = streams(config, s["T"], s["seed"])  # [T, n, C]
    y, post, comb = flagship_pre(config, w, X)
    hf_post, hf_comb, hf_y = hf_hyper_connection(config, w, "attn")(X[None])  # batch of 1
    assert max_err(y, hf_y[0]) <= TOL
    assert max_err(post, hf_post[0]) <= TOL
    assert max_err(comb, hf_comb[0]) <= TOL


@pytest.mark.parametrize("iters", [2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_control_one_sinkhorn_iteration_fewer_is_caught(iters: int, seed: int) -> None:
    # At 20 iterations Sinkhorn has converged to float32 resolution on these weights, so
    # an off-by-one is invisible (and harmless) there; at few iterations it shows.
    config = small_config(4, 64, iters)
    w = mhc_weights(config, seed)
    X = streams(config, 8, seed)
    _, hf_comb, _ = hf_hyper_connection(config, w, "attn")(X[None])
    _, _, comb = flagship_pre(config, w, X)
    _, _, fewer = flagship_pre(config, w, X, sinkhorn_iters=iters - 1)
    assert max_err(comb, hf_comb[0]) <= TOL
    assert max_err(fewer, hf_comb[0]) > TOL


@pytest.mark.parametrize("seed", range(3))
def test_control_transposed_comb_is_caught(seed: int) -> None:
    config = small_config(4, 64, 20)
    w = mhc_weights(config, seed)
    X = streams(config, 8, seed)
    _, hf_comb, _ = hf_hyper_connection(config, w, "attn")(X[None])
    _, _, comb = flagship_pre(config, w, X)
    assert max_err(comb, hf_comb[0]) <= TOL
    assert max_err(comb.transpose(1, 2), hf_comb[0]) > TOL


# -----------------------------------------------------------------------------
# (b) post-mixing, in a whole decoder layer


class _Attention(nn.Module):
    """Runs the flagship's attention where transformers' layer calls `self_attn`."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: Tensor, *, positions: Tensor, **_: object) -> tuple[Tensor, None]:
        return self.attn(x[0], positions)[None], None  # [1, T, C]


class _FFN(nn.Module):
    """Runs the flagship's FFN where transformers' layer calls `mlp`."""

    def __init__(self, ffn: nn.Module) -> None:
        super().__init__()
        self.ffn = ffn

    def forward(self, x: Tensor, input_ids: Tensor | None = None) -> Tensor:
        return self.ffn(x[0])[None]  # [1, T, C]


def hf_layer(model: AnyModel, index: int) -> HFDecoderLayer:
    """transformers' decoder layer `index`, with the flagship layer's mHC weights and
    norms, running the flagship layer's attention and FFN."""
    ours = model.layers[str(index)]
    layer = HFDecoderLayer(hf_config(model.config), index).requires_grad_(False)
    for name, hf_name in HF_LAYER_NAMES.items():
        layer.get_parameter(hf_name).copy_(ours.get_parameter(name))
    layer.self_attn = _Attention(ours.attn)
    layer.mlp = _FFN(ours.ffn)
    return layer


def loaded_model(config: DeepseekV4Config, seed: int) -> DeepseekV4Model:
    """The flagship model, loaded with `random_checkpoint(config, seed)`."""
    model = DeepseekV4Model(config)
    model.load_weights(random_checkpoint(config, seed))
    return model


@given(shapes)
def test_decoder_layer_post_mixing_matches_transformers(s: dict[str, int]) -> None:
    # Layer 1 of 2: the expanded path on both sides, attention then FFN post-mixing.
    config = small_config(s["n"], s["C"], s["iters"], num_layers=2)
    model = loaded_model(config, s["seed"])
    X = streams(config, s["T"], s["seed"])
    positions = torch.arange(s["T"])
    ours = model.layers["1"](X, positions)  # [T, n, C]
    theirs = hf_layer(model, 1)(X[None], positions=positions)[0]
    assert max_err(ours, theirs) <= TOL


def _post_comb_not_transposed(out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The wrong post-mixing: sums over comb's SECOND stream index."""
    return post[:, :, None] * out.float()[:, None, :] + torch.bmm(comb, residual.float())


def _post_without_gate(out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The wrong post-mixing: the sublayer's output added to every stream, ungated."""
    return out.float()[:, None, :] + torch.bmm(comb.transpose(1, 2), residual.float())


@pytest.mark.parametrize("wrong", [_post_comb_not_transposed, _post_without_gate])
def test_control_wrong_post_mixing_is_caught(
    wrong: Callable[..., Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_config(4, 64, 20, num_layers=2)
    model = loaded_model(config, seed=0)
    X, positions = streams(config, 8, seed=0), torch.arange(8)
    theirs = hf_layer(model, 1)(X[None], positions=positions)[0]
    assert max_err(model.layers["1"](X, positions), theirs) <= TOL
    monkeypatch.setattr(dsv4, "hc_post", wrong)
    assert max_err(model.layers["1"](X, positions), theirs) > TOL


# -----------------------------------------------------------------------------
# (c) the first layer: broadcast path against transformers' n copies


def broadcast_pre(
    config: DeepseekV4Config, w: dict[str, Tensor], x: Tensor, fold: Tensor
) -> Triple:
    """The flagship's `hc_pre_broadcast` of one stream `x [T, C]` with the folded `fold`."""
    return hc_pre_broadcast(
        x,
        fold,
        w["hc_attn_scale"],
        w["hc_attn_base"],
        hc_mult=config.hc_mult,
        rms_eps=config.rms_eps,
        hc_eps=config.hc_eps,
        sinkhorn_iters=config.sinkhorn_iters,
    )


def n_copies(x: Tensor, n: int) -> Tensor:
    """What transformers feeds its first layer: the embedding as n identical streams."""
    return x[:, None, :].expand(-1, n, -1).contiguous()  # [T, n, C]


@given(shapes)
def test_broadcast_pre_mixing_matches_transformers_on_n_copies(s: dict[str, int]) -> None:
    config = small_config(s["n"], s["C"], s["iters"])
    w = mhc_weights(config, s["seed"])
    x = streams(config, s["T"], s["seed"])[:, 0]  # [T, C], one stream
    fold = fold_streams(w["hc_attn_fn"], config.hc_mult, config.hidden_size)
    y, post, comb = broadcast_pre(config, w, x, fold)
    hf_post, hf_comb, hf_y = hf_hyper_connection(config, w, "attn")(n_copies(x, s["n"])[None])
    assert max_err(y, hf_y[0]) <= TOL
    assert max_err(post, hf_post[0]) <= TOL
    assert max_err(comb, hf_comb[0]) <= TOL


def _trap_mean_square_over_nC(
    config: DeepseekV4Config, w: dict[str, Tensor], x: Tensor, fold: Tensor
) -> Triple:
    """The wrong broadcast: the single stream's sum of squares divided by n*C, not C."""
    n, C = config.hc_mult, config.hidden_size
    r = torch.rsqrt(x.square().sum(-1, keepdim=True) / (n * C) + config.rms_eps)  # [T, 1]
    pre, post, comb = hc_split(
        F.linear(x, fold) * r,
        w["hc_attn_scale"],
        w["hc_attn_base"],
        hc_mult=n,
        hc_eps=config.hc_eps,
        sinkhorn_iters=config.sinkhorn_iters,
    )
    return pre.sum(-1, keepdim=True) * x, post, comb


def _fold_wrong_layout(
    config: DeepseekV4Config, w: dict[str, Tensor], x: Tensor, fold: Tensor
) -> Triple:
    """The wrong broadcast weight: `hc_attn_fn` folded as if stream-minor (`c*n + k`)."""
    wrong = w["hc_attn_fn"].view(-1, config.hidden_size, config.hc_mult).sum(-1)  # [mix, C]
    return broadcast_pre(config, w, x, wrong)


@pytest.mark.parametrize("wrong", [_trap_mean_square_over_nC, _fold_wrong_layout])
@pytest.mark.parametrize("seed", range(3))
def test_control_wrong_broadcast_is_caught(wrong: Callable[..., Triple], seed: int) -> None:
    config = small_config(4, 64, 20)
    w = mhc_weights(config, seed)
    x = streams(config, 8, seed)[:, 0]
    fold = fold_streams(w["hc_attn_fn"], config.hc_mult, config.hidden_size)
    hf_post, hf_comb, hf_y = hf_hyper_connection(config, w, "attn")(n_copies(x, 4)[None])
    assert max_err(broadcast_pre(config, w, x, fold)[0], hf_y[0]) <= TOL
    y, post, comb = wrong(config, w, x, fold)
    assert max(max_err(y, hf_y[0]), max_err(post, hf_post[0]), max_err(comb, hf_comb[0])) > TOL


# -----------------------------------------------------------------------------
# (d) the head


def hf_head(config: DeepseekV4Config, ckpt: dict[str, Tensor]) -> DeepseekV4HyperHead:
    """transformers' `DeepseekV4HyperHead` holding the flagship's `hc_head_*`."""
    head = DeepseekV4HyperHead(hf_config(config)).requires_grad_(False)
    head.load_state_dict({hf: ckpt[ours] for ours, hf in HF_HEAD_NAMES.items()})
    return head


def flagship_head(config: DeepseekV4Config, ckpt: dict[str, Tensor], X: Tensor) -> Tensor:
    """The flagship's `hc_head` of the streams `X [T, n, C]`."""
    return hc_head(
        X,
        ckpt["hc_head_fn"],
        ckpt["hc_head_scale"],
        ckpt["hc_head_base"],
        rms_eps=config.rms_eps,
        hc_eps=config.hc_eps,
    )


@given(shapes)
def test_head_matches_transformers(s: dict[str, int]) -> None:
    config = small_config(s["n"], s["C"], s["iters"])
    ckpt = dict(random_checkpoint(config, s["seed"]))
    X = streams(config, s["T"], s["seed"])
    assert max_err(flagship_head(config, ckpt, X), hf_head(config, ckpt)(X[None])[0]) <= TOL


@pytest.mark.parametrize("seed", range(3))
def test_control_head_without_rms_is_caught(seed: int) -> None:
    config = small_config(4, 64, 20)
    ckpt = dict(random_checkpoint(config, seed))
    X = 3 * streams(config, 8, seed)  # an RMS away from 1, as after a few layers
    theirs = hf_head(config, ckpt)(X[None])[0]
    assert max_err(flagship_head(config, ckpt, X), theirs) <= TOL
    # The wrong head: mixing logits straight from the projection, no weightless RMS.
    mixes = F.linear(X.flatten(1), ckpt["hc_head_fn"])  # [T, n]
    pre = torch.sigmoid(mixes * ckpt["hc_head_scale"] + ckpt["hc_head_base"]) + config.hc_eps
    assert max_err((pre[:, :, None] * X).sum(1), theirs) > TOL


# -----------------------------------------------------------------------------
# the whole model, across a reload


def hf_logits(model: AnyModel, ckpt: dict[str, Tensor], input_ids: Tensor) -> Tensor:
    """transformers' mHC around the flagship's embedding, sublayers, norm and LM head:
    n copies of the embedding, transformers' layers, transformers' head."""
    config = model.config
    positions = torch.arange(input_ids.shape[0])
    h = n_copies(model.embed(input_ids), config.hc_mult)[None]  # [1, T, n, C]
    for index in range(config.num_layers):
        h = hf_layer(model, index)(h, positions=positions)
    y = hf_head(config, ckpt)(h)[0]  # [T, C]
    return model.head(model.norm(y))  # [T, vocab]


def test_model_matches_transformers_across_a_reload() -> None:
    # The flagship's first layer takes the broadcast path through its derived buffer;
    # transformers runs n copies. After a reload the buffer must follow the new weights.
    config = DeepseekV4Config.preset("tiny")
    model = DeepseekV4Model(config)
    input_ids = torch.arange(8)
    for seed in (0, 1):
        ckpt = random_checkpoint(config, seed)
        model.load_weights(ckpt)
        with torch.no_grad():
            assert max_err(model(input_ids), hf_logits(model, dict(ckpt), input_ids)) <= TOL


def test_control_stale_broadcast_buffer_is_caught() -> None:
    # What a graph captured before the reload reads from the pre-fix model: the first
    # tensor bound as hc_attn_fn_broadcast, folded from the old weights.
    config = DeepseekV4Config.preset("tiny")
    model = NaiveDeepseekV4Model(config)
    input_ids = torch.arange(8)
    model.load_weights(random_checkpoint(config, seed=0))
    first = model.layers["0"].hc_attn_fn_broadcast
    ckpt = random_checkpoint(config, seed=1)
    model.load_weights(ckpt)
    with torch.no_grad():
        theirs = hf_logits(model, dict(ckpt), input_ids)
        assert max_err(model(input_ids), theirs) <= TOL
        model.layers["0"].hc_attn_fn_broadcast = first
        assert max_err(model(input_ids), theirs) > TOL
