"""TRL's weight sync into its colocated vLLM engine as one graphsafe update.

TRL's `VLLMGeneration.sync_weights` calls the engine model's `load_weights` once per
parameter. graphsafe wraps that `load_weights`, so each call would be a weight update of
its own, refreshing the derivations it touches: a fused [q; k; v] derived buffer three
times per layer per sync. Wrapped here, the whole sync is one update, with one refresh at
its end, whatever TRL's calls look like; what graphsafe found is kept per sync
(`SyncRecord`) for TRL's logs.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict

from graphsafe.integrations.vllm._attachment import Attachment, attachment

_SYNCS: weakref.WeakKeyDictionary[Any, list[SyncRecord]] = weakref.WeakKeyDictionary()
"""`VLLMGeneration` -> the records of its syncs, in order."""


class SyncRecord(BaseModel):
    """What graphsafe did during one TRL weight sync into the colocated engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    updates: int
    """graphsafe weight updates the sync made (1: the whole sync was one update)."""
    refreshed: int
    """Derived buffers refreshed at the update's end (0 with lazy refresh: the next step
    refreshes them)."""
    stale: tuple[str, ...]
    """Declared and discovered tensors stale after the sync: the next generate raises
    `StaleError` naming them, unless lazy refresh repairs the declared ones."""
    seconds: float
    """Wall time of the whole sync (TRL's loads, graphsafe's checks and refresh)."""
    refresh_seconds: float
    """Wall time of graphsafe's refresh at the update's end."""


def engine_attachment(generation: Any) -> Attachment | None:
    """graphsafe's attachment to the model of a TRL `VLLMGeneration`'s colocated engine
    (None: server mode, no engine yet, or graphsafe not attached to it)."""
    try:
        runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    except AttributeError:
        return None
    for model in (getattr(runner, "model", None), _get_model(runner)):
        if model is not None:
            a = attachment(model)
            if a is not None:
                return a
    return None


def _get_model(runner: Any) -> Any:
    get = getattr(runner, "get_model", None)
    return get() if callable(get) else None


def syncs(generation: Any) -> list[SyncRecord]:
    """The records of every sync of `generation` (a TRL `VLLMGeneration`) so far."""
    return list(_SYNCS.get(generation, ()))


def patch_sync(cls: Any) -> None:
    """Make `cls.sync_weights` (TRL's `VLLMGeneration`'s) one graphsafe update (once)."""
    sync = cls.sync_weights
    if getattr(sync, "_graphsafe", False):
        return

    @functools.wraps(sync)
    def sync_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        a = engine_attachment(self)
        if a is None:
            return sync(self, *args, **kwargs)
        rt = a.runtime
        updates, report = a.updates, rt.last_report
        start = time.perf_counter()
        ret = a.updating(sync_weights, sync)(self, *args, **kwargs)
        seconds = time.perf_counter() - start
        now = rt.last_report
        fresh = now is not None and now is not report
        status = a.status()
        _SYNCS.setdefault(self, []).append(SyncRecord(
            updates=a.updates - updates,
            refreshed=len(now.refreshed) if fresh and now is not None else 0,
            stale=tuple(status["stale"]),
            seconds=seconds,
            refresh_seconds=now.seconds if fresh and now is not None else 0.0,
        ))
        return ret

    sync_weights._graphsafe = True  # type: ignore[attr-defined]
    cls.sync_weights = sync_weights
