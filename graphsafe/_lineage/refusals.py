"""The refusals of what a model derived undeclared: stale since its sources were written
(`StaleError`), or, for a number or a handle a graph holds, changed since the capture
(`StorageMovedError`). Each names where the state is kept, its sources and how it was
computed, and the fix. And the warnings for what a recording could not follow: weights
read as NumPy arrays (`warn_unfollowed`), numbers computed in Python from the numbers it
took (`warn_untraced`), ops of threads it did not follow (`warn_strays`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from graphsafe._declare.spec import Drift
from graphsafe._errors import GraphSafetyWarning, StaleError, StorageMovedError
from graphsafe._lineage.record.recorder import Lineage
from graphsafe._lineage.resolve import Source, trace
from graphsafe._memory.snapshot import PLAIN
from graphsafe._memory.walk import storage_key

__all__ = [
    "STRAY", "UNFOLLOWED", "Named", "moved_error", "stale_error", "strays",
    "unfollowed", "warn_strays", "warn_unfollowed", "warn_untraced",
]


class Named(Protocol):
    """What a refusal reads of a discovered entry (`discovery._Entry` is one)."""

    @property
    def path(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def module_class(self) -> str: ...
    @property
    def chain(self) -> str: ...
    @property
    def site(self) -> Any: ...  # where it is held: `.key`, then the steps of `.chain`
    @property
    def sources(self) -> tuple[Source, ...]: ...

    def source_paths(self) -> tuple[str, ...]: ...


def stale_error(model_class: type, stale: Sequence[tuple[Named, str]]) -> StaleError:
    """The refusal of a replay that would read engine-derived state computed from
    weights written since."""
    first = stale[0][0]
    paths = [e.path for e, _ in stale]
    got = "; ".join(
        f"{e.path} (from {', '.join(e.source_paths())} by {e.chain}): {why}"
        for e, why in stale[:4]
    )
    declare = _declare_line(first)
    kinds = {e.kind for e, _ in stale}
    what = {"tensor": "tensor(s)", "scalar": "number(s)", "handle": "handle(s)"}.get(
        kinds.pop(), "value(s)") if len(kinds) == 1 else "value(s)"
    each = what.removesuffix("(s)")
    return StaleError(
        f"{len(stale)} {what} the model derived from its weights (found without a "
        "declaration) were not recomputed after their sources were written",
        paths=paths,
        module_class=first.module_class,
        path=", ".join(paths[:8]) + (" ..." if len(paths) > 8 else ""),
        expected=f"every {each} computed from the weights recomputed after they are written",
        got=got,
        fix="re-run the engine's post-load processing over what was written (in vLLM, "
        "its layerwise processing of the written layers, not `reload_weights` from disk, "
        f"which would discard the sync){declare}; or exempt it if it is meant to differ: "
        f'`gs.runtime(model).exempt("{first.path}", why="...")`',
    )


def moved_error(model_class: type, moved: Sequence[tuple[Named, str]]) -> StorageMovedError:
    """The refusal of a replay whose graph holds a scalar's old value or a handle
    rebuilt since the capture."""
    first = moved[0][0]
    drifts = [Drift(path=e.path, module_class=e.module_class,
                    what="value" if e.kind == "scalar" else "handle",
                    old=how.split(", now ")[0].removesuffix(" at capture"),
                    new=how.split(", now ")[-1]) for e, how in moved]
    got = "; ".join(f"{e.path} (a {e.kind} from {', '.join(e.source_paths())}): {how}"
                    for e, how in moved[:4])
    return StorageMovedError(
        f"{len(moved)} value(s) the model derived from its weights changed after graph "
        "capture: the graph holds the old one",
        drifts=drifts,
        module_class=first.module_class,
        path=", ".join(e.path for e, _ in moved[:8]),
        expected="a Python number or kernel handle the graph captured kept as it was "
        "(a graph bakes a number into its kernels' arguments and holds a handle's memory)",
        got=got,
        fix="re-capture the graphs after the engine's post-load processing changed them "
        "(release them: Graph.reset()); or keep such values in tensors the graph reads, "
        "updated in place",
    )


def _declare_line(e: Named) -> str:
    """`; or declare it: <the registry line>` where the tensor is a module attribute."""
    site = e.site
    if site.chain or not isinstance(site.key, str):
        return ""
    prefix = e.path.rsplit(".", 1)[0] + "." if "." in e.path else ""
    inputs = [s.path[len(prefix):] for s in e.sources if s.path.startswith(prefix)]
    if len(inputs) != len(e.sources):
        return ""
    return (f"; or declare it as a derivation: `@registry.derive({e.module_class}, "
            f"{site.key!r}, inputs={inputs!r})` over a function computing it")




def unfollowed(lineage: Lineage, sources: Mapping[int, Source]) -> dict[str, tuple[str, ...]]:
    """The reads of the weights as NumPy arrays the recording noted (taken from it once):
    how each was read (`lin.weight -> Tensor.numpy()`) -> the weights' paths."""
    calls, lineage.unfollowed = lineage.unfollowed, []
    reads: dict[str, tuple[str, ...]] = {}
    for call in calls:
        found, chain, _ = trace(call, dict(sources))
        if found:
            how = " -> ".join((*chain[:-1], "Tensor.numpy()"))
            reads[how] = tuple(dict.fromkeys(s.path for s in found))
    return reads


