"""The compiled walk (`walk.cpp`) finds what the Python walk finds, in the same order; and
the model map's compiled passes over its sites, its modules' dicts and the objects on the
way (`map_sites`, `map_modules`, `map_refs`) record what its Python loops record; and the
compiled reading of every parameter and buffer by storage (`table_sources`) finds what
`sources_of`'s loop finds (and `staged_sources`, the staging copies a load copied whole
into them, what its comprehension makes), and the compiled filter of the sites a recording wrote
(`written_sites`) keeps what `find`'s loop keeps; with each site's sources where one step
decides them (`traced_sites`), `find` finds what its Python loop finds.

Every place graphsafe looks for tensors walks the model (`graphsafe._memory.walk`); where
the compiled checks are built, the walk runs in one C++ call. Discovery, the model map
and the guard read its sites, refs and values by position (`via`, `chain`), so the
property is exact equality with the Python walk, object for object, on any object graph:
lists, tuples and dicts at any depth, functions with cells, defaults, keyword defaults
and attributes, partials, bound methods, plain and slotted objects, modules outside the
tree, parameters with attributes, back-references to the model, shared objects and
cycles, and values asked for by `wanted`. The model map reads the walk's sites
(parameters, persistent and non-persistent buffers, empty and meta tensors, tensors held
through objects and through a parameter's own attributes) into the rows its every-load
check compares: the same rows, on both paths.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from graphsafe import _native
from graphsafe._lineage import resolve as resolve_module
from graphsafe._lineage.record.native import record_lineage
from graphsafe._lineage.record.recorder import sid_of
from graphsafe._lineage.resolve import sources_of
from graphsafe._memory import walk as walk_module
from graphsafe._memory.walk import Attr, Reach, Wanted, walk, walk_tensors
from graphsafe._runtime.bind import model_map as model_map_module
from graphsafe._runtime.bind.model_map import ModelMap

pytestmark = pytest.mark.usefixtures("compiled_checks")


class _Plain:
    """An object with a `__dict__`, and a property the walk must never call."""

    @property
    def boom(self) -> Any:
        raise AssertionError("the walk called a property")


class _Slotted:
    __slots__ = ("__hidden", "a", "b")

    def __init__(self, a: Any, b: Any) -> None:
        self.a = a
        self.b = b
        self.__hidden = a


class _Kernel:
    def run(self) -> None:
        return None


# A recipe: what to build, drawn by hypothesis; built into real objects by `_build`.
_LEAVES = st.one_of(
    st.tuples(st.just("tensor"), st.sampled_from([
        "plain", "param", "param_attr", "attr", "view", "transposed", "empty", "param_view",
        "param_transposed"])),
    st.tuples(st.just("atom"), st.one_of(st.integers(-3, 3), st.floats(allow_nan=False),
                                         st.text(max_size=2), st.none(), st.booleans())),
    st.tuples(st.just("model")),
    st.tuples(st.just("tree")),
    st.tuples(st.just("shared"), st.integers(0, 20)),
    st.tuples(st.just("stop")),
)
_KEYS = st.one_of(st.text(min_size=1, max_size=3), st.integers(0, 3))


def _nodes(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    some = st.lists(children, max_size=4)
    return st.one_of(
        st.tuples(st.just("list"), some, st.booleans()),
        st.tuples(st.just("tuple"), some),
        st.tuples(st.just("dict"), st.lists(st.tuples(_KEYS, children), max_size=4)),
        st.tuples(st.just("fn"), some, some, some, some),
        st.tuples(st.just("partial"), some, some),
        st.tuples(st.just("obj"), some),
        st.tuples(st.just("slots"), children, children),
        st.tuples(st.just("method"), some),
        st.tuples(st.just("module"), some),
    )


_RECIPES = st.recursive(_LEAVES, _nodes, max_leaves=25)


def _build(recipe: Any, model: nn.Module, pool: list[Any]) -> Any:
    kind = recipe[0]
    if kind == "tensor":
        # Views too, held and registered: a pointer past its storage's start, strides of
        # other shapes (rows of one stride share its tuple), no bytes.
        made = {"view": lambda: torch.randn(3, 4)[1:], "transposed": lambda: torch.randn(3, 4).t(),
                "empty": lambda: torch.empty(0)}
        t = made.get(recipe[1].removeprefix("param_"), lambda: torch.randn(2))()
        if recipe[1].startswith("param"):
            t = nn.Parameter(t, requires_grad=False)
        if recipe[1].endswith("attr"):
            t.packed = torch.ones(1)  # type: ignore[attr-defined]
            t.scale = 0.5  # type: ignore[attr-defined]
        built: Any = t
    elif kind == "atom":
        return recipe[1]
    elif kind == "model":
        return model
    elif kind == "tree":
        return model.sub
    elif kind == "shared":
        return pool[recipe[1] % len(pool)] if pool else None
    elif kind == "stop":
        return logging.getLogger("graphsafe.test.walk")
    else:
        built = _container(recipe, model, pool)
    pool.append(built)
    return built


def _container(recipe: Any, model: nn.Module, pool: list[Any]) -> Any:
    kind, *parts = recipe

    def each(items: list[Any]) -> list[Any]:
        return [_build(r, model, pool) for r in items]

    if kind == "list":
        out = each(parts[0])
        if parts[1]:
            out.append(out)  # a cycle
        return out
    if kind == "tuple":
        return tuple(each(parts[0]))
    if kind == "dict":
        return {k: _build(r, model, pool) for k, r in parts[0]}
    if kind == "fn":
        cells, defaults, kwdefaults, attrs = (each(p) for p in parts)

        def fn(*args: Any) -> Any:
            return cells

        fn.__defaults__ = tuple(defaults) or None
        fn.__kwdefaults__ = {f"k{i}": v for i, v in enumerate(kwdefaults)} or None
        for i, v in enumerate(attrs):
            setattr(fn, f"a{i}", v)
        return fn
    if kind == "partial":
        args, kwargs = each(parts[0]), each(parts[1])
        return functools.partial(torch.add, *args, **{f"k{i}": v for i, v in enumerate(kwargs)})
    if kind == "obj":
        obj = _Plain()
        for i, v in enumerate(each(parts[0])):
            setattr(obj, f"a{i}", v)
        return obj
    if kind == "slots":
        return _Slotted(_build(parts[0], model, pool), _build(parts[1], model, pool))
    if kind == "method":
        kernel = _Kernel()
        for i, v in enumerate(each(parts[0])):
            setattr(kernel, f"a{i}", v)
        return kernel.run
    outside = nn.Linear(1, 1)  # a module kept outside the tree (a draft in a list)
    for i, v in enumerate(each(parts[0])):
        setattr(outside, f"a{i}", v)
    return outside


def _model(recipes: list[Any]) -> nn.Module:
    model = nn.Module()
    model.sub = nn.Linear(2, 2)
    model.blocks = nn.ModuleList([nn.Linear(1, 1), model.sub])  # a shared module
    pool: list[Any] = []
    holders = [model, model.sub, model.blocks[0]]
    for i, recipe in enumerate(recipes):
        value = _build(recipe, model, pool)
        holder = holders[i % len(holders)]
        holder.__dict__[f"x{i}"] = value  # as an engine sets a plain attribute
    model.sub.weight.kernel = pool[0] if pool else None  # a parameter's own attribute
    model.sub.register_buffer("running", torch.zeros(2), persistent=False)
    model.register_buffer("empty", torch.zeros(0))
    model.blocks[0].register_parameter(  # released: on the meta device
        "meta_w", nn.Parameter(torch.empty(2, device="meta"), requires_grad=False))
    model.blocks[0].register_buffer("absent", None)
    return model


def _walked(model: nn.Module, compiled: bool, wanted: Callable[[Any], bool] | None
            ) -> tuple[Reach, list[Any]]:
    with _native.using(compiled):
        return walk(model, wanted), walk_tensors_list(model)


def walk_tensors_list(model: nn.Module) -> list[Any]:
    return list(walk_tensors(model))


def _steps(chain: tuple[Any, ...]) -> list[tuple[type, Any]]:
    """A chain with each step's type: `Attr("a")` and `Slot("a")` are equal tuples."""
    return [(type(k), tuple(k) if isinstance(k, tuple) else k) for k in chain]


