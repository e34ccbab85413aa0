"""The `vllm.general_plugins` entry point (`plugin`) and `enable`, which turns it on: once
per process, every vLLM worker created afterwards is instrumented as it starts."""

from __future__ import annotations

import functools
import os
from typing import Any

from graphsafe.integrations.vllm._patches import _abort_refused_steps, _keep_cpu_weights, _once
from graphsafe.integrations.vllm._registries import (
    CPU_KEEP_LM_HEAD,
    CPU_KEEP_WEIGHTS,
    ENV,
    LAZY_REFRESH,
    NO_REGISTRY,
    registries_from,
)
from graphsafe.integrations.vllm._worker import instrument


def enable(
    *registries: str,
    cpu_keep_weights: bool | None = None,
    cpu_keep_lm_head: bool | None = None,
    lazy_refresh: bool | None = None,
) -> None:
    """Turn the plugin on for engines started later by this process and its children.

    Whatever is named, graphsafe records the engine's first load and post-load step and
    checks what vLLM's own code derived from the weights there (`graphsafe_status()`'s
    `discovered`); the registries add the derived buffers you declare. Each option is
    an environment variable, so it reaches vLLM's child processes; None leaves it as it is.

    Args:
        *registries: `"module:attribute"` names of `gs.Registry` objects (or of functions
            returning one), importable in every vLLM process. None: no declarations, only
            what is discovered (`GRAPHSAFE_VLLM_REGISTRIES` names an empty registry).
        cpu_keep_weights: On vLLM's CPU build, keep every linear layer's weight and the
            input embedding's instead of packing them into kernels, so that a bare
            `model.load_weights` (an RL loop's sync, such as TRL's) can write them
            (`GRAPHSAFE_VLLM_CPU_KEEP_WEIGHTS`). Off by default.
        cpu_keep_lm_head: On vLLM's CPU build, the LM head reads its weight instead of
            a packed copy made at startup, which a bare `load_weights` leaves stale
            (`GRAPHSAFE_VLLM_CPU_KEEP_LM_HEAD`). Off by default.
        lazy_refresh: Loads only mark derived buffers stale, and the check before the
            next step refreshes them once (`gs.Runtime.lazy_refresh`,
            `GRAPHSAFE_VLLM_LAZY_REFRESH`). Off by default.
    """
    os.environ[ENV] = ",".join(registries) or NO_REGISTRY
    for name, value in (
        (CPU_KEEP_WEIGHTS, cpu_keep_weights),
        (CPU_KEEP_LM_HEAD, cpu_keep_lm_head),
        (LAZY_REFRESH, lazy_refresh),
    ):
        if value is not None:
            os.environ[name] = "1" if value else "0"
    plugin()


def plugin() -> None:
    """The `vllm.general_plugins` entry point: does nothing unless `GRAPHSAFE_VLLM_REGISTRIES`
    is set; then every worker created in this process is instrumented."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return
    _abort_refused_steps()
    with _once("worker") as first:
        if not first:
            return
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        init_device = WorkerWrapperBase.init_device

        @functools.wraps(init_device)
        def init_device_instrumented(self: Any, *args: Any, **kwargs: Any) -> Any:
            now = os.environ.get(ENV, "").strip()  # an engine started with it unset: off
            if now:
                instrument(self.worker, now)  # the worker exists; its model not yet
            return init_device(self, *args, **kwargs)

        WorkerWrapperBase.init_device = init_device_instrumented
        registries_from(spec)  # a name that does not resolve fails here, loudly
        _keep_cpu_weights()
