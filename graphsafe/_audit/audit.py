"""The content audit: every derived tensor recomputed out of place and compared with what
the model holds.

The guard knows a derived buffer is fresh by its witnesses: versions, the journal, the
ledger. A write no mechanism sees (a NumPy view, a raw pointer, CUDA IPC, a collective on
a bare backend object, a kernel `torch.compile` generated) moves none of them, so the
guard replays stale memory. The audit looks at the content instead: each declared
derivation is run again, the way the engine's refresh runs it but into scratch memory,
from the inputs as they are now, and its result compared with the buffer, bitwise unless a
tolerance is given; so is each engine-derived tensor the runtime discovered, when it can
be recomputed. It writes nothing into the model: no value, no address, no `_version`, no
journal epoch, no witness changes.

Memory: one derivation's result at a time, computed into one scratch block reused for
every derivation that takes `out=` (on the host, kept with the model between audits);
the comparison (`_memory.compare`) allocates nothing of the buffers' size.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from typing import NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import nn

from graphsafe._errors import GraphSafetyError, GraphSafetyWarning, StaleError, one_line
from graphsafe._lineage.discovery import AuditItem
from graphsafe._memory.compare import compare
from graphsafe._memory.journal import Journal
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.bind.binding import BoundDerivation
from graphsafe._runtime.refresh.binder import tensor_at
from graphsafe._runtime.refresh.checks import check_results
from graphsafe._runtime.refresh.engine import Engine
from graphsafe._runtime.runtime import Runtime, runtime

__all__ = ["AuditReport", "Auditor", "Unchecked", "audit"]

_INVISIBLE = (
    "a NumPy view, a raw pointer, CUDA IPC, a collective on a bare backend object, a "
    "kernel torch.compile generated"
)


class Unchecked(BaseModel):
    """A derived tensor the audit could not recompute, and why: it is not vouched for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Dotted path of the tensor, from the model root."""
    why: str
    """Why it was not recomputed (never materialized, a released transient input, an
    opaque result the runtime cannot recompute)."""


class AuditReport(BaseModel):
    """What one audit compared, when everything it compared matched.

    Examples:
        >>> import torch, graphsafe as gs
        >>> from torch import nn
        >>> reg = gs.Registry()
        >>> @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
        ... def weight_t(m, w):
        ...     return w.t().contiguous()
        >>> lin = nn.Linear(3, 2)
        >>> _ = gs.runtime(lin, reg).refresh()
        >>> gs.audit(lin).checked
        ('weight_t',)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    checked: tuple[str, ...] = ()
    """Paths of every derived tensor recomputed and compared, declared then discovered."""
    declared: tuple[str, ...] = ()
    """Of `checked`, the outputs of declared derivations."""
    discovered: tuple[str, ...] = ()
    """Of `checked`, the engine-derived tensors the runtime discovered."""
    unchecked: tuple[Unchecked, ...] = ()
    """Derived tensors that could not be recomputed, with why: not vouched for."""
    nbytes: int = 0
    """Bytes of the held tensors compared."""
    seconds: float = 0.0
    """Wall time of the audit, recomputation included."""
    atol: float = 0.0
    """Absolute tolerance used (0 with `rtol` 0: bitwise)."""
    rtol: float = 0.0
    """Relative tolerance used."""

    @model_validator(mode="after")
    def _parts(self) -> AuditReport:
        if len(self.declared) + len(self.discovered) != len(self.checked):
            raise ValueError("checked must be exactly the declared and the discovered paths")
        return self

    @property
    def bitwise(self) -> bool:
        """Whether the comparison was bitwise (no tolerance)."""
        return self.atol == 0.0 and self.rtol == 0.0


class _Mismatch(NamedTuple):
    """One derived tensor that differs from its recomputation."""

    path: str
    what: str  # the derivation, or "engine-derived, from <sources>"
    module_class: str | None
    got: str  # the difference, or why it could not be compared
    how: str  # how its inputs were last written, as far as the journal knows


