"""`Guard(holds_addresses=False)`: where no captured graph holds the model's addresses (an
engine that runs the model's code at each step), a tensor rebound to new memory is followed,
not refused (`graphsafe._graphs.guard`, `Ledger.followed`).

Each "followed" test has its control: the same move under a captured `gs.Graph` (which
holds the old address) is refused, and replaying it unguarded is stale; stale content is
refused in the follow mode as ever.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import scaled_layer_class
from torch import nn

from graphsafe._errors import StaleError, StorageMovedError
from graphsafe._graphs.graph import Graph
from graphsafe._graphs.guard import Guard


class Packed(nn.Module):
    """A layer whose forward reads a copy of its weight held in a closure, as vLLM's CPU
    build keeps `cpu_linear = lambda x, weight, bias: kernel(x, packed_weight, ...)`."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.scale = torch.full((4,), 0.5)  # plain tensor attribute
        self.cache = [torch.ones(4)]
        self.post_load()

    def post_load(self) -> None:
        """The engine's post-load step: a new packed copy, in a new closure."""
        packed = self.weight.detach().t().contiguous()  # [in, out]
        self.cpu_linear: Callable[[torch.Tensor], torch.Tensor] = lambda x: x @ packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x) * self.scale + self.cache[0]


def _reload(m: Packed) -> None:
    """New weights at a new address, and the packed copy rebuilt from them."""
    m.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    m.post_load()


def _rebind_attribute(m: Packed) -> None:
    m.scale = torch.full((4,), 2.0)


def _replace_list_item(m: Packed) -> None:
    m.cache[0] = torch.zeros(4)


MOVES = [_reload, _rebind_attribute, _replace_list_item]
PATHS = {
    _reload: {"weight", "cpu_linear.<closure packed>"},
    _rebind_attribute: {"scale"},
    _replace_list_item: {"cache.0"},
}


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _step(guard: Guard, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One step of an engine without graphs: the guard's checks, then the model's code."""
    with guard.replaying(), torch.no_grad():
        return model(x)


@pytest.mark.parametrize("move", MOVES, ids=[m.__name__ for m in MOVES])
def test_without_graphs_a_moved_tensor_is_followed_and_listed(
    move: Callable[[Packed], None],
) -> None:
    model, x = Packed(), torch.randn(2, 4)
    guard = Guard(model, model, repair=False, holds_addresses=False)
    _step(guard, model, x)
    move(model)
    out = _step(guard, model, x)  # no error, and the new tensors are read
    assert torch.equal(out, _eager(model, x))
    assert PATHS[move] <= set(guard.followed)
    assert all(whats for whats in guard.followed.values()) and guard.faults() == {}
    assert guard.ledger.verify() == ()  # pinned where it is now: the flat check holds
    move(model)  # and a second move is followed from there
    assert torch.equal(_step(guard, model, x), _eager(model, x))


@pytest.mark.parametrize("move", MOVES, ids=[m.__name__ for m in MOVES])
def test_control_a_captured_graph_still_refuses_the_same_move(
    move: Callable[[Packed], None],
) -> None:
    model, x = Packed(), torch.randn(2, 4)
    g = Graph(backend="cpu", guard=model)
    with torch.no_grad(), g.capture(warmup=lambda: model(x)):
        out = model(x)
    move(model)
    with pytest.raises(StorageMovedError, match=r"(?s)after graph capture.*expected:.*got:"):
        g.replay()
    # What the refusal guards against: the graph reads the old addresses.
    unguarded = Graph(backend="cpu")
    model2 = Packed()
    with torch.no_grad(), unguarded.capture(warmup=lambda: model2(x)):
        out = model2(x)
    old = out.clone()
    move(model2)
    unguarded.replay()
    assert torch.equal(out, old) and not torch.equal(out, _eager(model2, x))


def test_control_a_guard_that_holds_addresses_refuses_and_lists_the_fault() -> None:
    model, x = Packed(), torch.randn(2, 4)
    guard = Guard(model, model, repair=False)
    _step(guard, model, x)
    _rebind_attribute(model)
    assert guard.faults() == {"scale": ("storage",)}
    with pytest.raises(StorageMovedError, match=r"scale was rebound after graph capture"):
        _step(guard, model, x)
    assert guard.followed == {}


def test_without_graphs_a_rebound_input_leaves_its_derived_buffer_stale_and_refused() -> None:
    layer = scaled_layer_class()()
    layer.load_weights([])
    guard = Guard(layer, layer, repair=False, holds_addresses=False)
    with guard.replaying():
        pass
    layer.w = nn.Parameter(torch.full((2, 3), 3.0))  # outside any load: content unknown
    with pytest.raises(StaleError, match=r"w_scaled"), guard.replaying():
        pass
    # The control: the buffer the forward would read was computed from the old weight.
    assert not torch.equal(layer.w_scaled, layer.w * layer.scale)
    # A load that writes it (into the new tensor) makes it fresh, followed and served.
    layer.load_weights([("w", torch.full((2, 3), 4.0))])
    with guard.replaying():
        assert torch.equal(layer.w_scaled, layer.w * layer.scale)
    assert "w" in guard.followed


def test_without_graphs_a_rebound_input_in_a_load_is_refreshed_not_refused() -> None:
    """Taken as before a pin: the new tensor is the input from now on, its derivations
    re-run when the load ends. The control: a graph's pin refuses the same load."""
    layer = scaled_layer_class()()
    layer.load_weights([])
    guard = Guard(layer, layer, repair=False, holds_addresses=False)
    with guard.replaying():
        pass
    layer.w = nn.Parameter(torch.full((2, 3), 3.0))
    layer.load_weights([("bias", torch.zeros(3))])
    with guard.replaying():
        assert torch.equal(layer.w_scaled, torch.full((2, 3), 3.0) * layer.scale)
    guard.release()

    control = scaled_layer_class()()
    control.load_weights([])
    held = Guard(control, control, repair=False)
    control.w = nn.Parameter(torch.full((2, 3), 3.0))
    with pytest.raises(StorageMovedError):
        control.load_weights([("bias", torch.zeros(3))])
    held.release()


def test_without_graphs_a_replaced_submodule_is_still_refused() -> None:
    model = nn.Sequential(Packed(), Packed())
    guard = Guard(model, model, repair=False, holds_addresses=False)
    model[1] = Packed()
    with pytest.raises(StorageMovedError, match=r"module 1 was replaced"), guard.replaying():
        pass
