"""torch's `load_state_dict` and `state_dict` on a model with derived buffers.

`load_state_dict` refreshes derived buffers as a load does (its copies are in place, so
they move version counters: `StateDictCall` finds what it wrote by them); transient
inputs the state dict holds get memory back before torch copies into them, and are not
reported missing while released; `state_dict` leaves released ones out (they live on the
meta device). torch copies every entry that fits, runs the hooks, and only then raises
for those that did not (a size mismatch, a strict load's missing or unexpected keys):
the errors it collects tell a load that fails. The hooks hold what they call weakly, so
the model does not keep its runtime alive through them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from graphsafe._errors import one_line
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.refresh.engine import Engine

__all__ = [
    "StateDictCall", "StateDictCalls", "forgive_released", "hold_in_state_dict",
    "hook_state_dict",
]

_Before = Callable[[nn.Module, dict[str, Any], str, list[str]], None]
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
    `before(module, state_dict, prefix, error_msgs)` runs before torch copies (torch
    collects its errors in `error_msgs`), `after(module, incompatible_keys)` once it
    has."""
    if model not in _HOOKED:

        def pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     *rest: Any) -> None:
            # rest: local_metadata, strict (always True here), missing_keys,
            # unexpected_keys, error_msgs
            fn = before()
            if fn is not None:
                fn(module, state_dict, prefix, rest[-1])

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


class StateDictCall:
    """One `load_state_dict` in progress: the version of every model tensor before torch
    copies, and the list torch collects its errors in (`errors`; it raises once the
    hooks ran if the list holds any).

    Args:
        tensors: Every tensor of the model.
        errors: The `error_msgs` list the pre-hook was given.
    """

    __slots__ = ("_before", "errors", "paths", "untied")

    def __init__(
        self, tensors: Iterable[torch.Tensor], errors: list[str], paths: dict[str, int],
        untied: frozenset[tuple[str, ...]],
    ) -> None:
        self._before = {id(t): (t, _version(t)) for t in tensors}
        self.errors = errors
        self.paths = paths
        """The storage key at each path when the call began (one rebound since, by
        `assign=True`, was written)."""
        self.untied = untied
        """The model's ties broken when the call began."""

    def written(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Storage keys of `tensors` (the model's, now) that torch copied into (their
        version moved) or put in place (`assign=True`)."""
        found = set()
        for t in tensors:
            before = self._before.get(id(t))
            if before is None or before[0] is not t or _version(t) != before[1]:
                found.add(storage_key(t))
        found.discard(0)
        return found


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor has none: counted as written
        return -1


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


class StateDictCalls:
    """The `load_state_dict` of the model in progress outside any load, and the verdict
    of the last one."""

    __slots__ = ("_begun", "_verdict")

    def __init__(self) -> None:
        self._begun: StateDictCall | None = None
        # The errors of the last `load_state_dict` that ended with missing or unexpected
        # keys: torch adds its strict refusal there once the hooks ran, then raises.
        self._verdict: list[str] | None = None

    def begin(
        self, engine: Engine, tensors: Callable[[], Iterable[torch.Tensor]],
        state_dict: dict[str, Any], prefix: str, error_msgs: list[str],
        begin: Callable[[], tuple[dict[str, int], frozenset[tuple[str, ...]]]] | None,
    ) -> None:
        """The pre-hook: transient inputs `state_dict` holds get their bytes back, and,
        unless a tracked load runs (`begin` None: its tracker sees the copies), the
        versions of the model's `tensors` are recorded, with what `begin()` says of the
        model now: the storage key at each path and the ties broken."""
        hold_in_state_dict(engine, state_dict, prefix)
        if begin is not None:
            self._begun = StateDictCall(tensors(), error_msgs, *begin())

    def end(
        self, tensors: Callable[[], Iterable[torch.Tensor]]
    ) -> tuple[StateDictCall | None, set[int], BaseException | None]:
        """The post-hook, outside a tracked load: the call that ends (None if its pre-hook
        recorded none), the storage keys it wrote, and what torch raises once the hooks
        ran (None: nothing, as far as the errors collected so far say)."""
        begun, self._begun = self._begun, None
        if begun is None:
            return None, set(), None
        raised = RuntimeError(begun.errors[0]) if begun.errors else None
        return begun, begun.written(tensors()), raised

    def drop(self) -> None:
        """The post-hook inside a tracked load or update: it refreshes when it ends."""
        self._begun = None

    def ended(self, begun: StateDictCall | None, incompatible: Any) -> None:
        """The call `begun` ended as a load: with missing or unexpected keys, its errors
        are kept (strict or not is known only once torch returns)."""
        if begun is not None and (incompatible.missing_keys or incompatible.unexpected_keys):
            self._verdict = begun.errors

    def settle(self) -> str | None:
        """Why the last call failed after its hooks (it was strict, and keys were missing
        or unexpected), once; None if it did not."""
        errors, self._verdict = self._verdict, None
        if not errors:
            return None
        return f"load_state_dict raised {one_line(RuntimeError(errors[0]))}"
