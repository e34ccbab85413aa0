"""DeepSeek V4 with manifold-constrained hyper-connections (mHC), small and exact.

The residual state between layers is `n = hc_mult` streams `X [T, n, C]`. Around each
sublayer (attention, then FFN) mHC computes per-token weights from the flattened streams:
`pre` collapses the streams into the sublayer's input, `post` spreads the sublayer's
output back over the streams, and a doubly stochastic `comb` (Sinkhorn-Knopp) mixes the
residual streams. The attention and FFN inside are deliberately small and standard.

The first layer of the first pipeline rank sees the embedding as one stream `x [T, C]`,
so it uses `hc_attn_fn_broadcast = hc_attn_fn.view(mix_hc, n, C).sum(1)`, a tensor
derived from a parameter. `DeepseekV4Model` declares it with `gs.derive`, so reloading
weights updates it in place and captured CUDA graphs keep reading the right memory.
`NaiveDeepseekV4Model` keeps the pre-fix behaviour (a fresh tensor bound on every load)
as a control. Both share every line of the math and load the same checkpoints.

Sources: mHC (arXiv 2512.24880), Hyper-Connections (arXiv 2409.19606) and the facts in
`reference/mhc.md`; everything runs in float32.

Examples:
    >>> config = DeepseekV4Config.preset("tiny")
    >>> model = DeepseekV4Model(config)
    >>> names = model.load_weights(random_checkpoint(config, seed=0))
    >>> model(torch.arange(8)).shape
    torch.Size([8, 128])
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

import graphsafe as gs
from graphsafe import recipes
from graphsafe.models._target import PresetTarget

__all__ = [
    "PRESETS",
    "DeepseekV4Config",
    "DeepseekV4DecoderLayer",
    "DeepseekV4Model",
    "DeepseekV4Target",
    "NaiveDeepseekV4DecoderLayer",
    "NaiveDeepseekV4Model",
    "fold_streams",
    "hc_head",
    "hc_mixes",
    "hc_post",
    "hc_pre",
    "hc_pre_broadcast",
    "hc_split",
    "random_checkpoint",
    "sinkhorn",
    "verify_target",
]


# -----------------------------------------------------------------------------
# config


class DeepseekV4Config(BaseModel):
    """Sizes of a DeepSeek V4 model with mHC, and this process's pipeline stage.

    The defaults are tiny, so a forward of a few tokens takes milliseconds on a CPU;
    `preset("flash")` has the real DeepSeek V4-Flash mHC sizes.

    Examples:
        >>> DeepseekV4Config(num_layers=5, pp_rank=1, pp_size=2).layer_range
        (3, 5)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(64, ge=1)
    """Width `C` of each residual stream."""
    hc_mult: int = Field(4, ge=1)
    """Number `n` of residual streams (the mHC expansion rate)."""
    num_layers: int = Field(4, ge=1)
    """Decoder layers of the whole model, over all pipeline ranks."""
    vocab_size: int = Field(128, ge=1)
    """Rows of the token embedding and of the LM head."""
    num_heads: int = Field(2, ge=1)
    """Attention heads."""
    head_dim: int = Field(16, ge=2)
    """Width of one attention head; even, since RoPE rotates pairs."""
    intermediate_size: int = Field(128, ge=1)
    """Hidden width of the SwiGLU FFN."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base."""
    sinkhorn_iters: int = Field(20, ge=1)
    """Sinkhorn-Knopp iterations: one column normalisation, then `sinkhorn_iters - 1`
    rounds of row and column normalisation."""
    hc_eps: float = Field(1e-6, gt=0)
    """Added to `pre`, to `comb` and to every Sinkhorn denominator."""
    rms_eps: float = Field(1e-6, gt=0)
    """Epsilon of mHC's weightless RMS over the flattened streams."""
    norm_eps: float = Field(1e-6, gt=0)
    """Epsilon of the weighted RMSNorms (before attention, FFN and LM head)."""
    pp_rank: int = Field(0, ge=0)
    """This process's pipeline-parallel rank."""
    pp_size: int = Field(1, ge=1)
    """Number of pipeline-parallel ranks."""

    @model_validator(mode="after")
    def _check(self) -> DeepseekV4Config:
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"pp_rank must be < pp_size, got {self.pp_rank} >= {self.pp_size}")
        if self.num_layers < self.pp_size:
            raise ValueError(
                f"every pipeline rank needs a layer: num_layers ({self.num_layers}) "
                f"< pp_size ({self.pp_size})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        return self

    @property
    def mix_hc(self) -> int:
        """Mixing logits per token: `n` pre, `n` post and `n * n` residual."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def layer_range(self) -> tuple[int, int]:
        """Global indices `[start, stop)` of this rank's layers; the first
        `num_layers % pp_size` ranks get one layer more than the others."""
        base, extra = divmod(self.num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return start, start + base + (self.pp_rank < extra)

    @property
    def is_first_rank(self) -> bool:
        """Whether this rank holds the embedding (and receives token ids)."""
        return self.pp_rank == 0

    @property
    def is_last_rank(self) -> bool:
        """Whether this rank holds the mHC head, final norm and LM head."""
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def preset(cls, name: str, **overrides: object) -> DeepseekV4Config:
        """A named configuration from `PRESETS`, with fields replaced and re-validated.

        Args:
            name: A key of `PRESETS` ("tiny" or "flash").
            **overrides: Fields to replace, for example `pp_rank=1, pp_size=2`.

        Returns:
            The validated config.

        Raises:
            KeyError: `name` is not a preset.

        Examples:
            >>> DeepseekV4Config.preset("flash").hidden_size
            4096
        """
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.model_validate({**PRESETS[name].model_dump(), **overrides})


PRESETS: dict[str, DeepseekV4Config] = {
    "tiny": DeepseekV4Config(),
    # DeepSeek V4-Flash's mHC sizes; attention, FFN and vocab shrunk so it fits anywhere.
    "flash": DeepseekV4Config(
        hidden_size=4096,
        hc_mult=4,
        num_layers=43,
        vocab_size=256,
        num_heads=2,
        head_dim=16,
        intermediate_size=64,
        sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_eps=1e-6,
        norm_eps=1e-6,
    ),
}


# -----------------------------------------------------------------------------
# mHC, as pure functions of tensors


def hc_mixes(xf: Tensor, hc_fn: Tensor, rms_eps: float) -> Tensor:
    """Mixing logits: project, then scale by a weightless RMS over the last dim.

    Args:
        xf: Flattened streams `[T, n*C]` (or the single stream `[T, C]` together with
            `fold_streams(hc_fn)`, which gives the same result).
        hc_fn: Projection `[mix, xf.shape[-1]]`.
        rms_eps: Added to the mean square.

    Returns:
        `[T, mix]` float32 logits.

    Examples:
        >>> hc_mixes(torch.ones(3, 8), torch.ones(24, 8), 1e-6).shape
        torch.Size([3, 24])
    """
    xf = xf.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)  # [T, 1]
    return F.linear(xf, hc_fn) * r  # [T, mix], scaled after the matmul


def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """Sinkhorn-Knopp normalisation of positive matrices towards doubly stochastic.

    One column normalisation, then `iters - 1` rounds of row then column normalisation,
    each with `eps` added to the denominator. The last step normalises columns, so
    columns sum to 1 up to `eps`; rows converge with the iterations.

    Args:
        comb: Positive matrices `[..., n, n]`.
        iters: Number of Sinkhorn iterations (at least 1).
        eps: Added to every denominator.

    Returns:
        A new tensor with the shape of `comb`.

    Examples:
        >>> sinkhorn(torch.tensor([[1.0, 3.0], [1.0, 1.0]]), 20, 1e-6).sum(-1)
        tensor([1.0000, 1.0000])
    """
    comb = comb / (comb.sum(-2, keepdim=True) + eps)  # columns
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)  # rows
        comb = comb / (comb.sum(-2, keepdim=True) + eps)  # columns
    return comb


def hc_split(
    mixes: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    *,
    hc_mult: int,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Turn mixing logits into the pre, post and residual-mixing weights.

    Args:
        mixes: `[T, (2 + n) * n]` logits from `hc_mixes`; rows `0:n` pre, `n:2n` post,
            `2n:` the row-major `n x n` residual mixing.
        hc_scale: `[3]` gates for the pre, post and residual logits.
        hc_base: `[(2 + n) * n]` static bias, same layout as `mixes`.
        hc_mult: `n`.
        hc_eps: Added to `pre`, to `comb` and to the Sinkhorn denominators.
        sinkhorn_iters: Sinkhorn iterations.

    Returns:
        `pre [T, n]` in `(0, 1]` (+eps), `post [T, n]` in `(0, 2)` and `comb [T, n, n]`
        (near doubly stochastic).

    Examples:
        >>> pre, post, comb = hc_split(torch.zeros(1, 24), torch.ones(3), torch.zeros(24),
        ...                            hc_mult=4, hc_eps=1e-6, sinkhorn_iters=20)
        >>> post
        tensor([[1., 1., 1., 1.]])
    """
    n = hc_mult
    pre = torch.sigmoid(mixes[:, :n] * hc_scale[0] + hc_base[:n]) + hc_eps  # [T, n]
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * hc_scale[1] + hc_base[n : 2 * n])  # [T, n]
    logits = (mixes[:, 2 * n :] * hc_scale[2] + hc_base[2 * n :]).view(-1, n, n)  # [T, n, n]
    comb = torch.softmax(logits, dim=-1) + hc_eps  # [T, n, n]
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def hc_pre(
    X: Tensor,
    hc_fn: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """mHC before a sublayer: mixing weights, and the streams collapsed with `pre`.

    Args:
        X: Residual streams `[T, n, C]`.
        hc_fn: `[(2 + n) * n, n*C]` projection of the flattened streams.
        hc_scale: `[3]` gates.
        hc_base: `[(2 + n) * n]` bias.
        rms_eps: Epsilon of the weightless RMS.
        hc_eps: See `hc_split`.
        sinkhorn_iters: See `hc_split`.

    Returns:
        `y [T, C]` float32 (the sublayer's input before its norm), `post [T, n]` and
        `comb [T, n, n]`.

    Examples:
        >>> X = torch.randn(3, 4, 8)
        >>> y, post, comb = hc_pre(X, torch.randn(24, 32), torch.ones(3), torch.zeros(24),
        ...                        rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
        >>> y.shape, comb.shape
        (torch.Size([3, 8]), torch.Size([3, 4, 4]))
    """
    n = X.shape[1]
    mixes = hc_mixes(X.flatten(1), hc_fn, rms_eps)  # [T, mix], xf index k*C + c
    pre, post, comb = hc_split(
        mixes, hc_scale, hc_base, hc_mult=n, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    y = (pre[:, :, None] * X.float()).sum(1)  # [T, C]
    return y, post, comb


def hc_pre_broadcast(
    x: Tensor,
    hc_fn_broadcast: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    *,
    hc_mult: int,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`hc_pre` for `n` identical streams, given only one of them.

    With `xf = [x, ..., x]`: `linear(xf, fn) = linear(x, fold_streams(fn))`, the mean
    square over `n*C` equals the mean square of `x` over `C`, and the collapse is
    `(sum_k pre[:, k]) * x`. Exact in real arithmetic, `n` times cheaper.

    Args:
        x: The single stream `[T, C]` (the token embedding).
        hc_fn_broadcast: `fold_streams(hc_fn)`, `[(2 + n) * n, C]`.
        hc_scale: `[3]` gates.
        hc_base: `[(2 + n) * n]` bias.
        hc_mult: `n`.
        rms_eps: Epsilon of the weightless RMS.
        hc_eps: See `hc_split`.
        sinkhorn_iters: See `hc_split`.

    Returns:
        As `hc_pre` on `x` repeated `n` times: `y [T, C]`, `post [T, n]`, `comb [T, n, n]`.

    Examples:
        >>> fn = torch.randn(24, 4 * 8)
        >>> y, _, _ = hc_pre_broadcast(torch.ones(3, 8), fold_streams(fn, 4, 8), torch.ones(3),
        ...                            torch.zeros(24), hc_mult=4, rms_eps=1e-6, hc_eps=1e-6,
        ...                            sinkhorn_iters=20)
        >>> y.shape
        torch.Size([3, 8])
    """
    xf = x.float()  # [T, C]
    mixes = hc_mixes(xf, hc_fn_broadcast, rms_eps)  # [T, mix], mean square over C, not n*C
    pre, post, comb = hc_split(
        mixes, hc_scale, hc_base, hc_mult=hc_mult, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters
    )
    y = pre.sum(-1, keepdim=True) * xf  # [T, C]
    return y, post, comb


def hc_post(out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """mHC after a sublayer: `X_new[:, j] = post[:, j] * out + sum_i comb[:, i, j] * X[:, i]`.

    Args:
        out: The sublayer's output `[T, C]`.
        residual: The streams that entered the sublayer, `[T, n, C]`.
        post: `[T, n]` from `hc_pre`.
        comb: `[T, n, n]` from `hc_pre`; the sum runs over its FIRST stream index.

    Returns:
        The new streams `[T, n, C]`, float32.

    Examples:
        >>> hc_post(torch.ones(2, 8), torch.zeros(2, 4, 8), torch.ones(2, 4),
        ...         torch.eye(4).expand(2, 4, 4)).shape
        torch.Size([2, 4, 8])
    """
    mixed = torch.bmm(comb.transpose(1, 2), residual.float())  # [T, n, C]: sum over i
    return post[:, :, None] * out.float()[:, None, :] + mixed  # [T, n, C]


def hc_head(
    X: Tensor, hc_fn: Tensor, hc_scale: Tensor, hc_base: Tensor, *, rms_eps: float, hc_eps: float
) -> Tensor:
    """Collapse the streams into one before the final norm and LM head.

    Args:
        X: Residual streams `[T, n, C]`.
        hc_fn: `[n, n*C]` projection.
        hc_scale: `[1]` gate.
        hc_base: `[n]` bias.
        rms_eps: Epsilon of the weightless RMS.
        hc_eps: Added to the collapse weights.

    Returns:
        `[T, C]` float32.

    Examples:
        >>> hc_head(torch.ones(2, 4, 8), torch.zeros(4, 32), torch.ones(1), torch.zeros(4),
        ...         rms_eps=1e-6, hc_eps=0.0)[0, 0]
        tensor(2.)
    """
    mixes = hc_mixes(X.flatten(1), hc_fn, rms_eps)  # [T, n]
    pre = torch.sigmoid(mixes * hc_scale + hc_base) + hc_eps  # [T, n]
    return (pre[:, :, None] * X.float()).sum(1)  # [T, C]


def fold_streams(
    hc_fn: Tensor, hc_mult: int, hidden_size: int, *, out: Tensor | None = None
) -> Tensor:
    """`hc_fn.view(mix, n, C).sum(1)`: the projection for `n` identical streams.

    The recipe `graphsafe.recipes.fold_streams(hc_mult, hidden_size)` as a function.

    Args:
        hc_fn: `[mix, n*C]`.
        hc_mult: `n`.
        hidden_size: `C`.
        out: If given, the result is written into it (same storage).

    Returns:
        `[mix, C]`; `out` itself when given.

    Examples:
        >>> fold_streams(torch.ones(24, 32), 4, 8)[0, 0]
        tensor(4.)
    """
    return recipes.fold_streams(hc_mult, hidden_size)(None, hc_fn, out=out)  # [mix, C]


# -----------------------------------------------------------------------------
# sublayers


class RMSNorm(nn.Module):
    """Weighted RMSNorm over the last dim."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x.float()
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate halves of the last dim of `x [H, T, D]` by angles `positions * freqs`."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # [D/2]
    angles = positions.float()[:, None] * freqs  # [T, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]  # [H, T, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE over one sequence of `T` tokens."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        inner = config.num_heads * config.head_dim
        self.num_heads, self.head_dim, self.rope_theta = (
            config.num_heads,
            config.head_dim,
            config.rope_theta,
        )
        self.wq = nn.Linear(config.hidden_size, inner, bias=False)
        self.wk = nn.Linear(config.hidden_size, inner, bias=False)
        self.wv = nn.Linear(config.hidden_size, inner, bias=False)
        self.wo = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        T = x.shape[0]
        q, k, v = (
            w(x).view(T, self.num_heads, self.head_dim).transpose(0, 1)
            for w in (self.wq, self.wk, self.wv)
        )  # [H, T, D] each
        q = apply_rope(q, positions, self.rope_theta)
        k = apply_rope(k, positions, self.rope_theta)
        y = F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True
        )  # [1, H, T, D]
        return self.wo(y[0].transpose(0, 1).reshape(T, -1))  # [T, C]


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # [T, C]


# -----------------------------------------------------------------------------
# decoder layer


class _DecoderLayer(nn.Module):
    """Attention and FFN, each wrapped by its own mHC parameters (shared math)."""

    hc_attn_fn_broadcast: Tensor | None  # bound by the subclasses, see their docstrings

    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__()
        start, stop = config.layer_range
        if not start <= layer_id < stop:
            raise ValueError(
                f"layer {layer_id} is not on pp rank {config.pp_rank}, whose layers are "
                f"[{start}, {stop})"
            )
        n, C, mix = config.hc_mult, config.hidden_size, config.mix_hc
        self.config = config
        self.layer_id = layer_id
        self.hc_mult = n
        self.hidden_size = C
        # The global first layer (always on pp rank 0) receives the single-stream embedding.
        self.is_first_pp_layer = config.is_first_rank and layer_id == start
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, n * C))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, n * C))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))
        self.attn_norm = RMSNorm(C, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(C, config.norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, h: Tensor, positions: Tensor) -> Tensor:
        """One decoder layer.

        Args:
            h: The streams `[T, n, C]`, or, on the first layer of pp rank 0 only, the
                single-stream embedding `[T, C]`, which takes the broadcast path through
                `hc_attn_fn_broadcast`. Feeding that layer the embedding repeated `n`
                times as `[T, n, C]` takes the expanded path instead (same result).
            positions: `[T]` token positions for RoPE.

        Returns:
            The new streams `[T, n, C]`, float32.

        Raises:
            RuntimeError: A single stream reaches a layer that cannot take it, or the
                first layer runs before `load_weights` bound `hc_attn_fn_broadcast`.
        """
        cfg = self.config
        mhc: dict[str, Any] = {
            "rms_eps": cfg.rms_eps,
            "hc_eps": cfg.hc_eps,
            "sinkhorn_iters": cfg.sinkhorn_iters,
        }
        if h.dim() == 2:  # [T, C]: the embedding, one stream
            fn_broadcast = getattr(self, "hc_attn_fn_broadcast", None)
            if not self.is_first_pp_layer or fn_broadcast is None:
                raise RuntimeError(
                    f"layers.{self.layer_id} got a single stream [T, C] but has no "
                    "hc_attn_fn_broadcast: only the first layer of pp rank 0 takes the "
                    "embedding, and only after load_weights"
                )
            y, post, comb = hc_pre_broadcast(
                h,
                fn_broadcast,
                self.hc_attn_scale,
                self.hc_attn_base,
                hc_mult=self.hc_mult,
                **mhc,
            )
            residual = h[:, None, :].expand(-1, self.hc_mult, -1)  # [T, n, C], n copies
        else:
            y, post, comb = hc_pre(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, **mhc)
            residual = h  # [T, n, C]
        X = hc_post(self.attn(self.attn_norm(y), positions), residual, post, comb)  # [T, n, C]
        y, post, comb = hc_pre(X, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, **mhc)
        return hc_post(self.ffn(self.ffn_norm(y)), X, post, comb)  # [T, n, C]


@gs.graphsafe
class DeepseekV4DecoderLayer(_DecoderLayer):
    """A decoder layer whose `hc_attn_fn_broadcast` is a graphsafe derived buffer.

    After the model's first `load_weights`, the first layer of pp rank 0 owns the
    non-persistent buffer `hc_attn_fn_broadcast [mix_hc, C]`; later loads write the new
    sum into that same storage. On every other layer the attribute is `None`.

    Args:
        config: Model sizes and pipeline stage.
        layer_id: Global index of the layer, within `config.layer_range`.

    Examples:
        >>> layer = DeepseekV4DecoderLayer(DeepseekV4Config(), 0)
        >>> layer.is_first_pp_layer, tuple(layer.hc_attn_fn.shape)
        (True, (24, 256))
    """

    @gs.derive(
        "hc_attn_fn_broadcast", inputs=["hc_attn_fn"], when=lambda self: self.is_first_pp_layer
    )
    def _hc_attn_fn_broadcast(self, hc_attn_fn: Tensor, *, out: Tensor | None = None) -> Tensor:
        return fold_streams(hc_attn_fn, self.hc_mult, self.hidden_size, out=out)


class NaiveDeepseekV4DecoderLayer(_DecoderLayer):
    """Control only: `hc_attn_fn_broadcast` is a plain attribute, rebound by every load.

    This is the pre-fix behaviour; a CUDA graph captured before a reload keeps reading
    the old tensor. Same math and parameter names as `DeepseekV4DecoderLayer`.

    Args:
        config: Model sizes and pipeline stage.
        layer_id: Global index of the layer, within `config.layer_range`.

    Examples:
        >>> NaiveDeepseekV4DecoderLayer(DeepseekV4Config(), 0).hc_attn_fn_broadcast is None
        True
    """

    def __init__(self, config: DeepseekV4Config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.hc_attn_fn_broadcast = None


# -----------------------------------------------------------------------------
# model

# Top-level checkpoint entries held by the first or the last pipeline rank only.
_FIRST_RANK_PARAMS = frozenset({"embed.weight"})
_LAST_RANK_PARAMS = frozenset(
    {"hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight", "head.weight"}
)
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


class _Model(nn.Module):
    """Embedding, this rank's decoder layers, mHC head, final norm and LM head."""

    layer_cls: ClassVar[type[_DecoderLayer]]

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        n, C = config.hc_mult, config.hidden_size
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, C) if config.is_first_rank else None
        # Keyed by the global index, so checkpoint names read `layers.<i>.hc_attn_fn`.
        self.layers = nn.ModuleDict(
            {str(i): self.layer_cls(config, i) for i in range(*config.layer_range)}
        )
        if config.is_last_rank:
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * C))
            self.hc_head_base = nn.Parameter(torch.zeros(n))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
            self.norm = RMSNorm(C, config.norm_eps)
            self.head = nn.Linear(C, config.vocab_size, bias=False)
        self.requires_grad_(False)  # an inference model: weights change only by loading

    def forward(
        self,
        input_ids: Tensor | None = None,
        positions: Tensor | None = None,
        *,
        hidden_states: Tensor | None = None,
    ) -> Tensor:
        """Run this rank's stage on one sequence.

        Args:
            input_ids: `[T]` token ids; required on pp rank 0, ignored elsewhere.
            positions: `[T]` positions for RoPE; `arange(T)` when omitted.
            hidden_states: `[T, n, C]` streams from the previous rank; required on
                every rank but the first.

        Returns:
            Logits `[T, vocab_size]` on the last rank, else the streams `[T, n, C]`
            to hand to the next rank.

        Raises:
            ValueError: The input this rank needs is missing.
        """
        cfg = self.config
        if cfg.is_first_rank:
            if input_ids is None or self.embed is None:
                raise ValueError("pp rank 0 needs input_ids [T]")
            h = self.embed(input_ids)  # [T, C], one stream until the first layer
        elif hidden_states is None:
            raise ValueError(f"pp rank {cfg.pp_rank} needs hidden_states [T, n, C]")
        else:
            h = hidden_states  # [T, n, C]
        if positions is None:
            positions = torch.arange(h.shape[0], device=h.device)
        for layer in self.layers.values():
            h = layer(h, positions)  # [T, n, C]
        if not cfg.is_last_rank:
            return h
        y = hc_head(
            h,
            self.hc_head_fn,
            self.hc_head_scale,
            self.hc_head_base,
            rms_eps=cfg.rms_eps,
            hc_eps=cfg.hc_eps,
        )  # [T, C]
        return self.head(self.norm(y))  # [T, vocab]

    def _owned_by_other_rank(self, name: str) -> bool:
        """Whether `name` is a parameter of the full model that another pp rank holds."""
        cfg = self.config
        if (match := _LAYER_NAME.fullmatch(name)) is not None:
            index, rest = int(match[1]), match[2]
            local = dict(next(iter(self.layers.values())).named_parameters())  # same per layer
            start, stop = cfg.layer_range
            return 0 <= index < cfg.num_layers and not start <= index < stop and rest in local
        return (name in _FIRST_RANK_PARAMS and not cfg.is_first_rank) or (
            name in _LAST_RANK_PARAMS and not cfg.is_last_rank
        )

    def _load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for entry, w in weights:
                name = entry.removeprefix("model.")
                param = params.get(name)
                if param is None:
                    if self._owned_by_other_rank(name):
                        continue  # another pipeline rank loads it, as in vLLM
                    raise gs.WeightLoadError(
                        f"unknown checkpoint entry {entry!r}",
                        name=entry,
                        module_class=type(self).__name__,
                        path=name,
                        expected="a parameter of this model, optionally prefixed 'model.'",
                        got=repr(entry),
                        fix="rename the entry to the model's parameter name, or drop it",
                    )
                try:
                    # Checked, then in place: captured graphs keep reading this storage.
                    gs.load_into(param, w, name=entry)
                except gs.WeightLoadError as err:
                    owner = self.get_submodule(name.rpartition(".")[0])
                    raise gs.WeightLoadError(
                        err.summary,
                        name=entry,
                        module_class=type(owner).__name__,
                        path=name,
                        expected=err.expected,
                        got=err.got,
                        fix=err.fix,
                    ) from None
                loaded.add(name)
        return loaded


