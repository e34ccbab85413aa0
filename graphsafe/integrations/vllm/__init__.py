"""graphsafe inside a vLLM engine, attached to vLLM's own classes without editing vLLM.

Turn it on before the engine starts, naming the registries that declare your derived
buffers (`"module:attribute"`, a `gs.Registry` or a function returning one):

    from graphsafe.integrations import vllm as gsv
    gsv.enable("my_pkg.derived:registry")      # sets GRAPHSAFE_VLLM_REGISTRIES
    llm = LLM(model=..., worker_extension_cls=gsv.EXTENSION)

`gsv.enable()` with no registry declares nothing: graphsafe then checks only what vLLM's
own code derives from the weights, found by provenance.

vLLM loads graphsafe's `vllm.general_plugins` entry point in every process it starts
(front end, engine core, workers); with `GRAPHSAFE_VLLM_REGISTRIES` set, the plugin wraps
each worker as it is created:

- `load_model`: vLLM's first load and post-load step run under graphsafe's lineage
  recorder; then graphsafe's runtime is bound to the loaded model with those registries,
  the derived buffers are materialized (adopting tensors vLLM's own code already bound,
  such as DeepSeek V4's `hc_attn_fn_broadcast`), and what that load computed from the
  weights without a declaration is discovered (the CPU build's packed LM head:
  `graphsafe_status()["discovered"]`), and checked from then on;
- after `compile_or_warm_up_model` (where vLLM captures its CUDA graphs): pins the model;
- `reload_weights`, the weight-transfer session (`start_weight_update` ...
  `finish_weight_update`), vLLM's layerwise reload and `model.load_weights` (as a worker
  extension reaches it through `collective_rpc`) each run as one graphsafe weight update:
  derived buffers refresh once, at its end, and a rebound tensor raises there;
- before each `execute_model`: the guard's checks (nothing moved, nothing stale, declared
  or discovered), so a mistake raises through the engine call that made or met it. An
  engine that runs op by op (`enforce_eager=True`) records its first forward, and from
  then on the guard checks only the model's tensors that forward read.

On vLLM's CPU backend, linear layers read by a derivation keep their weights (vLLM's own
`_cpu_skip_gemm_dispatch`); other layers are packed into kernels as usual, unless
`enable(cpu_keep_weights=True)` keeps every weight a bare `load_weights` writes (the
setting RL loops that sync that way need on a CPU; `cpu_keep_lm_head=True` the LM head's
too). `enable(lazy_refresh=True)`: loads only mark, the next step refreshes once.
"""

from __future__ import annotations

from graphsafe.integrations.vllm._attachment import Attachment as Attachment
from graphsafe.integrations.vllm._attachment import attachment as attachment
from graphsafe.integrations.vllm._deepseek_v4 import deepseek_v4_registry as deepseek_v4_registry
from graphsafe.integrations.vllm._plugin import enable as enable
from graphsafe.integrations.vllm._plugin import plugin as plugin
from graphsafe.integrations.vllm._registries import CPU_KEEP_LM_HEAD as CPU_KEEP_LM_HEAD
from graphsafe.integrations.vllm._registries import CPU_KEEP_WEIGHTS as CPU_KEEP_WEIGHTS
from graphsafe.integrations.vllm._registries import ENV as ENV
from graphsafe.integrations.vllm._registries import LAZY_REFRESH as LAZY_REFRESH
from graphsafe.integrations.vllm._registries import registries_from as registries_from
from graphsafe.integrations.vllm._worker import EXTENSION as EXTENSION
from graphsafe.integrations.vllm._worker import WorkerExtension as WorkerExtension
from graphsafe.integrations.vllm._worker import attach as attach
from graphsafe.integrations.vllm._worker import instrument as instrument

# isort: split
# Internals that benchmarks/vllm_engine.py and tests_vllm/ reach from here.
from graphsafe.integrations.vllm._attachment import _ATTACHED as _ATTACHED
from graphsafe.integrations.vllm._patches import _DONE as _DONE

__all__ = [
    "CPU_KEEP_LM_HEAD",
    "CPU_KEEP_WEIGHTS",
    "ENV",
    "EXTENSION",
    "LAZY_REFRESH",
    "Attachment",
    "WorkerExtension",
    "attach",
    "attachment",
    "deepseek_v4_registry",
    "enable",
    "instrument",
    "plugin",
    "registries_from",
]
