"""The storage ledger: every way a pinned tensor can move is reported."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from graphsafe._errors import StorageMovedError
from graphsafe._memory.ledger import Drift, Ledger
from graphsafe._memory.walk import storage_key, walk_modules, walk_tensors


class Block(nn.Module):
    """Every kind of place a tensor can live in a module."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("buf", torch.arange(4.0))
        self.x = torch.ones(4)  # plain tensor attribute
        self.cache = [torch.zeros(4), torch.zeros(4)]
        self.tables = {"k": torch.ones(2), "pair": (torch.ones(3), torch.zeros(3))}
        self.window = torch.arange(4.0)[:3]  # a view at offset 0 of a 4-element storage
        self.note = "not a tensor"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])


def _kinds(drifts: tuple[Drift, ...]) -> set[tuple[str, str]]:
    return {(d.path, d.what) for d in drifts}


def test_snapshot_finds_parameters_buffers_attributes_and_container_items() -> None:
    ledger = Ledger.snapshot(Net())
    expected = {
        "layers.0.lin.weight",
        "layers.0.lin.bias",
        "layers.0.buf",
        "layers.0.x",
        "layers.0.cache.0",
        "layers.0.cache.1",
        "layers.0.tables.k",
        "layers.0.tables.pair.0",
        "layers.0.tables.pair.1",
        "layers.0.window",
    }
    assert expected | {p.replace("layers.0", "layers.1") for p in expected} == set(ledger.paths)
    assert len(ledger) == 2 * len(expected)


def test_a_clean_model_reports_no_drift() -> None:
    ledger = Ledger.snapshot(Net())
    assert ledger.verify() == ()
    ledger.assert_stable()


def test_control_writes_into_existing_storage_are_not_drifts() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    block = net.layers[0]
    with torch.no_grad():
        block.lin.weight.data.copy_(torch.randn(4, 4))  # the loader idiom
        block.lin.bias.mul_(3.0)
        block.buf.copy_(torch.full((4,), 7.0))
        block.x[1:] = 5.0
        block.cache[1].add_(1.0)
        block.tables["k"].fill_(2.0)
        block.tables["pair"][0].zero_()
    assert ledger.verify() == ()


def _rebind_param_data(net: Net) -> None:
    net.layers[0].lin.weight.data = torch.randn(4, 4)


def _reassign_param(net: Net) -> None:
    net.layers[0].lin.weight = nn.Parameter(torch.randn(4, 4))


def _rebind_attribute(net: Net) -> None:
    net.layers[0].x = torch.ones(4)


def _register_buffer_again(net: Net) -> None:
    net.layers[0].register_buffer("buf", torch.arange(4.0))


def _set_(net: Net) -> None:
    net.layers[0].x.set_(torch.ones(4))


def _replace_list_item(net: Net) -> None:
    net.layers[0].cache[1] = torch.zeros(4)


def _replace_list(net: Net) -> None:
    net.layers[0].cache = [net.layers[0].cache[0], torch.zeros(4)]


def _replace_dict_entry(net: Net) -> None:
    net.layers[0].tables["k"] = torch.ones(2)


def _replace_tuple_in_dict(net: Net) -> None:
    pair = net.layers[0].tables["pair"]
    net.layers[0].tables["pair"] = (torch.ones(3), pair[1])


def _transpose_data(net: Net) -> None:
    weight = net.layers[0].lin.weight
    weight.data = weight.data.t()  # same storage, new strides


def _reinterpret_dtype(net: Net) -> None:
    block = net.layers[0]
    block.buf = block.buf.view(torch.int32)  # same memory, new dtype


def _shrink(net: Net) -> None:
    net.layers[0].buf.resize_(2)


def _grow(net: Net) -> None:
    net.layers[0].buf.resize_(4096)


def _shift_offset(net: Net) -> None:
    window = net.layers[0].window
    window.set_(window.untyped_storage(), 1, (3,), (1,))


def _to_meta(net: Net) -> None:
    net.layers[0].x = net.layers[0].x.to("meta")


def _to_double(net: Net) -> None:
    net.layers[0].x = net.layers[0].x.double()


def _set_none(net: Net) -> None:
    net.layers[0].x = None


def _delete_buffer(net: Net) -> None:
    del net.layers[0].buf


def _shrink_list(net: Net) -> None:
    net.layers[0].cache.pop()


def _delete_dict_key(net: Net) -> None:
    del net.layers[0].tables["k"]