def _rows(records: list[Any], last: str) -> list[tuple[Any, ...]]:
    """Each record, its objects by identity and its steps with their types."""
    return [(type(r), r.path, id(r.module), id(r.container), type(r.key), r.key,
             _steps(r.chain), id(getattr(r, last)), getattr(r, "via", None)) for r in records]


def _same(a: tuple[Reach, list[Any]], b: tuple[Reach, list[Any]]) -> None:
    (ra, ta), (rb, tb) = a, b
    assert _rows(ra.sites, "tensor") == _rows(rb.sites, "tensor")
    assert _rows(ra.refs, "obj") == _rows(rb.refs, "obj")
    assert (ra.values is None) == (rb.values is None)
    assert _rows(ra.values or [], "value") == _rows(rb.values or [], "value")
    assert list(map(id, ra.modules or [])) == list(map(id, rb.modules or []))
    assert _rows(ta, "tensor") == _rows(tb, "tensor")


_WANTED: dict[str, Callable[[Any], bool] | None] = {
    "none": None,
    "floats": lambda v: type(v) is float,
    "everything": lambda v: True,
}


@settings(max_examples=150, deadline=None)
@given(recipes=st.lists(_RECIPES, min_size=1, max_size=5),
       wanted=st.sampled_from(sorted(_WANTED)))
