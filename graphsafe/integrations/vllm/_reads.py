"""The read set of an engine that captures no graphs, taken from the first forward after the
pin: which engines run op by op (`runs_op_by_op`), which capture graphs that read the model
by address (`captures_graphs`), which steps run a forward (`runs_forward`), and the
recorder for a vLLM forward (`StepReadTracker`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from graphsafe._graphs.reads import ReadTracker
from graphsafe._memory.walk import storage_key, walk_tensors


def runs_op_by_op(worker: Any) -> bool:
    """Whether `worker`'s model runs op by op, every op through torch's dispatcher, so that
    a dispatch mode sees what a forward reads: no torch.compile (`compilation_config.mode`
    NONE) and no CUDA graphs (`cudagraph_mode` NONE), as `enforce_eager=True` sets.

    vLLM's default compiles (on its CPU build too), and its compiled model fails under a
    dispatch mode (dynamo steps aside: "found no compiled frames"); a graph replay reads
    what its capture read, out of any dispatch mode's sight. Neither is recorded.
    """
    config = getattr(getattr(worker, "vllm_config", None), "compilation_config", None)
    if config is None:
        return False
    return all(
        getattr(getattr(config, field, None), "name", None) == "NONE"
        for field in ("mode", "cudagraph_mode")
    )


def captures_graphs(worker: Any) -> bool:
    """Whether `worker`'s engine captures graphs that read the model by address: CUDA
    graphs on (`cudagraph_mode` not NONE) on a platform that has them. vLLM's CPU build
    captures none (it empties `cudagraph_capture_sizes`; its compiled code reads the
    model's tensors as inputs at each step), nor does `enforce_eager`. Where the config
    cannot be read, graphs are assumed (a moved tensor is refused)."""
    config = getattr(getattr(worker, "vllm_config", None), "compilation_config", None)
    mode = getattr(getattr(config, "cudagraph_mode", None), "name", None)
    if mode is None:
        return True
    if mode == "NONE":
        return False
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return True
    return not current_platform.is_cpu()


def runs_forward(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether an `execute_model(scheduler_output, ...)` call runs the model: a step that
    schedules no tokens returns before the forward, so it shows no read set."""
    out = args[0] if args else kwargs.get("scheduler_output")
    tokens = getattr(out, "total_num_scheduled_tokens", None)
    return tokens is None or tokens > 0


class StepReadTracker(ReadTracker):  # type: ignore[no-untyped-call]  # torch stubs
    """A `ReadTracker` for one vLLM forward.

    vLLM's own custom ops (namespace `vllm`: attention, fused MoE) reach their layer's
    state, such as the KV cache or the experts' weights, by the layer's name through the
    forward context, inside one op whose inner ops no dispatch mode sees. At the first of
    them, every tensor of every layer in the forward context counts as read; where there
    is no forward context to ask, `reads` is None (the whole model is checked).
    """

    def __init__(self) -> None:
        super().__init__()
        self.opaque = False
        """A vLLM op ran whose layers were not found: what it read is not known."""
        self._layers_noted = False

    @property
    def reads(self) -> frozenset[int] | None:
        """Storage keys read; None if compiled code or an opaque vLLM op ran."""
        return None if self.opaque else super().reads

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not self._layers_noted and str(getattr(func, "namespace", "")).startswith("vllm"):
            self._layers_noted = True
            self._note_layers()
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _note_layers(self) -> None:
        try:
            from vllm.forward_context import get_forward_context, is_forward_context_available
        except ImportError:
            self.opaque = True
            return
        if not is_forward_context_available():
            self.opaque = True
            return
        for layer in get_forward_context().no_compile_layers.values():
            if isinstance(layer, nn.Module):
                for site in walk_tensors(layer):
                    key = storage_key(site.tensor)
                    if key:
                        self.read.setdefault(key, site.tensor)
