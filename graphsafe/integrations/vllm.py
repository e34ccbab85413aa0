"""graphsafe inside a vLLM engine, attached to vLLM's own classes without editing vLLM.

Turn it on before the engine starts, naming the registries that declare your derived
buffers (`"module:attribute"`, a `gs.Registry` or a function returning one):

    from graphsafe.integrations import vllm as gsv
    gsv.enable("my_pkg.derived:registry")      # sets GRAPHSAFE_VLLM_REGISTRIES
    llm = LLM(model=..., worker_extension_cls=gsv.EXTENSION)

vLLM loads graphsafe's `vllm.general_plugins` entry point in every process it starts
(front end, engine core, workers); with `GRAPHSAFE_VLLM_REGISTRIES` set, the plugin wraps
each worker as it is created:

- after `load_model`: binds graphsafe's runtime to the loaded model with those
  registries and materializes the derived buffers (adopting tensors vLLM's own code
  already bound, such as DeepSeek V4's `hc_attn_fn_broadcast`);
- after `compile_or_warm_up_model` (where vLLM captures its CUDA graphs): pins the model;
- `reload_weights`, the weight-transfer session (`start_weight_update` ...
  `finish_weight_update`), vLLM's layerwise reload and `model.load_weights` (as a worker
  extension reaches it through `collective_rpc`) each run as one graphsafe weight update:
  derived buffers refresh once, at its end, and a rebound tensor raises there;
- before each `execute_model`: the guard's checks (nothing moved, nothing stale), so a
  mistake raises through the engine call that made or met it.

On vLLM's CPU backend, linear layers read by a derivation keep their weights (vLLM's own
`_cpu_skip_gemm_dispatch`); other layers are packed into kernels as usual.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from graphsafe import recipes
from graphsafe._declare.registry import Registry
from graphsafe._errors import GraphSafetyError, RegistrationError
from graphsafe._graphs.guard import Guard
from graphsafe._memory.walk import Site
from graphsafe._runtime.runtime import Runtime, runtime

__all__ = [
    "ENV",
    "EXTENSION",
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

ENV = "GRAPHSAFE_VLLM_REGISTRIES"
"""Environment variable naming the registries, comma-separated `module:attribute`."""

EXTENSION = "graphsafe.integrations.vllm.WorkerExtension"
"""Qualified name to pass as `LLM(worker_extension_cls=...)` for `graphsafe_status`."""

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Attachment] = weakref.WeakKeyDictionary()
_PATCHED = threading.Lock()
_DONE: set[str] = set()


def enable(*registries: str) -> None:
    """Turn the plugin on for engines started later by this process and its children.

    Args:
        *registries: `"module:attribute"` names of `gs.Registry` objects (or of functions
            returning one), importable in every vLLM process.
    """
    os.environ[ENV] = ",".join(registries)
    if registries:
        plugin()


def registries_from(spec: str | Iterable[str | Registry]) -> list[Registry]:
    """The registries named by `spec` (the format of `GRAPHSAFE_VLLM_REGISTRIES`).

    Args:
        spec: Comma-separated `module:attribute`, or an iterable of such names and
            registries.

    Returns:
        The registries.

    Raises:
        RegistrationError: A name does not resolve to a registry.
    """
    items = [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else spec
    out: list[Registry] = []
    for item in items:
        if isinstance(item, Registry):
            out.append(item)
            continue
        mod, _, attr = item.partition(":")
        try:
            obj: Any = getattr(importlib.import_module(mod), attr) if attr else None
        except (ImportError, AttributeError) as exc:
            obj = exc
        if callable(obj) and not isinstance(obj, Registry):
            obj = obj()
        if not isinstance(obj, Registry):
            raise RegistrationError(
                f"{ENV} names {item!r}, which is not a graphsafe registry",
                expected="'module:attribute' naming a gs.Registry or a function returning one",
                got=repr(obj) if not isinstance(obj, Exception) else f"{type(obj).__name__}: "
                f"{obj}",
                fix="make the module importable in every vLLM process (on its path) and "
                "name the registry object",
            )
        out.append(obj)
    return out


class Attachment:
    """graphsafe's state on one vLLM model: its runtime, the guard once pinned, and the
    weight update in progress.

    Args:
        model: The loaded model (`worker.model_runner.get_model()`).
        registries: Where its derived buffers are declared.
    """

    def __init__(self, model: nn.Module, registries: Iterable[Registry]) -> None:
        self._model = weakref.ref(model)
        rt = runtime(model)
        for reg in registries:
            rt.add_registry(reg)
        self.runtime: Runtime = rt
        self.guard: Guard | None = None
        self.updates = 0
        self._open: contextlib.ExitStack | None = None
        self._owner: object = None

    @property
    def model(self) -> nn.Module:
        """The attached model."""
        return self.runtime.model

    # -- updates -----------------------------------------------------------------

    def begin(self, owner: object) -> None:
        """Open a weight update unless one is open (`owner` then does not own it).

        Args:
            owner: Who opens it; only the same owner's `end` closes it.
        """
        if self._open is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.runtime.weight_update())
        self._open, self._owner = stack, owner

    def end(self, owner: object, exc: BaseException | None = None) -> None:
        """Close the update `owner` opened: refresh once, or fail closed on `exc`.

        Args:
            owner: Who opened it.
            exc: The exception that ends it, if any.

        Raises:
            GraphSafetyError: What the update's end found (a rebound tensor, a failed
                derivation).
        """
        stack = self._open
        if stack is None or self._owner is not owner:
            return
        self._open, self._owner = None, None
        if exc is not None:
            stack.__exit__(type(exc), exc, exc.__traceback__)
            return
        stack.close()
        self.updates += 1

    def updating(self, owner: object, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` run as one weight update (or inside the one open)."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.begin(owner)
            try:
                ret = fn(*args, **kwargs)
            except BaseException as exc:
                self.end(owner, exc)
                raise
            self.end(owner)
            return ret

        return run

    # -- pin and guard -----------------------------------------------------------

    def pin(self) -> None:
        """Pin the model as the engine's graphs saw it (after capture or warm-up).

        Every parameter, buffer, derived buffer and tensor attribute is pinned except
        host scalars kept as plain attributes (the attention layers' `_k_scale_cpu`):
        kernels take them by value, so a graph bakes in their value at capture, never
        their address, and vLLM's own reload binds them anew.
        """
        if self.guard is None:
            guard = self.guard = Guard(self.model, self, repair=False, keep=_read_by_address)
            # Every pinned tensor, not only derivation inputs, is checked when a load or
            # update ends, so a rebinding raises through the call that made it.
            self.runtime.add_load_check(guard.ledger.assert_stable)

    def status(self) -> dict[str, Any]:
        """What graphsafe holds for this model, as plain data (for `collective_rpc`)."""
        rt = self.runtime
        report = rt.last_report
        return {
            "pinned": rt.pinned,
            "stale": list(rt.stale),
            "updates": self.updates,
            "derived": [p for d in rt.derivations for p in d.outputs],
            "last_refresh_bytes": None if report is None else report.bytes_written,
        }


def _read_by_address(site: Site) -> bool:
    t = site.tensor
    host_scalar = t.device.type == "cpu" and t.dim() == 0
    return not (host_scalar and site.container is site.module.__dict__)


def attachment(model: nn.Module) -> Attachment | None:
    """The attachment of `model`, if it has one."""
    return _ATTACHED.get(model)


def attach(model: nn.Module, *registries: Registry | str) -> Attachment:
    """Bind graphsafe to a loaded vLLM model and materialize its derived buffers.

    `model.load_weights` becomes a graphsafe load (a weight update of its own, or part
    of the one open), vLLM's layerwise reload one weight update, and tensors vLLM's code
    already bound under a derived buffer's name are adopted.

    Args:
        model: The model, after vLLM loaded it.
        *registries: Registries, or `module:attribute` names of them.

    Returns:
        The attachment (the same one on a second call).

    Raises:
        RegistrationError: A derivation reads a weight vLLM's CPU backend dropped, or a
            bound tensor does not fit its derived buffer.
    """
    have = _ATTACHED.get(model)
    if have is not None:
        return have
    _patch_layerwise()
    regs = registries_from(registries)
    _refuse_packed_inputs(model, regs)
    att = Attachment(model, regs)
    att.runtime.refresh()
    _ATTACHED[model] = att
    load: Callable[..., Any] = getattr(model, "load_weights")  # noqa: B009 (a vLLM method)
    token = object()

    @functools.wraps(load)
    def load_weights(*args: Any, **kwargs: Any) -> Any:
        return att.updating(token, load)(*args, **kwargs)

    setattr(model, "load_weights", load_weights)  # noqa: B010 (on the instance)
    return att


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
    regs = registries_from(registries)
    state: dict[str, Attachment] = {}
    worker._graphsafe = state

    def att() -> Attachment | None:
        return state.get("model")

    def wrap(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        fn = getattr(worker, name, None)
        if fn is not None:
            setattr(worker, name, make(fn))

    def after_load(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def load_model(*args: Any, **kwargs: Any) -> Any:
            ret = fn(*args, **kwargs)
            state["model"] = attach(worker.model_runner.get_model(), *regs)
            return ret

        return load_model

    def after_warm_up(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
            ret = fn(*args, **kwargs)
            a = att()
            if a is not None:
                a.pin()
            return ret

        return compile_or_warm_up_model

    def as_update(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            a = att()
            return fn(*args, **kwargs) if a is None else a.updating(fn, fn)(*args, **kwargs)

        return run

    session = object()

    def starts(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def start_weight_update(*args: Any, **kwargs: Any) -> Any:
            a = att()
            if a is None:
                return fn(*args, **kwargs)
            a.begin(session)  # before vLLM moves the layers aside: their storages count
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                a.end(session, exc)
                raise

        return start_weight_update

    def within(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def update_weights(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                a = att()
                if a is not None:
                    a.end(session, exc)  # vLLM ends its session too: fail closed
                raise

        return update_weights

    def finishes(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def finish_weight_update(*args: Any, **kwargs: Any) -> Any:
            a = att()
            try:
                ret = fn(*args, **kwargs)
            except BaseException as exc:
                if a is not None:
                    a.end(session, exc)
                raise
            if a is not None:
                a.end(session)
            return ret

        return finish_weight_update

    def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def execute_model(*args: Any, **kwargs: Any) -> Any:
            a = att()
            guard = None if a is None else a.guard  # set once the model is pinned
            if guard is None:
                return fn(*args, **kwargs)
            with guard.replaying():
                return fn(*args, **kwargs)

        return execute_model

    wrap("load_model", after_load)
    wrap("compile_or_warm_up_model", after_warm_up)
    wrap("reload_weights", as_update)
    wrap("start_weight_update", starts)
    wrap("start_draft_weight_update", starts)
    wrap("update_weights", within)
    wrap("finish_weight_update", finishes)
    wrap("execute_model", guarded)


class WorkerExtension:
    """Methods for `collective_rpc` (`LLM(worker_extension_cls=gsv.EXTENSION)`)."""

    def graphsafe_status(self) -> dict[str, Any] | None:
        """graphsafe's state on this worker's model (None where it is not attached)."""
        state = getattr(self, "_graphsafe", None) or {}
        a = state.get("model")
        return None if a is None else a.status()

    def graphsafe_attach(self, registries: list[str]) -> dict[str, Any] | None:
        """Attach graphsafe to this running worker: the one call, without the plugin.

        The engine has loaded its model and captured its graphs: the worker's update
        entry points and steps are wrapped as the plugin wraps them, the model is
        attached (tensors vLLM's code bound, such as DeepSeek V4's
        `hc_attn_fn_broadcast`, are adopted in place) and pinned at once. Derived
        buffers that did not exist when the graphs were captured are not read by them;
        to have graphs read new buffers, use the plugin, which attaches before capture.

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
        state["model"].pin()
        return self.graphsafe_status()


# -- plugin and patches ------------------------------------------------------------------


def plugin() -> None:
    """The `vllm.general_plugins` entry point: does nothing unless `GRAPHSAFE_VLLM_REGISTRIES`
    is set; then every worker created in this process is instrumented."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return
    with _PATCHED:
        if "worker" in _DONE:
            return
        _DONE.add("worker")
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


def _keep_cpu_weights() -> None:
    """On vLLM's CPU backend, keep the weights of linear layers that derivations of the
    registries named now (`GRAPHSAFE_VLLM_REGISTRIES`) read."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    process = UnquantizedLinearMethod.process_weights_after_loading
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
        if reads_weight(layer):
            # vLLM's own switch (MLA's kv_b_proj): keep the weight, use plain F.linear.
            setattr(layer, "_cpu_skip_gemm_dispatch", True)  # noqa: B010
        process(self, layer)

    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading


def _patch_layerwise() -> None:
    """vLLM's layerwise reload (`initialize_layerwise_reload` ... `finalize_layerwise_reload`)
    on an attached model becomes one weight update.

    Between the two, vLLM moves every layer's tensors aside and loads into temporaries;
    it copies the results into the original storage and puts the originals back at the
    end. The update must open before the first and close after the last.
    """
    with _PATCHED:
        if "layerwise" in _DONE:
            return
        _DONE.add("layerwise")
        try:
            from vllm.model_executor.model_loader.reload import layerwise
        except ImportError:  # an older vLLM without layerwise reload
            return
        initialize = layerwise.initialize_layerwise_reload
        finalize = layerwise.finalize_layerwise_processing

        @functools.wraps(initialize)
        def initialize_layerwise_reload(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
            a = _ATTACHED.get(model)
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
            a = _ATTACHED.get(model)
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


# -- ready-made registries ---------------------------------------------------------------


def deepseek_v4_registry() -> Registry:
    """DeepSeek V4's first-layer broadcast weight on vLLM's own decoder layer class.

    `hc_attn_fn_broadcast = hc_attn_fn.view(mix, hc_mult, hidden).sum(1)`
    (`graphsafe.recipes.fold_streams`), on the layer where vLLM's
    `finalize_mhc_broadcast_weights` bound it (the first layer of the first pipeline
    rank): attach after vLLM's first load. The buffer keeps vLLM's storage.

    Returns:
        A registry for the DeepSeek V4 decoder layer class of the current platform.
    """
    classes = _deepseek_v4_layer_classes()
    reg = Registry()

    def bound_by_vllm(layer: nn.Module) -> bool:
        have = layer.__dict__.get("hc_attn_fn_broadcast")
        if have is None:
            have = layer._buffers.get("hc_attn_fn_broadcast")
        return isinstance(have, torch.Tensor)

    def broadcast(
        layer: nn.Module, hc_attn_fn: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        hc_mult: int = getattr(layer, "hc_mult")  # noqa: B009
        hidden: int = getattr(layer, "hidden_size")  # noqa: B009
        folded: torch.Tensor = recipes.fold_streams(hc_mult, hidden)(layer, hc_attn_fn, out=out)
        return folded

    for cls in classes:
        reg.derive(cls, "hc_attn_fn_broadcast", inputs=["hc_attn_fn"], when=bound_by_vllm)(
            broadcast
        )
    return reg


def _deepseek_v4_layer_classes() -> list[type]:
    from vllm.platforms import current_platform

    out: list[type] = []
    # The CPU build runs the NVIDIA class (its own CPU class has no broadcast weight).
    vendor = "amd" if current_platform.is_rocm() else "nvidia"
    for mod in (f"vllm.models.deepseek_v4.{vendor}.model",):
        try:
            cls = importlib.import_module(mod).DeepseekV4DecoderLayer
        except (ImportError, AttributeError):
            continue
        if "hc_attn_fn_broadcast" in _init_source(cls):
            out.append(cls)
    if not out:
        raise GraphSafetyError(
            "no vLLM DeepSeek V4 decoder layer with an mHC broadcast weight was found",
            expected="vllm.models.deepseek_v4.{nvidia,amd}.model.DeepseekV4DecoderLayer",
            got="neither imports, or neither binds hc_attn_fn_broadcast",
            fix="install the vLLM release graphsafe is tested with (pip install "
            "'graphsafe[vllm]')",
        )
    return out


def _init_source(cls: type) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""