def _not_a_tensor_any_more(net: Net) -> None:
    net.layers[0].x = 1.0


CASES: list[tuple[Callable[[Net], None], str, str]] = [
    (_rebind_param_data, "layers.0.lin.weight", "storage"),
    (_reassign_param, "layers.0.lin.weight", "storage"),
    (_rebind_attribute, "layers.0.x", "storage"),
    (_register_buffer_again, "layers.0.buf", "storage"),
    (_set_, "layers.0.x", "storage"),
    (_replace_list_item, "layers.0.cache.1", "storage"),
    (_replace_list, "layers.0.cache.1", "storage"),
    (_replace_dict_entry, "layers.0.tables.k", "storage"),
    (_replace_tuple_in_dict, "layers.0.tables.pair.0", "storage"),
    (_transpose_data, "layers.0.lin.weight", "stride"),
    (_reinterpret_dtype, "layers.0.buf", "dtype"),
    (_shrink, "layers.0.buf", "shape"),
    (_grow, "layers.0.buf", "shape"),
    (_shift_offset, "layers.0.window", "offset"),
    (_to_meta, "layers.0.x", "device"),
    (_to_double, "layers.0.x", "dtype"),
    (_set_none, "layers.0.x", "removed"),
    (_delete_buffer, "layers.0.buf", "removed"),
    (_shrink_list, "layers.0.cache.1", "removed"),
    (_delete_dict_key, "layers.0.tables.k", "removed"),
    (_not_a_tensor_any_more, "layers.0.x", "removed"),
]


@pytest.mark.parametrize(("move", "path", "what"), CASES, ids=[c[0].__name__ for c in CASES])
def test_each_kind_of_drift_is_reported_with_its_path_and_kind(
    move: Callable[[Net], None], path: str, what: str
) -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    move(net)
    drifts = ledger.verify()
    assert (path, what) in _kinds(drifts)
    assert {d.path for d in drifts} == {path}  # nothing else is blamed
    assert all(d.module_class == "Block" or d.module_class == "Linear" for d in drifts)


def test_a_reshaped_tensor_reports_storage_and_shape_and_old_and_new_values() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    old_ptr = net.layers[1].buf.untyped_storage().data_ptr()
    net.layers[1].buf.resize_(4096)  # grows: a new allocation
    drifts = {d.what: d for d in ledger.verify()}
    assert set(drifts) == {"storage", "shape"}
    assert drifts["storage"].old == f"0x{old_ptr:x}"
    assert drifts["storage"].new == f"0x{net.layers[1].buf.untyped_storage().data_ptr():x}"
    assert (drifts["shape"].old, drifts["shape"].new) == ("(4,)", "(4096,)")


def test_removed_says_what_is_there_now() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    net.layers[0].x = None
    net.layers[1].x = 3
    (gone, number) = ledger.verify()
    assert (gone.old, gone.new) == ("tensor (4,) torch.float32 on cpu", "None")
    assert number.new == "a int, not a tensor"


def test_an_attribute_turned_parameter_is_followed_not_reported_removed() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    net.layers[0].x = nn.Parameter(torch.ones(4))  # leaves __dict__ for _parameters
    assert _kinds(ledger.verify()) == {("layers.0.x", "storage")}


def test_an_address_freed_and_reused_is_still_a_drift() -> None:
    # The ledger keeps pinned storages alive, so a new allocation of the same size can
    # never land on the old address and make a rebinding look like no change.
    net = Net()
    ledger = Ledger.snapshot(net)
    old = net.layers[0].x.data_ptr()
    net.layers[0].x = None
    gc.collect()
    net.layers[0].x = torch.ones(4)
    assert net.layers[0].x.data_ptr() != old
    assert _kinds(ledger.verify()) == {("layers.0.x", "storage")}


def test_assert_stable_names_one_drift_with_expected_got_and_fix() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    net.layers[0].lin.weight.data = torch.randn(4, 4)
    with pytest.raises(
        StorageMovedError,
        match=r"(?s)layers\.0\.lin\.weight was rebound after the snapshot: its storage moved"
        r".*module:\s+Linear.*tensor:\s+layers\.0\.lin\.weight"
        r".*expected:\s+storage 0x[0-9a-f]+.*got:\s+storage 0x[0-9a-f]+"
        r".*fix:.*copy_.*re-capture",
    ) as e:
        ledger.assert_stable()
    assert e.value.path == "layers.0.lin.weight"
    assert [(d.path, d.what) for d in e.value.drifts] == [("layers.0.lin.weight", "storage")]


