"""The guard's compiled checks answer exactly as its Python path does.

The compiled path (`graphsafe native build`) only ever decides "nothing changed"; when it
says otherwise, the Python path names the change. So the property that matters is: for
every way a model can be changed, both paths give the same verdict, and the verdict is
right. Each mutation below has its known verdict (the oracle); both paths are held to
it, for the ledger (rebinding, geometry, module swaps) and for the witnesses (identity,
pointer, version, journal epoch).

The build is tested here too: the first use builds it (and nothing before that use does),
or, where it cannot, warns once and does not try again; the library's name changes with
whatever it is built from, builds that start together compile once, and a cache another
user could write is refused.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import HoldingStack
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._memory.journal import JOURNAL
from graphsafe._memory.ledger import Ledger
from graphsafe._memory.snapshot import Witnesses
from graphsafe._native import loader

pytestmark = pytest.mark.usefixtures("compiled_checks")


Model = HoldingStack


Mutation = Callable[[Model, int], None]


def _rebind(i: int, make: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    def go(m: Model, _: int) -> None:
        w = m.layers[i].w
        w.data = make(w.data)

    return go


def _swap(m: Model, i: int) -> None:
    m.layers[i] = copy.deepcopy(m.layers[i])


def _new_param(m: Model, i: int) -> None:
    m.layers[i].w = nn.Parameter(m.layers[i].w.detach().clone(), requires_grad=False)


def _new_dict(m: Model, i: int) -> None:
    m.layers[i]._parameters = dict(m.layers[i]._parameters)


def _list_item(m: Model, i: int) -> None:
    m.layers[i].listed[0] = torch.randn(2)


def _del_attr(m: Model, i: int) -> None:
    del m.layers[i].extra


def _inplace(m: Model, i: int) -> None:
    with torch.no_grad():
        m.layers[i].w.mul_(2)


def _through_data(m: Model, i: int) -> None:
    m.layers[i].w.data.copy_(torch.randn(4, 6))


def _buffer_rebind(m: Model, i: int) -> None:
    m.layers[i].b.data = torch.randn(6)


def _set(m: Model, i: int) -> None:
    with torch.no_grad():
        m.layers[i].w.set_(torch.randn(4, 6))


def _swap_tensors(m: Model, i: int) -> None:
    # The same object in the same dict, with another TensorImpl; the other tensor is
    # dropped, and with it, maybe, the TensorImpl the compiled check remembered.
    torch.utils.swap_tensors(m.layers[i].w, nn.Parameter(torch.randn(4, 6)))


# (mutation, the ledger still holds, the witnesses of w and b still hold)
MUTATIONS: dict[str, tuple[Mutation, bool, bool]] = {
    "nothing": (lambda m, i: None, True, True),
    "in place under no_grad": (_inplace, True, False),
    "through .data (invisible to both)": (_through_data, True, True),
    "rebound to new storage": (_rebind(0, torch.randn_like), False, False),
    "transposed view of the same storage": (_rebind(0, lambda d: d.t()), False, True),
    "narrowed view of the same storage": (_rebind(0, lambda d: d[:2]), False, True),
    "offset view of the same storage": (_rebind(0, lambda d: d.view(-1)[6:].view(3, 6)),
                                        False, False),
    "same bytes as another dtype": (_rebind(0, lambda d: d.view(torch.int32)), False, True),
    "emptied": (_rebind(0, lambda d: torch.empty(0)), False, False),
    "a buffer rebound": (_buffer_rebind, False, False),
    "set_() to new storage": (_set, False, False),
    "swap_tensors with another tensor": (_swap_tensors, False, False),
    "a new Parameter object": (_new_param, False, False),
    # Witnesses read the dict they were built on: a new dict or module is the ledger's.
    "a new _parameters dict": (_new_dict, False, True),
    "a submodule swapped": (_swap, False, True),
    "a tensor in a list replaced": (_list_item, False, True),
    "a plain attribute deleted": (_del_attr, False, True),
}


def _witness_sites(m: Model) -> list[tuple[dict[str, torch.Tensor], str]]:
    return [(layer._parameters, "w") for layer in m.layers] + [
        (layer._buffers, "b") for layer in m.layers
    ]


def _both(make: Callable[[], object]) -> tuple[object, object]:
    with _native.using(True):
        native = make()
    with _native.using(False):
        python = make()
    return native, python


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(sorted(MUTATIONS)), layer=st.integers(0, 2),
       primed=st.sampled_from(["no", "checked", "taken"]))
def test_both_paths_give_the_known_verdict(name: str, layer: int, primed: str) -> None:
    """Ledger and witnesses, compiled and Python, against the known verdict; `primed`:
    after checks that passed (`checked`), or witnesses taken anew (`taken`, as a refresh
    takes them), which the compiled checks remember (a dict that did not change since is
    not looked up again), so each change must show through what they remember."""
    mutate, ledger_holds, witnesses_hold = MUTATIONS[name]
    model = Model()
    ledgers = _both(lambda: Ledger.snapshot(model))
    witnesses = _both(lambda: Witnesses(_witness_sites(model), JOURNAL))
    assert ledgers[0]._native is not None and ledgers[1]._native is None
    assert witnesses[0]._native is not None and witnesses[1]._native is None
    for _ in range(2 if primed == "checked" else 0):
        assert all(ledger._unchanged() for ledger in ledgers)
        assert all(w.unchanged() for w in witnesses)
    if primed == "taken":
        for w in witnesses:
            assert isinstance(w, Witnesses)
            w.record(range(len(w)))
    # Rebind layer 0's weight by index; the other mutations take the drawn layer.
    mutate(model, layer)
    for ledger in ledgers:
        assert ledger._unchanged() is ledger_holds, name
    for w in witnesses:
        assert w.unchanged() is witnesses_hold, name
    # A verdict of "changed" is named by the Python path, whichever path decided it. A
    # new dict holding the same tensors is no drift: the graph reads the same memory.
    if not ledger_holds and name != "a new _parameters dict":
        assert ledgers[0].verify(), name


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_both_paths_take_the_same_witnesses_after_each_change(name: str) -> None:
    """A refresh takes the witnesses of what it refreshed anew (`record`): the compiled
    taking writes the same identity, pointer, version, storage key and epoch as the
    Python one, whatever the change before it."""
    model = Model()
    witnesses = _both(lambda: Witnesses(_witness_sites(model), JOURNAL))
    MUTATIONS[name][0](model, 1)
    for w in witnesses:
        w.record(range(len(w)))
    native, python = witnesses
    assert isinstance(native, Witnesses) and isinstance(python, Witnesses)
    taken = [(w._ids, w._ptrs, w._versions, w._skeys, w._epochs) for w in (native, python)]
    assert taken[0] == taken[1], name
    assert native.unchanged() and python.unchanged(), name


def test_control_the_compiled_taking_reads_the_tensors_anew() -> None:
    """Control for the test above: what the compiled taking writes follows the tensors
    (a pointer and a version that moved are taken as they are now), and sites it cannot
    read (a non-dict holder) are left to the Python path."""
    with _native.using(True):
        native = _native.get()
    assert native is not None
    model = Model()
    w = Witnesses(_witness_sites(model), JOURNAL)
    before = (list(w._ptrs), list(w._versions))
    _rebind(0, torch.randn_like)(model, 0)
    _inplace(model, 1)
    assert not w.unchanged()
    w.record([0, 1])
    assert w._ptrs[0] != before[0][0] and w._versions[1] != before[1][1]
    assert w.unchanged()
    holders, keys = [object(), model.layers[0]._parameters], ["w", "w"]
    got = native.take_witnesses(holders, keys, [0, 1], [0, 0], [0, 0], [0, 0], [0, 0])
    assert got == [0]


def test_control_what_the_compiled_taking_remembers_is_what_the_check_trusts() -> None:
    """Control for the `taken` cases above: the check trusts the rows the compiled taking
    writes, without looking their sites up. A row remembering the version an in-place
    write has since moved the tensor to (as a taking that read it too late would) hides
    that write; the row the taking wrote does not."""
    with _native.using(True):
        model = Model()
        w = Witnesses(_witness_sites(model), JOURNAL)
    assert w._native is not None
    w.record(range(len(w)))
    honest = bytes(w._looked[:40])  # site 0: layer 0's weight
    assert honest != bytes(40)
    _inplace(model, 0)
    late = bytearray(honest)
    late[32:40] = model.layers[0].w._version.to_bytes(8, sys.byteorder)
    w._looked[:40] = late
    assert w.unchanged()  # trusted: the write is hidden
    w._looked[:40] = honest
    assert not w.unchanged()


def test_a_declared_write_shows_in_both_paths() -> None:
    """A write graphsafe is told about (`gs.mark_written`) moves the journal epoch."""
    model = Model()
    witnesses = _both(lambda: Witnesses(_witness_sites(model), JOURNAL))
    assert all(w.unchanged() for w in witnesses)
    gs.mark_written(model.layers[1].b)
    assert not any(w.unchanged() for w in witnesses)


def _declared(m: Model, i: int) -> None:
    gs.mark_written(m.layers[i].b)


# Changes no dict: the identity of every site holds, and only what the witnesses read of
# the tensor itself (pointer, version) or the journal shows them.
NO_DICT_CHANGES: dict[str, Mutation] = {
    "in place under no_grad": _inplace,
    ".data = new storage": _rebind(0, torch.randn_like),
    ".data = a buffer's new storage": _buffer_rebind,
    "an offset view of the same storage": _rebind(0, lambda d: d.view(-1)[6:].view(3, 6)),
    "a declared write (the journal)": _declared,
    "set_() to new storage": _set,
    "swap_tensors with another tensor": _swap_tensors,
    "emptied": _rebind(0, lambda d: torch.empty(0)),
}


@pytest.mark.parametrize("name", sorted(NO_DICT_CHANGES))
def test_a_change_no_dict_sees_is_refused_after_the_compiled_shortcut(name: str) -> None:
    """Once the compiled check has passed, it skips the lookup of every site whose dict
    did not change; a change to the tensor itself or a journal write still shows on both
    paths."""
    model = Model()
    witnesses = _both(lambda: Witnesses(_witness_sites(model), JOURNAL))
    for _ in range(2):
        assert all(w.unchanged() for w in witnesses)
    NO_DICT_CHANGES[name](model, 1)
    assert [w.unchanged() for w in witnesses] == [False, False], name


@pytest.mark.parametrize("name", sorted(NO_DICT_CHANGES))
def test_control_the_identity_shortcut_alone_passes_those_changes(name: str) -> None:
    """The control of the test above: its changes are ones the dicts' shortcut alone
    misses. `same_items`, which checks identity only, takes the shortcut and passes each
    of them: the witnesses refuse them only by reading the tensors and the journal."""
    with _native.using(True):
        native = _native.get()
    assert native is not None
    model = Model()
    sites = _witness_sites(model)
    holders, keys = [h for h, _ in sites], [k for _, k in sites]
    objects = [h[k] for h, k in sites]
    looked = bytearray(16 * len(sites))
    assert native.same_items(holders, keys, objects, looked)
    NO_DICT_CHANGES[name](model, 1)
    assert native.same_items(holders, keys, objects, looked)
    model.layers[1].w = nn.Parameter(torch.randn(4, 6), requires_grad=False)
    assert not native.same_items(holders, keys, objects, looked)  # a rebinding does show


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_pointer_moved_refreshed_and_moved_back_is_refused(native: bool) -> None:
    """A site's new witnesses (a refresh took them) forget what the compiled check
    remembered of the old ones: a pointer moved, witnessed there, then moved back to
    where the remembered check saw it, is refused on both paths."""
    model = Model()
    w = model.layers[0].w
    first = w.data
    with _native.using(native):
        witnesses = Witnesses(_witness_sites(model), JOURNAL)
    for _ in range(2):
        assert witnesses.unchanged()
    second = torch.randn_like(first)
    w.data = second
    assert not witnesses.unchanged()
    witnesses.record([0])  # refreshed: the new storage is the one expected
    w.data = first  # back to the storage the first checks passed, before any check
    assert not witnesses.unchanged()
    assert witnesses.changed() == [(0, "rebound to new storage")]
    w.data = second
    assert witnesses.unchanged()


class _Kernel:
    __slots__ = ("packed",)

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed


class OddHolder(nn.Module):
    """Tensors held where no item lookup reads them: a slot, a closure cell, a function's
    default, a partial's arguments (the ledger's odd links)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = _Kernel(torch.randn(3))
        cell, packed = torch.randn(3), torch.randn(3)
        self.closure = lambda: cell
        self.default = lambda packed=packed: packed
        self.part = functools.partial(torch.add, torch.randn(3))


