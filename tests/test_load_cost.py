"""What a load reuses from the load before it, and the changes that make it look again.

A load's fixed cost follows what changed, not the model's size: the walk of the model
(`ModelMap`) is checked in one compiled pass, the binding is not checked for swapped
submodules again while that walk holds, and the set of storage keys a load watches is
one set kept with the walk (the compiled tracker reads it once). Each shortcut is held
here next to the change it must not skip: the walk's check on both paths against a known
verdict, a swap after a load that agreed, a tensor added to the model after the set was
kept, and the compiled tracker's cache of sets against a set freed and another made.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import HoldingLayer, HoldingStack
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._lineage.record import recorder
from graphsafe._memory import walk as walk_module
from graphsafe._memory.journal import JOURNAL
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.bind import model_map
from graphsafe._runtime.bind.model_map import ModelMap
from graphsafe._runtime.loads.load import Load
from graphsafe._runtime.refresh import binder
from graphsafe._runtime.refresh.engine import Engine


@pytest.fixture(scope="module")
def native() -> _native.Native:
    try:
        _native.build()
    except _native.NativeBuildError as exc:  # no C++ compiler on this machine
        pytest.skip(f"the compiled checks cannot be built here: {exc}")
    found = _native.get()
    if found is None:
        pytest.skip("the compiled checks are turned off (GRAPHSAFE_NATIVE=0)")
    return found


Layer, Stack = HoldingLayer, HoldingStack


def _data(make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Stack], None]:
    def go(m: Stack) -> None:
        w = m.layers[1].w
        w.data = make(w.data)

    return go


def _setattr(name: str, value: Callable[[Layer], object]) -> Callable[[Stack], None]:
    def go(m: Stack) -> None:
        setattr(m.layers[1], name, value(m.layers[1]))

    return go


def _delattr(m: Stack) -> None:
    del m.layers[1].extra


def _list_item(m: Stack) -> None:
    m.layers[1].listed[0] = torch.randn(2)


def _list_grown(m: Stack) -> None:
    m.layers[1].listed.append(torch.randn(2))


def _new_dict(m: Stack) -> None:
    m.layers[1]._parameters = dict(m.layers[1]._parameters)


def _swap(m: Stack) -> None:
    m.layers[1] = copy.deepcopy(m.layers[1])


def _set(m: Stack) -> None:
    with torch.no_grad():
        m.layers[1].w.set_(torch.randn(4, 6))


def _swap_tensors(m: Stack) -> None:
    # The same object in the same dict, with another TensorImpl (the other one is dropped:
    # what the compiled rows remembered of the first may be freed).
    torch.utils.swap_tensors(m.layers[1].w, nn.Parameter(torch.randn(4, 6)))


def _inplace(m: Stack) -> None:
    with torch.no_grad():
        m.layers[1].w.mul_(2)


# (change, whether the walk still describes the model: the same tensors where it found
# them, at the same pointer and stride; a write keeps everything)
CHANGES: dict[str, tuple[Callable[[Stack], None], bool]] = {
    "nothing": (lambda m: None, True),
    "written in place": (_inplace, True),
    "a transposed view of the same storage": (_data(lambda d: d.t()), False),
    "rebound to new storage": (_data(torch.randn_like), False),
    "an offset view of the same storage": (_data(lambda d: d.view(-1)[6:].view(3, 6)), False),
    "emptied": (_data(lambda d: torch.empty(0)), False),
    "a new Parameter object": (
        _setattr("w", lambda layer: nn.Parameter(layer.w.detach().clone())), False),
    "a buffer rebound": (_setattr("b", lambda layer: torch.randn(6)), False),
    "a new attribute": (_setattr("scale", lambda layer: 2.0), False),
    "an attribute replaced": (_setattr("extra", lambda layer: torch.randn(3)), False),
    "an attribute deleted": (_delattr, False),
    "a tensor in a list replaced": (_list_item, False),
    "a list grown": (_list_grown, False),
    "a new _parameters dict": (_new_dict, False),
    "a submodule swapped": (_swap, False),
    "set_() to new storage": (_set, False),
    "swap_tensors with another tensor": (_swap_tensors, False),
}

# The changes of CHANGES that leave every dict as it was: the compiled check's rows (a
# dict's version tag, the tensor's TensorImpl) must read the tensor to see them.
NO_DICT_CHANGES = [
    "a transposed view of the same storage", "rebound to new storage",
    "an offset view of the same storage", "emptied", "set_() to new storage",
    "swap_tensors with another tensor",
]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("name", list(CHANGES))
def test_the_walk_check_gives_the_known_verdict_on_both_paths(
    name: str, compiled: bool, request: pytest.FixtureRequest
) -> None:
    if compiled:
        request.getfixturevalue("native")
    change, holds = CHANGES[name]
    model = Stack()
    with _native.using(compiled):
        found = ModelMap(model)
    assert (found._native is not None) is compiled
    for _ in range(2):  # the second from what the compiled check remembers of the first
        assert found.holds()
    change(model)
    assert found.holds() is holds, name


@pytest.mark.parametrize("name", NO_DICT_CHANGES)
def test_control_the_dicts_alone_do_not_see_the_changes_the_rows_must_read(
    name: str, native: _native.Native
) -> None:
    """Control for the verdicts above: after each of these changes every dict the walk
    reads holds the objects it held (the identity check through the dicts' tags passes
    them), so the compiled rebinding check sees them only by reading each remembered
    tensor's pointer and strides from its TensorImpl, and that it does."""
    model = Stack()
    sites = [(layer._parameters, "w") for layer in model.layers]
    holders, keys = [h for h, _ in sites], [k for _, k in sites]
    objects = [h[k] for h, k in sites]
    looked = bytearray(16 * len(sites))
    with _native.using(True):
        found = ModelMap(model)
    for _ in range(2):
        assert native.same_items(holders, keys, objects, looked)
        assert found.holds()
    CHANGES[name][0](model)
    assert native.same_items(holders, keys, objects, looked), name
    assert not found._identities.unchanged(), name


