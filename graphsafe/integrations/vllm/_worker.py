"""graphsafe bound to a vLLM worker and its loaded model: `attach` (the model),
`instrument` (the worker's methods, wrapped on the instance) and `WorkerExtension` (the
methods `collective_rpc` reaches)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from graphsafe._declare.registry import Registry
from graphsafe._errors import RegistrationError
from graphsafe._fingerprint.digest import fingerprint
from graphsafe._lineage import Lineage, record_lineage
from graphsafe.integrations._engine import attach_once
from graphsafe.integrations.vllm._attachment import _ATTACHED, Attachment
from graphsafe.integrations.vllm._patches import _abort_refused_steps, _on, _patch_layerwise
from graphsafe.integrations.vllm._reads import captures_graphs, runs_forward, runs_op_by_op
from graphsafe.integrations.vllm._registries import LAZY_REFRESH, registries_from

EXTENSION = "graphsafe.integrations.vllm.WorkerExtension"
"""Qualified name to pass as `LLM(worker_extension_cls=...)` for `graphsafe_status`."""

_Fn = Callable[..., Any]


def attach(
    model: nn.Module, *registries: Registry | str, lineage: Lineage | None = None
) -> Attachment:
    """Bind graphsafe to a loaded vLLM model and materialize its derived buffers.

    `model.load_weights` becomes a graphsafe load (a weight update of its own, or part
    of the one open), vLLM's layerwise reload one weight update, and tensors vLLM's code
    already bound under a derived buffer's name are adopted.

    Args:
        model: The model, after vLLM loaded it.
        *registries: Registries, or `module:attribute` names of them (none: graphsafe
            checks only what it discovers).
        lineage: What `gs.record_lineage()` recorded around vLLM's first load
            and post-load step (`process_weights_after_loading`): the tensors that load
            computed from the weights without a declaration (a packed copy of the LM
            head, DeepSeek V4's mHC broadcast weight) are discovered, and checked from
            now on (`gs.runtime(model).discovered`).

    Returns:
        The attachment (the same one on a second call).

    Example:
        >>> with record_lineage() as lineage:              # doctest: +SKIP
        ...     model = load_and_post_process()            # vLLM's first load
        >>> attach(model, lineage=lineage).status()["discovered"]  # doctest: +SKIP
        {'lm_head.cpu_linear.<closure handler>.handler_tensor': ['lm_head.weight'], ...}

    Raises:
        RegistrationError: A derivation reads a weight vLLM's CPU backend dropped, or a
            bound tensor does not fit its derived buffer.
    """

    def make() -> Attachment:
        _patch_layerwise()
        _abort_refused_steps()
        regs = registries_from(registries)
        _refuse_packed_inputs(model, regs)
        return Attachment(model, regs)

    return attach_once(_ATTACHED, model, make, lineage=lineage, lazy_refresh=_on(LAZY_REFRESH))


def _refuse_packed_inputs(model: nn.Module, registries: list[Registry]) -> None:
    """Name a derivation input that vLLM's CPU backend emptied after packing it, before
    the registries are added to the model's runtime."""
    for mpath, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        for reg in registries:
            for d in reg.derivations_for(type(module)):
                for rel in d.inputs:
                    t = getattr(module, rel, None) if "." not in rel else None
                    if not (isinstance(t, torch.Tensor) and t.numel() == 0):
                        continue
                    path = f"{mpath}.{rel}" if mpath else rel
                    raise RegistrationError(
                        f"vLLM's CPU backend packed {path!r} into a kernel and left an "
                        "empty tensor, so a derivation cannot read it",
                        module_class=type(module).__name__,
                        path=path,
                        derivation=d.name,
                        expected="the weight itself",
                        got=f"shape {tuple(t.shape)}",
                        fix="start the engine with the plugin on (graphsafe.integrations"
                        ".vllm.enable(...)) so layers read by derivations keep their "
                        "weights, or derive from another tensor",
                    )


# -- the worker ------------------------------------------------------------------------


def instrument(worker: Any, registries: Iterable[Registry | str]) -> None:
    """Wrap one vLLM worker's methods (on the instance) so that graphsafe follows it.

    Args:
        worker: The worker (`CPUWorker`, the CUDA `Worker`, ...), before `load_model`.
        registries: Where the derived buffers are declared.
    """
    if getattr(worker, "_graphsafe", None) is not None:
        return
    hooks = _Hooks(worker, registries_from(registries))
    worker._graphsafe = hooks.state
    for name, make in _WRAPPED:
        fn = getattr(worker, name, None)
        if fn is not None:
            setattr(worker, name, make(hooks, fn))


class _Hooks:
    """The wrappers of one worker's methods. They share the worker's attachment, made
    when its model is loaded, and the owner token of its weight-transfer session."""

    def __init__(self, worker: Any, registries: list[Registry]) -> None:
        self.worker = worker
        self.registries = registries
        self.state: dict[str, Attachment] = {}  # the worker's `_graphsafe`
        self.session = object()

    def att(self) -> Attachment | None:
        return self.state.get("model")

    def after_load(self, fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def load_model(*args: Any, **kwargs: Any) -> Any:
            # vLLM's first load and post-load step run before the model is known: their
            # lineage is recorded now and resolved against the model once it exists.
            with record_lineage() as lineage:
                ret = fn(*args, **kwargs)
            model = self.worker.model_runner.get_model()
            self.state["model"] = attach(model, *self.registries, lineage=lineage)
            return ret

        return load_model

    def after_warm_up(self, fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
            ret = fn(*args, **kwargs)
            a = self.att()
            if a is not None:
                a.pin(record_reads=runs_op_by_op(self.worker),
                      graphs=captures_graphs(self.worker))
            return ret

        return compile_or_warm_up_model

    def as_update(self, fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            a = self.att()
            return fn(*args, **kwargs) if a is None else a.updating(fn, fn)(*args, **kwargs)

        return run

    def starts(self, fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def start_weight_update(*args: Any, **kwargs: Any) -> Any:
            a = self.att()
            if a is None:
                return fn(*args, **kwargs)
            a.begin(self.session)  # before vLLM moves the layers aside: their storages count
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                a.end(self.session, exc)
                raise

        return start_weight_update

    def within(self, fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def update_weights(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                a = self.att()
                if a is not None:
                    a.end(self.session, exc)  # vLLM ends its session too: fail closed
                raise

        return update_weights

    def finishes(self, fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def finish_weight_update(*args: Any, **kwargs: Any) -> Any:
            a = self.att()
            try:
                ret = fn(*args, **kwargs)
            except BaseException as exc:
                if a is not None:
                    a.end(self.session, exc)
                raise
            if a is not None:
                a.end(self.session)
            return ret

        return finish_weight_update

    def guarded(self, fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def execute_model(*args: Any, **kwargs: Any) -> Any:
            a = self.att()
            guard = None if a is None else a.guard  # set once the model is pinned
            if guard is None:
                return fn(*args, **kwargs)
            if a is not None and a.recording and runs_forward(args, kwargs):
                with a.recorded():  # the first forward after the pin: its read set
                    return fn(*args, **kwargs)
            with guard.replaying():
                return fn(*args, **kwargs)

        return execute_model


# The worker methods `instrument` wraps, in order, and the hook that wraps each.
_WRAPPED: tuple[tuple[str, Callable[[_Hooks, _Fn], _Fn]], ...] = (
    ("load_model", _Hooks.after_load),
    ("compile_or_warm_up_model", _Hooks.after_warm_up),
    ("reload_weights", _Hooks.as_update),
    ("start_weight_update", _Hooks.starts),
    ("start_draft_weight_update", _Hooks.starts),
    ("update_weights", _Hooks.within),
    ("finish_weight_update", _Hooks.finishes),
    ("execute_model", _Hooks.guarded),
)


class WorkerExtension:
    """Methods for `collective_rpc` (`LLM(worker_extension_cls=gsv.EXTENSION)`)."""

    def graphsafe_status(self) -> dict[str, Any] | None:
        """graphsafe's state on this worker's model (None where it is not attached)."""
        state = getattr(self, "_graphsafe", None) or {}
        a = state.get("model")
        return None if a is None else a.status()

    def graphsafe_fingerprint(self, names: list[str] | None = None) -> dict[str, str]:
        """`gs.fingerprint` of this worker's model, attached or not: its parameters and
        persistent buffers by vLLM's names, or `names` among them.

        A trainer compares them with its own after a sync, by name where the names map
        one to one (`llm.collective_rpc("graphsafe_fingerprint")`: one mapping per
        worker; a tensor-parallel worker's shard has its own).

        Raises:
            KeyError: `names` holds a name the model does not hold.
        """
        return dict(fingerprint(self.model_runner.get_model(), names))  # type: ignore[attr-defined]

    def graphsafe_exempt(self, path: str, why: str) -> dict[str, Any] | None:
        """Never check the discovered tensor at `path` on this worker's model (one meant to
        differ from its weights); `why` is listed with it in `rt.discovered`.

        Returns:
            `graphsafe_status()` after exempting (None where graphsafe is not attached).

        Raises:
            GraphSafetyError: `path` is not a discovered tensor, or `why` is empty.
        """
        state = getattr(self, "_graphsafe", None) or {}
        a: Attachment | None = state.get("model")
        if a is None:
            return None
        a.runtime.exempt(path, why=why)
        return a.status()

    def graphsafe_attach(self, registries: list[str]) -> dict[str, Any] | None:
        """Attach graphsafe to this running worker: the one call, without the plugin.

        The engine has loaded its model and captured its graphs: the worker is wrapped as
        the plugin wraps it, the model attached (adopting in place the tensors vLLM's
        code bound, such as DeepSeek V4's `hc_attn_fn_broadcast`) and pinned at once
        (an engine that runs op by op then takes its read set from its next forward).
        Graphs captured before do not read derived buffers made now: for that, use the
        plugin, which attaches before capture.

        Args:
            registries: `module:attribute` names of the registries.

        Returns:
            `graphsafe_status()` after attaching.
        """
        state = getattr(self, "_graphsafe", None)
        if state is None or "model" not in state:
            instrument(self, registries)
            state = self._graphsafe  # type: ignore[attr-defined]
            state["model"] = attach(self.model_runner.get_model(), *registries)  # type: ignore[attr-defined]
        state["model"].pin(record_reads=runs_op_by_op(self), graphs=captures_graphs(self))
        return self.graphsafe_status()
