"""torch's `load_state_dict` calls on one model, as the runtime's loads see them.

Outside a tracked load, a `load_state_dict` is a load of its own: its pre-hook records the
versions of the model's tensors (`StateDictLoad`), its post-hook ends it as a load. torch
adds its strict refusal of missing or unexpected keys to its error list only once the
hooks ran, then raises: the errors are kept (`verdict`) and the model fails when the
next load begins or the guard next checks. `StateDictCalls` owns that state; the runtime's
`Loads` holds one and drives it from the hooks, under the model's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphsafe._errors import one_line
from graphsafe._runtime.engine import Engine
from graphsafe._runtime.state_dict import StateDictLoad, hold_in_state_dict

__all__ = ["StateDictCalls"]


class StateDictCalls:
    """The `load_state_dict` of the model in progress outside any load, and the verdict
    of the last one."""

    __slots__ = ("_begun", "verdict")

    def __init__(self) -> None:
        self._begun: StateDictLoad | None = None
        self.verdict: list[str] | None = None
        """The errors of the last `load_state_dict` that ended with missing or unexpected
        keys: torch adds its strict refusal there once the hooks ran, then raises."""

    def begin(
        self, engine: Engine, tensors: Callable[[], Iterable[torch.Tensor]],
        state_dict: dict[str, Any], prefix: str, error_msgs: list[str], *, tracked: bool,
    ) -> None:
        """The pre-hook: transient inputs `state_dict` holds get their bytes back, and,
        unless a tracked load runs (its tracker sees the copies), the versions of the
        model's `tensors` are recorded."""
        hold_in_state_dict(engine, state_dict, prefix)
        if not tracked:
            self._begun = StateDictLoad(tensors(), error_msgs)

    def end(
        self, tensors: Callable[[], Iterable[torch.Tensor]]
    ) -> tuple[StateDictLoad | None, set[int], BaseException | None]:
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

    def ended(self, begun: StateDictLoad | None, incompatible: Any) -> None:
        """The call `begun` ended as a load: with missing or unexpected keys, its errors
        are kept (strict or not is known only once torch returns)."""
        if begun is not None and (incompatible.missing_keys or incompatible.unexpected_keys):
            self.verdict = begun.errors

    def settle(self) -> str | None:
        """Why the last call failed after its hooks (it was strict, and keys were missing
        or unexpected), once; None if it did not."""
        errors = self.verdict
        if not errors:
            return None
        self.verdict = None
        return f"load_state_dict raised {one_line(RuntimeError(errors[0]))}"