class _Packed:
    """A kernel object off the tree: a list of closures, each over a packed tensor."""

    def __init__(self, w: torch.Tensor) -> None:
        self.fns = [_closure(w.t().contiguous()), _closure(w.t().contiguous() * 2)]


def _closure(packed: torch.Tensor) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        return packed

    return read


def _deep() -> Stack:
    """A stack whose middle layer keeps tensors three objects below its dict."""
    model = Stack()
    model.layers[1].quant = _Packed(model.layers[1].w.detach())
    return model


def _cell(m: Stack) -> None:
    read = m.layers[1].quant.fns[1]
    assert read.__closure__ is not None
    read.__closure__[0].cell_contents = torch.randn(6, 4)


def _fns(m: Stack) -> None:
    m.layers[1].quant.fns = list(m.layers[1].quant.fns)  # another list, the same closures


def _fn(m: Stack) -> None:
    m.layers[1].quant.fns[1] = _closure(torch.randn(6, 4))


def _fns_grown(m: Stack) -> None:
    m.layers[1].quant.fns.append(_closure(torch.randn(6, 4)))


def _packed_data(m: Stack) -> None:
    read = m.layers[1].quant.fns[0]
    read().data = torch.randn(6, 4)


# Changes below a module's dict, which none of its dicts or tables shows: each object on
# the way is read from the one that held it, the last one first replaced, grown or moved.
DEEP_CHANGES: dict[str, Callable[[Stack], None]] = {
    "a closure's cell rebound": _cell,
    "the list on the way replaced by one with the same closures": _fns,
    "a closure in the list replaced": _fn,
    "the list on the way grown": _fns_grown,
    "a tensor in a closure moved to new storage": _packed_data,
}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("name", list(DEEP_CHANGES))
def test_the_walk_check_sees_a_change_deep_below_a_module(
    name: str, compiled: bool, request: pytest.FixtureRequest
) -> None:
    if compiled:
        request.getfixturevalue("native")
    model = _deep()
    with _native.using(compiled):
        found = ModelMap(model)
    assert any(p.startswith("layers.1.quant.fns.1.") for p in found.by_path)
    for _ in range(2):
        assert found.holds()
    DEEP_CHANGES[name](model)
    assert not found.holds(), name


