"""The guard's compiled checks answer exactly as its Python path does.

The compiled path (`graphsafe native build`) only ever decides "nothing changed"; when it
says otherwise, the Python path names the change. So the property that matters is: for
every way a model can be changed, both paths give the same verdict, and the verdict is
right. Each mutation below has its known verdict (the oracle); both paths are held to
it, for the ledger (rebinding, geometry, module swaps) and for the witnesses (identity,
pointer, version, journal epoch).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._memory.journal import Witnesses
from graphsafe._memory.ledger import Ledger


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """Build the extension (cached after the first time; `scripts/setup` builds it)."""
    try:
        _native.build()
    except _native.NativeBuildError as exc:  # no C++ compiler on this machine
        pytest.skip(f"the compiled guard cannot be built here: {exc}")


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6), requires_grad=False)
        self.register_buffer("b", torch.randn(6))
        self.extra = torch.randn(3)  # a plain tensor attribute
        self.listed = [torch.randn(2), torch.randn(2)]  # tensors inside a list


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(3)])


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


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(MUTATIONS)), layer=st.integers(0, 2))
def test_both_paths_give_the_known_verdict(name: str, layer: int) -> None:
    """Ledger and witnesses, compiled and Python, against the known verdict."""
    mutate, ledger_holds, witnesses_hold = MUTATIONS[name]
    model = Model()
    ledgers = _both(lambda: Ledger.snapshot(model))
    witnesses = _both(lambda: Witnesses(_witness_sites(model)))
    assert ledgers[0]._native is not None and ledgers[1]._native is None
    assert witnesses[0]._native is not None and witnesses[1]._native is None
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


def test_a_declared_write_shows_in_both_paths() -> None:
    """A write graphsafe is told about (`gs.mark_written`) moves the journal epoch."""
    model = Model()
    witnesses = _both(lambda: Witnesses(_witness_sites(model)))
    assert all(w.unchanged() for w in witnesses)
    gs.mark_written(model.layers[1].b)
    assert not any(w.unchanged() for w in witnesses)


def test_an_inference_tensor_is_left_to_the_python_path() -> None:
    """An inference tensor has no version counter: the compiled check says "cannot
    tell", as the Python path does, and nothing raises."""
    model = Model()
    with torch.inference_mode():
        model.layers[0].b = torch.zeros(6)
    witnesses = _both(lambda: Witnesses(_witness_sites(model)))
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
    model.w.data = model.w.data.clone()  # rebound after capture
    with pytest.raises(gs.StorageMovedError, match="w"):
        graph.replay()
    graph.reset()


def test_a_failed_build_says_why_and_the_guard_keeps_its_python_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAPHSAFE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(_native.NativeBuildError, match=r"compiling native.cpp failed \(exit 1\)"):
        _native.build()
    assert not _native.path().exists()
    with (
        pytest.raises(_native.NativeBuildError, match="graphsafe native build"),
        _native.using(True),
    ):
        pass


def test_without_a_build_the_command_line_says_python_and_the_guard_still_refuses(
    tmp_path: Path,
) -> None:
    """A fresh process with an empty cache: the status names the Python path, and a
    guarded replay after an in-place write is still refused."""
    env = {**os.environ, "GRAPHSAFE_CACHE": str(tmp_path)}
    env.pop("GRAPHSAFE_NATIVE", None)
    status = subprocess.run(
        [sys.executable, "-m", "graphsafe", "native", "status"],
        env=env, capture_output=True, text=True, check=True,
    )
    assert "python (not built: run `graphsafe native build`)" in status.stdout
    script = (
        "import torch, graphsafe as gs\n"
        "from graphsafe import _native\n"
        "from torch import nn\n"
        "assert _native.get() is None\n"
        "reg = gs.Registry()\n"
        "m = nn.Linear(4, 4)\n"
        "@reg.derive(nn.Linear, 'w_t', inputs=['weight'])\n"
        "def f(self, weight, *, out=None):\n"
        "    return weight.t().contiguous() if out is None else out.copy_(weight.t())\n"
        "gs.runtime(m, reg).refresh()\n"
        "g = gs.Graph(backend='cpu', guard=m)\n"
        "with torch.no_grad(), g.capture():\n"
        "    y = m.w_t.sum()\n"
        "with torch.no_grad():\n"
        "    m.weight.add_(1)\n"
        "try:\n"
        "    g.replay()\n"
        "except gs.StaleError as e:\n"
        "    print('refused:', type(e).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True)
    assert "refused: StaleError" in done.stdout


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


def test_build_on_first_use_when_asked(tmp_path: Path) -> None:
    """`GRAPHSAFE_NATIVE=build` compiles the extension at the first guard when it is
    missing. Control: the same fresh cache without it stays on the Python path."""
    env = {**os.environ, "GRAPHSAFE_CACHE": str(tmp_path)}
    script = "from graphsafe import _native; print(_native.describe())"
    env["GRAPHSAFE_NATIVE"] = "1"
    plain = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True)
    assert plain.stdout.startswith("python (not built")
    env["GRAPHSAFE_NATIVE"] = "build"
    built = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True)
    assert built.stdout.startswith(f"native ({tmp_path}")
