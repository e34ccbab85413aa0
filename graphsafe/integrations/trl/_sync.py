"""TRL's weight sync into its colocated vLLM engine as one graphsafe update.

TRL's `VLLMGeneration.sync_weights` calls the engine model's `load_weights` once per
parameter. graphsafe wraps that `load_weights`, so each call would be a weight update of
its own, refreshing the derivations it touches: a fused [q; k; v] derived buffer three
times per layer per sync. Wrapped here, the whole sync is one update, with one refresh at
its end, whatever TRL's calls look like; what graphsafe found is kept per sync
(`SyncRecord`) for TRL's logs.

After each sync the policy's parameters are compared with the engine's, by fingerprint
(`gs.fingerprint`), wherever the engine holds a tensor of the same name and shape: the
engine serves the policy's weights, bit for bit, or the record names the ones it does
not. A fused engine tensor (`qkv_proj`, `gate_up_proj`) has no counterpart in the policy
and is not compared; neither are parameters held as shards (DeepSpeed ZeRO-3, FSDP) or
under other names (PEFT adapters, merged into the engine's weights).
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from graphsafe._fingerprint.digest import fingerprint
from graphsafe.integrations.vllm._attachment import Attachment, attachment

_SYNCS: weakref.WeakKeyDictionary[Any, list[SyncRecord]] = weakref.WeakKeyDictionary()
"""`VLLMGeneration` -> the records of its syncs, in order."""
_COMPARE = [True]
"""Whether each sync compares the policy's fingerprints with the engine's (set by
`patch_sync` alone)."""


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
    fingerprints_compared: int = 0
    """Parameters of the policy whose fingerprint was compared with the engine's after
    the sync: those the engine holds under the same name and shape (the policy's cast to
    the engine's dtype first, as the engine's loader casts it)."""
    fingerprint_mismatches: tuple[str, ...] = ()
    """Those whose fingerprints differ: the engine serves other values than the policy
    holds."""
    fingerprint_seconds: float = 0.0
    """Wall time of the comparison (not in `seconds`)."""


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


def patch_sync(cls: Any, *, fingerprints: bool = True) -> None:
    """Make `cls.sync_weights` (TRL's `VLLMGeneration`'s) one graphsafe update (once),
    followed by the comparison of fingerprints when `fingerprints` (the latest call's
    setting holds)."""
    _COMPARE[0] = fingerprints
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
        start = time.perf_counter()
        compared, mismatches = _compare(self, a.model) if _COMPARE[0] else (0, ())
        _SYNCS.setdefault(self, []).append(SyncRecord(
            updates=a.updates - updates,
            refreshed=len(now.refreshed) if fresh and now is not None else 0,
            stale=tuple(status["stale"]),
            seconds=seconds,
            refresh_seconds=now.seconds if fresh and now is not None else 0.0,
            fingerprints_compared=compared,
            fingerprint_mismatches=mismatches,
            fingerprint_seconds=time.perf_counter() - start if _COMPARE[0] else 0.0,
        ))
        return ret

    sync_weights._graphsafe = True  # type: ignore[attr-defined]
    cls.sync_weights = sync_weights


def _compare(generation: Any, engine: nn.Module) -> tuple[int, tuple[str, ...]]:
    """After a sync: how many of the policy's parameters the engine holds under the same
    name (as TRL's sync names them) and shape, and those whose fingerprint differs from
    the engine's tensor's, the policy's cast to the engine's dtype."""
    policy = getattr(generation, "model", None)
    if not isinstance(policy, nn.Module):
        return 0, ()
    rename = getattr(generation, "_fix_param_name_to_vllm", None)
    served = engine.state_dict(keep_vars=True)
    sent: dict[str, torch.Tensor] = {}
    for name, p in policy.named_parameters():
        name = rename(name) if callable(rename) else name
        t = served.get(name)
        # A plain tensor of the same shape: a shard (ZeRO-3, DTensor) compares nothing.
        if isinstance(t, torch.Tensor) and type(p.data) is torch.Tensor and t.shape == p.shape:
            sent[name] = p.detach().to(t.dtype)
    if not sent:
        return 0, ()
    mine, theirs = fingerprint(sent), fingerprint(engine, list(sent))
    return len(sent), tuple(n for n in sent if mine[n] != theirs[n])