def test_the_compiled_walk_finds_what_the_python_walk_finds(recipes: list[Any],
                                                             wanted: str) -> None:
    model = _model(recipes)
    _same(_walked(model, True, _WANTED[wanted]), _walked(model, False, _WANTED[wanted]))


@settings(max_examples=60, deadline=None)
@given(recipes=st.lists(_RECIPES, min_size=1, max_size=5))
def test_a_wanted_by_kind_is_decided_as_it_is_called(recipes: list[Any]) -> None:
    """A `Wanted` (numbers, and what the recording saw leave torch, by id: what a
    recorded load's end asks for) is decided in the compiled walk without calling it:
    the same values as the Python walk, which calls it."""
    model = _model(recipes)
    wanted = Wanted(frozenset({float, bool}),
                    {id(v): None for k, v in vars(model).items() if k.startswith("x")})
    _same(_walked(model, True, wanted), _walked(model, False, wanted))


def test_the_compiled_walk_on_a_loaded_engine_style_model() -> None:
    """Thousands of kernel closures (a packed copy in each default), a parameter's own
    attributes, a back-reference and a logger: the same sites, refs and values."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])
    for layer in model:
        packed = layer.weight.detach().t().contiguous()
        layer.kernel = lambda packed=packed: packed
        layer.weight.scale = 0.5
    model.owner = {"model": model, "log": logging.getLogger("x")}
    model.cache = [torch.zeros(1)] * 3
    wanted = _WANTED["floats"]
    a, b = _walked(model, True, wanted), _walked(model, False, wanted)
    _same(a, b)
    assert len(a[0].sites) == 50 * 3 + 3 and a[0].values


def test_control_a_walk_that_skips_a_functions_attributes_is_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison above catches a walk that differs in one step: the Python walk
    made to skip a function's attributes (what the compiled one enters itself)."""
    real = walk_module._function_children
    monkeypatch.setattr(walk_module, "_function_children",
                        lambda fn: [(k, v) for k, v in real(fn) if type(k) is not Attr])
    model = _model([("fn", [], [], [], [("tensor", "plain")])])
    with pytest.raises(AssertionError):
        _same(_walked(model, True, None), _walked(model, False, None))


