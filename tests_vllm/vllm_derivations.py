"""Derived buffers declared on vLLM's own classes, as a user of the integration would.

The engine tests name this registry in GRAPHSAFE_VLLM_REGISTRIES.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear

import graphsafe as gs
from graphsafe import recipes

registry = gs.Registry()

# A kernel-format copy of the fused [q; k; v] weight: [in, q + k + v], contiguous.
registry.derive(QKVParallelLinear, "qkv_weight_t", inputs=["weight"])(recipes.transpose())

# For attaching to a running engine (`graphsafe_attach`): on a normalization layer, whose
# weight vLLM's CPU backend does not pack.
norms = gs.Registry()


@norms.derive(RMSNorm, "weight_plus_one", inputs=["weight"])
def weight_plus_one(
    m: RMSNorm, weight: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.add(weight, 1.0, out=out)

# For a quantized model whose kernels drop the weight after loading (vLLM's CPU W8A8
# int8 kernel packs it and sets `weight` to None): `when=` skips those layers, so the
# layers that keep their weight get the derived buffer and the others none.
kept = gs.Registry()
kept.derive(
    QKVParallelLinear, "qkv_weight_t", inputs=["weight"], when=lambda m: m.weight is not None
)(recipes.transpose())