UNFOLLOWED = ("a read of the weights as a NumPy array: what was made from the array (a "
              "number, an array) is not followed, so it cannot be recomputed or checked")


def warn_unfollowed(reads: Mapping[str, tuple[str, ...]], model_class: str) -> None:
    """Warn of reads of the weights as NumPy arrays (`unfollowed`): a number or an array
    the model keeps from one goes stale after a sync, and nothing refuses."""
    warnings.warn(
        f"{model_class}: its bring-up read weights as NumPy arrays ({'; '.join(reads)}): "
        "what it made from them (a number, an array) is not followed, so after a sync that "
        "writes those weights it goes stale and no replay is refused. Take numbers with "
        "`.item()` or `.tolist()` (followed), declare the state with `gs.derive`, or re-run "
        "the post-load step and re-capture after each sync",
        GraphSafetyWarning, stacklevel=2,
    )


def warn_untraced(numbers: Mapping[str, tuple[str, ...]], model_class: str) -> None:
    """Warn of floats the bring-up set that no number it took explains (`untraced_numbers`):
    computed in Python, they are guarded as numbers of those weights, but never audited."""
    weights = ", ".join(dict.fromkeys(p for paths in numbers.values() for p in paths))
    warnings.warn(
        f"{model_class}: its bring-up set {', '.join(numbers)} to floats computed in Python "
        f"from numbers it took from {weights}: that arithmetic is not followed. They are "
        "guarded as numbers of those weights (a sync that writes them without re-running "
        "the post-load step leaves them stale, a value changed since the capture is "
        "refused), but the audit cannot recompute them. Compute them in torch and take the "
        "result's number (`(1.0 / s).item()`: followed and audited), or declare them with "
        "`gs.derive`",
        GraphSafetyWarning, stacklevel=2,
    )


def strays(lineage: Lineage, sources: Mapping[int, Source]) -> dict[str, tuple[str, ...]]:
    """The ops of threads the recording did not follow that read or wrote the weights
    (taken from it once), by thread: `thread 'w' (OS thread 7) -> aten.t, aten.contiguous`
    -> the weights' paths (`wrote ...` before those it wrote)."""
    noted, lineage.strays = lineage.strays, []
    if not noted:
        return {}
    with PLAIN():
        paths = {storage_key(t): s.path for s in sources.values()
                 if isinstance(t := s.holder.get(s.key), torch.Tensor)}
    ops: dict[str, list[str]] = {}
    touched: dict[str, dict[str, None]] = {}
    for stray in noted:
        names = [paths[k] for k in stray.weights if k in paths]
        if not names:
            continue
        op = stray.op.replace("::", ".")
        if op not in ops.setdefault(stray.thread, []):
            ops[stray.thread].append(op)
        for name in names:
            touched.setdefault(stray.thread, {})[f"wrote {name}" if stray.wrote else name] = None
    return {f"{thread} -> {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}":
            tuple(touched[thread]) for thread, names in ops.items()}


STRAY = ("ops of a thread the recording did not follow (it existed before, or a C++ "
         "library started it) read the weights: what it made is not recorded, so it "
         "cannot be recomputed or checked")


def warn_strays(found: Mapping[str, tuple[str, ...]], held: Sequence[str],
                model_class: str) -> None:
    """Warn of ops of threads the recording did not follow over the weights (`strays`):
    `held`, the paths where the model keeps what they made (guarded by its sources)."""
    kept = (f"what the model keeps of what they made ({', '.join(held)}) is guarded by the "
            "weights it came from, but its ops are not known (the audit lists it "
            "unchecked); anything else they derived is neither guarded nor checked"
            if held else "nothing the model keeps was seen made by them; anything they "
            "derived that reaches it another way is neither guarded nor checked")
    seen = "; ".join(f"{how}: {', '.join(paths)}" for how, paths in found.items())
    warnings.warn(
        f"{model_class}: while its bring-up was recorded, threads the recording does not "
        f"follow read or wrote its weights ({seen}): "
        f"the recording follows only the threads and pool tasks the recorded code starts; "
        f"{kept}. Run that work in a thread the post-load step starts or a "
        "ThreadPoolExecutor task (followed), or declare what it derives with `gs.derive`",
        GraphSafetyWarning, stacklevel=2,
    )
