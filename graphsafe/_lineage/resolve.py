"""What a recorded lineage means for one model: which tensors it holds were computed from
which of its weights, and how; and the recomputation of such a tensor from the weights
as they are now.

A *source* is a tensor the model keeps as a parameter or buffer (weights, and declared
derived buffers). A tensor the model holds anywhere the walk reaches (an attribute, a
kernel object, a closure, a partial), whose storage the recording saw written and whose
writers reach a source, is *found*; one whose writers reach no source (a rotary cache
computed from the config) is not. A view of a source is the source itself. So is a value
that left torch (a Python number from `.item()`, a kernel handle) the model keeps where
the walk reaches, found by its identity (`find_values`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container, Iterable, Mapping, Sequence, Set
from typing import Any, NamedTuple

import torch
from torch import nn

from graphsafe import _native
from graphsafe._lineage.record.recorder import DERIVED_COPY, Arg, Call, Lineage, ambiguous, sid_of
from graphsafe._memory.snapshot import PLAIN
from graphsafe._memory.walk import (
    Site,
    ValueSite,
    module_prefixes,
    storage_ids,
    storage_key,
    walk_values,
)

__all__ = [
    "COMPUTED", "NOTHING", "Foreign", "Found", "Rewrite", "Source", "arguments_now", "atoms_of",
    "find", "find_rewrites", "find_tainted", "find_values", "foreign_keys", "foreign_of",
    "foreign_sources", "made_sources", "recompute", "recompute_scalar", "sources_of", "trace",
    "untraced_numbers",
]

_CHAIN = 4
"""Ops kept at each end of a chain in messages."""


class Source(NamedTuple):
    """A weight the model keeps: `holder[key]` (`module._parameters`, "weight") at `path`."""

    path: str
    holder: dict[str, Any]
    key: str
    sid: int


def staged_sources(copied: dict[int, int], sources: dict[int, Source],
                   foreign: dict[int, Source]) -> dict[int, Source]:
    """The staging copies a load copied whole into a weight (`copied`: staged -> weight),
    each standing for its weight (a source at the weight's place), but those that are
    sources themselves (among `sources` or `foreign`). One compiled call where the compiled
    checks are built (`staged_sources`, held to this comprehension by a property test):
    a load of every weight from a checkpoint in memory copies thousands."""
    native = _native.get()
    if native is not None:
        done = native.staged_sources(copied, sources, foreign, Source)
        if done is not None:
            return done
    get = sources.get
    return {staged: _new(Source, (src.path, src.holder, src.key, staged))
            for staged, weight in copied.items()
            if (src := get(weight)) is not None and staged not in sources
            and staged not in foreign}


class Found(NamedTuple):
    """A tensor the model holds (`site`) that the recording saw computed from `sources`
    by `chain` (op names, the first from a source), last written by `writer`; or a value
    that left torch (`site` a `ValueSite`, `writer`'s `Arg` None: the call made it).
    `writer` is None for a tensor a load that was not recorded computed (`find_tainted`):
    its ops are not known."""

    site: Site | ValueSite
    sources: tuple[Source, ...]
    chain: tuple[str, ...]
    opaque: bool
    writer: tuple[Call, Arg | None] | None


def sources_of(model: nn.Module) -> dict[int, Source]:
    """Every parameter and buffer of `model` by storage identity (the first path of each,
    in `named_modules(remove_duplicate=False)` order)."""
    prefixes = module_prefixes(model)
    native = _native.get()
    if native is not None:  # one compiled call (`table_sources`), held to this loop by a test
        done = native.table_sources(prefixes, Source)
        if done is not None:
            return done
    held: list[tuple[str, dict[str, Any], str, torch.Tensor]] = []
    for head, module in prefixes:
        for table in (module._parameters, module._buffers):
            held += [(head + name, table, name, t) for name, t in table.items()
                     if isinstance(t, torch.Tensor)]
    tensors = [t for *_, t in held]
    found: dict[int, Source] = {}
    sids = _sids(tensors)
    with PLAIN():
        metas = [t.is_meta for t in tensors]
    for (path, table, name, _), sid, meta in zip(held, sids, metas, strict=True):
        if sid and not meta and sid not in found:
            found[sid] = _new(Source, (path, table, name, sid))
    return found


_new = tuple.__new__
"""Builds a `Source` or `Found` from all its fields, without the named tuple's own
`__new__` (a Python call per weight, per tensor found)."""


def _sids(tensors: list[torch.Tensor]) -> list[int]:
    """`sid_of` each tensor: one compiled call where the compiled checks are built."""
    sids = storage_ids(tensors)
    if sids is None:
        with PLAIN():  # once, not per tensor
            sids = list(map(sid_of, tensors))
    return sids


class Foreign(NamedTuple):
    """Another bound model's weights as a recording of this one reads them (`foreign_of`):
    its sources by storage identity, each path led by its model's class
    (`Target:lm_head.weight`), their storage keys (0 left out), and whether its model was
    loading in another thread when they were read (read again where needed later)."""

    sources: dict[int, Source]
    keys: frozenset[int]
    loading: bool = False


def foreign_of(other: nn.Module, keys: frozenset[int] | None = None, *,
               loading: bool = False) -> Foreign:
    """`other`'s weights as another model's recording reads them (see `Foreign`);
    `keys`: their storage keys where the caller has them (a walk's `table_keys`);
    `loading`: `other` is loading in another thread."""
    name = type(other).__name__
    found = {sid: src._replace(path=f"{name}:{src.path}")
             for sid, src in sources_of(other).items()}
    if keys is None:
        with PLAIN():
            keys = frozenset(storage_key(t) for src in found.values()
                             if isinstance(t := src.holder.get(src.key), torch.Tensor))
    return Foreign(found, keys - {0}, loading)


def foreign_sources(others: Iterable[Foreign], own: Iterable[int]) -> dict[int, Source]:
    """The weights of `others` (the other models graphsafe binds, `foreign_of` each) that
    the model does not hold itself (`own`: its sources' storage identities), by storage
    identity (the first model's where two hold one)."""
    found: dict[int, Source] = {}
    for other in reversed(list(others)):
        found.update(other.sources)
    if found:
        for sid in own:
            found.pop(sid, None)
    return found


def foreign_keys(others: Iterable[Foreign], own: frozenset[int]) -> frozenset[int]:
    """The storage keys of the weights of `others` (the other models graphsafe binds,
    `foreign_of` each) but those in `own` (the model's parameters and buffers).

    Every recorded load is given them: while the other models' weights stay as they
    were, it gets the same set object (the compiled recorder reads a set it was given
    before only once)."""
    parts = tuple(other.keys for other in others)
    last = _FOREIGN_KEYS[0]
    if len(parts) != len(last[0]) or any(a is not b for a, b in zip(parts, last[0])):
        last = _FOREIGN_KEYS[0] = (parts, frozenset().union(*parts))  # one assignment
    union = last[1]
    return union if union.isdisjoint(own) else union - own


_FOREIGN_KEYS: list[tuple[tuple[frozenset[int], ...], frozenset[int]]] = [((), frozenset())]
"""The last `foreign_keys` union, with the sets it was made of (process-wide: a model's
first load is its only recorded one)."""


def find_tainted(
    sites: Iterable[Site], sources: dict[int, Source],
    tainted: Mapping[int, tuple[tuple[int, ...], str]], known: Container[str],
) -> list[Found]:
    """The tensors held at `sites` whose storage a load that was not recorded computed
    from the weights (`tainted`: storage key -> the weights' storage keys, the last op),
    but those at `known` paths (found before: a later load that writes them is followed)
    and the weights themselves; one per storage, at its first path."""
    with PLAIN():
        by_key = {storage_key(t): s for s in sources.values()
                  if isinstance(t := s.holder.get(s.key), torch.Tensor)}
        out: list[Found] = []
        taken: set[int] = set()
        for site in sites:
            key = storage_key(site.tensor)
            made = tainted.get(key)
            if made is None or key in by_key or key in taken or site.path in known:
                continue
            taken.add(key)
            srcs = tuple({by_key[k].path: by_key[k] for k in made[0] if k in by_key}.values())
            if srcs:
                chain = (srcs[0].path, "...", made[1].replace("::", "."))
                out.append(Found(site, srcs, chain, False, None))
    return out


def trace(
    writer: Call, sources: dict[int, Source]
) -> tuple[tuple[Source, ...], tuple[str, ...], bool]:
    """The sources `writer`'s result was computed from, the op chain from the first of
    them, and whether a value left torch on the way (a handle)."""
    found: dict[int, Source] = {}
    first: str | None = None
    for a in writer.reads():  # most read only sources, or what no call wrote: one step
        src = sources.get(a.sid)
        if src is None:
            if a.writer is not None:
                break  # written by a call: followed below
        else:
            if first is None:
                first = src.path
            found.setdefault(src.sid, src)
    else:
        return (tuple(found.values()), () if first is None else (first, writer.name),
                writer.opaque)
    found = {}
    opaque = False
    chains: dict[int, tuple[str, ...] | None] = {}

    def visit(call: Call) -> tuple[str, ...] | None:
        nonlocal opaque
        key = id(call)
        if key in chains:
            return chains[key]
        chains[key] = None  # a cycle cannot happen (writers precede readers); be safe
        opaque = opaque or call.opaque
        best: tuple[str, ...] | None = None
        for a in call.reads():
            src = sources.get(a.sid)
            if src is not None:
                found.setdefault(src.sid, src)  # a staging copy: the same path again
                sub: tuple[str, ...] | None = (src.path,)
            elif a.writer is not None:
                sub = visit(a.writer)
            else:
                sub = None
            if sub is not None and best is None:
                best = sub
        chain = None if best is None else (*best, call.name)
        chains[key] = chain
        return chain

    chain = visit(writer) or ()
    if len(chain) > 2 * _CHAIN + 1:
        chain = (*chain[:_CHAIN], "...", *chain[-_CHAIN:])
    return tuple(found.values()), chain, opaque  # a staging copy's too: replays read it


def find(
    lineage: Lineage, sites: Iterable[Site], sources: dict[int, Source], among: set[int]
) -> list[Found]:
    """The tensors held at `sites` (a walk of the model) whose storage is one of `among`
    (written in the recording) and whose writers reach a source; one per storage, at its
    first path."""
    out: list[Found] = []
    sites = list(sites)
    native = _native.get()
    traced = None if native is None else native.traced_sites(
        sites, among, sources, lineage.writers, Arg)
    if traced is None:  # the same, one site at a time
        writers = lineage.writers
        traced = [(i, sid, writers[sid], None) for i, sid in _written_sites(sites, among, sources)]
    for i, _, writer, srcs in traced:
        call = writer[0]
        if srcs is None:  # the first step did not decide: followed
            srcs, chain, opaque = trace(call, sources)
        else:  # decided in one step, as `trace` decides it
            chain = (srcs[0].path, call.name) if srcs else ()
            opaque = call.opaque
        if srcs:
            out.append(_new(Found, (sites[i], srcs, chain, opaque, writer)))
    return out


def _written_sites(sites: list[Site], among: Set[int], skip: dict[int, Any]
                   ) -> list[tuple[int, int]]:
    """The index and storage identity of each site whose storage is one of `among` and no
    key of `skip`, at its storage's first site only: one compiled call where the compiled
    checks are built (`written_sites`, held to this loop by a property test)."""
    native = _native.get()
    if native is not None:
        found = native.written_sites(sites, among, skip)
        if found is not None:
            return found
    out = []
    taken: set[int] = set()
    for i, sid in enumerate(_sids([site.tensor for site in sites])):
        if sid in among and sid not in taken and sid not in skip:
            taken.add(sid)
            out.append((i, sid))
    return out


class Rewrite(NamedTuple):
    """A weight (`weight`) the recording saw rewritten in place after it was loaded, by
    ops over the model's state (`ops`, in order: a scale folded in, `1 + w`, a layout
    interleaved or prepacked): it holds derived state, computed from `sources` (itself
    among them) by `chain`."""

    weight: Source
    ops: tuple[str, ...]
    sources: tuple[Source, ...]
    chain: tuple[str, ...]
    rebound: bool = False
    """Rewritten by binding a new tensor computed from the loaded one at its path (vLLM's
    `replace_parameter` of a prepacked copy), not by writing it in place."""


def made_sources(lineage: Lineage, model: nn.Module, sources: dict[int, Source],
                 foreign: dict[int, Source], alive: Set[int],
                 weights: frozenset[int] | None, declared: Set[str]) -> list[int]:
    """The sources (by storage identity) that are derived state, not weights: the
    buffers no load fills (`persistent=False`) and no declaration makes (`declared`: the
    declared outputs' paths), and the parameters the recorded load created (not weights
    when it began, `weights`; not bound in place of one: a rewrite), that the recording
    computed from the weights (a packed copy the post-load step registered as a buffer or
    a new parameter, or wrote into a buffer). `alive`: the written storages alive now."""
    written = [sid for sid in sources if sid in alive]  # a loaded weight is not
    if not written:
        return []
    tables: dict[int, tuple[str, nn.Module]] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        tables.setdefault(id(m._buffers), (prefix, m))
        tables.setdefault(id(m._parameters), (prefix, m))
    made = []
    for sid in written:
        src = sources[sid]
        prefix, m = tables.get(id(src.holder), ("", None))
        if m is None:
            continue
        if src.holder is m._buffers:
            if (src.key in m._non_persistent_buffers_set
                    and (f"{prefix}.{src.key}" if prefix else src.key) not in declared):
                made.append(sid)
        elif (weights is not None and sid not in lineage.replaced
                and isinstance(p := src.holder.get(src.key), torch.Tensor)
                and storage_key(p) not in weights):
            made.append(sid)
    if not made:
        return []
    rest = {**foreign, **{k: v for k, v in sources.items() if k not in made}}
    return [sid for sid in made if trace(lineage.writers[sid][0], rest)[0]]


def find_rewrites(lineage: Lineage, sources: dict[int, Source],
                  derived: frozenset[int] = frozenset()) -> list[Rewrite]:
    """The weights whose last writes in the recording, after the last time they were
    loaded, are ops over the model's state (not a copy of loaded values); `derived`: the
    storage identities of declared derived buffers, never weights. A `copy_` of values
    computed from the weights is named `DERIVED_COPY`: the write trackers tell it from a
    load the same way."""
    weights: dict[int, Source] | None = None  # made for the first weight written after its load
    out = []
    for sid, writes in lineage.weight_writes.items():
        if writes[-1][2] is None:
            continue  # last written by a load (most): nothing after it
        weight = sources.get(sid)
        if weight is None or sid in derived:
            continue
        if weights is None:
            weights = {sid: s for sid, s in sources.items() if sid not in derived}
        named = [_written_as(op, call, weights) for op, _, call in writes]
        after = len(named)
        while after and named[after - 1] is not None:
            after -= 1
        ops = tuple(op for op in named[after:] if op is not None)
        last = lineage.writers.get(sid)
        if not ops or last is None:
            continue
        srcs, chain, _ = trace(last[0], sources)
        if srcs:  # over the model's state: derived from the weight as it was loaded
            out.append(Rewrite(weight, ops, srcs, chain))
    return out + _rebound(lineage, sources, derived)


def _rebound(lineage: Lineage, sources: dict[int, Source],
             derived: frozenset[int]) -> list[Rewrite]:
    """The weights the recording bound in place of a parameter (`Lineage.replaced`) to a
    tensor it computed from that parameter (a prepacked copy put in the loaded weight's
    place, the loader kept: vLLM's `replace_parameter`): a later load writes its values
    raw into the packed layout."""
    out: list[Rewrite] = []
    if not lineage.replaced:  # most: no parameter was bound in place of another
        return out
    for sid, weight in sources.items():
        old = lineage.replaced.get(sid)
        last = lineage.writers.get(sid)
        if old is None or last is None or sid in derived:
            continue
        loaded: dict[int, Source] = {}
        while old is not None and old not in loaded:  # replaced again: padded, then packed
            loaded[old] = Source(f"{weight.path} as loaded", {}, "", old)
            old = lineage.replaced.get(old)
        srcs, chain, _ = trace(last[0], {**sources, **loaded})
        if any(s.sid in loaded for s in srcs) and not _same_values(last[0], loaded, weight):
            ops = chain[1:] or ("a copy",)
            mine = tuple(s for s in srcs if s.sid not in loaded)
            out.append(Rewrite(weight, tuple(ops), (weight, *mine), (chain[0], *ops),
                               rebound=True))
    return out


_COPIES = frozenset({"aten.clone", "aten._to_copy", "aten.contiguous", "aten.to"})
"""Ops whose result holds their argument's values (cast, or laid out anew)."""


def _same_values(call: Call, loaded: Container[int], weight: Source) -> bool:
    """Whether `call` made the tensor bound at `weight` as a copy of the loaded values in
    their own order (`p.data = p.data.to(torch.bfloat16)`, `.contiguous()`): a later load
    that copies loaded values into it writes what re-binding the copy would, so it is no
    rewrite. A copy of a view that reorders them (`p.data.t().contiguous()`) is one."""
    if call.name not in _COPIES or not call.args:
        return False
    arg, out = call.args[0], call.outs.get(0)
    now = weight.holder.get(weight.key)
    if not isinstance(arg, Arg) or arg.sid not in loaded or out is None or not isinstance(
            now, torch.Tensor):
        return False
    with PLAIN():
        geometry = (tuple(now.shape), tuple(now.stride()), int(now.storage_offset()))
    return (arg.offset == 0 and arg.stride == _row_major(arg.size) and arg.size == geometry[0]
            and (out.size, out.stride, out.offset) == geometry)


def _row_major(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _written_as(op: str, call: Call | None, weights: dict[int, Source]) -> str | None:
    """How a write into a weight is named to the trackers' order, or None for a load: a
    copy of loaded values, or of values computed from no weight (a dequantized entry)."""
    if call is None:
        return None
    if op == "aten::copy_":
        return DERIVED_COPY if _reaches(call, weights) else None
    return op


def _reaches(call: Call, sources: Container[int]) -> bool:
    """Whether `call` read one of `sources`, or something computed from one (`trace`'s
    sources, not empty: without building the chain)."""
    todo, seen = [call], {id(call)}
    while todo:
        for a in todo.pop().reads():
            if a.sid in sources:
                return True
            w = a.writer
            if w is not None and id(w) not in seen:
                seen.add(id(w))
                todo.append(w)
    return False


def atoms_of(model: nn.Module) -> Callable[[], dict[str, object]]:
    """How to read where `model` keeps `bool`s, small `int`s and floats, by path (for
    `Lineage.note_places`; the model is held weakly)."""
    ref = weakref.ref(model)

    def read() -> dict[str, object]:
        now = ref()
        return {} if now is None else {s.path: s.value for s in walk_values(now, _atom)}

    return read


def find_values(
    lineage: Lineage, model: nn.Module, sources: dict[int, Source],
    held: Sequence[ValueSite] | None = None,
) -> list[Found]:
    """The values that left torch in the recording (`Lineage.values`) that `model` keeps
    where the walk reaches, computed from its sources: by identity; a `bool` or small
    `int` only at a place the recording set (it held another value, or none, before).
    `held`: the values a walk of `model` just found, these among them (None: walked for
    them)."""
    values = lineage.values
    if not values:
        return []
    before = lineage.before
    out: list[Found] = []
    for site in _held(model, lambda v: id(v) in values, held):
        made = values[id(site.value)]
        if ambiguous(site.value):
            if before is None:
                continue  # nothing tells this occurrence from one set elsewhere
            was = before.get(site.path, NOTHING)
            if type(was) is type(site.value) and was == site.value:
                continue  # held so before the recording made it
        found: dict[int, Source] = {}
        chain: tuple[str, ...] = ()
        opaque = False
        for call, _ in made:  # equal small values from several calls: every source
            srcs, how, dark = trace(call, sources)
            for src in srcs:
                found.setdefault(src.sid, src)
            chain = chain or how
            opaque = opaque or dark
        if found:
            out.append(Found(site, tuple(found.values()), chain, opaque, (made[-1][0], None)))
    return out


NOTHING = object()


def _atom(value: object) -> bool:
    return ambiguous(value) or type(value) is float


def untraced_numbers(
    lineage: Lineage, model: nn.Module, sources: dict[int, Source], found: Container[str],
    held: Sequence[ValueSite] | None = None,
) -> list[Found]:
    """Floats the model keeps at places the recording set (`Lineage.before`), none of
    them a number it took or one found at `found`, when it took numbers from the weights:
    computed in Python from them (`1.0 / s.item()`), which no recording follows. Each is
    found with the weights numbers were taken from as its sources, its ops not known
    (its chain ends with `COMPUTED`). `held`: as `find_values`'."""
    before = lineage.before
    if before is None:
        return []
    taken: dict[str, Source] = {}
    for made in lineage.values.values():
        for call, value in made:
            if type(value) in (bool, int, float):
                taken.update((s.path, s) for s in trace(call, sources)[0])
    if not taken:
        return []
    values = lineage.values
    srcs = tuple(taken.values())
    chain = (srcs[0].path, "...", COMPUTED)
    return [
        Found(site, srcs, chain, False, None)
        for site in _held(model, lambda v: type(v) is float, held)
        if site.path not in found and id(site.value) not in values
        and before.get(site.path, NOTHING) is not site.value
    ]


COMPUTED = "computed in Python"
"""The last step of the chain of a number the bring-up computed in Python from numbers it
took from the weights (`untraced_numbers`): its arithmetic is not followed."""


def _held(model: nn.Module, wanted: Callable[[Any], bool],
          held: Sequence[ValueSite] | None) -> Iterable[ValueSite]:
    """The places `model` keeps a value `wanted` asks for: among `held` (a walk's, which
    asked for them and more), or walked for (None)."""
    if held is None:
        return walk_values(model, wanted)
    return [s for s in held if wanted(s.value)]


def recompute_scalar(call: Call, sources: Iterable[Source]) -> torch.Tensor | None:
    """The number `call` (`.item()`, `float()`, `int()` or `bool()` of a tensor) took, from
    the sources as they are now, as a 0-d tensor (None: its tensor cannot be recomputed)."""
    args = arguments_now(call, sources)
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    with torch.no_grad(), PLAIN():
        return torch.tensor(call.func(args[0]))


class _Unreplayable(Exception):
    """The chain cannot be run again (a handle, a constant gone, a layout that moved)."""


def recompute(
    writer: tuple[Call, Arg], held: torch.Tensor, sources: Iterable[Source]
) -> torch.Tensor | None:
    """Run the recorded chain again over the sources as they are now, out of place
    (nothing the model holds is written), and return the result viewed as `held` is, or
    None when it cannot be run again: it went through a handle (an op whose result left
    torch), a constant it read is gone, or a result's layout differs from the recording's.
    """
    by_sid = {s.sid: s for s in sources}
    memo: dict[int, dict[int, torch.Tensor]] = {}
    try:
        with torch.no_grad(), PLAIN():
            base = _run(writer[0], by_sid, memo)[writer[1].sid]
            return _view(base, _geometry(held), held.dtype)
    except (_Unreplayable, RuntimeError, TypeError, ValueError, IndexError):
        return None


def arguments_now(call: Call, sources: Iterable[Source]) -> list[Any] | None:
    """The arguments of `call` (an op that made a handle) with each tensor recomputed
    from the sources as they are now, out of place; None if one cannot be."""
    by_sid = {s.sid: s for s in sources}
    memo: dict[int, dict[int, torch.Tensor]] = {}

    def value(a: Any) -> Any:
        if isinstance(a, Arg):
            return _arg_value(a, by_sid, memo)
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return a

    try:
        with torch.no_grad(), PLAIN():
            return [value(a) for a in call.args]
    except (_Unreplayable, RuntimeError, TypeError, ValueError, IndexError):
        return None


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


def _view(
    base: torch.Tensor, geometry: tuple[tuple[int, ...], tuple[int, ...], int],
    dtype: torch.dtype,
) -> torch.Tensor:
    if base.dtype != dtype:
        raise _Unreplayable("a view of another dtype")
    size, stride, offset = geometry
    return base.as_strided(size, stride, offset)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing a copy of `t`'s whole storage as `t` views it (so that an op that
    writes it writes no storage the model or another replayed value holds)."""
    storage = t.untyped_storage().clone()  # type: ignore[no-untyped-call]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.shape, t.stride()
    )


def _run(
    call: Call, sources: dict[int, Source], memo: dict[int, dict[int, torch.Tensor]]
) -> dict[int, torch.Tensor]:
    """Run `call` again; return each storage it wrote -> a tensor over its new value."""
    done = memo.get(id(call))
    if done is not None:
        return done
    if call.opaque:
        raise _Unreplayable(f"{call.name} returned a value that left torch")

    def value(a: Any) -> Any:
        if isinstance(a, Arg):
            return _arg_value(a, sources, memo)
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return a

    args = [value(a) for a in call.args]
    kwargs = {k: value(v) for k, v in call.kwargs.items()}
    written: dict[int, torch.Tensor] = {}
    for where in call.mutated:  # a position, or a keyword (`out=`)
        if isinstance(where, int):
            args[where] = _own(args[where])
            written[call.args[where].sid] = args[where]
        else:
            kwargs[where] = _own(kwargs[where])
            written[call.kwargs[where].sid] = kwargs[where]
    out = call.func(*args, **kwargs)
    results = out if isinstance(out, (list, tuple)) else (out,)
    for i, arg in call.outs.items():
        r = results[i]
        if not isinstance(r, torch.Tensor) or _geometry(r) != (arg.size, arg.stride, arg.offset):
            raise _Unreplayable(f"{call.name} gave a result of another layout")
        written[arg.sid] = r
    memo[id(call)] = written
    return written


def _arg_value(
    a: Arg, sources: dict[int, Source], memo: dict[int, dict[int, torch.Tensor]]
) -> torch.Tensor:
    geometry = (a.size, a.stride, a.offset)
    src = sources.get(a.sid)
    if src is not None:
        now = src.holder.get(src.key)
        if not isinstance(now, torch.Tensor):
            raise _Unreplayable(f"the source {src.path} is gone")
        return _view(now, geometry, a.dtype)
    if a.writer is not None:
        return _view(_run(a.writer, sources, memo)[a.sid], geometry, a.dtype)
    if a.keep is None or a.keep.expired():  # type: ignore[no-untyped-call]
        raise _Unreplayable("a constant it read is gone")
    storage = torch.UntypedStorage._new_with_weak_ptr(a.keep.cdata)
    return torch.empty(0, dtype=a.dtype, device=storage.device).set_(
        storage, a.offset, a.size, a.stride)


Recompute = Callable[[], "torch.Tensor | None"]