def test_control_a_walk_that_renumbers_no_ref_is_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """And one that keeps every ref (no `_needed`): an empty dict on the way holds no
    tensor, so the refs after it are renumbered, and the sites' `via` with them."""
    monkeypatch.setattr(walk_module._Walker, "_needed", lambda self: self.refs)
    model = _model([("list", [("dict", []), ("tensor", "plain")], False)])
    with pytest.raises(AssertionError):
        _same(_walked(model, True, None), _walked(model, False, None))


def _map_rows(model: nn.Module, compiled: bool) -> dict[str, Any]:
    """What a model map records of `model`, each object by identity, each step with its
    type."""
    with _native.using(compiled):
        found = ModelMap(model)
    rows = found.rows
    return {
        "keys": list(found.keys.items()), "by_path": list(found.by_path.items()),
        "weights": found.weights, "weight_keys": found.weight_keys,
        "table_keys": found.table_keys, "key_set": found.key_set,
        "rows": (list(map(id, rows.holders)), rows.keys, rows.ids, rows.ptrs, rows.strides,
                 rows.n_strided),
        "nested": [(i, type(k), k, _steps(chain), t, ptr, via)
                   for i, k, chain, t, ptr, via in found._nested],
        "tables": (found._tables, found._table_ids),
        "entries": (found._holders, [(type(k), k) for k in found._names], found._ids),
        "refs": [(i, type(k), k, _steps(chain), obj, via)
                 for i, k, chain, obj, via in found._refs],
        "sizes": found._lens,
    }


@settings(max_examples=100, deadline=None)
@given(recipes=st.lists(_RECIPES, min_size=1, max_size=5))
def test_the_compiled_map_records_what_the_python_map_records(recipes: list[Any]) -> None:
    model = _model(recipes)
    assert _map_rows(model, True) == _map_rows(model, False)


class _Altered:
    """The compiled module with some of its functions replaced (`parts`: name -> the
    replacement, given the compiled function), for a control: `_native.get` returns it."""

    def __init__(self, parts: dict[str, Callable[..., Any]]) -> None:
        with _native.using(True):
            native = _native.get()
        assert native is not None
        self._native = native
        self._parts = {name: functools.partial(part, getattr(native, name))
                       for name, part in parts.items()}

    def __getattr__(self, name: str) -> Any:
        found = self.__dict__["_parts"].get(name)
        return found if found is not None else getattr(self.__dict__["_native"], name)

    def __call__(self) -> _Altered:
        return self


def test_control_a_map_that_drops_a_weight_is_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison above catches a compiled pass that differs in one row: its last
    weight dropped (a weight no load is then expected to write)."""

    def dropping(map_sites: Callable[..., Any], *args: Any) -> Any:
        found = map_sites(*args)
        assert found is not None and found[2]
        found[2].pop()
        return found

    model = _model([("tensor", "plain")])
    honest = _map_rows(model, True)
    monkeypatch.setattr(model_map_module._native, "get", _Altered({"map_sites": dropping}))
    with pytest.raises(AssertionError):
        assert _map_rows(model, True) == honest


def _short_one(map_modules: Callable[..., Any], *args: Any) -> Any:
    found = map_modules(*args)
    for column in found[3:6]:  # the last entry's holder, key and id
        column.pop()
    return found


def _one_more(map_refs: Callable[..., Any], *args: Any) -> Any:
    rows, sizes = map_refs(*args)
    sizes[-1] += 1
    return rows, sizes


@pytest.mark.parametrize("part", ["map_modules", "map_refs"])
def test_control_a_map_that_misses_an_attribute_or_a_size_is_told_apart(
    part: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison above catches a compiled pass over the module dicts that drops one
    attribute (a module's attribute rebound later would go unseen), and one over the
    objects on the way that miscounts one (a list grown later would go unseen)."""
    model = _model([("list", [("tensor", "plain")], False)])
    honest = _map_rows(model, True)
    wrong = _short_one if part == "map_modules" else _one_more
    monkeypatch.setattr(model_map_module._native, "get", _Altered({part: wrong}))
    with pytest.raises(AssertionError):
        assert _map_rows(model, True) == honest


