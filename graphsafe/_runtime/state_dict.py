"""torch's `load_state_dict` and `state_dict` on a model with derived buffers.

`load_state_dict` refreshes derived buffers as a load does (its copies are in place, so
they move version counters); transient inputs the state dict holds get memory back
before torch copies into them, and are not reported missing while released; `state_dict`
leaves released ones out (they live on the meta device). The hooks hold what they call
weakly, so the model does not keep its runtime alive through them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from graphsafe._runtime.engine import Engine

__all__ = ["forgive_released", "hold_in_state_dict", "hook_state_dict"]

_Before = Callable[[nn.Module, dict[str, Any], str], None]
_After = Callable[[nn.Module, Any], None]
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_DROPPING: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def hook_state_dict(
    model: nn.Module,
    engine: Engine,
    before: weakref.WeakMethod[_Before],
    after: weakref.WeakMethod[_After],
) -> None:
    """Install the hooks on `model` (once) and on the owners of its transient inputs:
    `before(module, state_dict, prefix)` runs before torch copies, `after(module,
    incompatible_keys)` once it has."""
    if model not in _HOOKED:

        def pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     *_: Any) -> None:
            fn = before()
            if fn is not None:
                fn(module, state_dict, prefix)

        def post_hook(module: nn.Module, incompatible: Any) -> None:
            fn = after()
            if fn is not None:
                fn(module, incompatible)

        model.register_load_state_dict_pre_hook(pre_hook)  # type: ignore[no-untyped-call]
        model.register_load_state_dict_post_hook(post_hook)  # type: ignore[no-untyped-call]
        _HOOKED.add(model)
    for tr in engine.transients:
        owner = tr.input.owner()
        if owner is not None and owner not in _DROPPING:
            owner.register_state_dict_post_hook(_drop_released)  # type: ignore[no-untyped-call]
            _DROPPING.add(owner)


def hold_in_state_dict(engine: Engine, state_dict: dict[str, Any], prefix: str) -> None:
    """Transient inputs the state dict holds get their bytes back before torch copies
    into them; the load that `load_state_dict` ends refreshes their readers and releases
    them again."""
    for tr in engine.transients:
        if prefix + tr.input.path in state_dict:
            engine.transients.hold_whole(tr)


def forgive_released(engine: Engine, incompatible: Any) -> None:
    """What a released transient input's model cannot give back, it does not ask for."""
    released = {tr.input.path for tr in engine.transients}
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in released]


def _drop_released(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    # A released transient input lives on the meta device: it holds no weights any more.
    for container in (module._parameters, module._buffers):
        for name, t in container.items():
            if t is not None and t.device.type == "meta":
                state_dict.pop(prefix + name, None)