def test_assert_stable_lists_every_drift() -> None:
    net = Net()
    ledger = Ledger.snapshot(net, label="graph capture")
    net.layers[0].x = torch.ones(4)
    net.layers[1].cache[0] = torch.zeros(4)
    net.layers[1].tables["k"] = None
    with pytest.raises(
        StorageMovedError,
        match=r"(?s)3 pinned tensors moved after graph capture \(3 drifts\)"
        r".*layers\.0\.x \(Block\): storage moved\n    expected: storage 0x.*\n    got: "
        r".*layers\.1\.cache\.0 \(Block\): storage moved"
        r".*layers\.1\.tables\.k \(Block\): removed\n    expected: tensor \(2,\).*\n"
        r"    got:      None.*fix:",
    ) as e:
        ledger.assert_stable()
    assert len(e.value.drifts) == 3


def test_shared_modules_are_walked_once_and_tied_weights_at_each_path() -> None:
    shared = nn.Linear(2, 2)
    net = nn.Sequential(shared, shared, nn.Linear(2, 2))
    net[2].weight = shared.weight  # tied
    ledger = Ledger.snapshot(net)
    assert ledger.paths == ("0.weight", "0.bias", "2.weight", "2.bias")
    shared.weight.data = torch.zeros(2, 2)
    assert {d.path for d in ledger.verify()} == {"0.weight", "2.weight"}


def test_cycles_in_attribute_containers_end() -> None:
    m = nn.Module()
    loop: list[object] = [torch.ones(1)]
    loop.append(loop)
    m.loop = loop
    assert Ledger.snapshot(m).paths == ("loop.0",)


@given(
    moves=st.lists(st.sampled_from(range(6)), unique=True, max_size=6),
    writes=st.lists(st.sampled_from(range(6)), max_size=6),
)
def test_property_verify_reports_exactly_the_rebound_paths(
    moves: list[int], writes: list[int]
) -> None:
    # In-place writes anywhere never show; every rebinding does, and only it.
    net = Net()
    block = net.layers[0]
    paths = [
        "layers.0.lin.weight",
        "layers.0.buf",
        "layers.0.x",
        "layers.0.cache.0",
        "layers.0.tables.k",
        "layers.0.tables.pair.1",
    ]

    def get(i: int) -> torch.Tensor:
        return [
            block.lin.weight,
            block.buf,
            block.x,
            block.cache[0],
            block.tables["k"],
            block.tables["pair"][1],
        ][i]

    ledger = Ledger.snapshot(net)
    with torch.no_grad():
        for i in writes:
            get(i).add_(1.0)
    for i in moves:
        fresh = get(i).detach().clone()
        if i == 0:
            block.lin.weight.data = fresh
        elif i == 1:
            block.register_buffer("buf", fresh)
        elif i == 2:
            block.x = fresh
        elif i == 3:
            block.cache[0] = fresh
        elif i == 4:
            block.tables["k"] = fresh
        else:
            block.tables["pair"] = (block.tables["pair"][0], fresh)
    assert {d.path for d in ledger.verify()} == {paths[i] for i in moves}


def test_same_memory_under_another_dtype_is_a_dtype_drift_alone() -> None:
    # The data pointer is unchanged, so only the dtype in the flat check can catch it.
    net = Net()
    ledger = Ledger.snapshot(net)
    _reinterpret_dtype(net)
    assert _kinds(ledger.verify()) == {("layers.0.buf", "dtype")}


# Module identity: every path is pinned to the module bound there. The tensors of a
# replaced module are untouched, so a ledger that resolves them through the old module's
# dicts sees nothing: each of these tests fails on such a ledger.


def _replace_list_item_module(net: Net) -> None:
    net.layers[0] = Block()


def _replace_child(net: Net) -> None:
    net.layers[0].lin = nn.Linear(4, 4)


def _set_deep_copy(net: Net) -> None:
    setattr(net.layers[1], "lin", copy.deepcopy(net.layers[1].lin))  # noqa: B010


def _replace_module_list(net: Net) -> None:
    net.layers = nn.ModuleList([net.layers[0], Block()])


def _child_to_none(net: Net) -> None:
    net.layers[0].lin = None


def _delete_child(net: Net) -> None:
    del net.layers[1].lin


