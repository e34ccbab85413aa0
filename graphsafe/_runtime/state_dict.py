"""torch's `load_state_dict` and `state_dict` on a model with derived buffers.

`load_state_dict` refreshes derived buffers as a load does (its copies are in place, so
they move version counters); transient inputs the state dict holds get memory back
before torch copies into them, and are not reported missing when they are released;
`state_dict` leaves released transient inputs out (they live on the meta device).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from graphsafe._runtime.engine import Engine

__all__ = ["hook_state_dict"]


class _Owner(Protocol):
    """The runtime, as the hooks use it."""

    _engine: Engine | None

    @property
    def model(self) -> nn.Module: ...

    def _after_state_dict_load(self) -> None: ...


_FIND: list[Callable[[nn.Module], Any]] = []
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_DROPPING: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def hook_state_dict(
    model: nn.Module, engine: Engine, find: Callable[[nn.Module], _Owner | None]
) -> None:
    """Install the hooks on `model` (once) and on the owners of its transient inputs.

    Args:
        model: The root module.
        engine: Its engine.
        find: The runtime of a module, if any.
    """
    if not _FIND:
        _FIND.append(find)
    if model not in _HOOKED:
        model.register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
            _before_load_state_dict
        )
        model.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            _after_load_state_dict
        )
        _HOOKED.add(model)
    for tr in engine.transients:
        owner = tr.input.owner()
        if owner is not None and owner not in _DROPPING:
            owner.register_state_dict_post_hook(_drop_released)  # type: ignore[no-untyped-call]
            _DROPPING.add(owner)


def _before_load_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    # Transient inputs the state dict holds get their bytes back before torch copies
    # into them; the post-hook refreshes their readers and releases them again.
    rt = _FIND[0](module) if _FIND else None
    engine = rt._engine if rt is not None else None
    if engine is None or rt is None or rt.model is not module:
        return
    for tr in engine.transients:
        if prefix + tr.input.path in state_dict:
            engine.transients.hold(tr)
            tr.written = tr.numel


def _after_load_state_dict(module: nn.Module, incompatible: Any) -> None:
    rt = _FIND[0](module) if _FIND else None
    if rt is not None:
        engine = rt._engine
        if engine is not None and rt.model is module:
            # What a transient input's model cannot give back, it does not ask for either.
            released = {tr.input.path for tr in engine.transients}
            incompatible.missing_keys[:] = [
                k for k in incompatible.missing_keys if k not in released
            ]
        rt._after_state_dict_load()


def _drop_released(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    # A released transient input lives on the meta device: it holds no weights any more.
    for container in (module._parameters, module._buffers):
        for name, t in container.items():
            if t is not None and t.device.type == "meta":
                state_dict.pop(prefix + name, None)
