"""graphsafe's state on one SGLang model (`Attachment`) and the map of attached models, so
that patched SGLang code finds a model's attachment."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from graphsafe._declare.registry import Registry
from graphsafe._errors import GraphSafetyError
from graphsafe.integrations._engine import EngineAttachment

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Attachment] = weakref.WeakKeyDictionary()


class UpdateRefused(Exception):
    """SGLang reported a weight update as failed (`(False, message)`) after it may have
    written: the update ends failed, so graphsafe fails closed."""


class Attachment(EngineAttachment):
    """graphsafe's state on one SGLang model: its runtime, the guard once pinned, and the
    weight update in progress.

    Args:
        model: The loaded model (`ModelRunner.model`).
        registries: Where its derived buffers are declared.
    """

    recorded_forwards = 2  # SGLang runs no warm-up forward before the pin

    def __init__(self, model: nn.Module, registries: Iterable[Registry]) -> None:
        super().__init__(model, registries)
        self.session = object()
        """The owner of SGLang's begin/end weight-update session's graphsafe update."""
        self._refused: str | None = None  # the session's refused end, until reported

    # -- updates -----------------------------------------------------------------

    def begin_session(self) -> None:
        """SGLang's `begin_weight_update`: the session's update opens (a refusal an
        earlier session left unreported is dropped)."""
        self._refused = None
        self.begin(self.session)

    def end_session(self, exc: BaseException | None = None) -> None:
        """SGLang's `end_weight_update`: the session's update ends (failed, with `exc`).
        A refusal of its end is kept for the scheduler to report (`take_refusal`), never
        raised into SGLang."""
        if exc is not None:
            self.end(self.session, exc)
            return
        try:
            self.end(self.session)
        except GraphSafetyError as err:
            self._refused = refusal(err)

    def take_refusal(self) -> str | None:
        """graphsafe's text for the session's refused end, once (None: none)."""
        refused, self._refused = self._refused, None
        return refused

    def fail(self, exc: BaseException) -> None:
        """End the update open now as failed, whoever opened it (a call inside SGLang's
        session fails the session's update)."""
        if self._open is not None:
            self.end(self._owner, exc)

    def reported(self, fn: Callable[..., Any]) -> Callable[..., tuple[bool, str]]:
        """One of SGLang's update entry points returning `(success, message)`, run as one
        weight update (or inside the one open), that never raises graphsafe's errors into
        SGLang's scheduler (an exception there stops the engine): a refusal is returned as
        `(False, graphsafe's text)`, and SGLang's own `(False, message)` ends the update
        failed. Either way the model stays failed closed (its next forward is refused)
        until a load completes."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> tuple[bool, str]:
            owner = object()
            self.begin(owner)
            try:
                ret = fn(*args, **kwargs)
            except BaseException as exc:
                self.fail(exc)
                raise
            ok, message = ret
            try:
                if ok:
                    self.end(owner)
                else:
                    self.fail(UpdateRefused(message))
            except GraphSafetyError as err:
                return False, refusal(err)
            return ok, message

        return run

    # -- pin and guard -----------------------------------------------------------

    def guarded(self, *, runs_model: bool = True) -> contextlib.AbstractContextManager[None]:
        """What a forward runs under: the guard's checks once pinned (nothing moved,
        nothing stale, declared or discovered, the last update ended and held); the first
        forward that runs the model after a pin with `record_reads` is recorded
        (`recorded`).

        Args:
            runs_model: The forward runs the model (not an idle batch, which reads none
                of it and is not recorded).

        Raises:
            StorageMovedError: A pinned tensor or submodule was rebound.
            StaleError: Derived buffers are stale, or the last weight update failed or has
                not ended.
        """
        if self.guard is None:
            return contextlib.nullcontext()
        if self.recording and runs_model:
            return self.recorded()
        return self.guard.replaying()

    def status(self) -> dict[str, Any]:
        """What graphsafe holds for this model, as plain data."""
        return self._describe()


def refusal(err: GraphSafetyError) -> str:
    """The message SGLang returns for an update graphsafe refused."""
    return f"graphsafe refused the weight update: {type(err).__name__}: {err}"


def attachment(model: nn.Module) -> Attachment | None:
    """The attachment of `model`, if it has one."""
    return _ATTACHED.get(model)