def _sources(model: nn.Module, compiled: bool) -> list[tuple[Any, ...]]:
    """What `sources_of` finds, each table by identity, in its order."""
    with _native.using(compiled):
        found = sources_of(model)
    return [(sid, type(src), src.path, id(src.holder), src.key, src.sid)
            for sid, src in found.items()]


@settings(max_examples=100, deadline=None)
@given(recipes=st.lists(_RECIPES, min_size=1, max_size=5))
def test_the_compiled_sources_are_the_python_sources(recipes: list[Any]) -> None:
    """Every parameter and buffer by storage, first path first (a shared module's at its
    first binding, one storage under two names once), meta tensors left out."""
    model = _model(recipes)
    model.tied = nn.Linear(2, 2)
    model.tied.weight = model.sub.weight  # one storage, two paths
    model.blocks.append(model.sub)  # a shared module at a third path
    assert _sources(model, True) == _sources(model, False)


def test_control_sources_that_drop_one_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    def dropping(table_sources: Callable[..., Any], *args: Any) -> Any:
        found = table_sources(*args)
        found.pop(next(iter(found)))
        return found

    model = _model([("tensor", "plain")])
    honest = _sources(model, True)
    monkeypatch.setattr(resolve_module._native, "get", _Altered({"table_sources": dropping}))
    with pytest.raises(AssertionError):
        assert _sources(model, True) == honest


def _staged(copied: dict[int, int], sources: dict[int, Any], foreign: dict[int, Any],
            compiled: bool) -> list[tuple[Any, ...]]:
    """What `staged_sources` makes, each holder by identity, in its order."""
    with _native.using(compiled):
        made = resolve_module.staged_sources(copied, sources, foreign)
    return [(sid, type(src), src.path, id(src.holder), src.key, src.sid)
            for sid, src in made.items()]


_SIDS = st.integers(min_value=1, max_value=12)


@settings(max_examples=200, deadline=None)
@given(copied=st.dictionaries(_SIDS, _SIDS), own=st.sets(_SIDS), foreign=st.sets(_SIDS))
def test_the_compiled_staged_sources_are_the_python_ones(
    copied: dict[int, int], own: set[int], foreign: set[int],
) -> None:
    """Each staging copy of a weight (`copied`: staged -> weight) stands for its weight, at
    the weight's place, in `copied`'s order; not one whose weight is no source, nor one
    that is a source itself (its own model's or another's), nor a copy of itself."""
    tables = [{"w": torch.zeros(1)}, {"b": torch.zeros(1)}]
    sources = {sid: resolve_module.Source(f"m{sid}.w", tables[sid % 2], "w", sid)
               for sid in own}
    others = {sid: resolve_module.Source(f"other.m{sid}.w", tables[0], "w", sid)
              for sid in foreign}
    assert _staged(copied, sources, others, True) == _staged(copied, sources, others, False)