@pytest.mark.parametrize("name", list(DEEP_CHANGES))
def test_control_the_modules_alone_do_not_see_the_deep_changes(
    name: str, native: _native.Native
) -> None:
    """Control for the verdicts above: after each deep change every module dict and table
    holds what it held and every parameter is where it was (the compiled pass over the
    modules and the rebinding rows pass), so only the read of the objects on the way,
    each from the one that held it, sees it."""
    model = _deep()
    with _native.using(True):
        found = ModelMap(model)
    n = len(found._modules) + len(found._table_ids)
    DEEP_CHANGES[name](model)
    assert native.same_tree(found._modules, *found._tables, found._table_ids, found._holders,
                            found._names, found._ids, found._lens[:n], found._looked), name
    assert found._identities.unchanged(), name
    assert not found._off_modules_hold(found._lens[n:]), name


def test_the_compiled_walk_check_answers_alone_when_nothing_changed(
    native: _native.Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control for the verdicts above: the compiled pass, not the Python one behind it,
    answered them (the Python pass runs only once the compiled one saw a change)."""
    model = Stack()
    with _native.using(True):
        found = ModelMap(model)
    python_pass: list[bool] = []
    real = ModelMap._holds
    monkeypatch.setattr(model_map.ModelMap, "_holds",
                        lambda self, **kw: python_pass.append(True) or real(self, **kw))
    assert found.holds()
    assert python_pass == []
    _swap(model)
    assert not found.holds()
    assert python_pass == [True]


@gs.graphsafe
class Folded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 6), requires_grad=False)

    @gs.derive("w_t", inputs=["w"])
    def _t(self, w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous()


@gs.graphsafe
class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Folded(), Folded()])
        self.watched: list[frozenset[int]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        load = gs.runtime(self)._loads.current
        assert load is not None
        self.watched.append(load.watch)
        tensors = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        for name, w in weights:
            gs.load_into(tensors[name], w, name=name)


def _loaded_counting_swaps(monkeypatch: pytest.MonkeyPatch) -> tuple[Model, list[bool]]:
    """A model past its first (recorded) load, and the list each swap check appends to."""
    model = Model()
    model.load_weights([])  # the first load, recorded: the walk is taken anew at its end
    model.load_weights([])
    checked: list[bool] = []
    real = binder.swapped_modules
    monkeypatch.setattr(binder, "swapped_modules",
                        lambda binding: checked.append(True) or real(binding))
    return model, checked


def test_a_load_does_not_check_for_swaps_again_while_the_walk_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, checked = _loaded_counting_swaps(monkeypatch)
    model.load_weights([("layers.0.w", torch.ones(4, 6))])
    assert checked == []  # the walk held: the binding's submodules are where they were
    assert torch.equal(model.layers[0].w_t, torch.ones(6, 4))


def test_control_a_swap_after_a_load_that_agreed_is_bound_at_the_next_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The case the shortcut must not skip: the walk no longer holds, the binding is
    checked, the new submodule bound and its buffer made from what the load wrote."""
    model, checked = _loaded_counting_swaps(monkeypatch)
    model.layers[1] = Folded()  # never loaded: no derived buffer yet
    model.load_weights([("layers.1.w", torch.full((4, 6), 3.0))])
    assert checked  # the swap check ran, and found the swap
    assert torch.equal(model.layers[1].w_t, torch.full((6, 4), 3.0))


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    scans: list[bool] = []
    real = Engine.scan_moved
    monkeypatch.setattr(Engine, "scan_moved",
                        lambda self, pinned: scans.append(True) or real(self, pinned))
    return scans


def test_a_load_scans_for_rebinding_once_when_the_walk_recorded_every_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Model()
    model.load_weights([])
    model.load_weights([])
    scans = _count_scans(monkeypatch)
    model.load_weights([("layers.0.w", torch.ones(4, 6))])
    assert scans == [True]  # at its end (the loader may rebind); not as it began
    assert torch.equal(model.layers[0].w_t, torch.ones(6, 4))


REBINDINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "new storage": lambda d: torch.full_like(d, 5.0),
    "a view of the same storage at another stride": lambda d: d.as_strided(d.shape, (1, 4)),
}


