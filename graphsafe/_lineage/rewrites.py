"""Weights the post-load step rewrites in place, and how each later load is judged.

A weight the recorded load rewrote after loading it, by ops over the model's state (a
scale folded in, `1 + w`, a layout interleaved or prepacked), holds derived state in the
parameter itself. Every later load must write it the way the first did: loaded values,
then the same rewrite; both write trackers keep, for these weights, the ops that write
each in order, a `copy_` of values computed from the weights (`w.copy_(1 + w)`) named
apart from a copy of loaded values by what its source was computed from (the trackers'
taint). A load whose last writes are not (raw values with the rewrite not re-applied, or
the rewrite alone over its own output: a fold applied twice) leaves it wrong, and it
stays so until a load writes it whole again; so does a write outside any tracked load
(raw values copied in by hand, `p.data.copy_(w)`, seen by the process-wide write observer
or by the parameter's version), which re-applies nothing. `Discovery` keeps one
`Rewritten` per such weight, in its `Rewrites`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence, Set

import torch

from graphsafe._errors import StaleError
from graphsafe._lineage.record.recorder import DERIVED_COPY
from graphsafe._lineage.resolve import Rewrite, Source
from graphsafe._memory.journal import Journal
from graphsafe._memory.snapshot import PLAIN, Witnesses
from graphsafe._memory.walk import storage_key

__all__ = ["Rewrites", "Rewritten", "rewritten_error"]

_LOAD_OPS = frozenset({"aten::copy_"})
"""The ops a load writes loaded values with (a `copy_` of values computed from the
weights is named apart: `DERIVED_COPY`)."""


class Rewritten:
    """A weight the recorded load rewrote in place (`Rewrite`), and whether a later load
    broke it (`broken`: why)."""

    __slots__ = ("broken", "chain", "inputs", "module_class", "ops", "path", "raw",
                 "rebound", "site", "sources")

    def __init__(self, rewrite: Rewrite, module_class: str) -> None:
        self.path = rewrite.weight.path
        self.site = (rewrite.weight.holder, rewrite.weight.key)
        self.module_class = module_class
        self.ops = rewrite.ops
        self.sources = tuple(dict.fromkeys(s.path for s in rewrite.sources))
        self.inputs = tuple((s.path, s.holder, s.key) for s in rewrite.sources
                            if s.path != self.path)
        """The other weights the rewrite reads (a scale folded in), where they are held."""
        self.chain = " -> ".join(rewrite.chain)
        self.rebound = rewrite.rebound
        """Rewritten by binding a new tensor computed from the loaded one at its path: a
        load re-applies it by binding another such tensor there."""
        self.broken: str | None = None
        self.raw = False
        """Whether it holds loaded values the rewrite was not applied to (a load that did
        not re-apply it, or a load of another model sharing it, a tied weight): the
        rewrite alone over them makes it whole."""

    def key(self) -> int:
        holder, key = self.site
        with PLAIN():
            t = holder.get(key)
            return storage_key(t) if isinstance(t, torch.Tensor) else 0

    def input_written(self, written: Set[int],
                      before: Mapping[str, int] | None = None) -> str | None:
        """Why a load that wrote `written` (storage keys) and not the weight left it
        wrong: it wrote another weight the rewrite reads (a new scale, not folded in), or
        bound one to new memory (`before`: each path's storage key when it began)."""
        with PLAIN():
            for path, holder, key in self.inputs:
                t = holder.get(key)
                if not isinstance(t, torch.Tensor):
                    continue
                now = storage_key(t)
                was = None if before is None else before.get(path)
                if now in written or (was is not None and was != now):
                    return (f"{path}, which the post-load rewrite ({self.chain}) reads, was "
                            "written by a load that did not write the weight and rewrite it "
                            "again")
        return None

    def judge(self, ops: Sequence[str]) -> str | None:
        """Why a load whose writes into the weight were `ops` (in order) left it wrong,
        or None: loaded, then rewritten exactly once the way the recorded load did (or,
        over raw values an earlier load left, rewritten exactly once). A load is a copy
        of loaded values (`aten::copy_`); a rewrite by `copy_` is `DERIVED_COPY`."""
        raw, self.raw = self.raw, False
        done = " -> ".join(self.ops)
        # A rewrite by rebinding is re-applied in place by a copy of what it computes.
        mine = [DERIVED_COPY] if self.rebound else list(self.ops)
        if not ops:
            self.raw = True
            return (f"written by a load graphsafe saw no op of (load_state_dict, a write "
                    f"it tracks by versions): the post-load rewrite ({done}) not re-applied")
        loads = [i for i, op in enumerate(ops) if op in _LOAD_OPS]
        tail = list(ops[loads[-1] + 1:]) if loads else list(ops)
        if tail == mine and (loads or raw):
            return None  # loaded (by this load, or raw values an earlier one left), rewritten once
        wrote = " -> ".join(ops)
        if not tail:
            self.raw = True  # loaded values, not rewritten
            return (f"written by {wrote}: raw values where the model reads the output of "
                    f"the post-load rewrite ({done}), which this load did not re-apply")
        if tail == mine:
            again = " -> ".join(mine)
            return (f"written only by {again}, which no load wrote before: the post-load "
                    "rewrite re-applied over its own output (a fold applied twice)")
        if tail[-len(mine):] == mine:
            return (f"written by {wrote}: the post-load rewrite ({done}) applied again over "
                    "its own output after the weight was loaded (a fold applied twice)")
        return (f"written by {wrote}: not the post-load rewrite ({done}) applied once over "
                "loaded values")


class Rewrites(dict[str, "Rewritten"]):
    """The weights of one model rewritten by its post-load step, by path, and how each
    load that ends leaves them; between loads, each is witnessed where it is held
    (`witness`, `written_outside`)."""

    def __init__(self, journal: Journal | None = None) -> None:
        super().__init__()
        self._journal = journal
        self._witnesses: Witnesses | None = None
        self._sites: list[tuple[int, object]] = []  # (id of the holder, key) per weight

    def witness(self) -> None:
        """What each weight holds now is what every load so far left there, judged: a
        write from now on that no load makes (`written_outside`) leaves it wrong."""
        if self._journal is None or not self:
            self._witnesses, self._sites = None, []
            return
        sites = [r.site for r in self.values()]
        ids = _ids(sites)
        if self._witnesses is not None and ids == self._sites:
            self._witnesses.record(range(len(sites)))
        else:
            self._witnesses, self._sites = Witnesses(sites, self._journal), ids

    def written_outside(self) -> None:
        """Each weight written or rebound since `witness` outside any tracked load (the
        process-wide write observer saw the write, or the parameter's version moved) is
        left wrong: no load wrote it and re-applied the rewrite. One flat check when none
        was."""
        w = self._witnesses
        if w is None:
            return
        if _ids([r.site for r in self.values()]) != self._sites:  # rehomed: see `rehome`
            self.witness()
            return
        if w.unchanged():
            return
        rows = list(self.values())
        for row, how in w.changed(by_journal=True):
            r = rows[row]
            if r.broken is None:
                r.raw = False
                r.broken = (f"{how}: the post-load rewrite ({r.chain}) was not re-applied "
                            "(no tracked load wrote it since)")
        w.record(range(len(rows)))

    def sequenced_keys(self) -> frozenset[int]:
        """Storage keys of the weights rewritten in place: a load keeps the ops that write
        each, in order, for `judge`."""
        return frozenset(k for r in self.values() if (k := r.key()))

    def judge(
        self, written: Set[int], ops: Mapping[int, Sequence[str]],
        before: Mapping[str, int] | None, tainted: Mapping[int, tuple[tuple[int, ...], str]] | None,
        exempt: Container[str],
    ) -> list[Rewritten]:
        """A load ended that wrote `written` (storage keys), each rewritten weight by
        `ops[key]`: every weight it left wrong (not in `exempt`); one written the way the
        recorded load did is whole again. `before`: the storage key of each path when the
        load began; a rewritten weight the load bound to new memory is left wrong (its
        writes there are not kept: whether the rewrite was re-applied is not known), but
        one the recorded load rewrote by binding a new tensor (`Rewritten.rebound`) that
        the load bound to a tensor it computed from other weights (`tainted`, its
        tracker's): re-applied so."""
        broken = []
        for r in self.values():
            key = r.key()
            was = None if before is None else before.get(r.path)
            if was is not None and was != key and r.rebound and _computed(key, tainted):
                r.broken, r.raw = None, False  # rebound to a transform this load computed
            elif was is not None and was != key:
                r.broken = ("bound to new memory by the load (`p.data = ...`): whether the "
                            "post-load rewrite was re-applied there is not known (load it "
                            "in place, with `copy_`)")
            elif key not in written:
                why = r.input_written(written, before)
                if why is None:
                    continue
                r.broken = why
            else:
                r.broken = r.judge(ops.get(key, ()))
            if r.broken is not None and r.path not in exempt:
                broken.append(r)
        return broken

    def rehome(self, now: Mapping[str, Source]) -> None:
        """Read each weight and each input of its rewrite where the model holds it now
        (`now`: by path). A module replaced since leaves the weight wrong: a replaced
        weight holds values no load wrote and rewrote, a replaced input (a new scale)
        values the rewrite did not read. Either stays wrong until a load writes the weight
        whole again."""
        for r in self.values():
            here = now.get(r.path)
            if here is not None and here.holder is not r.site[0]:
                r.site, r.raw = (here.holder, here.key), False
                r.broken = ("its module was replaced since the post-load rewrite "
                            f"({r.chain}) wrote it: it holds values no load wrote and rewrote")
            inputs = []
            for path, holder, key in r.inputs:
                here = now.get(path)
                if here is not None and here.holder is not holder:
                    holder, key = here.holder, here.key
                    r.broken = (f"{path}, which the post-load rewrite ({r.chain}) reads, was "
                                "replaced with its module since: its values are not the ones "
                                "the rewrite read")
                inputs.append((path, holder, key))
            r.inputs = tuple(inputs)

    def written_elsewhere(self, keys: Set[int]) -> None:
        """A load of another model (a tied weight) wrote the storages `keys`: each weight
        rewritten in place among them holds raw values now, until a load of this model
        writes it whole again."""
        for r in self.values():
            if r.key() in keys:
                r.raw = True
                r.broken = ("written by a load of another model that shares it, which does "
                            "not re-apply this model's post-load rewrite")

    def broken(self, exempt: Container[str]) -> list[Rewritten]:
        """The weights a load left wrong, not in `exempt`."""
        return [r for r in self.values() if r.broken is not None and r.path not in exempt]


def _ids(sites: Sequence[tuple[object, object]]) -> list[tuple[int, object]]:
    """Sites told apart by their holders' identity (a holder's `==` compares tensors)."""
    return [(id(holder), key) for holder, key in sites]


def _computed(key: int, tainted: Mapping[int, tuple[tuple[int, ...], str]] | None) -> bool:
    """Whether the load computed storage `key` from weights other than itself (`tainted`:
    its tracker's; a storage it overwrote with loaded values is its own source only)."""
    sources = (tainted or {}).get(key, ((), ""))[0]
    return any(k != key for k in sources)


def rewritten_error(broken: list[Rewritten]) -> StaleError:
    """The refusal of a load, or a replay, after a load left weights that the post-load
    step rewrites in place with the wrong values."""
    first = broken[0]
    return StaleError(
        f"{len(broken)} weight(s) the post-load step rewrites in place were written "
        "without that rewrite re-applied the same way (by a load, or outside any load)",
        paths=[r.path for r in broken],
        module_class=first.module_class,
        path=", ".join(r.path for r in broken[:8]) + (" ..." if len(broken) > 8 else ""),
        expected="each load writes the loaded values, then re-applies the post-load rewrite "
        "(as the first load did: " + first.chain + ")",
        got="; ".join(f"{r.path}: {r.broken}" for r in broken[:4]),
        fix="run the engine's full post-load processing after loading these weights (in "
        "vLLM, its layerwise reload of the written layers); if the rewrite is applied "
        "elsewhere on purpose, exempt the weight: "
        f'`gs.runtime(model).exempt("{first.path}", why="...")`',
    )
