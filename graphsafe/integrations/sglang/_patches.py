"""`attach` (graphsafe bound to a loaded SGLang model) and `install`, the patches to SGLang's
own classes that the plugin installs once per process: the model runner attaches after
its load, pins after its graphs are captured and guards each forward; each of SGLang's
weight-update entry points runs as one graphsafe weight update."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from graphsafe._declare.registry import Registry
from graphsafe._lineage import Lineage, record_lineage
from graphsafe.integrations._engine import Once, attach_once
from graphsafe.integrations.sglang._attachment import _ATTACHED, Attachment, attachment
from graphsafe.integrations.sglang._registries import ENV, registries_from

_Fn = Callable[..., Any]
_once = Once()


def attach(
    model: nn.Module, *registries: Registry | str, lineage: Lineage | None = None
) -> Attachment:
    """Bind graphsafe to a loaded SGLang model and materialize its derived buffers.

    Tensors SGLang's code already bound under a derived buffer's name (the `w_kc` and
    `w_vc` its first `post_load_weights` made) are adopted in place, and
    `model.load_weights` becomes a graphsafe load (a weight update of its own, or part of
    the one open).

    Args:
        model: The model, after SGLang loaded it.
        *registries: Registries, or `module:attribute` names of them (none: graphsafe
            checks only what it discovers).
        lineage: What `gs.record_lineage()` recorded around SGLang's first load (its
            `load_weights` and `post_load_weights`): the tensors it computed from the
            weights without a declaration are discovered, and checked from now on
            (`gs.runtime(model).discovered`).

    Returns:
        The attachment (the same one on a second call).

    Raises:
        RegistrationError: A registry name does not resolve, or a bound tensor does not fit
            its derived buffer.
    """
    return attach_once(
        _ATTACHED, model, lambda: Attachment(model, registries_from(registries)), lineage=lineage
    )


def _sglang(module: str) -> Any:
    """An SGLang module (imported when patched, never when graphsafe is)."""
    return importlib.import_module(module)


def _sglang_refuses(model: nn.Module) -> bool:
    """Whether SGLang refuses online updates of `model` itself, before writing anything (a
    module carrying `_derived_weight_cache_error`, compensated mHC splits, HPC-Ops GEMM)."""
    updater = _sglang("sglang.srt.model_executor.model_runner_components.weight_updater")
    check = getattr(updater, "_unsupported_derived_weight_cache_error", None)
    return check is not None and check(model) is not None


def install(registries: str) -> None:
    """Patch SGLang's model runner and weight updaters (once per process).

    Args:
        registries: What a runner's model is attached with where
            `GRAPHSAFE_SGLANG_REGISTRIES` is unset when it loads (the variable's value
            otherwise); names are resolved in the process that loads the model.
    """
    with _once("sglang") as first:
        if not first:
            return
        _patch_runner(_sglang("sglang.srt.model_executor.model_runner").ModelRunner, registries)
        _patch_updater(
            _sglang("sglang.srt.model_executor.model_runner_components.weight_updater")
            .WeightUpdater
        )
        _patch_session_end(
            _sglang("sglang.srt.managers.scheduler_components.weight_updater")
            .SchedulerWeightUpdaterManager
        )
        _load_in_the_calling_thread()


def _load_in_the_calling_thread() -> None:
    """SGLang's loaders copy host tensors into the weights from a thread pool
    (`maybe_executor_submit`); graphsafe tracks the writes of the thread that runs the load
    or update, so with the plugin on they are made there (`use_async=False`)."""
    utils = _sglang("sglang.srt.model_loader.utils")
    submit = utils.maybe_executor_submit

    @functools.wraps(submit)
    def maybe_executor_submit(*args: Any, use_async: bool = False, **kwargs: Any) -> Any:
        return submit(*args, use_async=False, **kwargs)

    utils.maybe_executor_submit = maybe_executor_submit
    # Modules that imported it by name hold the original (later imports take this one).
    for name, mod in list(sys.modules.items()):
        if name.startswith("sglang") and getattr(mod, "maybe_executor_submit", None) is submit:
            setattr(mod, "maybe_executor_submit", maybe_executor_submit)  # noqa: B010


def captures_graphs(runner: Any) -> bool:
    """Whether SGLang's `ModelRunner` captured CUDA graphs that read the model by address:
    not with `disable_cuda_graph`, nor on a CPU (`device="cpu"`, where SGLang captures no
    CUDA graph). Where its server arguments cannot be read, graphs are assumed (a moved
    tensor is refused)."""
    args = getattr(runner, "server_args", None)
    if args is None:
        return True
    return not (getattr(args, "device", None) == "cpu"
                or getattr(args, "disable_cuda_graph", False) is True)


def runs_op_by_op(runner: Any) -> bool:
    """Whether SGLang's `ModelRunner` runs its model op by op, every op through torch's
    dispatcher, so that a dispatch mode sees what a forward reads: no CUDA graphs
    (`captures_graphs`), no graph runner of its own (the CPU graph runner replays
    compiled code), and no `enable_torch_compile` (compiled code under a dispatch mode
    is not what serves)."""
    args = getattr(runner, "server_args", None)
    if args is None or captures_graphs(runner):
        return False
    if getattr(args, "enable_torch_compile", False) is not False:
        return False
    if getattr(runner, "decode_cuda_graph_runner", None) is not None:
        return False
    prefill = getattr(runner, "prefill_cuda_graph_runner", None)
    return prefill is None or type(prefill).__name__ == "EagerRunner"


def runs_model(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `ModelRunner.forward(forward_batch, ...)` call runs the model: an idle
    batch (data parallel attention) reads none of it."""
    batch = args[0] if args else kwargs.get("forward_batch")
    mode = getattr(batch, "forward_mode", None)
    is_idle = getattr(mode, "is_idle", None)
    return not (callable(is_idle) and is_idle())