MODULE_CASES: list[tuple[Callable[[Net], None], set[str]]] = [
    (_replace_list_item_module, {"layers.0"}),
    (_replace_child, {"layers.0.lin"}),
    (_set_deep_copy, {"layers.1.lin"}),
    (_replace_module_list, {"layers"}),
    (_child_to_none, {"layers.0.lin"}),
    (_delete_child, {"layers.1.lin"}),
]


@pytest.mark.parametrize(("swap", "paths"), MODULE_CASES, ids=[c[0].__name__ for c in MODULE_CASES])
def test_a_replaced_module_is_a_module_drift_at_its_path(
    swap: Callable[[Net], None], paths: set[str]
) -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    swap(net)
    # Only the binding: the old module's tensors are no longer the model's.
    assert _kinds(ledger.verify()) == {(p, "module") for p in paths}


def test_deleting_from_a_module_list_shifts_every_later_binding() -> None:
    # `ModuleList.__delitem__` renumbers into a new `_modules` dict: pinning the old dict
    # alone would miss it.
    net = Net()
    ledger = Ledger.snapshot(net)
    del net.layers[0]
    drifts = {d.path: d for d in ledger.verify()}
    assert set(drifts) == {"layers.0", "layers.1"}
    assert drifts["layers.0"].new.startswith("Block (id 0x")  # the old layers.1
    assert drifts["layers.1"].new == "missing"


def test_assert_stable_names_a_replaced_module_and_how_to_fix_it() -> None:
    net = Net()
    ledger = Ledger.snapshot(net, label="graph capture")
    old = net.layers[0]
    net.layers[0] = copy.deepcopy(old)
    with pytest.raises(
        StorageMovedError,
        match=r"(?s)module layers\.0 was replaced after graph capture"
        r".*module:\s+ModuleList.*tensor:\s+layers\.0"
        rf".*expected:\s+Block \(id 0x{id(old):x}\)"
        rf".*got:\s+Block \(id 0x{id(net.layers[0]):x}\)"
        r".*fix:.*load_state_dict.*instead of replacing it.*re-capture",
    ) as e:
        ledger.assert_stable()
    assert e.value.path == "layers.0"


def test_control_modules_put_back_or_containers_rebuilt_alike_are_no_drift() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    first = net.layers[0]
    net.layers[0] = Block()
    net.layers[0] = first
    del net.layers[2:2]  # rebuilds `_modules` with the same modules
    net.layers[1]._parameters = dict(net.layers[1]._parameters)
    net.layers.append(Block())  # new modules were never pinned
    assert ledger.verify() == ()


def test_a_replaced_parameter_dict_is_followed() -> None:
    # The flat check pins `_parameters` itself too: the old dict still holds the old
    # weight, so looking there alone would see nothing.
    lin = Net().layers[0].lin
    ledger = Ledger.snapshot(lin)
    lin._parameters = {"weight": nn.Parameter(torch.randn(4, 4)), "bias": lin.bias}
    assert _kinds(ledger.verify()) == {("weight", "storage")}


def test_a_module_shared_by_two_parents_is_pinned_at_both_bindings() -> None:
    shared = nn.Linear(2, 2)
    net = nn.Sequential(shared, shared)
    ledger = Ledger.snapshot(net)
    net[1] = nn.Linear(2, 2)
    assert _kinds(ledger.verify()) == {("1", "module")}


def test_a_module_replaced_at_one_binding_but_still_held_at_another_is_still_checked() -> None:
    shared = nn.Linear(2, 2)
    net = nn.Sequential(shared, shared)
    ledger = Ledger.snapshot(net)
    net[0] = nn.Linear(2, 2)
    shared.weight.data = torch.zeros(2, 2)  # still read through net[1]
    assert _kinds(ledger.verify()) == {("0", "module"), ("0.weight", "storage")}


# Identity: the diff names a path that holds another tensor object than the one pinned,
# even when it reads the same memory (data pointers cannot tell these apart); a graph
# reads the same addresses through it, so the check lets it pass and pins the new one.


def test_swapping_one_empty_tensor_for_another_is_an_object_drift() -> None:
    m = nn.Module()
    m.e = torch.empty(0)
    m.register_buffer("b", torch.empty(0, 3))
    ledger = Ledger.snapshot(m)
    assert m.e.data_ptr() == 0  # every empty tensor has this address
    m.e = torch.empty(0)
    m.register_buffer("b", torch.empty(0, 3))
    assert _kinds(ledger.verify()) == {("e", "object"), ("b", "object")}