def test_control_staged_sources_that_ignore_another_models_weights_are_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison above catches a compiled pass that forgets `foreign`: a draft's
    weight copied whole from its target's would be taken for the target's staging copy."""

    def forgetting(staged_sources: Callable[..., Any], copied: Any, sources: Any,
                   foreign: Any, source: Any) -> Any:
        return staged_sources(copied, sources, {}, source)

    table = {"w": torch.zeros(1)}
    sources = {1: resolve_module.Source("w", table, "w", 1)}
    foreign = {2: resolve_module.Source("other.w", table, "w", 2)}
    honest = _staged({2: 1}, sources, foreign, True)
    assert honest == [] == _staged({2: 1}, sources, foreign, False)
    monkeypatch.setattr(resolve_module._native, "get", _Altered({"staged_sources": forgetting}))
    assert _staged({2: 1}, sources, foreign, True) != honest


@settings(max_examples=100, deadline=None)
@given(recipes=st.lists(_RECIPES, min_size=1, max_size=5), picks=st.data())
def test_the_compiled_filter_of_written_sites_is_the_python_one(
    recipes: list[Any], picks: st.DataObject,
) -> None:
    """`find`'s filter of a walk's sites: those whose storage was written (`among`) and is
    no source (`skip`), each storage at its first site (a tensor held twice, a view of a
    weight), in order."""
    model = _model(recipes)
    model.again = [model.sub.weight, model.sub.weight[:1]]  # one storage at three sites
    sites = walk(model).sites
    sids = sorted({sid_of(site.tensor) for site in sites})
    among = set(picks.draw(st.lists(st.sampled_from(sids), unique=True)))
    skip = dict.fromkeys(picks.draw(st.lists(st.sampled_from(sids), unique=True)))
    with _native.using(True):
        compiled = resolve_module._written_sites(sites, among, skip)
    with _native.using(False):
        python = resolve_module._written_sites(sites, among, skip)
    assert compiled == python


def test_control_a_filter_that_keeps_a_source_is_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison above catches a compiled filter that ignores `skip`: a weight the
    recording wrote would be taken for a tensor derived from the weights."""

    def keeping(written_sites: Callable[..., Any], sites: Any, among: Any, skip: Any) -> Any:
        return written_sites(sites, among, {})

    sites = walk(_model([("tensor", "plain")])).sites
    sids = {sid_of(site.tensor) for site in sites}
    honest = resolve_module._written_sites(sites, sids, dict.fromkeys(sids))
    assert honest == []
    monkeypatch.setattr(resolve_module._native, "get", _Altered({"written_sites": keeping}))
    assert resolve_module._written_sites(sites, sids, dict.fromkeys(sids)) != honest


def _mutate(model: nn.Module, how: str, pick: int) -> None:
    """One change to what the model keeps off its tables: an object on the way grown or
    replaced, or a tensor held through one rebound to other memory."""
    reach = walk(model)
    if how == "rebind":
        held = [s for s in reach.sites if s.chain and type(s.tensor) is torch.Tensor]
        if held:
            t = held[pick % len(held)].tensor
            t.data = torch.randn(t.shape)  # other memory, the same object
        return
    objs = [r.obj for r in reach.refs if not isinstance(r.obj, (tuple, torch.Tensor))]
    if not objs:
        return
    obj = objs[pick % len(objs)]
    if how == "grow":
        if isinstance(obj, list):
            obj.append(None)
        elif isinstance(obj, dict):
            obj["grown"] = 1
        elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
            obj.__dict__["grown"] = 1
    elif how == "replace" and isinstance(obj, list) and obj:
        obj[0] = [obj[0]]  # the object at its first place: another one


@settings(max_examples=120, deadline=None)
@given(recipes=st.lists(_RECIPES, min_size=1, max_size=5),
       how=st.sampled_from(["none", "grow", "rebind", "replace"]), pick=st.integers(0, 50))
def test_the_compiled_check_of_the_objects_on_the_way_agrees_with_python(
    recipes: list[Any], how: str, pick: int,
) -> None:
    """`same_refs` (what a map's check runs before every load, over every object on the way
    to tensors: kernel objects, closures) answers as the Python pass, after any change;
    and says "the same" only when nothing changed."""
    model = _model(recipes)
    with _native.using(True):
        native = _native.get()
        found = ModelMap(model)
    assert native is not None
    _mutate(model, how, pick)
    n = len(found._modules) + len(found._table_ids)
    sizes = found._lens[n:]
    python = found._off_modules_hold(sizes)
    compiled = native.same_refs(found._modules, found._refs, sizes, found._nested,
                                model_map_module._STEPS)
    assert compiled == python
    if how == "none":
        assert compiled