def _wrap(cls: type, name: str, make: Callable[[_Fn], _Fn]) -> None:
    fn = getattr(cls, name, None)
    if fn is not None:
        setattr(cls, name, functools.wraps(fn)(make(fn)))


def _patch_runner(cls: type, registries: str) -> None:
    pending: dict[int, Lineage] = {}  # a runner whose weights are committed later

    def named() -> str:
        # As named when the model loads (a later enable() in this process counts).
        return os.environ.get(ENV, "").strip() or registries

    def load_model(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            # SGLang's first load and post_load_weights run before the model is known:
            # their lineage is recorded now and resolved once it exists.
            with record_lineage() as lineage:
                ret = fn(self, *args, **kwargs)
            if getattr(self, "startup_weight_load", None) is not None:
                pending[id(self)] = lineage  # weights still to commit (overlapped load)
            else:
                attach(self.model, named(), lineage=lineage)
            return ret

        return run

    def finalize_startup_weight_load(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            lineage = pending.pop(id(self), None)
            with record_lineage(lineage) as lineage:
                ret = fn(self, *args, **kwargs)
            attach(self.model, named(), lineage=lineage)
            return ret

        return run

    def init_cuda_graphs(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            ret = fn(self, *args, **kwargs)
            a = attachment(self.model)
            if a is not None:  # as the graphs (if any) were captured
                a.pin(record_reads=runs_op_by_op(self), graphs=captures_graphs(self))
            return ret

        return run

    def forward(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            a = attachment(self.model)
            if a is None:
                return fn(self, *args, **kwargs)
            with a.guarded(runs_model=runs_model(args, kwargs)):
                return fn(self, *args, **kwargs)

        return run

    _wrap(cls, "load_model", load_model)
    _wrap(cls, "finalize_startup_weight_load", finalize_startup_weight_load)
    _wrap(cls, "init_cuda_graphs", init_cuda_graphs)
    _wrap(cls, "forward", forward)


def _patch_updater(cls: type) -> None:
    """The runner's `WeightUpdater` (a frozen dataclass: patched on the class; the model
    is `self.get_model()`)."""

    def reported(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            model = self.get_model()
            a = attachment(model)
            if a is None or _sglang_refuses(model):
                return fn(self, *args, **kwargs)  # SGLang refuses it, writing nothing
            return a.reported(functools.partial(fn, self))(*args, **kwargs)

        return run

    def begin_weight_update(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            a = attachment(self.get_model())
            if a is None:
                return fn(self, *args, **kwargs)
            # Before SGLang restores packed weights: that is the session's first write.
            a.begin_session()
            try:
                return fn(self, *args, **kwargs)
            except BaseException as exc:
                a.end_session(exc)
                raise

        return run

    def end_weight_update(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            a = attachment(self.get_model())
            try:
                ret = fn(self, *args, **kwargs)
            except BaseException as exc:
                if a is not None:
                    a.end_session(exc)
                raise
            if a is not None:
                a.end_session()  # a refusal: the scheduler's end reports it
            return ret

        return run

    for name in ("update_weights_from_disk", "update_weights_from_tensor",
                 "load_weights_from_distributed", "update_weights_from_ipc"):
        _wrap(cls, name, reported)
    _wrap(cls, "begin_weight_update", begin_weight_update)
    _wrap(cls, "end_weight_update", end_weight_update)


def _patch_session_end(cls: type) -> None:
    """The scheduler's `end_weight_update` returns `success=False` with graphsafe's text
    when the session's update was refused at its end."""

    def end_weight_update(fn: _Fn) -> _Fn:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            session = getattr(self, "_session", None)
            runners = [] if session is None else self._select_runners(session.selector)
            ret = fn(self, *args, **kwargs)
            for _, runner in runners:
                a = attachment(runner.model)
                message = None if a is None else a.take_refusal()
                if message is not None:
                    return type(ret)(success=False, message=message)
            return ret

        return run

    _wrap(cls, "end_weight_update", end_weight_update)
