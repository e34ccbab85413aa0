"""graphsafe's state on one vLLM model (`Attachment`) and the map of attached models, below
`attach` and the vLLM patches, so that patched vLLM code finds a model's attachment."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from graphsafe._declare.registry import Registry
from graphsafe._graphs.guard import Guard
from graphsafe._memory.walk import Site
from graphsafe._runtime.runtime import Runtime, runtime

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Attachment] = weakref.WeakKeyDictionary()


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
        """Open a weight update owned by `owner` (only its `end` closes it), unless one is
        open already (`owner` then owns nothing)."""
        if self._open is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.runtime.weight_update())
        self._open, self._owner = stack, owner

    def end(self, owner: object, exc: BaseException | None = None) -> None:
        """Close the update `owner` opened: refresh once, or fail closed on `exc`.

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
