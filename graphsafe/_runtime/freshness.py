"""The freshness check the guard runs, and what its errors tell the user to do.

Why each derivation is stale is the engine's (`Engine.stale_reasons`: failed or never
made, witnesses that no longer match, rebound inputs and buffers, writes of an update
still in progress, poisoned storage); this turns the answer into a repair or a
`StaleError`.
"""

from __future__ import annotations

from graphsafe._declare.decorators import is_wrapped_loader
from graphsafe._errors import StaleError
from graphsafe._runtime.engine import Engine

__all__ = ["check_fresh", "fresh_fix", "in_update_error", "unmaterialized_error"]


def check_fresh(engine: Engine, keys: frozenset[int], model_class: type, *, repair: bool) -> None:
    """Raise unless every derived buffer is fresh and no storage read is poisoned.

    Args:
        engine: The engine of the model's binding.
        keys: Storage keys the model's graphs read (for the journal's poison).
        model_class: The model's class, for messages.
        repair: Refresh buffers stale by writes in place instead of raising; failures
            and poisoned storage are never repaired.

    Raises:
        StaleError: Naming the stale buffers and how their inputs were written, or the
            failed weight update.
    """
    stale = engine.stale_reasons(set())
    if stale and repair and not any(i in engine.reasons for i in stale):
        engine.recompute(engine.closure(stale))
        stale = {}
    if stale:
        paths = [p for i in sorted(stale) for p in engine.bound[i].out_paths]
        first = engine.bound[min(stale)]
        unmaterialized = any(b.buffers is None for b in engine.bound)
        raise StaleError(
            f"{len(paths)} derived buffer(s) do not match their inputs",
            paths=paths,
            module_class=first.module_class,
            derivation=first.spec.name,
            path=", ".join(paths[:8]) + (" ..." if len(paths) > 8 else ""),
            expected="every derived buffer refreshed from the current weights",
            got="; ".join(f"{engine.bound[i].path}: {why}" for i, why in list(stale.items())[:4]),
            fix=fresh_fix(model_class, unmaterialized),
        )
    failed = engine.journal.poisoned_among(keys)
    if failed:
        raise StaleError(
            "the last weight update failed; the model holds a mix of old and new weights",
            module_class=model_class.__name__,
            expected="a weight update that completed",
            got=next(iter(failed.values())),
            fix="load the weights again; the model is usable once a load completes",
        )


def fresh_fix(model_class: type, unmaterialized: bool) -> str:
    """How to make the buffers fresh, naming an undecorated loader when there is one.

    Args:
        model_class: The model's class.
        unmaterialized: Whether some buffers were never made.

    Returns:
        The fix line of the error.
    """
    loader = getattr(model_class, "load_weights", None)
    if unmaterialized and loader is not None and not is_wrapped_loader(loader):
        return (
            f"{model_class.__name__}.load_weights is not decorated with @gs.graphsafe, so "
            "its writes were not tracked: decorate the class, or call it inside "
            "`with gs.weight_update(model):`"
        )
    if unmaterialized:
        return (
            "load the weights first (a method wrapped by @gs.graphsafe, load_state_dict, "
            "or a `gs.weight_update(model)` block), or call gs.runtime(model).refresh()"
        )
    return (
        "write weights through a tracked load (a method wrapped by @gs.graphsafe, "
        "load_state_dict, or a `gs.weight_update(model)` block; declare writes graphsafe "
        "cannot see with gs.mark_written) and let it end; gs.runtime(model)."
        "refresh_stale() recomputes stale buffers, and Graph(..., on_stale='refresh') "
        "does so before each replay; a failed load is repaired only by loading again"
    )


def in_update_error(model_class: type, written: int) -> StaleError:
    """The error for a replay while a weight update has written `written` storages."""
    return StaleError(
        "a weight update is in progress; the model holds a mix of old and new weights",
        module_class=model_class.__name__,
        expected="the weight_update block (or load) to have ended",
        got=f"{written} tensor storage(s) written so far",
        fix="run the model after the `with gs.weight_update(model):` block exits",
    )


def unmaterialized_error(model_class: type, missing: list[str]) -> StaleError:
    """The error for pinning (capturing) a model whose buffers were never made."""
    return StaleError(
        "cannot pin: derived buffers were never materialized",
        paths=missing,
        path=", ".join(missing[:8]),
        expected="derived buffers allocated by a first load or refresh()",
        got="not materialized",
        fix=fresh_fix(model_class, True),
    )