class Auditor:
    """Audits models, keeping one scratch block per device between audits.

    A graph with `audit_every` keeps its own, so that repeated audits do not allocate
    (and fault in) their scratch each time; `gs.audit(model)` uses one per model that
    keeps host scratch only (`keep=False`): a fresh host block is faulted in page by page
    on every audit (about 0.15 of a refresh for a memory-bound derivation, figure 10a),
    while a device's caching allocator keeps a freed block for the next audit anyway.
    The block is as large as the largest derivation output computed into it.
    """

    __slots__ = ("_keep", "_scratch")

    def __init__(self, *, keep: bool = True) -> None:
        self._keep = keep  # False: device scratch is freed when each audit ends
        self._scratch: dict[torch.device, torch.Tensor] = {}

    def audit(self, model: nn.Module, *, atol: float = 0.0, rtol: float = 0.0) -> AuditReport:
        """Audit `model` under its lock (loads wait); see `graphsafe.audit`."""
        _check_tolerance(atol, rtol)
        rt = runtime(model)
        with rt.holding():
            return self.run(rt, atol=atol, rtol=rtol)

    def run(self, rt: Runtime, *, atol: float, rtol: float) -> AuditReport:
        """Audit the model of `rt`, whose lock the caller holds (a guarded replay)."""
        start = time.perf_counter()
        with rt.holding() as engine:
            return self._run(rt, engine, start, atol=atol, rtol=rtol)

    def _run(self, rt: Runtime, engine: Engine, start: float, *, atol: float,
             rtol: float) -> AuditReport:
        mismatches: list[_Mismatch] = []
        declared: list[str] = []
        discovered: list[str] = []
        unchecked: list[Unchecked] = []
        nbytes = 0
        differ: set[int] = set()  # derivations found to differ, or reading one that does
        seen = _Seen(engine)
        try:
            for b in engine.bound:  # topological: what a derivation reads comes first
                upstream = sorted(differ.intersection(b.deps))
                if upstream:
                    # Its inputs as held are wrong: what it holds is stale whatever it
                    # computes from them (a refresh recomputes it after them).
                    got = f"reads {engine.bound[upstream[0]].path}, which differs"
                    how = "stale with what it reads"
                    mismatches.extend(
                        _Mismatch(p, b.spec.name, b.module_class, got, how) for p in b.out_paths
                    )
                    differ.add(b.index)
                    continue
                before = len(mismatches)
                nbytes += self._derivation(engine, seen, b, atol, rtol, declared,
                                           unchecked, mismatches)
                if len(mismatches) > before:
                    differ.add(b.index)
        finally:
            if not self._keep:
                for device in [d for d in self._scratch if d.type != "cpu"]:
                    del self._scratch[device]
        # Engine-derived tensors the runtime discovered: each recomputes itself.
        for item in rt.audit_items():
            nbytes += _discovered(item, rt.model, engine.journal, atol, rtol, discovered,
                                  unchecked, mismatches)
        if mismatches:
            raise _audit_error(type(rt.model).__name__, mismatches, atol, rtol)
        if not declared and not discovered:
            warnings.warn(_nothing_checked(type(rt.model).__name__, unchecked),
                          GraphSafetyWarning, stacklevel=4)
        return AuditReport(
            checked=(*declared, *discovered),
            declared=tuple(declared),
            discovered=tuple(discovered),
            unchecked=tuple(unchecked),
            nbytes=nbytes,
            seconds=time.perf_counter() - start,
            atol=atol,
            rtol=rtol,
        )

    def _derivation(
        self,
        engine: Engine,
        seen: _Seen,
        b: BoundDerivation,
        atol: float,
        rtol: float,
        declared: list[str],
        unchecked: list[Unchecked],
        mismatches: list[_Mismatch],
    ) -> int:
        """Recompute `b` and compare each output; return the bytes compared."""
        buffers = b.buffers
        if buffers is None:
            unchecked.extend(
                Unchecked(path=p, why="never materialized: a first load or refresh() makes it")
                for p in b.out_paths
            )
            return 0
        blocked = engine.transients.blocked(b) if engine.transients else None
        if blocked is not None:
            why = (f"its transient input {blocked.input.path} is released between updates: "
                   "only a load that writes it can recompute it")
            unchecked.extend(Unchecked(path=p, why=why) for p in b.out_paths)
            return 0
        try:
            results = self._recompute(b, buffers)
        except Exception as exc:
            how = _how_written(engine.journal, seen, b)
            got = f"recomputing it raised {one_line(exc)}"
            mismatches.extend(
                _Mismatch(p, b.spec.name, b.module_class, got, how) for p in b.out_paths
            )
            return 0
        nbytes = 0
        for path, r, held in zip(b.out_paths, results, buffers):
            nbytes += held.nbytes
            differs = compare(r, held, atol=atol, rtol=rtol)
            if differs is None:
                declared.append(path)
            else:
                how = _how_written(engine.journal, seen, b)
                mismatches.append(_Mismatch(path, b.spec.name, b.module_class, differs, how))
        return nbytes

    def _recompute(self, b: BoundDerivation, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """`b`'s results from its inputs as they are now, as the engine's refresh computes
        them (the hot path's `out=` where it takes it, into scratch memory), checked to fit
        the buffers (`DerivationDriftError`)."""
        module = b.module_ref()
        if module is None:
            raise RuntimeError("its module was garbage-collected")
        args = [c[k] for c, k in b.in_refs]
        # As the engine's refresh: normal tensors, no autograd; writes into scratch only.
        with torch.inference_mode(False), torch.no_grad():
            held = buffers[0]
            if b.fast and held.is_contiguous():
                out = self._scratch_like(held)
                ret = b.fn(module, *args, out=out)
            else:
                ret = b.fn(module, *args)
        return check_results(b, ret)

    def _scratch_like(self, t: torch.Tensor) -> torch.Tensor:
        """Scratch memory shaped as `t` (contiguous), aliasing every other scratch view."""
        block = self._scratch.get(t.device)
        if block is None or block.numel() < t.nbytes:
            block = self._scratch[t.device] = torch.empty(
                max(t.nbytes, 1), dtype=torch.uint8, device=t.device
            )
        return block[: t.nbytes].view(t.dtype).view(t.shape)


def audit(model: nn.Module, *, atol: float = 0.0, rtol: float = 0.0) -> AuditReport:
    """Recompute every derived tensor of `model` from its current inputs and compare.

    Every declared derivation is run again out of place, the way a refresh runs it, and
    compared with its buffer; so is every engine-derived tensor the runtime discovered that
    can be recomputed. Nothing of the model is written: no value, no address, no version
    counter, no journal epoch, and nothing is marked refreshed. This finds the writes no
    mechanism of the guard sees (NumPy views, raw pointers, CUDA IPC, collectives on a
    bare backend object, kernels `torch.compile` generated). It holds the model's lock:
    loads wait for it.

    Args:
        model: The model (its runtime is created if it has none).
        atol: Absolute tolerance, for derivations whose kernels are not deterministic.
        rtol: Relative tolerance. With both 0 (the default) the comparison is bitwise.

    Returns:
        What was compared, when everything matched; `unchecked` lists what could not be
        recomputed (never materialized, a released transient input, an opaque result).

    Raises:
        StaleError: Naming every mismatch (`.paths`): its derivation, the largest
            absolute difference, and how its inputs were last written if the journal knows.
        ValueError: A negative or non-finite tolerance.

    Examples:
        >>> import torch, graphsafe as gs
        >>> from torch import nn
        >>> reg = gs.Registry()
        >>> @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
        ... def weight_t(m, w):
        ...     return w.t().contiguous()
        >>> lin = nn.Linear(3, 2)
        >>> _ = gs.runtime(lin, reg).refresh()
        >>> lin.weight.detach().numpy()[:] = 0.0  # no mechanism sees this write
        >>> gs.audit(lin)
        Traceback (most recent call last):
        ...
        graphsafe.StaleError: gs.audit: 1 derived tensor(s) differ from their derivation ...
    """
    auditor = _AUDITORS.get(model)
    if auditor is None:
        auditor = _AUDITORS[model] = Auditor(keep=False)
    return auditor.audit(model, atol=atol, rtol=rtol)


_AUDITORS: weakref.WeakKeyDictionary[nn.Module, Auditor] = weakref.WeakKeyDictionary()
"""The auditor `gs.audit` uses for each model, and the host scratch it keeps: freed with
the model."""


# -- discovered tensors ------------------------------------------------------------------


def _discovered(
    item: AuditItem,
    model: nn.Module,
    journal: Journal,
    atol: float,
    rtol: float,
    discovered: list[str],
    unchecked: list[Unchecked],
    mismatches: list[_Mismatch],
) -> int:
    """Recompute one discovered tensor and compare it; return the bytes compared."""
    what = "engine-derived, from " + (", ".join(item.sources) or "no recorded source")
    how = _sources_written(model, journal, item)
    try:
        with torch.inference_mode(False), torch.no_grad():
            r = item.recompute()
    except Exception as exc:
        mismatches.append(_Mismatch(item.path, what, None,
                                    f"recomputing it raised {one_line(exc)}", how))
        return 0
    if r is None and item.probe is not None:  # a handle: run it against the reference
        with torch.inference_mode(False), torch.no_grad():
            pair = item.probe()
        if pair is not None:
            got = compare(pair[0], pair[1], atol=item.atol, rtol=item.rtol)
            if got is not None:
                mismatches.append(_Mismatch(
                    item.path, what + " (a handle, probed against the reference op)", None,
                    got, how))
            else:
                discovered.append(item.path)
            return pair[0].nbytes
    if r is None and item.stale:  # cannot be recomputed, and the guard holds it stale
        mismatches.append(_Mismatch(
            item.path, what, None, f"held stale by the guard ({item.stale}); it cannot be "
            "recomputed to compare", how))
        return 0
    if r is None:
        why = item.why or (
            "an opaque result (a value that left torch, such as a packed-kernel handle) "
            "with no probe registered (`graphsafe.register_probe`)"
            if item.opaque else "its recorded op chain cannot be run again")
        unchecked.append(Unchecked(path=item.path, why=why))
        return 0
    got = compare(r, item.held, atol=atol, rtol=rtol)
    if got is not None:
        mismatches.append(_Mismatch(item.path, what, None, got, how))
    else:
        discovered.append(item.path)
    return item.held.nbytes


# -- messages ----------------------------------------------------------------------------


class _Seen:
    """What the guard itself knows is stale (asked at the first mismatch only: asking
    its witnesses records the writes the process-wide observer already saw)."""

    __slots__ = ("_dirty", "_engine")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._dirty: dict[int, str] | None = None

    def why(self, index: int) -> str | None:
        """Why the guard holds derivation `index` stale, or None if it sees nothing."""
        engine = self._engine
        if self._dirty is None:
            self._dirty = engine.witness_dirty()
        if index in engine.stale:
            return engine.reasons.get(index, "not materialized or not refreshed")
        return self._dirty.get(index)


def _how_written(journal: Journal, seen: _Seen, b: BoundDerivation) -> str:
    """Whether the guard sees `b` stale too, and else what the journal last recorded of
    its leaf inputs: a mismatch the guard does not see is a write it cannot see."""
    why = seen.why(b.index)
    if why is not None:
        return f"the guard sees it too: {why}"
    parts = []
    for inp in b.leaf_inputs:
        t = inp.container.get(inp.key)
        if isinstance(t, torch.Tensor):
            parts.append(f"{inp.path} {_last_write(journal, storage_key(t))}")
    return "no write graphsafe saw since its last refresh" + (
        f" ({'; '.join(parts)})" if parts else ""
    )


def _sources_written(model: nn.Module, journal: Journal, item: AuditItem) -> str:
    """How the sources of `item` were last written, as far as the journal knows."""
    parts = []
    for path in item.sources:
        try:
            t = tensor_at(model, path)
        except GraphSafetyError:
            parts.append(f"{path} is no longer held by the model")
            continue
        parts.append(f"{path} {_last_write(journal, storage_key(t))}")
    return "; ".join(parts) or "no recorded source"


def _last_write(journal: Journal, key: int) -> str:
    if key and journal.epochs_of([key])[0]:
        return f"last recorded as written by {journal.how_written(key)}"
    return "has no recorded write"


def _audit_error(model_class: str, mismatches: list[_Mismatch], atol: float,
                 rtol: float) -> StaleError:
    paths = [m.path for m in mismatches]
    first = mismatches[0]
    lines = [f"{m.path} ({m.what}): {m.got}; {m.how}" for m in mismatches]
    shown = lines[0] if len(lines) == 1 else "".join("\n    " + line for line in lines)
    compared = ("bitwise" if atol == 0.0 and rtol == 0.0
                else f"within atol={atol:g}, rtol={rtol:g}")
    return StaleError(
        f"gs.audit: {len(paths)} derived tensor(s) differ from their derivation recomputed "
        "from the current inputs: " + ", ".join(paths[:8]) + (" ..." if len(paths) > 8 else ""),
        paths=paths,
        module_class=first.module_class or model_class,
        derivation=first.what,
        path=", ".join(paths[:8]) + (" ..." if len(paths) > 8 else ""),
        expected=f"every derived tensor equal ({compared}) to its recomputation",
        got=shown,
        fix="bring the buffers up to date with gs.runtime(model).refresh() (for an "
        "engine-derived tensor, re-run the engine's post-load step over what was written); "
        "a difference with no write graphsafe saw since the last refresh comes from a write "
        "it cannot see (" + _INVISIBLE + "): declare such writes with "
        "gs.mark_written(tensor), so that the guard sees them from then on",
    )


def _nothing_checked(model_class: str, unchecked: list[Unchecked]) -> str:
    """The warning of an audit that compared nothing: a clean report would overstate."""
    why = (f"; {len(unchecked)} listed unchecked ({unchecked[0].path}: {unchecked[0].why})"
           if unchecked else "")
    return (
        f"gs.audit({model_class}) checked nothing: the model has no declared derivation and "
        f"nothing its recorded loads derived from its weights{why}. A clean report vouches "
        "only for what it checked: state made where graphsafe records nothing (after the "
        "first capture outside any load, in threads the recording did not follow) is in "
        "neither. "
        "Declare it with a registry, or make it inside the load"
    )


def _check_tolerance(atol: float, rtol: float) -> None:
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