def _swap_cell(m: OddHolder) -> None:
    m.closure.__closure__[0].cell_contents = torch.randn(3)  # type: ignore[index]


def _swap_defaults(m: OddHolder) -> None:
    m.default.__defaults__ = (torch.randn(3),)


def _write_slot(m: OddHolder) -> None:
    with torch.no_grad():
        m.kernel.packed.add_(1)


# (mutation of an odd link, the ledger still holds)
ODD_CHANGES: dict[str, tuple[Callable[[OddHolder], None], bool]] = {
    "nothing": (lambda m: None, True),
    "a slot's tensor written in place": (_write_slot, True),
    "a slot rebound": (lambda m: setattr(m.kernel, "packed", torch.randn(3)), False),
    "a closure cell rebound": (_swap_cell, False),
    "a function's defaults replaced": (_swap_defaults, False),
}


@pytest.mark.parametrize("name", sorted(ODD_CHANGES))
def test_both_paths_check_the_odd_links_with_the_known_verdict(name: str) -> None:
    """The ledger's links that no item lookup reads (slots, closure cells, builtins'
    fields) are checked in one compiled call when built (`same_steps`): after checks that
    passed, each rebinding is refused and nothing else is, on both paths."""
    model = OddHolder()
    ledgers = _both(lambda: Ledger.snapshot(model))
    assert ledgers[0]._native is not None and ledgers[1]._native is None
    assert all(len(ledger._odd) == 4 for ledger in ledgers)  # slot, cell, defaults, args
    for _ in range(2):
        assert all(ledger._unchanged() for ledger in ledgers)
    mutate, holds = ODD_CHANGES[name]
    mutate(model)
    assert [ledger._unchanged() for ledger in ledgers] == [holds, holds], name
    if not holds:
        assert ledgers[0].verify(), name