def test_a_new_object_over_the_same_memory_is_named_but_passes_and_is_pinned() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    block = net.layers[0]
    block.x = block.x.detach()  # same storage, offset, shape, stride, dtype
    block.cache[0] = block.cache[0].view(4)
    assert _kinds(ledger.verify()) == {("layers.0.x", "object"), ("layers.0.cache.0", "object")}
    ledger.assert_stable()  # vLLM's MLA impl makes such views anew at every load
    again = ledger.checked()
    assert again is not ledger and again.verify() == () and again.checked() is again
    # Control: a new object over other memory is a moved storage, and is refused.
    block.x = block.x.clone()
    with pytest.raises(StorageMovedError, match=r"layers\.0\.x was rebound.*storage moved"):
        again.assert_stable()


# The fast check reads each pinned tensor's data pointer, stride, shape and dtype because
# `.data =` moves no version counter and can change each of them alone: a check that
# skips any one of the four fails one of these.

SINGLE_FIELD_MOVES: list[tuple[Callable[[torch.Tensor], None], str]] = [
    (lambda w: setattr(w, "data", w.data.clone()), "storage"),
    (lambda w: setattr(w, "data", w.data.t()), "stride"),
    (lambda w: setattr(w, "data", w.data.as_strided((2, 8), (4, 1))), "shape"),
    (lambda w: setattr(w, "data", w.data.view(torch.int32)), "dtype"),
]


@pytest.mark.parametrize(
    ("move", "what"), SINGLE_FIELD_MOVES, ids=[w for _, w in SINGLE_FIELD_MOVES]
)
def test_data_assignment_that_changes_one_field_alone_is_caught(
    move: Callable[[torch.Tensor], None], what: str
) -> None:
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    ledger = Ledger.snapshot(m)
    version = m.w._version
    move(m.w)
    assert m.w._version == version  # nothing but the field itself shows it
    assert _kinds(ledger.verify()) == {("w", what)}


def test_swap_tensors_under_a_kept_object_is_caught() -> None:
    net = Net()
    ledger = Ledger.snapshot(net)
    torch.utils.swap_tensors(net.layers[0].x, torch.ones(4))
    assert _kinds(ledger.verify()) == {("layers.0.x", "storage")}


def test_a_zero_byte_tensor_moved_to_another_device_is_caught() -> None:
    # Its data pointer is 0 on every device, so its device is compared too.
    m = nn.Module()
    m.e = torch.empty(0)
    ledger = Ledger.snapshot(m)
    torch.utils.swap_tensors(m.e, torch.empty(0, device="meta"))
    assert _kinds(ledger.verify()) == {("e", "device")}


# The walker (`graphsafe._memory.walk`), which the ledger pins from.


def test_every_site_resolves_to_its_tensor_through_container_key_and_chain() -> None:
    net = Net()
    sites = list(walk_tensors(net))
    for s in sites:
        value = s.container[s.key]
        for k in s.chain:
            value = value[k]
        assert value is s.tensor
        assert s.container in (s.module._parameters, s.module._buffers, vars(s.module))
    assert [s.path for s in sites if s.chain] == [
        f"layers.{i}.{p}"
        for i in (0, 1)
        for p in ("cache.0", "cache.1", "tables.k", "tables.pair.0", "tables.pair.1")
    ]


def test_walk_modules_gives_every_binding_and_walks_a_shared_module_once() -> None:
    shared = nn.Sequential(nn.Linear(2, 2))
    net = nn.Sequential(shared, shared)
    sites = list(walk_modules(net))
    assert [(s.path, s.key) for s in sites] == [("", ""), ("0", "0"), ("0.0", "0"), ("1", "1")]
    for s in sites[1:]:
        assert s.parent is not None and s.parent._modules[s.key] is s.module
    assert [s.path for s in walk_tensors(net)] == ["0.0.weight", "0.0.bias"]


def test_storage_key_is_zero_exactly_when_there_are_no_bytes_to_tell_apart() -> None:
    x = torch.zeros(4)
    assert storage_key(x) == storage_key(x[1:]) == x.untyped_storage().data_ptr() != 0
    assert storage_key(torch.empty(0)) == 0
    assert storage_key(torch.empty(4, device="meta")) == 0
    assert storage_key(torch.eye(2).to_sparse()) == 0
