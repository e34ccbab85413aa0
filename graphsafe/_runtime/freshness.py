"""The freshness check the guard runs, and what its errors tell the user to do.

Why each derivation is stale is the engine's (`Engine.stale_reasons`: failed or never
made, witnesses that no longer match, rebound inputs and buffers, writes of an update
still in progress, poisoned storage), and what a failed update still owes the runtime's
(`Owed`); this turns the answers into a repair or a `StaleError`.
"""

from __future__ import annotations

from graphsafe._declare.decorators import is_wrapped_loader
from graphsafe._errors import StaleError
from graphsafe._runtime.loads.debts import Owed
from graphsafe._runtime.refresh.engine import Engine

__all__ = ["check_fresh", "fresh_fix", "in_update_error", "owed_error", "unmaterialized_error"]

_HEAL = "load the weights again: a complete load heals it"


def check_fresh(
    engine: Engine, keys: frozenset[int], model_class: type, *, repair: bool,
    owed: Owed | None = None,
) -> None:
    """Raise unless every derived buffer is fresh, nothing is owed and no storage read
    is poisoned.

    Args:
        engine: The engine of the model's binding.
        keys: Storage keys the model's graphs read (for the journal's poison).
        model_class: The model's class, for messages.
        repair: Refresh buffers stale by writes in place instead of raising; failures,
            what is owed and poisoned storage are never repaired.
        owed: What a failed update of the model still owes.

    Raises:
        StaleError: Naming the stale buffers and how their inputs were written, or what
            a failed update still owes, or the failed weight update of another model.
    """
    stale = engine.stale_reasons(set())
    if stale and repair and not any(i in engine.reasons for i in stale):
        engine.recompute(engine.closure(stale))
        stale = {}
    if stale:
        paths = [p for i in sorted(stale) for p in engine.bound[i].out_paths]
        bound = [engine.bound[i] for i in sorted(stale)]
        classes = list(dict.fromkeys(b.module_class for b in bound))
        names = list(dict.fromkeys(b.spec.name for b in bound))
        unmaterialized = any(b.buffers is None for b in engine.bound)
        raise StaleError(
            f"{len(paths)} derived buffer(s) do not match their inputs",
            paths=paths,
            module_class=", ".join(classes),  # each buffer's own below, in `got`
            derivation=", ".join(names[:4]) + (" ..." if len(names) > 4 else ""),
            path=", ".join(paths[:8]) + (" ..." if len(paths) > 8 else ""),
            expected="every derived buffer refreshed from the current weights",
            got="; ".join(
                f"{engine.bound[i].path} ({engine.bound[i].module_class}, "
                f"{engine.bound[i].spec.name}): {why}"
                if len(names) > 1 else f"{engine.bound[i].path}: {why}"
                for i, why in list(stale.items())[:4]),
            fix=fresh_fix(model_class, unmaterialized),
        )
    if owed:
        raise owed_error(model_class, owed)
    failed = engine.journal.poisoned_among(keys)
    if failed:
        raise StaleError(
            "the last weight update failed; the model holds a mix of old and new weights",
            module_class=model_class.__name__,
            expected="a weight update that completed",
            got=f"{len(failed)} storage(s) it reads were left by a failure: "
            f"{next(iter(failed.values()))}",
            fix=f"{_HEAL} (of the model that failed, or of this one, writing the "
            "storages they share)",
        )


def owed_error(model_class: type, owed: Owed) -> StaleError:
    """The error for a replay while a failed update's tensors are not all written again.

    Args:
        model_class: The model's class.
        owed: What is owed.

    Returns:
        The error, naming how many tensors are owed and the first few.
    """
    paths = list(owed.paths)
    shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
    return StaleError(
        "the last weight update failed; the model holds a mix of old and new weights",
        module_class=model_class.__name__,
        path=paths[0],
        expected="every tensor the failed update may have written, written again by "
        "completed loads",
        got=f"{len(paths)} tensor(s) still owed since {owed.why}: {shown}",
        fix=f"{_HEAL} (a partial load heals only what it writes; a refresh heals nothing)",
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
