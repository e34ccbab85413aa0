"""The `vllm.general_plugins` entry point (`plugin`) and `enable`, which turns it on: once
per process, every vLLM worker created afterwards is instrumented as it starts."""

from __future__ import annotations

import functools
import os
from typing import Any

from graphsafe.integrations.vllm._patches import _keep_cpu_weights, _once
from graphsafe.integrations.vllm._registries import ENV, NO_REGISTRY, registries_from
from graphsafe.integrations.vllm._worker import instrument


def enable(*registries: str) -> None:
    """Turn the plugin on for engines started later by this process and its children.

    Whatever is named, graphsafe records the engine's first load and post-load step and
    checks what vLLM's own code derived from the weights there (`graphsafe_status()`'s
    `discovered`); the registries add the derived buffers you declare.

    Args:
        *registries: `"module:attribute"` names of `gs.Registry` objects (or of functions
            returning one), importable in every vLLM process. None: no declarations, only
            what is discovered (`GRAPHSAFE_VLLM_REGISTRIES` names an empty registry).
    """
    os.environ[ENV] = ",".join(registries) or NO_REGISTRY
    plugin()


def plugin() -> None:
    """The `vllm.general_plugins` entry point: does nothing unless `GRAPHSAFE_VLLM_REGISTRIES`
    is set; then every worker created in this process is instrumented."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return
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
