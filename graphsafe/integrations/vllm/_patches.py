"""The patches to vLLM's own code, each installed once per process: linear layers on the
CPU backend keep the weights derivations read (or every weight a bare `load_weights`
writes, when asked), the layerwise reload becomes one weight update of the attached
model it reloads, and a step graphsafe refuses aborts the requests in flight."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from torch import nn
from torch.nn import functional as F

from graphsafe._declare.registry import Registry
from graphsafe._errors import GraphSafetyError
from graphsafe.integrations._engine import Once
from graphsafe.integrations.vllm._attachment import attachment
from graphsafe.integrations.vllm._registries import (
    CPU_KEEP_LM_HEAD,
    CPU_KEEP_WEIGHTS,
    ENV,
    registries_from,
)

_once = Once()
_DONE = _once.done  # the patches installed in this process


def _keep_cpu_weights() -> None:
    """On vLLM's CPU backend, keep the weights of linear layers that derivations of the
    registries named now (`GRAPHSAFE_VLLM_REGISTRIES`) read; with `CPU_KEEP_WEIGHTS` on,
    those of every linear layer and of the input embedding; with `CPU_KEEP_LM_HEAD` on,
    the LM head's too (read by `F.linear`, no packed copy)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    process = UnquantizedLinearMethod.process_weights_after_loading
    process_embedding = UnquantizedEmbeddingMethod.process_weights_after_loading
    named: dict[str, list[Registry]] = {}

    def reads_weight(layer: nn.Module) -> bool:
        spec = os.environ.get(ENV, "").strip()
        if not spec:
            return False
        if spec not in named:
            named[spec] = registries_from(spec)
        return any(
            "weight" in d.inputs for r in named[spec] for d in r.derivations_for(type(layer))
        )

    @functools.wraps(process)
    def process_weights_after_loading(self: Any, layer: nn.Module) -> None:
        if _on(CPU_KEEP_WEIGHTS) or reads_weight(layer):
            # vLLM's own switch (MLA's kv_b_proj): keep the weight, use plain F.linear.
            setattr(layer, "_cpu_skip_gemm_dispatch", True)  # noqa: B010
        process(self, layer)

    @functools.wraps(process_embedding)
    def process_embedding_weights(self: Any, layer: nn.Module) -> None:
        lm_head = isinstance(layer, ParallelLMHead)
        if _on(CPU_KEEP_LM_HEAD if lm_head else CPU_KEEP_WEIGHTS):
            # The packed copy is what the LM head's matmul reads (the input embedding's
            # forward reads the weight itself): plain F.linear reads the weight instead.
            setattr(layer, "cpu_linear", F.linear)  # noqa: B010
            return
        process_embedding(self, layer)

    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading
    UnquantizedEmbeddingMethod.process_weights_after_loading = process_embedding_weights


def _abort_refused_steps() -> None:
    """vLLM's engine in the caller's process (`LLM`, `LLMEngine`): when graphsafe refuses
    a step, every request in flight is aborted through vLLM's own abort path, and the
    prefix cache is reset, before the refusal propagates.

    The refusal is raised by the worker's `execute_model`, after the scheduler allocated
    the step's KV blocks and before any forward wrote them. Without this the requests
    stay scheduled and keep their blocks: the `generate` that raised returns none of
    them, and the next one waits for them forever (a step the model runner cannot
    serve). `LLMEngine.abort_request` removes them from the output processor and
    finishes them in the scheduler, which frees their blocks; the blocks were hashed
    into the prefix cache for tokens no forward computed, so the cache is reset too.
    Every request in flight goes, not only the step's: they were all to be served by
    the model graphsafe refused. An engine core in a process of its own dies on any
    error of a step; this leaves it as it is."""
    with _once("refused steps") as first:
        if not first:
            return
        try:
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError:  # attached without vLLM (a model of its shape, in tests)
            return
        step = LLMEngine.step

        @functools.wraps(step)
        def step_or_abort(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return step(self, *args, **kwargs)
            except GraphSafetyError:
                in_flight = list(self.output_processor.request_states)
                if in_flight:
                    self.abort_request(in_flight, internal=True)
                self.reset_prefix_cache()
                raise

        LLMEngine.step = step_or_abort


def _on(name: str) -> bool:
    """Whether the switch `name` (an environment variable) is on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _patch_layerwise() -> None:
    """vLLM's layerwise reload of an attached model (`initialize_layerwise_reload` ...
    `finalize_layerwise_processing`, which `finalize_layerwise_reload` calls) becomes one
    weight update, open from before the first (which moves every layer's tensors aside)
    to after the last (which copies what was loaded into the original storage and puts
    the originals back)."""
    with _once("layerwise") as first:
        if not first:
            return
        try:
            from vllm.model_executor.model_loader.reload import layerwise
        except ImportError:  # an older vLLM without layerwise reload
            return
        initialize = layerwise.initialize_layerwise_reload
        finalize = layerwise.finalize_layerwise_processing

        @functools.wraps(initialize)
        def initialize_layerwise_reload(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
            a = attachment(model)
            if a is not None:
                a.begin(initialize)
            try:
                return initialize(model, *args, **kwargs)
            except BaseException as exc:
                if a is not None:
                    a.end(initialize, exc)
                raise

        @functools.wraps(finalize)
        def finalize_layerwise_processing(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
            a = attachment(model)
            try:
                ret = finalize(model, *args, **kwargs)
            except BaseException as exc:
                if a is not None:
                    a.end(initialize, exc)
                raise
            if a is not None:
                a.end(initialize)
            return ret

        # Modules that imported the functions by name hold the originals: replace those
        # references too (later imports read the patched module attribute).
        for name, mod in list(sys.modules.items()):
            if not name.startswith("vllm") or mod is None:
                continue
            for attr, orig, new in (
                ("initialize_layerwise_reload", initialize, initialize_layerwise_reload),
                ("finalize_layerwise_processing", finalize, finalize_layerwise_processing),
            ):
                if getattr(mod, attr, None) is orig:
                    setattr(mod, attr, new)