@gs.graphsafe
class DeepseekV4Model(_Model):
    """DeepSeek V4 with mHC; `hc_attn_fn_broadcast` stays correct across reloads.

    Args:
        config: Model sizes and pipeline stage. The model builds only the layers of
            `config.layer_range`; the embedding lives on the first pp rank and the mHC
            head, final norm and LM head on the last.

    Examples:
        >>> config = DeepseekV4Config()
        >>> model = DeepseekV4Model(config)
        >>> _ = model.load_weights(random_checkpoint(config, seed=0))
        >>> tuple(model.layers["0"].hc_attn_fn_broadcast.shape)
        (24, 64)
    """

    layer_cls = DeepseekV4DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy checkpoint entries into the parameters, in place (vLLM style).

        Works bucket by bucket, with any partition and order of the checkpoint; graphsafe
        refreshes the derived buffers after each call. Entries are the model's parameter
        names, optionally prefixed with `model.`. Entries of layers, embedding or head that
        another pipeline rank holds are skipped (their shapes are not checked). Each entry
        is checked before it is written, so no tensor is ever half-written; entries before
        a bad one in the same call stay loaded.

        Args:
            weights: `(name, tensor)` pairs; tensors may live on any device.

        Returns:
            The parameter names loaded by this call (without the `model.` prefix).

        Raises:
            WeightLoadError: An entry has an unknown name, is not a tensor, or has the
                wrong shape or dtype (checked by `gs.load_into`, which `copy_` would
                broadcast or cast silently); `.name` is the entry and the parameter
                keeps its old value.

        Examples:
            >>> model = DeepseekV4Model(DeepseekV4Config())
            >>> model.load_weights([("model.embed.weight", torch.zeros(128, 64))])
            {'embed.weight'}
        """
        return self._load_weights(weights)


class NaiveDeepseekV4Model(_Model):
    """Control only: the pre-fix model that rebinds `hc_attn_fn_broadcast` on each load.

    Not managed by graphsafe. Same parameters, checkpoints and forward as
    `DeepseekV4Model`; only the lifetime of the broadcast tensor differs.

    Args:
        config: As for `DeepseekV4Model`.

    Examples:
        >>> model = NaiveDeepseekV4Model(DeepseekV4Config())
        >>> _ = model.load_weights(random_checkpoint(model.config, seed=0))
        >>> before = model.layers["0"].hc_attn_fn_broadcast
        >>> _ = model.load_weights(random_checkpoint(model.config, seed=0))
        >>> model.layers["0"].hc_attn_fn_broadcast is before
        False
    """

    layer_cls = NaiveDeepseekV4DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """As `DeepseekV4Model.load_weights`, then bind a FRESH broadcast tensor.

        Args:
            weights: `(name, tensor)` pairs.

        Returns:
            The parameter names loaded by this call.

        Raises:
            WeightLoadError: As for `DeepseekV4Model.load_weights`.
        """
        loaded = self._load_weights(weights)
        with torch.no_grad():
            for layer in self.modules():
                if isinstance(layer, _DecoderLayer) and layer.is_first_pp_layer:
                    # The bug: a new tensor at a new address on every load.
                    layer.hc_attn_fn_broadcast = fold_streams(
                        layer.hc_attn_fn, layer.hc_mult, layer.hidden_size
                    )
        return loaded


# -----------------------------------------------------------------------------
# random weights


def random_checkpoint(
    config: DeepseekV4Config, seed: int, device: torch.device | str | None = None
) -> list[tuple[str, Tensor]]:
    """A full checkpoint (all pipeline ranks) of deterministic random float32 weights.

    Scaled so activations stay finite over many layers and mHC mixing is non-trivial:
    projections ~ `N(0, 1/fan_in)`, norm weights ~ 1 +- 0.1, mHC gates uniform in
    `[0.1, 1]`, mHC biases ~ `N(0, 0.1^2)`. The same `(config sizes, seed)` gives the same
    tensors whatever `pp_rank`/`pp_size` say.

    Args:
        config: Model sizes; the pipeline fields are ignored.
        seed: Seed of the generator.
        device: Where to put the tensors (generated on the CPU).

    Returns:
        `(name, tensor)` pairs in the order of the model's parameters.

    Examples:
        >>> ckpt = dict(random_checkpoint(DeepseekV4Config(), seed=0))
        >>> ckpt["layers.0.hc_attn_fn"].shape, len(ckpt)
        (torch.Size([24, 256]), 66)
    """
    full = config.model_copy(update={"pp_rank": 0, "pp_size": 1})
    with torch.device("meta"):
        skeleton = NaiveDeepseekV4Model(full)  # names and shapes only, no memory
    g = torch.Generator().manual_seed(seed)
    ckpt: list[tuple[str, Tensor]] = []
    for name, p in skeleton.named_parameters():
        leaf = name.rpartition(".")[2]
        if leaf.endswith("_scale"):
            w = 0.1 + 0.9 * torch.rand(p.shape, generator=g)
        elif leaf.endswith("_base"):
            w = 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name == "embed.weight":
            w = torch.randn(p.shape, generator=g)
        else:  # projections [out, in], incl. hc_*_fn [mix, n*C]
            w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        ckpt.append((name, w.to(device) if device is not None else w))
    return ckpt


# -----------------------------------------------------------------------------
# target of `graphsafe verify`


@dataclasses.dataclass(frozen=True)
class DeepseekV4Target(PresetTarget):
    """What `graphsafe verify` needs to build, load and run DeepSeek V4.

    Examples:
        >>> model = verify_target.build("tiny", naive=False, device=torch.device("cpu"))
        >>> _ = model.load_weights(verify_target.checkpoint(model, seed=0))
        >>> model(*verify_target.example_input(model, seed=0)).shape
        torch.Size([8, 128])
    """

    name: str = "deepseek_v4"
    """Name of the target."""
    presets: tuple[str, ...] = ("tiny", "flash")
    """Presets `build` accepts."""
    critical: tuple[str, ...] = ("hc_attn_fn",)
    """Suffixes of parameter names whose refit a derived buffer must follow; verify
    loads them in the last bucket."""

    label: ClassVar[str] = "DeepSeek V4"
    model_cls: ClassVar[type[nn.Module]] = DeepseekV4Model
    naive_cls: ClassVar[type[nn.Module]] = NaiveDeepseekV4Model
    base_cls: ClassVar[type[nn.Module]] = _Model
    config_cls: ClassVar[Any] = DeepseekV4Config
    make_checkpoint = staticmethod(random_checkpoint)


verify_target = DeepseekV4Target()
"""The `graphsafe.targets` entry point `deepseek_v4`."""
