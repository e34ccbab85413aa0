"""Derived buffers declared on vLLM's own classes, as a user of the integration would.

The engine tests name this registry in GRAPHSAFE_VLLM_REGISTRIES.
"""

from __future__ import annotations

from vllm.model_executor.layers.linear import QKVParallelLinear

import graphsafe as gs
from graphsafe import recipes

registry = gs.Registry()

# A kernel-format copy of the fused [q; k; v] weight: [in, q + k + v], contiguous.
registry.derive(QKVParallelLinear, "qkv_weight_t", inputs=["weight"])(recipes.transpose())