def test_control_a_rebound_tensor_behind_a_closure_is_seen_by_both() -> None:
    """A packed copy in a kernel's default rebound to other memory: both passes say the
    map no longer holds, and so does the map's check."""
    model = nn.Sequential(nn.Linear(2, 2))
    packed = torch.ones(2)
    model[0].kernel = lambda packed=packed: packed
    with _native.using(True):
        native = _native.get()
        found = ModelMap(model)
        assert found.holds()
        packed.data = torch.zeros(4)
        n = len(found._modules) + len(found._table_ids)
        assert native is not None
        assert not native.same_refs(found._modules, found._refs, found._lens[n:],
                                    found._nested, model_map_module._STEPS)
        assert not found._off_modules_hold(found._lens[n:])
        assert not found.holds()


def _derived_model() -> tuple[nn.Module, Any]:
    """A model whose post-load step, recorded, derives state from its weights in each of
    the ways `find` tells apart: one op over a weight (a packed copy, a cat of two
    weights, a weight read twice, a keyword argument), ops chained through a temporary,
    an op that writes in place, and a tensor no weight feeds."""
    model = nn.Module()
    model.a = nn.Linear(4, 4)
    model.b = nn.Linear(4, 4)
    wa, wb = model.a.weight, model.b.weight
    with torch.no_grad(), record_lineage() as lineage:
        model.packed = wa.t().contiguous()
        model.joined = torch.cat([wa, wb])
        model.twice = torch.add(wa, wa)
        model.scaled = torch.add(wa, wb, alpha=2.0)
        model.chained = (wa * 2 + 1).relu()
        folded = wb.clone()
        folded.mul_(3)
        model.folded = folded
        model.plain = torch.ones(4)
    return model, lineage


def _found(model: nn.Module, lineage: Any, compiled: bool) -> list[tuple[Any, ...]]:
    """What `find` finds in `lineage` over a walk of `model`, each by its path, its
    sources' paths, its chain, whether it is opaque and its writer's call."""
    sources = sources_of(model)
    among = lineage.alive() - sources.keys()
    with _native.using(compiled):
        found = resolve_module.find(lineage, walk(model).sites, sources, among)
    return [(f.site.path, tuple(s.path for s in f.sources), f.chain, f.opaque, id(f.writer[0]))
            for f in found]


def test_the_compiled_first_step_of_find_finds_what_trace_finds() -> None:
    """Every derived tensor of the recording, with its sources, chain and writer, on
    both paths; those one step decides and those `trace` follows."""
    model, lineage = _derived_model()
    compiled = _found(model, lineage, True)
    assert compiled == _found(model, lineage, False)
    paths = {row[0] for row in compiled}
    assert {"packed", "joined", "twice", "scaled", "chained", "folded"} <= paths
    assert "plain" not in paths
    assert dict((row[0], row[1]) for row in compiled)["joined"] == ("a.weight", "b.weight")


def test_control_a_first_step_that_drops_a_source_is_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The comparison above catches a compiled first step that keeps only the first
    source it read: the cat of two weights would be guarded against one of them."""

    def first_only(traced_sites: Callable[..., Any], *args: Any) -> Any:
        return [(i, sid, writer, None if srcs is None else srcs[:1])
                for i, sid, writer, srcs in traced_sites(*args)]

    model, lineage = _derived_model()
    honest = _found(model, lineage, False)
    monkeypatch.setattr(resolve_module._native, "get", _Altered({"traced_sites": first_only}))
    sources = sources_of(model)
    found = resolve_module.find(lineage, walk(model).sites, sources,
                                lineage.alive() - sources.keys())
    assert [(f.site.path, tuple(s.path for s in f.sources), f.chain, f.opaque,
             id(f.writer[0])) for f in found] != honest