@pytest.mark.parametrize("name", [n for n, (_, holds) in ODD_CHANGES.items() if not holds])
def test_control_without_the_odd_links_the_compiled_ledger_passes_those_changes(
    name: str,
) -> None:
    """The control of the test above: its rebindings change no dict and no pinned
    tensor, so a compiled ledger that read no odd link would pass each of them."""
    model = OddHolder()
    with _native.using(True):
        ledger = Ledger.snapshot(model)
    ledger._odd_steps = ([], [], [])
    ledger._odd = []
    ODD_CHANGES[name][0](model)
    assert ledger._unchanged(), name


def test_an_inference_tensor_is_left_to_the_python_path() -> None:
    """An inference tensor has no version counter: the compiled check says "cannot
    tell", as the Python path does, and nothing raises."""
    model = Model()
    with torch.inference_mode():
        model.layers[0].b = torch.zeros(6)
    witnesses = _both(lambda: Witnesses(_witness_sites(model), JOURNAL))
    assert [w.unchanged() for w in witnesses] == [False, False]


class Folded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4), requires_grad=False)


def _guarded(native: bool) -> tuple[nn.Module, gs.Graph, torch.Tensor, torch.Tensor]:
    reg = gs.Registry()

    @reg.derive(Folded, "w_t", inputs=["w"])
    def _w_t(self: Folded, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return w.t().contiguous() if out is None else out.copy_(w.t())

    model = Folded()
    gs.runtime(model, reg).refresh()
    x = torch.randn(3, 8)
    with _native.using(native):
        graph = gs.Graph(backend="cpu", guard=model)
        with torch.no_grad(), graph.capture():
            out = x @ model.w_t.t()
    return model, graph, x, out


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_the_guard_refuses_a_stale_or_moved_replay_on_either_path(native: bool) -> None:
    model, graph, x, out = _guarded(native)
    graph.replay()  # healthy: replays
    assert torch.equal(out, x @ model.w_t.t())
    with torch.no_grad():
        model.w.mul_(2)  # in place, outside any load
    with pytest.raises(gs.StaleError, match="w_t"):
        graph.replay()
    gs.runtime(model).refresh()
    graph.replay()
    assert torch.equal(out, x @ model.w_t.t())
    model.w_t.data = model.w_t.data.clone()  # what the graph reads, rebound after capture
    with pytest.raises(gs.StorageMovedError, match="w_t"):
        graph.replay()
    graph.reset()


def test_a_failed_build_says_why_and_the_guard_keeps_its_python_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAPHSAFE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(_native.NativeBuildError, match=r"compiling checks.cpp failed \(exit 1\)"):
        _native.build()
    assert not _native.path().exists()
    with (
        pytest.raises(_native.NativeBuildError, match="graphsafe native build"),
        _native.using(True),
    ):
        pass


# A first use of the compiled checks (a guarded capture pins the model, snapshots its
# ledger and witnesses), a write only the observer sees, then an in-place write either
# path sees, and what the process got: the number of GraphSafetyWarnings and their text,
# then the guard's path.
_FIRST_USE = """
import json, warnings
import torch, graphsafe as gs
from graphsafe import _native
from torch import nn
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    reg = gs.Registry()
    m = nn.Linear(4, 4)
    @reg.derive(nn.Linear, 'w_t', inputs=['weight'])
    def f(self, weight, *, out=None):
        return weight.t().contiguous() if out is None else out.copy_(weight.t())
    gs.runtime(m, reg).refresh()
    g = gs.Graph(backend='cpu', guard=m)
    with torch.no_grad(), g.capture():
        y = m.w_t.sum()
    m.weight.data.copy_(torch.randn(4, 4))  # moves no version: only the observer sees it
    try:
        g.replay()
        print('unseen')
    except gs.StaleError as e:
        print('observed')
    gs.runtime(m).refresh()
    with torch.no_grad():
        m.weight.add_(1)  # in place: its version moves, which either path sees
    try:
        g.replay()
        print('replayed')
    except gs.StaleError as e:
        print('refused')
    g.reset()
warned = [str(w.message) for w in caught if issubclass(w.category, gs.GraphSafetyWarning)]
print(len(warned))
print(json.dumps(warned))
print(_native.describe())
"""


def _first_use(env: dict[str, str]) -> tuple[str, int, list[str], str, str]:
    """`_FIRST_USE` in a fresh process: ("observed refused" where the observer runs,
    "unseen refused" where it does not; the number of warnings, their texts, the guard's
    path, stderr)."""
    done = subprocess.run([sys.executable, "-c", _FIRST_USE], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    observed, replay, count, texts, status = done.stdout.splitlines()[-5:]
    return f"{observed} {replay}", int(count), json.loads(texts), status, done.stderr


def test_without_a_compiler_the_python_path_runs_with_one_warning_and_still_refuses(
    tmp_path: Path,
) -> None:
    """No C++ compiler and an empty cache: nothing is built, the status names the Python
    path, the process gets one warning saying what it loses (the observer, speed) and the
    fix, and the guard still refuses a replay after an in-place write (what its Python path
    sees), while a `.data` write goes unseen, as the warning says. The
    observer's own warning at pin is not given on top of it. Control: the same script
    where the compiler is (the suite's cache, built) warns nothing and runs compiled, and
    its observer sees the write the Python path missed."""
    env = {**os.environ, "GRAPHSAFE_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-c++")}
    env.pop("GRAPHSAFE_NATIVE", None)
    status = subprocess.run(
        [sys.executable, "-m", "graphsafe", "native", "status"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert "python (not built yet: the first use builds it" in status.stdout
    replay, count, texts, path, stderr = _first_use(env)
    assert count == 1, texts
    assert texts[0].startswith("graphsafe takes its Python path")
    assert f"got: no C++ compiler found (tried $CXX={tmp_path / 'no-c++'})" in texts[0]
    assert "\nlost: the process-wide write observer" in texts[0]
    assert "threads a recorded bring-up does not follow" in texts[0]
    assert "and speed" in texts[0]
    assert texts[0].endswith("GRAPHSAFE_NATIVE=0 takes the Python path without this warning")
    assert "\nfix: install a C++ compiler" in texts[0]
    assert replay == "unseen refused"  # the loss the warning names: no observer
    assert path.startswith("python (the build failed: no C++ compiler found")
    assert "building the compiled checks" not in stderr
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing half-written
    env = {k: v for k, v in os.environ.items() if k != "GRAPHSAFE_NATIVE"}
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here for the control")
    replay, count, texts, path, stderr = _first_use(env)
    assert (replay, count, path) == ("observed refused", 0, f"native ({_native.path()})"), texts


def _failing_compiler(at: Path, log: Path) -> str:
    """A compiler that answers `--version` and fails every compile, noting each in `log`."""
    at.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo failing c++ 1.0; exit 0; fi\n'
        f'echo "$*" >> {shlex.quote(str(log))}\necho "error: no" >&2\nexit 1\n'
    )
    at.chmod(0o755)
    return str(at)


def test_a_failed_build_on_first_use_is_said_once_and_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The first use tries the build once, says so on stderr as it starts and ends, warns
    once, and leaves no library; a later first use in the same process (as after `get()`
    forgets its answer) neither compiles nor warns again. Control: an explicit
    `graphsafe native build` does try again, so it is the memory of the failure that
    spares the process, not a build that never ran."""
    log = tmp_path / "compiler.log"
    monkeypatch.setenv("GRAPHSAFE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", _failing_compiler(tmp_path / "c++", log))
    monkeypatch.delenv("GRAPHSAFE_NATIVE", raising=False)
    for name, fresh in (("_loaded", loader._UNSET), ("_failed", {}), ("_announced", [])):
        monkeypatch.setattr(loader, name, fresh)
    with pytest.warns(gs.GraphSafetyWarning, match=r"(?s)got: compiling \w+\.cpp failed.*lost"):
        assert _native.get() is None
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("graphsafe: building the compiled checks for torch")
    assert re.fullmatch(r"graphsafe: building the compiled checks failed after \d+\.\d s: "
                        r"compiling \w+\.cpp failed \(exit 1\).*", err[1]), err
    tries = len(log.read_text().splitlines())
    assert tries == len(loader._SOURCES)  # compiled side by side, then refused
    assert sorted(p.name for p in _native.path().parent.iterdir()) == ["build.lock"]
    monkeypatch.setattr(loader, "_loaded", loader._UNSET)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert _native.get() is None
    assert again == [] and capfd.readouterr().err == ""
    assert len(log.read_text().splitlines()) == tries
    with pytest.raises(_native.NativeBuildError, match=r"compiling \w+\.cpp failed"):
        _native.build()
    assert len(log.read_text().splitlines()) == 2 * tries


def test_the_native_switch_turns_it_off(tmp_path: Path) -> None:
    env = {**os.environ, "GRAPHSAFE_NATIVE": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "graphsafe", "native", "status"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert done.stdout.strip() == "guard: python (GRAPHSAFE_NATIVE=0)"


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_rebound_input_is_found_at_the_next_load_on_either_path(native: bool) -> None:
    """The every-load rebinding check (identity, pointer, stride of every input and
    buffer): before pin the new tensor is taken, after pin the load is refused."""
    with _native.using(native):
        model, graph, x, _ = _guarded(native)
        graph.reset()  # unpinned: a rebinding is taken
        model.w.data = model.w.data.t().contiguous().t()  # same values, new strides
        gs.runtime(model).refresh()
        assert torch.equal(model.w_t, model.w.t())
        graph = gs.Graph(backend="cpu", guard=model)
        with torch.no_grad(), graph.capture():
            _ = x @ model.w_t.t()
        model.w.data = torch.randn(8, 4)  # pinned: refused at the next load
        with pytest.raises(gs.StorageMovedError, match="w"):
            gs.runtime(model).refresh()
        graph.reset()


# --- The build: its cache key, its lock, its compiler runs ---------------------------


def _compiler_script(at: Path, version: str, log: Path | None = None) -> str:
    """A compiler that answers `--version` with `version` and otherwise runs the real one
    (noting its arguments in `log`, its stderr in `log` + ".err")."""
    real = shutil.which("c++") or shutil.which("g++")
    if real is None:
        pytest.skip("no C++ compiler here")
    note = f'echo "$*" >> {shlex.quote(str(log))}\n' if log else ""
    err = f" 2>> {shlex.quote(str(log))}.err" if log else ""
    at.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo {shlex.quote(version)}; exit 0; fi\n'
        f'{note}exec {shlex.quote(real)} "$@"{err}\n'
    )
    at.chmod(0o755)
    return str(at)


def _edited(tmp_path: Path, files: tuple[Path, ...]) -> tuple[Path, ...]:
    """Copies of `files` (same names), the last one with a line added."""
    out = []
    for file in files:
        copy = tmp_path / "edited" / file.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(file.read_bytes())
        out.append(copy)
    out[-1].write_text(out[-1].read_text() + "// edited\n")
    return tuple(out)


Change = Callable[[pytest.MonkeyPatch, Path], None]
CHANGES: dict[str, Change] = {
    "a compile flag": lambda mp, tmp: mp.setattr(
        loader, "_COMPILE_FLAGS", (*loader._COMPILE_FLAGS, "-O3")),
    "a link flag": lambda mp, tmp: mp.setattr(
        loader, "_LINK_FLAGS", (*loader._LINK_FLAGS, "-Wl,-O1")),
    "the compiler's path": lambda mp, tmp: mp.setenv(
        "CXX", _compiler_script(tmp / "other-c++", "fake c++ 1.0")),
    "the compiler's version": lambda mp, tmp: mp.setenv(
        "CXX", _compiler_script(tmp / "c++", "fake c++ 10.0")),  # the same file, rewritten
    "torch's git version": lambda mp, tmp: mp.setattr(torch.version, "git_version", "0" * 40),
    "torch's version": lambda mp, tmp: mp.setattr(torch, "__version__", "0.0.0"),
    "Python's version": lambda mp, tmp: mp.setattr(sys, "version", "3.0.0"),
    "the platform": lambda mp, tmp: mp.setattr(sysconfig, "get_platform", lambda: "other"),
    "a source": lambda mp, tmp: mp.setattr(loader, "_SOURCES", _edited(tmp, loader._SOURCES)),
    "the header": lambda mp, tmp: mp.setattr(loader, "_HEADERS", _edited(tmp, loader._HEADERS)),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_the_library_name_changes_with_what_it_is_built_from(
    change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library built otherwise is never loaded in place of this one."""
    monkeypatch.setenv("CXX", _compiler_script(tmp_path / "c++", "fake c++ 1.0"))
    before = _native.path().name
    CHANGES[change](monkeypatch, tmp_path)
    assert _native.path().name != before


def test_control_the_library_name_is_the_same_for_the_same_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pairs the test above: the name is not new on every call, nor in every process."""
    monkeypatch.setenv("CXX", _compiler_script(tmp_path / "c++", "fake c++ 1.0"))
    name = _native.path().name
    assert _native.path().name == name
    again = subprocess.run(
        [sys.executable, "-c", "from graphsafe import _native; print(_native.path().name)"],
        capture_output=True, text=True, check=True,
    )
    assert again.stdout.strip() == name


def _compiler_runs(log: Path) -> list[list[str]]:
    return [run.split() for run in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.skipif(
    loader._setting() == "off",
    reason="a real build (a minute): run once, in the suite's default run, not its "
    "GRAPHSAFE_NATIVE=0 rerun (the test sets its processes' switch itself)",
)
def test_the_first_use_builds_once_for_processes_starting_together_and_nothing_else_builds(
    tmp_path: Path,
) -> None:
    """With an empty cache and a compiler, by default: importing every module of graphsafe,
    `graphsafe --help` and `graphsafe native status` build nothing, nor does a first use
    with `GRAPHSAFE_NATIVE=0`; then two processes whose first use starts together compile
    the extension once (the build lock), with -Wall and without a warning, each saying on
    stderr that it builds and when it is ready, and both guard on the compiled path (their
    observer refuses a write only it sees). The builds that do not happen are the controls
    of the one that does, with the same cache and compiler, and it of them."""
    log = tmp_path / "compiler.log"
    cache = tmp_path / "cache"
    env = {**os.environ, "GRAPHSAFE_CACHE": str(cache),
           "CXX": _compiler_script(tmp_path / "c++", "counting c++", log)}
    env.pop("GRAPHSAFE_NATIVE", None)
    imports = ("import importlib, pkgutil, graphsafe\n"
               "for m in pkgutil.walk_packages(graphsafe.__path__, 'graphsafe.'):\n"
               "    if m.name != 'graphsafe.__main__': importlib.import_module(m.name)\n")
    for argv in (["-c", imports], ["-m", "graphsafe", "--help"],
                 ["-m", "graphsafe", "native", "status"]):
        done = subprocess.run([sys.executable, *argv], env=env, capture_output=True,
                              text=True, check=True)
        assert "building" not in done.stderr, argv
    assert "python (not built yet" in done.stdout
    replay, count, _, status, stderr = _first_use({**env, "GRAPHSAFE_NATIVE": "0"})
    assert (replay, count, status) == ("unseen refused", 1, "python (GRAPHSAFE_NATIVE=0)")
    assert "building" not in stderr
    assert _compiler_runs(log) == [] and not (cache / "native").exists()
    both = [
        subprocess.Popen([sys.executable, "-c", _FIRST_USE], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for process in both:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        assert out.splitlines()[-5:-2] == ["observed", "refused", "0"], out
        assert out.splitlines()[-1].startswith(f"native ({cache}"), out
        said = [line for line in err.splitlines() if line.startswith("graphsafe:")]
        assert len(said) == 2, err
        assert said[0].startswith("graphsafe: building the compiled checks for torch ")
        assert said[0].endswith("GRAPHSAFE_NATIVE=0 skips it) ...")
        assert re.fullmatch(r"graphsafe: compiled checks ready in \d+\.\d s \(\S+\)", said[1])
    runs = _compiler_runs(log)
    compiled = sorted(Path(run[run.index("-c") + 1]).name for run in runs if "-c" in run)
    assert compiled == ["checks.cpp", "fingerprint.cpp", "found.cpp", "kernels.cpp",
                        "map_rows.cpp", "model_map.cpp", "observer.cpp", "recorder.cpp",
                        "records.cpp", "strays.cpp", "tracker.cpp", "walk.cpp", "witnesses.cpp"]
    assert len(runs) == 14  # and one link
    assert all("-Wall" in run and "-w" not in run for run in runs if "-c" in run)
    assert "warning" not in Path(f"{log}.err").read_text()
    library, lock = sorted(p.name for p in (cache / "native").iterdir())  # nothing else
    assert lock == "build.lock" and library.startswith("_graphsafe_native_"), library


_HOLD_LOCK = (
    "import fcntl, sys\n"
    "lock = open(sys.argv[1], 'a')\n"
    "fcntl.flock(lock, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.readline()\n"
)


def _put_library(lib: Path, content: bytes) -> None:
    """What a build does last: the finished library replaces the path at once."""
    tmp = lib.with_name("incoming")
    tmp.write_bytes(content)
    tmp.chmod(0o755)
    os.replace(tmp, lib)


def _build_or_error(force: bool) -> Path | Exception:
    try:
        return _native.build(force=force)
    except Exception as exc:  # shown by the test's assertion
        return exc


@pytest.mark.parametrize("force", [False, True], ids=["build", "forced build"])
def test_a_build_waits_for_the_one_under_way_and_takes_its_library(
    force: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the build lock: the build waits, then takes the library that
    process made. The compiler is `false`, so a build that returns a path did not compile.
    Control: with no build under way, the same call compiles (and fails)."""
    monkeypatch.setenv("GRAPHSAFE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")
    lib = _native.path()
    for directory in (lib.parent.parent, lib.parent):
        directory.mkdir(mode=0o700)
    if force:
        _put_library(lib, b"an older library")
    with pytest.raises(_native.NativeBuildError, match=r"compiling checks\.cpp failed"):
        _native.build(force=force)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lib.parent / "build.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results: list[Path | Exception] = []
    waiter = threading.Thread(target=lambda: results.append(_build_or_error(force)))
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not results  # waiting for the lock
        _put_library(lib, b"the library the other build made")
        holder.stdin.write("done\n")
        holder.stdin.flush()  # the holder exits: its lock is released
        waiter.join(timeout=60)
    finally:
        holder.kill()
        holder.wait()
        waiter.join(timeout=60)
    assert results == [lib]
    assert lib.read_bytes() == b"the library the other build made"


# --- The cache is trusted as ssh trusts a key -----------------------------------------


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this user's own, mode 0o700, holding a copy of the built library; the
    guard looks for it afresh. Returns the library's path."""
    built = _native.path()
    root = tmp_path / "cache"
    (root / "native").mkdir(mode=0o700, parents=True)
    root.chmod(0o700)
    monkeypatch.setenv("GRAPHSAFE_CACHE", str(root))
    monkeypatch.delenv("GRAPHSAFE_NATIVE", raising=False)
    lib = _native.path()
    assert lib.name == built.name
    shutil.copyfile(built, lib)
    lib.chmod(0o755)
    monkeypatch.setattr(loader, "_loaded", loader._UNSET)
    return lib


def _describe_afresh(monkeypatch: pytest.MonkeyPatch) -> str:
    """`describe()` as a new process would say it (get() remembers its first answer)."""
    monkeypatch.setattr(loader, "_loaded", loader._UNSET)
    return _native.describe()


def _assert_loads(lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert loader._load() is not None
    assert _describe_afresh(monkeypatch) == f"native ({lib})"


def test_control_a_cache_of_ones_own_loads(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pairs the refusals below: the cache they start from loads."""
    _assert_loads(own_cache, monkeypatch)
    with _native.using(True):
        assert _native.get() is not None


@pytest.mark.parametrize(("level", "mode"), [
    pytest.param(level, mode, id=f"{level} {mode:#o}")
    for level, mode in [("GRAPHSAFE_CACHE", 0o770), ("native", 0o777), ("native", 0o702)]
])
def test_a_cache_directory_others_can_write_is_refused(
    level: str, mode: int, own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not loaded, not built into; the status says which directory, its mode and the fix.
    Control: `chmod go-w` and it loads."""
    directory = own_cache.parent if level == "native" else own_cache.parent.parent
    directory.chmod(mode)
    assert loader._load() is None
    status = _describe_afresh(monkeypatch)
    assert status.startswith(f"python (refused {directory}: writable by group or others")
    assert f"got: owned by uid {os.geteuid()}, mode {mode:#o}" in status
    assert f"fix: `chmod go-w {directory}`" in status
    with pytest.raises(_native.NativeBuildError, match=(
        rf"refusing to build into {re.escape(str(own_cache.parent))}: "
        rf"{re.escape(str(directory))} is writable by group or others\n"
        r"expected: owned by you .*\ngot: .*\nfix: `chmod go-w"
    )):
        _native.build(force=True)
    with (
        pytest.raises(_native.NativeBuildError, match="writable by group or others"),
        _native.using(True),
    ):
        pass
    directory.chmod(mode & ~0o022)
    _assert_loads(own_cache, monkeypatch)


def test_a_library_others_can_write_is_refused(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library file anyone may write is not loaded: `graphsafe native status` (a new
    process) says so and how to fix it. Control: made read-only for others, it loads."""
    own_cache.chmod(0o777)
    assert loader._load() is None
    status = subprocess.run([sys.executable, "-m", "graphsafe", "native", "status"],
                            capture_output=True, text=True, check=True).stdout
    assert status.startswith(f"guard: python (refused {own_cache}: writable by group or others")
    assert "mode 0o777" in status
    assert f"fix: remove it (`rm {own_cache}`) and run `graphsafe native build`" in status
    own_cache.chmod(0o755)
    _assert_loads(own_cache, monkeypatch)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away takes root")
@pytest.mark.parametrize("level", ["GRAPHSAFE_CACHE", "native", "library"])
def test_a_cache_owned_by_another_user_is_refused(
    level: str, own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Modes alone are not enough: another user's directory or library is refused. Control:
    given back, it loads."""
    target = {"GRAPHSAFE_CACHE": own_cache.parent.parent, "native": own_cache.parent,
              "library": own_cache}[level]
    os.chown(target, 12345, -1)
    try:
        assert loader._load() is None
        status = _describe_afresh(monkeypatch)
        assert status.startswith(f"python (refused {target}: owned by uid 12345")
        assert f"expected: owned by you (uid {os.geteuid()})" in status
        if level != "library":
            assert "fix: point GRAPHSAFE_CACHE at a directory of your own" in status
            with pytest.raises(_native.NativeBuildError, match="owned by uid 12345"):
                _native.build(force=True)
    finally:
        os.chown(target, os.geteuid(), -1)
    _assert_loads(own_cache, monkeypatch)


def test_the_loader_makes_the_cache_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directories a build creates are mode 0o700 whatever the umask. Control: under the
    same umask a plain mkdir makes a directory anyone can write."""
    root = tmp_path / "new" / "cache"
    monkeypatch.setenv("GRAPHSAFE_CACHE", str(root))
    monkeypatch.setenv("CXX", "false")  # fails after the directories are made
    old = os.umask(0)
    try:
        with pytest.raises(_native.NativeBuildError, match=r"compiling checks\.cpp failed"):
            _native.build()
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    for directory in (tmp_path / "new", root, root / "native"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert (tmp_path / "plain").stat().st_mode & 0o777 == 0o777


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.int64,
           torch.complex64, torch.float8_e4m3fn]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(_DTYPES), shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    start=st.integers(0, 3), transpose=st.booleans(), meta=st.booleans(),
    parameter=st.booleans(),
)
def test_the_compiled_storage_reads_are_the_python_ones(
    dtype: torch.dtype, shape: list[int], start: int, transpose: bool, meta: bool,
    parameter: bool,
) -> None:
    """`storage_rows`, `storage_ids` and `storage_keys` (what a recorded load's end and
    the ties read of thousands of tensors in one call) give, for any plain tensor, what
    graphsafe reads in Python: the storage identity, the storage key, `data_ptr()` and
    `stride()`; views at an offset, a transposed view, empty and meta tensors included."""
    from graphsafe._lineage.record.recorder import sid_of
    from graphsafe._memory.walk import storage_key

    with _native.using(True):
        native = _native.get()
    assert native is not None
    base = torch.zeros(start + 6 * 6 * 6, dtype=dtype, device="meta" if meta else "cpu")
    n = 1
    for size in shape:
        n *= size
    t = base[start:start + n].view(shape)  # `[]`: a 0-d view of one element
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)
    if parameter and dtype.is_floating_point:
        t = nn.Parameter(t, requires_grad=False)
    tensors = [t, base, torch.ones(3)]
    python = [(sid_of(x), storage_key(x), x.data_ptr(), x.stride()) for x in tensors]
    assert native.storage_rows(tensors) == python
    assert native.storage_ids(tensors) == [row[0] for row in python]
    assert native.storage_keys(tensors) == [row[1] for row in python]


def test_control_what_the_compiled_storage_reads_cannot_read_is_left_to_python() -> None:
    """A sparse tensor among them: neither call answers (None), so the caller reads each
    apart in Python, as it would have; and their answers are not the same numbers for
    two views of one storage at other offsets (the pointer is the view's)."""
    with _native.using(True):
        native = _native.get()
    assert native is not None
    dense = torch.arange(8.0)
    assert native.storage_rows([dense, torch.eye(2).to_sparse()]) is None
    assert native.storage_ids([torch.eye(2).to_sparse()]) is None
    assert native.storage_keys([torch.eye(2).to_sparse()]) is None
    a, b = native.storage_rows([dense[:4], dense[4:]])
    assert a[0] == b[0] and a[1] == b[1] and b[2] - a[2] == 16