@pytest.mark.parametrize("make", list(REBINDINGS.values()), ids=list(REBINDINGS))
def test_control_an_input_rebound_between_loads_is_taken_by_the_next(
    make: Callable[[torch.Tensor], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The case the shortcut must not skip: the walk no longer holds, the engine's pass
    runs as the load begins and takes the new tensor, whose writes are then seen."""
    model = Model()
    model.load_weights([])
    model.load_weights([])
    scans = _count_scans(monkeypatch)
    w = model.layers[1].w
    w.data = make(w.data)
    model.load_weights([("layers.1.w", torch.full((4, 6), 7.0))])
    assert scans == [True, True]
    assert torch.equal(model.layers[1].w_t, torch.full((6, 4), 7.0))


def test_a_load_watches_the_set_the_last_load_watched_while_the_model_is_unchanged() -> None:
    model = Model()
    model.load_weights([])
    model.load_weights([])
    model.load_weights([])
    assert model.watched[1] is model.watched[2]  # one set, not one per load
    assert {storage_key(p) for p in model.parameters()} <= model.watched[2]


def test_control_a_tensor_added_after_the_set_was_kept_is_watched_by_the_next_load() -> None:
    """A buffer registered between loads is no storage of the set the loads shared: the
    walk no longer holds, the next load watches it, and its write reaches the journal."""
    model = Model()
    model.load_weights([])
    model.load_weights([])
    kept = model.watched[-1]
    model.layers[0].register_buffer("scale", torch.zeros(3))
    key = storage_key(model.layers[0].scale)
    assert key not in kept
    clock = JOURNAL.clock
    model.load_weights([("layers.0.scale", torch.ones(3))])
    assert key in model.watched[-1]
    assert key in JOURNAL.written_since(clock)


def test_the_compiled_tracker_watches_each_set_it_is_given(native: _native.Native) -> None:
    """It reads a frozenset once and shares it with later trackers given the same set;
    a set freed and another made (perhaps at the same address) is read anew."""
    a, b = torch.zeros(2), torch.zeros(2)
    ka, kb = storage_key(a), storage_key(b)

    def written(watched: frozenset[int]) -> set[int]:
        tracker = native.tracker_new(watched)
        native.tracker_push(tracker)
        try:
            a.add_(1)
            b.add_(1)
        finally:
            native.tracker_pop(tracker)
        found = native.tracker_written(tracker)
        native.tracker_free(tracker)
        return found

    only_a = frozenset({ka})
    assert written(only_a) == {ka}
    assert written(only_a) == {ka}  # the same set again: shared
    for _ in range(20):  # many sets made and freed: none is taken for another
        assert written(frozenset({kb})) == {kb}
        gc.collect()
    assert written(frozenset()) == set()
    assert written(only_a) == {ka}


@gs.graphsafe
class BroughtUp(nn.Module):
    """Holding layers and a declared derivation, loaded by a loader that packs a copy of
    each layer's weight into a closure after loading (an engine's post-load step)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = HoldingStack().layers
        self.folded = Folded()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        tensors = dict(self.named_parameters())
        for name, w in weights:
            gs.load_into(tensors[name], w, name=name)
        for layer in self.layers:
            layer.kernel = _kernel(layer.w.t().contiguous())


def _kernel(packed: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: packed


def _counting_walks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The list each walk of a model appends to (every walk, of tensors or of values, is
    one `_Walker`'s)."""
    walks: list[bool] = []
    real = walk_module._Walker.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        walks.append(True)
        real(self, *args, **kwargs)

    monkeypatch.setattr(walk_module._Walker, "__init__", counted)
    return walks


def _describes(kept: ModelMap, model: nn.Module) -> bool:
    fresh = ModelMap(model)
    return kept.holds() and (kept.by_path, kept.key_set) == (fresh.by_path, fresh.key_set)


def test_a_recorded_load_walks_the_model_once_at_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its refresh's first materialization, discovery and the numbers it keeps share one
    walk, which (with the buffer the refresh registered) is the map the next load checks."""
    model = BroughtUp()
    walks = _counting_walks(monkeypatch)
    model.load_weights([("folded.w", torch.ones(4, 6))])
    assert len(walks) == 2  # as it began (its map), and once as it ended
    rt = gs.runtime(model)
    assert torch.equal(model.folded.w_t, torch.ones(6, 4))
    assert {d.path for d in rt.discovered} == {
        f"layers.{i}.kernel.<closure packed>" for i in range(3)}
    kept = rt._binder.model_map()
    assert kept is rt._binder._map and len(walks) == 2  # the map kept holds
    assert "folded.w_t" in kept.by_path
    assert _describes(kept, model)


# CHANGES, but for those the walk still describes (nothing, a write).
MOVES = [name for name, (_, holds) in CHANGES.items() if not holds]


@pytest.mark.parametrize("name", MOVES)
def test_control_a_change_during_the_refresh_of_a_recorded_load_is_in_its_one_walk(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What changes as the refresh ends is in the map the load keeps: its end walks the
    model after the refresh (a walk taken before it would describe the model as it was)."""
    change = CHANGES[name][0]
    model = BroughtUp()
    real = Load.end

    def end(self: Load, *args: object, **kwargs: object) -> set[int]:
        written = real(self, *args, **kwargs)  # type: ignore[arg-type]
        change(model)  # type: ignore[arg-type]
        return written

    monkeypatch.setattr(Load, "end", end)
    walks = _counting_walks(monkeypatch)
    model.load_weights([("folded.w", torch.ones(4, 6))])
    assert len(walks) == 2  # as it began, and once after the refresh
    kept = gs.runtime(model)._binder._map  # as the load left it, not checked again
    assert kept is not None and _describes(kept, model)


@gs.graphsafe
class Packing(nn.Module):
    """A layer whose loader packs a copy of its weight into a new attribute (an engine's
    post-load step), so that the first materialization runs after the model changed;
    its derivation does `how` with that copy, or nothing ("own": it writes in place
    only into what it made)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.zeros(4, 6), requires_grad=False)

    @gs.derive("w_t", inputs=["w"])
    def _t(self, w: torch.Tensor) -> torch.Tensor:
        if self.how == "reads":
            return w.t() + self.packed.sum()
        if self.how == "returns":
            return self.packed  # type: ignore[no-any-return]
        if self.how == "aliases":  # a tensor it made, pointed at the copy's memory
            alias = torch.empty(0).set_(self.packed.untyped_storage(), 0, (6, 4), (4, 1))
            return w.t() + alias
        if self.how == "writes":
            self.packed.add_(1.0)
        x = w.t() * 2  # [6, 4]
        x.add_(1.0)
        return x

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            gs.load_into(getattr(self, name), w, name=name)
        self.packed = self.w.t().contiguous()  # [6, 4]


def _unrecorded_load(model: nn.Module) -> None:
    saved, recorder.RECORDING[0] = recorder.RECORDING[0], "off"
    try:
        model.load_weights([("w", torch.ones(4, 6))])
    finally:
        recorder.RECORDING[0] = saved


def test_a_first_materialization_that_reads_only_its_inputs_does_not_walk_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its read and write checks ask the model's storages only for what the function
    did not make: here nothing, and the load walks the model once, as it begins."""
    model = Packing("own")
    walks = _counting_walks(monkeypatch)
    _unrecorded_load(model)
    assert len(walks) == 1
    assert torch.equal(model.w_t, torch.full((6, 4), 3.0))


@pytest.mark.parametrize("how", ["reads", "aliases"])
def test_control_an_undeclared_read_of_what_the_loader_attached_is_refused(how: str) -> None:
    """The tensor it reads was attached after the load's walk: the check walks the
    model when the read is of nothing the function made, and finds it there (a tensor
    it made and then pointed at that memory with `set_` is not one it made)."""
    model = Packing(how)
    with pytest.raises(gs.RegistrationError, match="reads 'packed', a tensor of the model"):
        _unrecorded_load(model)


def test_control_a_write_into_what_the_loader_attached_is_refused_before_it_lands() -> None:
    model = Packing("writes")
    with pytest.raises(gs.ImpureDerivationError, match="wrote into 'packed'"):
        _unrecorded_load(model)
    assert torch.equal(model.packed, torch.ones(6, 4))  # the write was refused


def test_control_a_result_that_is_a_tensor_the_loader_attached_is_copied() -> None:
    """A buffer over the model's own tensor would change with it: it gets a copy."""
    model = Packing("returns")
    _unrecorded_load(model)
    assert torch.equal(model.w_t, model.packed)
    assert storage_key(model.w_t) != storage_key(model.packed)


def test_the_walk_reads_every_tensor_the_same_in_flat_passes_or_one_by_one() -> None:
    """A model whose tensors all read in flat passes, and the same model holding a
    sparse tensor (no storage: the passes give way to one read per tensor), give the
    same record of what they share."""
    model = HoldingStack()
    flat = ModelMap(model)
    model.layers[2].sparse = torch.eye(2).to_sparse()  # type: ignore[assignment]
    apart = ModelMap(model)
    assert model_map._read_all(walk_module.walk(model).sites) is None  # the control
    assert apart.by_path == {**flat.by_path, "layers.2.sparse": 0}
    assert (apart.keys, apart.weights, apart.rows.ptrs) == (flat.keys, flat.weights,
                                                            flat.rows.ptrs)
    assert apart.holds() and flat.holds() is False  # the attribute is a change


def test_a_load_hands_the_journal_each_storage_as_a_read_one_by_one_would() -> None:
    """What a first load's end tells the journal of each storage it wrote, read in flat
    passes: the same keys and storages as `storage_key` and `untyped_storage` per tensor
    (views share their base's; zero-size and meta tensors have key 0)."""
    from graphsafe._runtime.loads.load import _storages

    base = torch.randn(4, 6)
    tensors = [base, base[1], base.t(), torch.empty(0), torch.randn(3),
               torch.empty(2, device="meta")]
    found = _storages(iter(tensors))
    one_by_one = {storage_key(t): t.untyped_storage() for t in tensors}
    assert found.keys() == one_by_one.keys() and len(found) == 3
    assert all(found[k]._cdata == s._cdata for k, s in one_by_one.items())


@pytest.mark.parametrize("compiled", [True, False])
def test_the_tables_hold_whatever_the_objects_on_the_way_do(compiled: bool) -> None:
    """`tables_hold` (what another model's recording needs of this one: its weights) reads
    the module tree, the modules' own dicts and their tables alone: a tensor rebound
    inside a kernel's function leaves them holding, though the walk no longer does; a
    parameter rebound to other memory, one registered, or a submodule swapped does
    not."""
    if compiled and _native.get() is None:
        pytest.skip("the compiled checks are not built here")
    with _native.using(compiled):
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        m[0].kernel = lambda w=torch.ones(1): w  # noqa: B008
        found = ModelMap(m)
        assert found.holds() and found.tables_hold()
        m[0].kernel.__defaults__ = (torch.zeros(1),)  # inside the kernel, after the walk
        assert not found.holds() and found.tables_hold()
        for change in (lambda: setattr(m[1].weight, "data", torch.zeros(2, 2)),
                       lambda: m[1].register_parameter("extra", nn.Parameter(torch.ones(1))),
                       lambda: m.__setitem__(1, nn.Linear(2, 2))):
            found = ModelMap(m)
            change()
            assert not found.tables_hold() and not found.holds()
