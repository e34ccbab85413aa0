"""Llama whose forward reads kernel-format weights: fused QKV and gate-up, optionally FP8.

One sequence of `T` tokens through RMSNorm, rotary embeddings (RoPE, with Llama 3.1's
frequency scaling), grouped-query attention and a SwiGLU MLP, as in Hugging Face's
`LlamaForCausalLM`, whose checkpoint names the parameters carry
(`model.layers.0.self_attn.q_proj.weight`, ...).

The forward does not read the checkpoint's projections one by one. Like an inference
engine, it reads tensors derived from them in the layout its kernels take, declared with
`graphsafe.recipes`, so that every load refreshes them in place:

- `self_attn.qkv_weight = cat(q_proj, k_proj, v_proj)`, `[(H + 2 KV) * D, C]`;
- `mlp.gate_up_weight = cat(gate_proj, up_proj)`, `[2 I, C]`;
- with `fp8=True`, instead, FP8 QKV, output, gate-up and down weights with float32
  block scales (`*_fp8`, `*_scale_inv`), dequantized in the forward. They are quantized
  straight from the checkpoint's projections, declared transient: between loads those
  live on the meta device and the model holds only the FP8 weights (plus embeddings,
  norms and head). `LlamaConfig(fp8=True, transient=False)` keeps them resident.

`NaiveLlamaForCausalLM` has the same parameters, checkpoints and math, but binds fresh
tensors for the derived weights on every load: the bug a captured graph cannot see, kept
as the control.

Examples:
    >>> config = LlamaConfig()
    >>> model = LlamaForCausalLM(config)
    >>> names = model.load_weights(random_checkpoint(config, seed=0))
    >>> model(torch.arange(8)).shape
    torch.Size([8, 128])
"""

from __future__ import annotations

import dataclasses
import math
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
    "Llama3RopeScaling",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "LlamaTarget",
    "NaiveLlamaAttention",
    "NaiveLlamaForCausalLM",
    "NaiveLlamaMLP",
    "RMSNorm",
    "ResidentLlamaAttention",
    "ResidentLlamaMLP",
    "RotaryEmbedding",
    "apply_rope",
    "random_checkpoint",
    "rope_inv_freq",
    "verify_target",
]


# -----------------------------------------------------------------------------
# config


