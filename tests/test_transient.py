"""Transient inputs: checkpoint-format weights held only while a load writes them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

import graphsafe as gs

Weights = Sequence[tuple[str, torch.Tensor]]
D = 8


def _copy_in(module: nn.Module, weights: Weights) -> None:
    for name, t in weights:
        module.get_parameter(name).data.copy_(t)


def _held(t: torch.Tensor) -> bool:
    return t.device.type != "meta"


@gs.graphsafe
class Layer(nn.Module):
    """A checkpoint-format `weight` [D, D] (transient) and the kernel-format `weight_k`:
    a half-precision transpose, with a resident `bias` read by the same derivation."""

    def __init__(self, transient: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(D, D), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(D), requires_grad=False)

    @gs.derive("weight_k", inputs=["weight", "bias"], transient=["weight"])
    def _weight_k(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return (weight.t() + bias).to(torch.float16).contiguous()  # [D, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_k.float()  # [T, D]

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


@gs.graphsafe
class ResidentLayer(Layer):
    """The same layer keeping its checkpoint-format weight (the control)."""

    @gs.derive("weight_k", inputs=["weight", "bias"])
    def _weight_k(self, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return (weight.t() + bias).to(torch.float16).contiguous()


@gs.graphsafe
class Stack(nn.Module):
    def __init__(self, layers: int = 4, cls: type[Layer] = Layer) -> None:
        super().__init__()
        self.layers = nn.ModuleList(cls() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


def _checkpoint(n: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        out.append((f"layers.{i}.weight", torch.randn(D, D, generator=g) / D))
        out.append((f"layers.{i}.bias", torch.randn(D, generator=g) / D))
    return out


def _reference(ck: Weights, x: torch.Tensor) -> torch.Tensor:
    w = dict(ck)
    n = len(ck) // 2
    for i in range(n):
        k = (w[f"layers.{i}.weight"].t() + w[f"layers.{i}.bias"]).to(torch.float16)
        x = x @ k.float()
    return x


def _x() -> torch.Tensor:
    return torch.randn(3, D, generator=torch.Generator().manual_seed(7))


def test_transient_inputs_hold_no_memory_between_loads() -> None:
    stack, ck = Stack(), _checkpoint(4, 0)
    stack.load_weights(ck)
    assert not any(_held(layer.weight) for layer in stack.layers)
    assert all(_held(layer.bias) for layer in stack.layers)  # resident
    assert torch.allclose(stack(_x()), _reference(ck, _x()))
    assert gs.runtime(stack).stale == ()


def test_control_resident_inputs_stay_held() -> None:
    stack = Stack(cls=ResidentLayer)
    stack.load_weights(_checkpoint(4, 0))
    assert all(_held(layer.weight) for layer in stack.layers)


def test_a_bucketed_update_holds_only_the_layers_in_flight() -> None:
    stack = Stack()
    stack.load_weights(_checkpoint(4, 0))
    x = _x()
    g = gs.Graph(backend="cpu", guard=stack)
    with torch.no_grad(), g.capture():
        out = stack(x)
    ck = _checkpoint(4, 1)
    held_after_each_bucket = []
    with gs.weight_update(stack):
        for i in range(4):  # one layer per bucket, weight and bias together
            stack.load_weights([e for e in ck if e[0].startswith(f"layers.{i}.")])
            held_after_each_bucket.append(sum(_held(layer.weight) for layer in stack.layers))
    # Each layer refreshed and released as soon as its weight was complete.
    assert held_after_each_bucket == [0, 0, 0, 0]
    g.replay()
    assert torch.equal(out, stack(x))
    assert torch.allclose(out, _reference(ck, x))


def test_control_a_layer_split_across_buckets_is_held_until_complete() -> None:
    stack = Stack()
    stack.load_weights(_checkpoint(4, 0))
    ck = dict(_checkpoint(4, 1))
    with gs.weight_update(stack):
        stack.load_weights([("layers.0.weight", ck["layers.0.weight"])])
        w = stack.layers[0].weight
        with torch.no_grad():
            half = ck["layers.1.weight"][: D // 2]
        stack.get_parameter("layers.1.weight").data[: D // 2].copy_(half)
        stack.load_weights([])  # a bucket boundary: layer 1 is only half written
        assert not _held(w)  # layer 0 complete: refreshed and released
        assert _held(stack.layers[1].weight)  # layer 1 in flight
        stack.get_parameter("layers.1.weight").data[D // 2 :].copy_(
            ck["layers.1.weight"][D // 2 :]
        )
    assert not _held(stack.layers[1].weight)
    expected = (ck["layers.1.weight"].t() + stack.layers[1].bias).to(torch.float16)
    assert torch.equal(stack.layers[1].weight_k, expected)


def test_a_transient_input_partly_written_when_the_update_ends_is_stale() -> None:
    stack = Stack()
    stack.load_weights(_checkpoint(4, 0))
    x = _x()
    g = gs.Graph(backend="cpu", guard=stack)
    with torch.no_grad(), g.capture():
        stack(x)
    with gs.weight_update(stack):
        stack.get_parameter("layers.2.weight").data[:2].copy_(torch.ones(2, D))
    assert gs.runtime(stack).stale == ("layers.2.weight_k",)
    with pytest.raises(gs.StaleError, match=r"layers\.2\.weight was only partly written"):
        g.replay()
    assert not _held(stack.layers[2].weight)  # released all the same
    # A complete load repairs it.
    stack.load_weights(_checkpoint(4, 2))
    g.replay()


def test_control_the_same_update_written_completely_replays() -> None:
    stack = Stack()
    stack.load_weights(_checkpoint(4, 0))
    x = _x()
    g = gs.Graph(backend="cpu", guard=stack)
    with torch.no_grad(), g.capture():
        out = stack(x)
    ck = _checkpoint(4, 3)
    with gs.weight_update(stack):
        stack.load_weights(ck)
    g.replay()
    assert torch.equal(out, stack(x))
    assert torch.allclose(out, _reference(ck, x))


def test_a_resident_input_written_after_its_early_refresh_is_stale() -> None:
    # The derivation ran as soon as its transient weight was complete, and the weight
    # was released; a later write of its resident bias cannot be followed: fail closed.
    stack = Stack(layers=1)
    stack.load_weights(_checkpoint(1, 0))
    ck = dict(_checkpoint(1, 1))
    with gs.weight_update(stack):
        stack.load_weights([("layers.0.weight", ck["layers.0.weight"])])
        stack.load_weights([("layers.0.bias", ck["layers.0.bias"])])
    assert gs.runtime(stack).stale == ("layers.0.weight_k",)
    with pytest.raises(gs.StaleError, match=r"transient input layers\.0\.weight is released"):
        gs.runtime(stack).assert_fresh()


def test_control_the_bias_first_then_the_weight_is_fresh() -> None:
    stack = Stack(layers=1)
    stack.load_weights(_checkpoint(1, 0))
    ck = _checkpoint(1, 1)
    with gs.weight_update(stack):
        stack.load_weights([ck[1]])  # bias
        stack.load_weights([ck[0]])  # weight: the derivation runs with both
    gs.runtime(stack).assert_fresh()
    assert torch.allclose(stack(_x()), _reference(ck, _x()))


def test_a_failed_update_releases_and_fails_closed() -> None:
    stack = Stack()
    stack.load_weights(_checkpoint(4, 0))
    with pytest.raises(ConnectionError), gs.weight_update(stack):
        stack.load_weights(_checkpoint(4, 1)[:2])
        raise ConnectionError("sync died")
    assert not any(_held(layer.weight) for layer in stack.layers)
    with pytest.raises(gs.StaleError):
        gs.runtime(stack).assert_fresh()


def test_state_dict_omits_released_transient_inputs_and_load_state_dict_takes_them() -> None:
    stack = Stack(layers=2)
    ck = _checkpoint(2, 0)
    stack.load_weights(ck)
    sd = stack.state_dict()
    assert sorted(sd) == ["layers.0.bias", "layers.1.bias"]  # the weights are not held
    other = Stack(layers=2)
    other.load_weights(_checkpoint(2, 5))
    other.load_state_dict(dict(ck))  # a full checkpoint: weights held, refreshed, released
    assert torch.allclose(other(_x()), _reference(ck, _x()))
    assert not any(_held(layer.weight) for layer in other.layers)
    result = other.load_state_dict(sd)  # what the model gives back, strict
    assert result.missing_keys == [] and result.unexpected_keys == []


def test_a_full_refresh_leaves_derivations_of_released_inputs_as_they_are() -> None:
    stack = Stack(layers=2)
    ck = _checkpoint(2, 0)
    stack.load_weights(ck)
    before = [layer.weight_k.clone() for layer in stack.layers]
    report = gs.runtime(stack).refresh()
    assert report.refreshed == ()
    assert all(torch.equal(layer.weight_k, b) for layer, b in zip(stack.layers, before))
    assert gs.runtime(stack).stale == ()


def test_declaring_transient_inputs_wrongly_is_refused() -> None:
    with pytest.raises(ValueError, match="not among the inputs"):
        gs.Derivation(outputs="y", inputs=["w"], fn=lambda m, w: w, transient=["v"])

    @gs.graphsafe
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        @gs.derive("a", inputs=["w"], transient=["w"])
        def _a(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

        @gs.derive("b", inputs=["w"])
        def _b(self, w: torch.Tensor) -> torch.Tensor:
            return w * 3

    mixed = Mixed()
    with pytest.raises(gs.RegistrationError, match="transient for one derivation and resident"):
        gs.runtime(mixed).refresh()

    @gs.graphsafe
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            base = torch.ones(4)
            self.w = nn.Parameter(base[:2])  # a view: cannot be released alone

        @gs.derive("a", inputs=["w"], transient=["w"])
        def _a(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    shared = Shared()
    with pytest.raises(gs.RegistrationError, match="shares its storage"):
        gs.runtime(shared).refresh()


def test_state_dict_of_a_model_that_owns_its_transient_inputs_leaves_them_out() -> None:
    layer = Layer()
    layer.load_weights([("weight", torch.ones(D, D))])
    assert layer.weight.device.type == "meta"
    assert sorted(layer.state_dict()) == ["bias"]


@gs.graphsafe
class PureLayer(nn.Module):
    """A kernel-format weight that reads nothing but its transient checkpoint weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(D, D), requires_grad=False)

    @gs.derive("weight_k", inputs=["weight"], transient=["weight"])
    def _weight_k(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t().to(torch.float16).contiguous()


@gs.graphsafe
class Watching(nn.Module):
    """A stack whose loader notes how many checkpoint weights are held after each write."""

    def __init__(self, cls: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(cls() for _ in range(4))
        self.held: list[int] = []

    def load_weights(self, weights: Weights) -> None:
        for name, t in weights:
            self.get_parameter(name).data.copy_(t)
            self.held.append(sum(_held(layer.weight) for layer in self.layers))


def test_a_derivation_of_transient_inputs_only_runs_as_soon_as_its_input_is_complete() -> None:
    # Within one loader call: each layer's weight is quantized and released right after
    # its copy lands, so one layer's checkpoint weight is held at a time.
    stack = Watching(PureLayer)
    stack.load_weights([(f"layers.{i}.weight", torch.ones(D, D)) for i in range(4)])
    stack.held.clear()
    new = [(f"layers.{i}.weight", torch.full((D, D), float(i))) for i in range(4)]
    stack.load_weights(new)
    assert stack.held == [0, 0, 0, 0]
    for i, layer in enumerate(stack.layers):
        assert torch.equal(layer.weight_k, torch.full((D, D), float(i), dtype=torch.float16))


def test_control_a_derivation_with_a_resident_input_waits_for_the_call_to_end() -> None:
    # Its bias may still be written later in the same call: the weights stay held.
    stack = Watching(Layer)
    stack.load_weights([(f"layers.{i}.weight", torch.ones(D, D)) for i in range(4)])
    stack.held.clear()
    stack.load_weights([(f"layers.{i}.weight", torch.ones(D, D)) for i in range(4)])
    assert stack.held == [1, 2, 3, 4]
    assert not any(_held(layer.weight) for layer in stack.layers)  # released at the end