class Llama3RopeScaling(BaseModel):
    """Llama 3.1's RoPE frequency scaling (`rope_type: llama3`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    factor: float = Field(gt=0)
    """Long wavelengths are divided by this."""
    low_freq_factor: float = Field(gt=0)
    """Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled."""
    high_freq_factor: float = Field(gt=0)
    """Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept."""
    original_max_position_embeddings: int = Field(ge=1)
    """Context length of pre-training."""

    @model_validator(mode="after")
    def _check(self) -> Llama3RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self


class LlamaConfig(BaseModel):
    """Sizes of a Llama model, and the format of the weights its forward reads.

    The defaults are tiny; `from_hf` reads a Hugging Face `LlamaConfig`.

    Examples:
        >>> LlamaConfig(num_attention_heads=8, num_key_value_heads=2).num_key_value_groups
        4
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(128, ge=1)
    """Rows of the token embedding and of the LM head."""
    hidden_size: int = Field(64, ge=1)
    """Width `C` of the residual stream."""
    intermediate_size: int = Field(96, ge=1)
    """Hidden width `I` of the SwiGLU MLP."""
    num_hidden_layers: int = Field(2, ge=1)
    """Decoder layers."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads `H`."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads `KV`; each serves `H / KV` consecutive query heads."""
    head_dim: int = Field(16, ge=2)
    """Width `D` of one head; even, since RoPE rotates pairs."""
    rms_norm_eps: float = Field(1e-6, gt=0)
    """Epsilon of every RMSNorm."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base."""
    rope_scaling: Llama3RopeScaling | None = None
    """Llama 3.1 frequency scaling, or None for plain RoPE."""
    tie_word_embeddings: bool = False
    """Whether the LM head is the embedding matrix."""
    fp8: bool = False
    """Whether the forward reads FP8 (e4m3) copies of the QKV, output, gate-up and down
    weights, dequantized on the fly."""
    fp8_block: tuple[int, int] | None = (128, 128)
    """Rows and columns of one FP8 scale block (DeepSeek's 128 x 128), or None for one
    scale per tensor."""
    transient: bool = True
    """With `fp8`: whether the checkpoint-format projections the FP8 weights are
    quantized from are transient (on the meta device between loads, held only while a
    load writes them) rather than resident. Without `fp8` the forward reads the fused
    float weights and the projections, which stay resident."""

    @model_validator(mode="after")
    def _check(self) -> LlamaConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.fp8_block is not None and min(self.fp8_block) < 1:
            raise ValueError(f"fp8_block must be positive, got {self.fp8_block}")
        return self

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf_config: Any, **options: Any) -> LlamaConfig:
        """Read a Hugging Face `LlamaConfig` (transformers 4 or 5).

        Args:
            hf_config: The Hugging Face config (any object with its attributes).
            **options: Fields to set or override, e.g. `fp8=True, fp8_block=(128, 128)`.

        Returns:
            The validated config.

        Raises:
            ValueError: The checkpoint uses something this model does not implement
                (biases, an activation other than SiLU, a RoPE type other than
                `default` or `llama3`).

        Examples:
            >>> from types import SimpleNamespace
            >>> hf = SimpleNamespace(vocab_size=32, hidden_size=64, intermediate_size=128,
            ...                      num_hidden_layers=1, num_attention_heads=4)
            >>> LlamaConfig.from_hf(hf, fp8=True).num_key_value_heads
            4
        """

        def get(key: str, default: Any = None) -> Any:
            value = getattr(hf_config, key, None)
            return default if value is None else value

        for flag in ("attention_bias", "mlp_bias"):
            if get(flag, False):
                raise ValueError(f"{flag}=True is not supported: this Llama has no biases")
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {get('hidden_act')!r}")
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4 in `rope_theta`
        # and `rope_scaling`.
        rope = dict(get("rope_parameters", {}))
        rope = {**dict(get("rope_scaling", {})), **rope}
        theta = rope.get("rope_theta", get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling: Llama3RopeScaling | None = None
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
            )
        elif rope_type != "default":
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; this Llama implements 'default' "
                "and 'llama3'"
            )
        heads = hf_config.num_attention_heads
        fields = {
            "vocab_size": hf_config.vocab_size,
            "hidden_size": hf_config.hidden_size,
            "intermediate_size": hf_config.intermediate_size,
            "num_hidden_layers": hf_config.num_hidden_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": get("num_key_value_heads", heads),
            "head_dim": get("head_dim", hf_config.hidden_size // heads),
            "rms_norm_eps": get("rms_norm_eps", 1e-6),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": get("tie_word_embeddings", False),
        }
        return cls.model_validate({**fields, **options})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named configuration from `PRESETS`, with fields replaced and re-validated.

        Args:
            name: A key of `PRESETS`.
            **overrides: Fields to replace.

        Returns:
            The validated config.

        Raises:
            KeyError: `name` is not a preset.

        Examples:
            >>> LlamaConfig.preset("tiny-fp8").fp8_block
            (24, 24)
        """
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.model_validate({**PRESETS[name].model_dump(), **overrides})


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    # Blocks of 24 leave ragged edge blocks in every quantized weight (64 = 24 + 24 + 16).
    "tiny-fp8": LlamaConfig(fp8=True, fp8_block=(24, 24)),
}


# -----------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    """Weighted RMSNorm over the last dim, computed in float32 as Hugging Face does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> Tensor:
    """RoPE inverse frequencies `[D/2]`, float32, with Llama 3.1 scaling if configured.

    Args:
        config: Model sizes.

    Returns:
        `theta ** (-2i / D)` for `i < D/2`, long wavelengths scaled down under
        `rope_scaling`.

    Examples:
        >>> rope_inv_freq(LlamaConfig(head_dim=4, rope_theta=100.0))
        tensor([1.0000, 0.1000])
    """
    D = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2).float() / D))  # [D/2]
    s = config.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin of `positions * inv_freq`, each frequency used for both halves."""

    inv_freq: Tensor  # [D/2]

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        # From the config, not the checkpoint: never loaded, never derived from weights.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of the last dim of `x [H, T, D]` (Hugging Face's layout).

    Examples:
        >>> apply_rope(torch.ones(1, 1, 2), torch.zeros(1, 2), torch.ones(1, 2))
        tensor([[[-1.,  1.]]])
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [H, T, D]
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def _is_fp8(module: nn.Module) -> bool:
    return bool(getattr(module, "fp8", False))


def _is_float(module: nn.Module) -> bool:
    return not _is_fp8(module)


# One recipe object serves every declaration and the naive control alike.
_FUSE = recipes.concat(0)

_QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
_O = ("o_proj.weight",)
_GATE_UP = ("gate_proj.weight", "up_proj.weight")
_DOWN = ("down_proj.weight",)


class _Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; reads the fused QKV weight."""

    qkv_weight: Tensor | None  # [(H + 2 KV) * D, C]; None with fp8
    qkv_weight_fp8: Tensor | None  # [(H + 2 KV) * D, C]; None without fp8
    qkv_weight_scale_inv: Tensor | None
    o_weight_fp8: Tensor | None  # [C, H * D]
    o_weight_scale_inv: Tensor | None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        H, KV, D, C = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.hidden_size,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = H, KV, D
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, KV * D, bias=False)
        self.v_proj = nn.Linear(C, KV * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.fp8 = config.fp8
        self.fp8_block = config.fp8_block
        # With several weights, quantizes their concatenation without materializing it.
        self.quantize = recipes.fp8_quantize(block=config.fp8_block)

    def weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The QKV and output weights the forward multiplies by, FP8 dequantized."""
        if not self.fp8:
            assert self.qkv_weight is not None
            return self.qkv_weight, self.o_proj.weight
        assert self.qkv_weight_fp8 is not None and self.qkv_weight_scale_inv is not None
        assert self.o_weight_fp8 is not None and self.o_weight_scale_inv is not None
        block = self.fp8_block
        return (
            recipes.dequantize_fp8(
                self.qkv_weight_fp8, self.qkv_weight_scale_inv, block=block, dtype=dtype
            ),
            recipes.dequantize_fp8(
                self.o_weight_fp8, self.o_weight_scale_inv, block=block, dtype=dtype
            ),
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        T = x.shape[0]
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        w_qkv, w_o = self.weights(x.dtype)
        q, k, v = torch.split(F.linear(x, w_qkv), [H * D, KV * D, KV * D], dim=-1)  # [T, *]
        q = apply_rope(q.view(T, H, D).transpose(0, 1), cos, sin)  # [H, T, D]
        k = apply_rope(k.view(T, KV, D).transpose(0, 1), cos, sin)  # [KV, T, D]
        v = v.view(T, KV, D).transpose(0, 1)  # [KV, T, D]
        # Grouped query: kv head j serves query heads j * H/KV ... (j + 1) * H/KV - 1.
        k = k[:, None].expand(KV, H // KV, T, D).reshape(H, T, D)  # [H, T, D]
        v = v[:, None].expand(KV, H // KV, T, D).reshape(H, T, D)  # [H, T, D]
        y = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        return F.linear(y.transpose(0, 1).reshape(T, H * D), w_o)  # [T, C]


@gs.graphsafe
class LlamaAttention(_Attention):
    """Attention whose fused QKV (or FP8) weights are graphsafe derived buffers.

    With fp8, the FP8 weights are quantized straight from the checkpoint's projections,
    which are transient: released to the meta device once their FP8 weights are made.

    Args:
        config: Model sizes and weight format.

    Examples:
        >>> attn = LlamaAttention(LlamaConfig())
        >>> _ = gs.runtime(attn).refresh()
        >>> tuple(attn.qkv_weight.shape), attn.qkv_weight_fp8
        ((128, 64), None)
    """

    _qkv_weight = recipes.derive("qkv_weight", inputs=_QKV, fn=_FUSE, when=_is_float)

    @gs.derive(("qkv_weight_fp8", "qkv_weight_scale_inv"), inputs=_QKV, transient=_QKV,
               when=_is_fp8)
    def _qkv_weight_fp8(
        self, q: Tensor, k: Tensor, v: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, q, k, v, out=out)  # type: ignore[no-any-return]

    @gs.derive(("o_weight_fp8", "o_weight_scale_inv"), inputs=_O, transient=_O,
               when=_is_fp8)
    def _o_weight_fp8(
        self, o: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, o, out=out)  # type: ignore[no-any-return]


@gs.graphsafe
class ResidentLlamaAttention(LlamaAttention):
    """`LlamaAttention` keeping the checkpoint's projections resident beside the FP8
    weights (`LlamaConfig(fp8=True, transient=False)`): the same outputs, redeclared
    without `transient`."""

    @gs.derive(("qkv_weight_fp8", "qkv_weight_scale_inv"), inputs=_QKV, when=_is_fp8)
    def _qkv_weight_fp8(
        self, q: Tensor, k: Tensor, v: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, q, k, v, out=out)  # type: ignore[no-any-return]

    @gs.derive(("o_weight_fp8", "o_weight_scale_inv"), inputs=_O, when=_is_fp8)
    def _o_weight_fp8(
        self, o: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, o, out=out)  # type: ignore[no-any-return]


class NaiveLlamaAttention(_Attention):
    """Control only: the derived weights are plain attributes, rebound by `rebind`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.qkv_weight = None
        self.qkv_weight_fp8 = self.qkv_weight_scale_inv = None
        self.o_weight_fp8 = self.o_weight_scale_inv = None

    def rebind(self) -> None:
        """The bug: fresh tensors, at new addresses, after every load."""
        q, k, v = self.q_proj.weight, self.k_proj.weight, self.v_proj.weight
        if not self.fp8:
            self.qkv_weight = _FUSE(self, q, k, v)
            return
        self.qkv_weight_fp8, self.qkv_weight_scale_inv = self.quantize(self, q, k, v)
        self.o_weight_fp8, self.o_weight_scale_inv = self.quantize(self, self.o_proj.weight)


class _MLP(nn.Module):
    """SwiGLU `down(silu(gate x) * up x)`; reads the fused gate-up weight."""

    gate_up_weight: Tensor | None  # [2 I, C]; None with fp8
    gate_up_weight_fp8: Tensor | None  # [2 I, C]; None without fp8
    gate_up_weight_scale_inv: Tensor | None
    down_weight_fp8: Tensor | None  # [C, I]
    down_weight_scale_inv: Tensor | None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        C, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(C, inner, bias=False)
        self.up_proj = nn.Linear(C, inner, bias=False)
        self.down_proj = nn.Linear(inner, C, bias=False)
        self.fp8 = config.fp8
        self.fp8_block = config.fp8_block
        self.quantize = recipes.fp8_quantize(block=config.fp8_block)

    def weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The gate-up and down weights the forward multiplies by, FP8 dequantized."""
        if not self.fp8:
            assert self.gate_up_weight is not None
            return self.gate_up_weight, self.down_proj.weight
        assert self.gate_up_weight_fp8 is not None and self.gate_up_weight_scale_inv is not None
        assert self.down_weight_fp8 is not None and self.down_weight_scale_inv is not None
        block = self.fp8_block
        return (
            recipes.dequantize_fp8(
                self.gate_up_weight_fp8, self.gate_up_weight_scale_inv, block=block, dtype=dtype
            ),
            recipes.dequantize_fp8(
                self.down_weight_fp8, self.down_weight_scale_inv, block=block, dtype=dtype
            ),
        )

    def forward(self, x: Tensor) -> Tensor:
        w_gate_up, w_down = self.weights(x.dtype)
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)  # [T, I] each
        return F.linear(F.silu(gate) * up, w_down)  # [T, C]


@gs.graphsafe
class LlamaMLP(_MLP):
    """SwiGLU whose fused gate-up (or FP8) weights are graphsafe derived buffers.

    With fp8, the FP8 weights are quantized straight from the checkpoint's projections,
    which are transient.

    Args:
        config: Model sizes and weight format.
    """

    _gate_up_weight = recipes.derive("gate_up_weight", inputs=_GATE_UP, fn=_FUSE,
                                     when=_is_float)

    @gs.derive(("gate_up_weight_fp8", "gate_up_weight_scale_inv"), inputs=_GATE_UP,
               transient=_GATE_UP, when=_is_fp8)
    def _gate_up_weight_fp8(
        self, gate: Tensor, up: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, gate, up, out=out)  # type: ignore[no-any-return]

    @gs.derive(("down_weight_fp8", "down_weight_scale_inv"), inputs=_DOWN, transient=_DOWN,
               when=_is_fp8)
    def _down_weight_fp8(
        self, down: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, down, out=out)  # type: ignore[no-any-return]


@gs.graphsafe
class ResidentLlamaMLP(LlamaMLP):
    """`LlamaMLP` keeping the checkpoint's projections resident beside the FP8 weights."""

    @gs.derive(("gate_up_weight_fp8", "gate_up_weight_scale_inv"), inputs=_GATE_UP,
               when=_is_fp8)
    def _gate_up_weight_fp8(
        self, gate: Tensor, up: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, gate, up, out=out)  # type: ignore[no-any-return]

    @gs.derive(("down_weight_fp8", "down_weight_scale_inv"), inputs=_DOWN, when=_is_fp8)
    def _down_weight_fp8(
        self, down: Tensor, *, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        return self.quantize(self, down, out=out)  # type: ignore[no-any-return]


class NaiveLlamaMLP(_MLP):
    """Control only: the derived weights are plain attributes, rebound by `rebind`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.gate_up_weight = None
        self.gate_up_weight_fp8 = self.gate_up_weight_scale_inv = None
        self.down_weight_fp8 = self.down_weight_scale_inv = None

    def rebind(self) -> None:
        """The bug: fresh tensors, at new addresses, after every load."""
        gate, up = self.gate_proj.weight, self.up_proj.weight
        if not self.fp8:
            self.gate_up_weight = _FUSE(self, gate, up)
            return
        self.gate_up_weight_fp8, self.gate_up_weight_scale_inv = self.quantize(self, gate, up)
        self.down_weight_fp8, self.down_weight_scale_inv = self.quantize(
            self, self.down_proj.weight
        )


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream."""

    def __init__(
        self, config: LlamaConfig, attention_cls: type[_Attention], mlp_cls: type[_MLP]
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention_cls(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp_cls(config)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)  # [T, C]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, C]


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: Hugging Face's `model.` prefix."""

    def __init__(
        self, config: LlamaConfig, attention_cls: type[_Attention], mlp_cls: type[_MLP]
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls, mlp_cls)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h = self.embed_tokens(input_ids)  # [T, C]
        cos, sin = self.rotary_emb(positions)  # [T, D] each
        for layer in self.layers:
            h = layer(h, cos, sin)  # [T, C]
        return self.norm(h)  # [T, C]


# -----------------------------------------------------------------------------
# model


class _LlamaForCausalLM(nn.Module):
    """Llama with its LM head; the checkpoint's names are the parameters' names."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, *self.layer_classes(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one tensor, two names
        self.requires_grad_(False)  # an inference model: weights change only by loading

    @classmethod
    def layer_classes(cls, config: LlamaConfig) -> tuple[type[_Attention], type[_MLP]]:
        """The attention and MLP classes of `config`'s layers.

        Args:
            config: Model sizes and weight format.

        Returns:
            `(attention class, MLP class)`.
        """
        raise NotImplementedError

    def forward(self, input_ids: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits of one sequence.

        Args:
            input_ids: `[T]` token ids.
            positions: `[T]` positions for RoPE; `arange(T)` when omitted.

        Returns:
            `[T, vocab_size]` logits.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.lm_head(self.model(input_ids, positions))  # [T, vocab]

    def _load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for entry, w in weights:
                if entry.endswith("rotary_emb.inv_freq"):
                    continue  # older checkpoints carry RoPE's frequencies: made from config
                if entry == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue  # the head is the embedding, loaded as model.embed_tokens.weight
                param = params.get(entry)
                if param is None:
                    raise gs.WeightLoadError(
                        f"unknown checkpoint entry {entry!r}",
                        name=entry,
                        module_class=type(self).__name__,
                        path=entry,
                        expected="a Hugging Face LlamaForCausalLM name of this config, e.g. "
                        "'model.layers.0.self_attn.q_proj.weight' (num_hidden_layers="
                        f"{self.config.num_hidden_layers})",
                        got=repr(entry),
                        fix="rename the entry to the Hugging Face name, drop it, or check "
                        "that the config matches the checkpoint",
                    )
                owner = self.get_submodule(entry.rpartition(".")[0])
                if tuple(w.shape) != tuple(param.shape) or not w.is_floating_point():
                    what = "shape" if tuple(w.shape) != tuple(param.shape) else "dtype"
                    raise gs.WeightLoadError(
                        f"checkpoint entry {entry!r} has the wrong {what}",
                        name=entry,
                        module_class=type(owner).__name__,
                        path=entry,
                        expected=f"shape {tuple(param.shape)}, a floating-point dtype",
                        got=f"shape {tuple(w.shape)}, dtype {w.dtype}",
                        fix="check that the config matches the checkpoint "
                        "(LlamaConfig.from_hf(checkpoint_config))",
                    )
                param.data.copy_(w)  # in place: captured graphs keep reading this storage
                loaded.add(entry)
        return loaded


@gs.graphsafe
class LlamaForCausalLM(_LlamaForCausalLM):
    """Llama reading fused (or FP8) weights that follow every load.

    With `config.fp8`, the checkpoint's projections are transient (unless
    `config.transient` is False): a load gives them memory while it writes them, and
    they go back to the meta device once their FP8 weights are made. In a bucketed
    `gs.weight_update`, a layer sent in one bucket is quantized and released when that
    bucket's load returns.

    Args:
        config: Model sizes and weight format.

    Examples:
        >>> model = LlamaForCausalLM(LlamaConfig())
        >>> _ = model.load_weights(random_checkpoint(model.config, seed=0))
        >>> tuple(model.model.layers[0].mlp.gate_up_weight.shape)
        (192, 64)
    """

    @classmethod
    def layer_classes(cls, config: LlamaConfig) -> tuple[type[_Attention], type[_MLP]]:
        """Transient projections with fp8 (unless `config.transient` is False).

        Args:
            config: Model sizes and weight format.

        Returns:
            `(attention class, MLP class)`.
        """
        if config.fp8 and not config.transient:
            return ResidentLlamaAttention, ResidentLlamaMLP
        return LlamaAttention, LlamaMLP

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy Hugging Face checkpoint entries into the parameters, in place.

        Works bucket by bucket, in any partition and order; graphsafe refreshes the
        derived weights after each call (once per `gs.weight_update` block). Each entry
        is checked before it is written; entries before a bad one stay loaded.
        `*.rotary_emb.inv_freq` entries are skipped, and so is `lm_head.weight` when the
        embeddings are tied.

        Args:
            weights: `(name, tensor)` pairs; any floating dtype (converted) and device.

        Returns:
            The entries loaded by this call.

        Raises:
            WeightLoadError: An entry has an unknown name, the wrong shape or a
                non-floating dtype; `.name` is the entry, and its parameter keeps its
                old value.

        Examples:
            >>> model = LlamaForCausalLM(LlamaConfig())
            >>> model.load_weights([("model.norm.weight", torch.ones(64))])
            {'model.norm.weight'}
        """
        return self._load_weights(weights)


class NaiveLlamaForCausalLM(_LlamaForCausalLM):
    """Control only: binds fresh fused (and FP8) weights on every load.

    Not managed by graphsafe. Same parameters, checkpoints and forward as
    `LlamaForCausalLM`; only the lifetime of the derived weights differs.

    Args:
        config: As for `LlamaForCausalLM`.
    """

    @classmethod
    def layer_classes(cls, config: LlamaConfig) -> tuple[type[_Attention], type[_MLP]]:
        """The naive layers, whatever the config.

        Args:
            config: Model sizes and weight format.

        Returns:
            `(NaiveLlamaAttention, NaiveLlamaMLP)`.
        """
        return NaiveLlamaAttention, NaiveLlamaMLP

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """As `LlamaForCausalLM.load_weights`, then bind FRESH derived weights.

        Args:
            weights: `(name, tensor)` pairs.

        Returns:
            The entries loaded by this call.
        """
        loaded = self._load_weights(weights)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (NaiveLlamaAttention, NaiveLlamaMLP)):
                    m.rebind()
        return loaded


# -----------------------------------------------------------------------------
# random weights


def random_checkpoint(
    config: LlamaConfig, seed: int, device: torch.device | str | None = None
) -> list[tuple[str, Tensor]]:
    """A full checkpoint of deterministic random float32 weights, Hugging Face names.

    Projections ~ `N(0, 1/fan_in)`, norm weights ~ 1 +- 0.1, embedding ~ `N(0, 1)`
    (`N(0, 1/C)` when it is also the head): the logits are of order one, so a wrong weight
    layout shows. With tied embeddings there is no `lm_head.weight`, as in Hugging Face's
    saved checkpoints.

    Args:
        config: Model sizes.
        seed: Seed of the generator.
        device: Where to put the tensors (generated on the CPU).

    Returns:
        `(name, tensor)` pairs in the order of the model's parameters.

    Examples:
        >>> ckpt = dict(random_checkpoint(LlamaConfig(), seed=0))
        >>> ckpt["model.layers.1.self_attn.k_proj.weight"].shape, len(ckpt)
        (torch.Size([32, 64]), 21)
    """
    with torch.device("meta"):
        skeleton = NaiveLlamaForCausalLM(config)  # names and shapes only, no memory
    g = torch.Generator().manual_seed(seed)
    ckpt: list[tuple[str, Tensor]] = []
    for name, p in skeleton.named_parameters():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name == "model.embed_tokens.weight":
            w = torch.randn(p.shape, generator=g)
            if config.tie_word_embeddings:  # it is the head too: keep the logits of order one
                w /= math.sqrt(p.shape[-1])
        else:  # projections [out, in]
            w = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        ckpt.append((name, w.to(device) if device is not None else w))
    return ckpt


# -----------------------------------------------------------------------------
# target of `graphsafe verify`


@dataclasses.dataclass(frozen=True)
class LlamaTarget(PresetTarget):
    """What `graphsafe verify --model llama` needs to build, load and run Llama.

    Examples:
        >>> model = verify_target.build("tiny-fp8", naive=False, device=torch.device("cpu"))
        >>> _ = model.load_weights(verify_target.checkpoint(model, seed=0))
        >>> model(*verify_target.example_input(model, seed=0)).shape
        torch.Size([8, 128])
    """

    name: str = "llama"
    """Name of the target."""
    presets: tuple[str, ...] = ("tiny", "tiny-fp8")
    """Presets `build` accepts."""
    critical: tuple[str, ...] = ("k_proj.weight", "up_proj.weight")
    """Inputs of the fused weights; verify loads them in the last bucket of one refit."""

    label: ClassVar[str] = "Llama"
    model_cls: ClassVar[type[nn.Module]] = LlamaForCausalLM
    naive_cls: ClassVar[type[nn.Module]] = NaiveLlamaForCausalLM
    base_cls: ClassVar[type[nn.Module]] = _LlamaForCausalLM
    config_cls: ClassVar[Any] = LlamaConfig
    make_checkpoint = staticmethod(random_checkpoint)


verify_target = LlamaTarget()
"""The `graphsafe.targets` entry point `llama`."""
