"""Transient inputs: checkpoint-format weights held only while a load writes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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
        # laid out as `weight_k` is: a matmul over a transposed view may round differently
        k = (w[f"layers.{i}.weight"].t() + w[f"layers.{i}.bias"]).to(torch.float16).contiguous()
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


# -- completeness by coverage: which elements a load wrote, not how many -------------

E = 4  # experts


@gs.graphsafe
class Experts(nn.Module):
    """Expert weights [E, D, D] in checkpoint format (transient), and their kernel format:
    each expert's half-precision transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, D, D), requires_grad=False)

    @gs.derive("weight_k", inputs=["weight"], transient=["weight"])
    def _weight_k(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.transpose(1, 2).to(torch.float16).contiguous()  # [E, D, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("td,edk->etk", x, self.weight_k.float())  # [E, T, D]

    def load_weights(self, weights: Weights) -> None:
        _copy_in(self, weights)


def _experts(seed: int) -> torch.Tensor:
    return torch.randn(E, D, D, generator=torch.Generator().manual_seed(seed))


def _captured(
    model: nn.Module, x: torch.Tensor, *, guard: bool
) -> tuple[gs.Graph, torch.Tensor]:
    """A CPU graph of `model(x)` (`x` must outlive it), guarded or not, and its output."""
    g = gs.Graph(backend="cpu", guard=model) if guard else gs.Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        out = model(x)
    return g, out


def _resend_half(stack: Stack, ck: dict[str, torch.Tensor]) -> None:
    """A bucket holding the first half of layer 1's weight, received twice."""
    with gs.weight_update(stack):
        w = stack.get_parameter("layers.1.weight")
        for _ in range(2):
            w.data[: D // 2].copy_(ck["layers.1.weight"][: D // 2])


def test_a_bucket_sent_twice_does_not_complete_a_half_written_input() -> None:
    stack = Stack()
    stack.load_weights(_checkpoint(4, 0))
    x = _x()
    g, _ = _captured(stack, x, guard=True)
    k = stack.layers[1].weight_k.clone()
    _resend_half(stack, dict(_checkpoint(4, 1)))  # 2 x 32 elements, but rows 4..7 unwritten
    assert gs.runtime(stack).stale == ("layers.1.weight_k",)
    assert torch.equal(stack.layers[1].weight_k, k)  # not computed from unwritten memory
    with pytest.raises(gs.StaleError, match=(
        r"(?s)tensor: +layers\.1\.weight_k.*derivation: +Layer\._weight_k.*transient input "
        r"layers\.1\.weight was only partly written by weight_update \(32 of 64 elements "
        r"written; first unwritten element at offset 32, index \(4, 0\)\)"
    )):
        g.replay()
    assert not _held(stack.layers[1].weight)  # released: nothing computes from it


def test_control_an_unguarded_graph_replays_the_half_written_layer_silently() -> None:
    # The same bucket, sent twice, under a graph without the guard: the replay goes on
    # with a layer 1 that no longer matches the weights the update wrote.
    stack = Stack()
    stack.load_weights(_checkpoint(4, 0))
    x = _x()
    g, out = _captured(stack, x, guard=False)
    before = out.clone()
    _resend_half(stack, dict(_checkpoint(4, 1)))
    g.replay()
    assert torch.equal(out, before)


def _one_expert(model: Experts, new: torch.Tensor) -> None:
    with gs.weight_update(model):
        model.weight.data.index_copy_(0, torch.tensor([1]), new[1:2])  # expert 1 only


def test_index_copy_of_one_expert_covers_that_expert_only() -> None:
    # Counted by elements, the written argument is the whole [E, D, D] tensor.
    model = Experts()
    model.load_weights([("weight", _experts(0))])
    x = _x()
    g, _ = _captured(model, x, guard=True)
    k = model.weight_k.clone()
    _one_expert(model, _experts(1))
    assert gs.runtime(model).stale == ("weight_k",)
    assert torch.equal(model.weight_k, k)  # not computed from three unwritten experts
    with pytest.raises(gs.StaleError, match=(
        r"(?s)derivation: +Experts\._weight_k.*transient input weight was only partly "
        r"written by weight_update \(64 of 256 elements written; first unwritten element "
        r"at offset 0, index \(0, 0, 0\)\)"
    )):
        g.replay()


def test_control_the_one_expert_update_replays_silently_without_the_guard() -> None:
    model = Experts()
    model.load_weights([("weight", _experts(0))])
    x = _x()
    g, out = _captured(model, x, guard=False)
    before = out.clone()
    _one_expert(model, _experts(1))
    g.replay()
    assert torch.equal(out, before)  # expert 1's new weights are nowhere in it


@pytest.mark.parametrize("last", [E, E - 1], ids=["every-expert", "control-one-missing"])
def test_index_copy_of_every_expert_one_by_one_completes_it(last: int) -> None:
    model = Experts()
    model.load_weights([("weight", _experts(0))])
    x = _x()
    g, out = _captured(model, x, guard=True)
    new = _experts(1)
    with gs.weight_update(model):
        for e in range(last):
            model.weight.data.index_copy_(0, torch.tensor([e]), new[e : e + 1])
    if last < E:
        with pytest.raises(gs.StaleError, match=r"192 of 256 elements written; first "
                           r"unwritten element at offset 192, index \(3, 0, 0\)"):
            g.replay()
        return
    g.replay()
    k = new.transpose(1, 2).half().contiguous()  # laid out as `weight_k` is
    assert torch.equal(out, torch.einsum("td,edk->etk", x, k.float()))


def _fresh_layer() -> tuple[Layer, dict[str, torch.Tensor]]:
    layer = Layer()
    layer.load_weights([("weight", torch.ones(D, D)), ("bias", torch.zeros(D))])
    ck = dict(_checkpoint(1, 4))
    return layer, {"weight": ck["layers.0.weight"], "bias": layer.bias.detach().clone()}


def _expected_k(ck: dict[str, torch.Tensor]) -> torch.Tensor:
    return (ck["weight"].t() + ck["bias"]).to(torch.float16)


@pytest.mark.parametrize("complete", [True, False], ids=["together-all-rows", "control-gap"])
def test_re_sent_buckets_that_together_cover_everything_complete_it(complete: bool) -> None:
    layer, ck = _fresh_layer()
    rows = [(0, 4), (0, 4), (2, 6), (2, 6)] + ([(4, 8)] if complete else [])
    with gs.weight_update(layer):
        for a, b in rows:
            layer.weight.data[a:b].copy_(ck["weight"][a:b])
    if complete:
        gs.runtime(layer).assert_fresh()
        assert torch.equal(layer.weight_k, _expected_k(ck))
        return
    with pytest.raises(gs.StaleError, match=r"48 of 64 elements written; first unwritten "
                       r"element at offset 48, index \(6, 0\)"):
        gs.runtime(layer).assert_fresh()


@pytest.mark.parametrize("complete", [True, False], ids=["both-column-halves", "control-one"])
def test_column_slices_count_the_columns_they_write(complete: bool) -> None:
    layer, ck = _fresh_layer()
    with gs.weight_update(layer):
        layer.weight.data[:, :3].copy_(ck["weight"][:, :3])
        if complete:
            layer.weight.data[:, 3:].copy_(ck["weight"][:, 3:])
    if complete:
        gs.runtime(layer).assert_fresh()
        assert torch.equal(layer.weight_k, _expected_k(ck))
        return
    with pytest.raises(gs.StaleError, match=r"24 of 64 elements written; first unwritten "
                       r"element at offset 3, index \(0, 3\)"):
        gs.runtime(layer).assert_fresh()


def _steps(kind: str, w: torch.Tensor, full: torch.Tensor) -> list[Callable[[], object]]:
    """Writes of `full` into `w` (the weight's `.data`) in two steps, by one indexed op."""
    even, odd = torch.arange(0, D, 2), torch.arange(1, D, 2)
    upper = torch.ones(D, D, dtype=torch.bool).triu()
    if kind == "index_copy_-rows":
        return [lambda: w.index_copy_(0, even, full[even]),
                lambda: w.index_copy_(0, odd, full[odd])]
    if kind == "index_copy_-columns":
        return [lambda: w.index_copy_(1, even, full[:, even]),
                lambda: w.index_copy_(1, odd, full[:, odd])]
    if kind == "setitem-rows":  # index_put_
        return [lambda: w.__setitem__(even, full[even]), lambda: w.__setitem__(odd, full[odd])]
    if kind == "setitem-columns":  # index_put_ with a leading None
        return [lambda: w.__setitem__((slice(None), even), full[:, even]),
                lambda: w.__setitem__((slice(None), odd), full[:, odd])]
    if kind == "setitem-mask":  # index_put_ with a bool index
        return [lambda: w.__setitem__(upper, full[upper]),
                lambda: w.__setitem__(~upper, full[~upper])]
    if kind == "index_fill_":  # `full` is 2.0 in its even rows, 3.0 in its odd ones
        return [lambda: w.index_fill_(0, even, 2.0), lambda: w.index_fill_(0, odd, 3.0)]
    if kind == "scatter_":  # row i of `index` names rows i and i + D // 2
        index = torch.arange(D // 2)[:, None].expand(D // 2, D)
        return [lambda: w.scatter_(0, index, full[: D // 2]),
                lambda: w.scatter_(0, index + D // 2, full[D // 2 :])]
    if kind == "masked_scatter_":
        return [lambda: w.masked_scatter_(upper, full[upper]),
                lambda: w.masked_scatter_(~upper, full[~upper])]
    assert kind == "masked_fill_"  # `full` is 2.0 on and above the diagonal, 3.0 below
    return [lambda: w.masked_fill_(upper, 2.0), lambda: w.masked_fill_(~upper, 3.0)]


_KINDS = ["index_copy_-rows", "index_copy_-columns", "setitem-rows", "setitem-columns",
          "setitem-mask", "index_fill_", "scatter_", "masked_scatter_", "masked_fill_"]


@pytest.mark.parametrize("complete", [True, False], ids=["all", "control-first-half"])
@pytest.mark.parametrize("kind", _KINDS)
def test_an_indexed_write_with_host_indices_covers_what_they_name(kind: str,
                                                                  complete: bool) -> None:
    layer, ck = _fresh_layer()
    full = ck["weight"]
    if kind == "index_fill_":
        full = torch.tensor([2.0, 3.0]).repeat(D // 2)[:, None].expand(D, D).contiguous()
    if kind == "masked_fill_":
        full = torch.where(torch.ones(D, D, dtype=torch.bool).triu(), 2.0, 3.0)
    with gs.weight_update(layer):
        steps = _steps(kind, layer.weight.data, full)
        for step in steps if complete else steps[:1]:
            step()
    if complete:
        gs.runtime(layer).assert_fresh()
        assert torch.equal(layer.weight_k, _expected_k({**ck, "weight": full}))
        return
    with pytest.raises(gs.StaleError, match=r"transient input weight was only partly "
                       r"written by weight_update \((32|36) of 64 elements written"):
        gs.runtime(layer).assert_fresh()


@pytest.mark.parametrize("first", [True, False], ids=["copy-then-add", "control-add-alone"])
def test_an_update_of_values_in_place_defines_nothing_new(first: bool) -> None:
    # `add_` reads what it updates: into a released input, that is memory nobody wrote.
    layer, ck = _fresh_layer()
    with gs.weight_update(layer):
        if first:
            layer.weight.data.copy_(ck["weight"])
        layer.weight.data.add_(1.0)
    if first:
        gs.runtime(layer).assert_fresh()
        assert torch.equal(layer.weight_k, _expected_k({**ck, "weight": ck["weight"] + 1}))
        return
    with pytest.raises(gs.StaleError, match=r"\(0 of 64 elements written; first unwritten "
                       r"element at offset 0, index \(0, 0\); aten::add_ updates values it "
                       r"reads"):
        gs.runtime(layer).assert_fresh()


@pytest.mark.parametrize(("rows", "skip", "written"), [(D, 0, 64), (D // 2, 0, 32), (D, 2, 56)],
                         ids=["all-bytes", "control-half", "control-part-of-each-first"])
def test_a_write_through_a_byte_view_counts_whole_elements(rows: int, skip: int,
                                                           written: int) -> None:
    # FP8 loaders write raw bytes: `param.data.view(torch.uint8)`, taken while released.
    # Skipping the first `skip` bytes of each row leaves its first element half written.
    layer, ck = _fresh_layer()
    with gs.weight_update(layer):
        raw = layer.weight.data.view(torch.uint8)  # [D, 4 D], on meta
        raw[:rows, skip:].copy_(ck["weight"].view(torch.uint8)[:rows, skip:])
    if written == D * D:
        gs.runtime(layer).assert_fresh()
        assert torch.equal(layer.weight_k, _expected_k(ck))
        return
    with pytest.raises(gs.StaleError, match=rf"\({written} of 64 elements written"):
        gs.runtime(layer).assert_fresh()


@pytest.mark.parametrize("written", [True, False], ids=["from-written-rows", "control-unwritten"])
def test_a_copy_from_the_input_itself_defines_only_what_its_source_holds(written: bool) -> None:
    layer, ck = _fresh_layer()
    w = layer.weight
    with gs.weight_update(layer):
        w.data[: D // 2].copy_(ck["weight"][: D // 2])  # held now
        if written:  # rows 4..7 repeat rows 0..3 (as a loader replicating heads does)
            w.data[D // 2 :].copy_(w.data[: D // 2])
        else:  # rows 0..3 from rows 4..7, which nobody wrote
            w.data[: D // 2].copy_(w.data[D // 2 :])
    if written:
        gs.runtime(layer).assert_fresh()
        half = ck["weight"][: D // 2]
        assert torch.equal(layer.weight_k, _expected_k({**ck, "weight": torch.cat([half, half])}))
        return
    with pytest.raises(gs.StaleError, match=r"32 of 64 elements written; first unwritten "
                       r"element at offset 32, index \(4, 0\)"):
        gs.runtime(layer).assert_fresh()


@pytest.mark.parametrize("host", [True, False], ids=["host-indices", "device-indices"])
def test_an_indexed_write_whose_indices_are_not_on_the_host_counts_nothing(host: bool) -> None:
    # No CUDA index here: the check of where an index lives is given (a stand-in that
    # calls every index a device's). On a GPU, the CUDA test below runs the real one.
    from graphsafe._runtime.transient.coverage import Coverage

    w = torch.empty(E, D)
    cov = Coverage(w)
    rows = torch.arange(E)
    cov.write(w, 0, torch.ops.aten.index_copy_.default, (w, 0, rows, torch.ones(E, D)), {},
              readable=lambda t: host)
    assert cov.complete is host
    if not host:
        assert cov.describe() == (
            "0 of 32 elements written; first unwritten element at offset 0, index (0, 0); "
            "aten::index_copy_ wrote it with indices on cpu, which graphsafe does not read "
            "(that would synchronize); index with host (CPU) tensors, or copy_ whole slices")
        cov.write(w, 0, torch.ops.aten.copy_.default, (w, torch.ones(E, D)), {})
        assert cov.complete  # an overwrite of everything since defines every element


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("on", ["cpu", "cuda"], ids=["host-indices", "cuda-indices"])
def test_an_indexed_write_with_cuda_indices_is_refused_by_name(on: str) -> None:
    model = Experts().cuda()
    new = _experts(1).cuda()
    model.load_weights([("weight", _experts(0).cuda())])
    with gs.weight_update(model):
        for e in range(E):  # index_put_, which takes host indices into a CUDA tensor too
            model.weight.data[torch.tensor([e], device=on)] = new[e : e + 1]
    if on == "cpu":
        gs.runtime(model).assert_fresh()
        assert torch.equal(model.weight_k, new.transpose(1, 2).half())
        return
    with pytest.raises(gs.StaleError, match=r"transient input weight was only partly written "
                       r"by weight_update \(0 of 256 .*indices on cuda:0"):
        gs.runtime(model).assert_fresh()


_SPAN = st.tuples(st.integers(0, D), st.integers(0, D)).map(sorted)


def _check_against(layer: Layer, ck: dict[str, torch.Tensor], seen: torch.Tensor,
                   touched: bool) -> None:
    """The layer is fresh exactly when `seen` (the cells written) is everything, and
    otherwise says how many were written."""
    n = int(seen.sum())
    if not touched:  # its derivation still holds what the last load made
        gs.runtime(layer).assert_fresh()
    elif n == D * D:
        gs.runtime(layer).assert_fresh()
        assert torch.equal(layer.weight_k, _expected_k(ck))
    else:
        with pytest.raises(gs.StaleError, match=rf"\({n} of {D * D} elements written; "):
            gs.runtime(layer).assert_fresh()


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(_SPAN, max_size=6))
def test_complete_exactly_when_the_written_rows_are_every_row(rows: list[list[int]]) -> None:
    # Row slices (one range each), overlapping and repeated, as re-sent buckets are.
    layer, ck = _fresh_layer()
    seen = torch.zeros(D, D, dtype=torch.bool)  # the reference: cells written
    with gs.weight_update(layer):
        for a, b in rows:
            layer.weight.data[a:b].copy_(ck["weight"][a:b])
            seen[a:b] = True
    _check_against(layer, ck, seen, bool(rows))


_WRITES = st.lists(st.tuples(st.sampled_from(["rows", "columns", "cells"]), _SPAN), max_size=8)


@settings(max_examples=100, deadline=None)
@given(writes=_WRITES)
def test_complete_exactly_when_the_union_of_any_writes_is_everything(
    writes: list[tuple[str, list[int]]],
) -> None:
    # Row and column slices (ranges) and cells (a mask), in any order: the input is
    # complete exactly when the writes together cover every element.
    layer, ck = _fresh_layer()
    seen = torch.zeros(D, D, dtype=torch.bool)
    i, j = torch.arange(D)[:, None], torch.arange(D)
    with gs.weight_update(layer):
        w = layer.weight.data
        for kind, (a, b) in writes:
            if kind == "rows":
                w[a:b].copy_(ck["weight"][a:b])
                seen[a:b] = True
            elif kind == "columns":
                w[:, a:b].copy_(ck["weight"][:, a:b])
                seen[:, a:b] = True
            else:  # the cells (i, j) with a <= i + j < b
                cells = (i + j >= a) & (i + j < b)
                w.masked_scatter_(cells, ck["weight"][cells])
                seen |= cells
    _check_against(layer, ck, seen, bool(writes))


def _layout(kind: str) -> torch.Tensor:
    """A [4, 6] input: contiguous, transposed (dense, permuted), or with gaps between its
    rows and an offset into its storage."""
    if kind == "contiguous":
        return torch.empty(4, 6)
    if kind == "transposed":
        return torch.empty(6, 4).t()
    return torch.empty(40).as_strided((4, 6), (8, 1), 2)


def _draw_write(
    data: st.DataObject, x: torch.Tensor
) -> tuple[Any, torch.Tensor, tuple[Any, ...]]:
    """A random write into `x` (`op`, the written view, the op's arguments)."""
    aten = torch.ops.aten
    kind = data.draw(st.sampled_from(["rows", "columns", "step", "index_copy_", "index_put_",
                                      "mask", "index_fill_", "scatter_", "masked_fill_"]))
    dim = data.draw(st.integers(0, 1))
    n = x.size(dim)
    a, b = data.draw(st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted))
    picked = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True)),
                          dtype=torch.int64)
    if kind in ("rows", "columns"):
        v = x[a:b] if kind == "rows" else x[:, a:b]
        return aten.copy_.default, v, (v, torch.ones(v.shape))
    if kind == "step":
        v = x[:, ::2]
        return aten.fill_.Scalar, v, (v, 1.0)
    if kind == "index_copy_":
        shape = list(x.shape)
        shape[dim] = picked.numel()
        return aten.index_copy_.default, x, (x, dim, picked, torch.ones(shape))
    if kind == "index_put_":
        ix: list[torch.Tensor | None] = [picked] if dim == 0 else [None, picked]
        return aten.index_put_.default, x, (x, ix, torch.ones(()))
    cells = torch.tensor(data.draw(st.lists(st.booleans(), min_size=24, max_size=24))).view(4, 6)
    if kind == "mask":
        return aten.index_put_.default, x, (x, [cells], torch.ones(()))
    if kind == "index_fill_":
        return aten.index_fill_.int_Scalar, x, (x, dim, picked, 1.0)
    if kind == "scatter_":
        index = torch.randint(0, 4, (data.draw(st.integers(0, 4)), 6),
                              generator=torch.Generator().manual_seed(data.draw(st.integers(0, 9))))
        return aten.scatter_.value, x, (x, 0, index, 1.0)
    return aten.masked_fill_.Scalar, x, (x, cells, 1.0)


@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from(["contiguous", "transposed", "gaps"]), data=st.data())
def test_coverage_is_exactly_what_the_writes_wrote(layout: str, data: st.DataObject) -> None:
    # The oracle: run each write into an input of NaNs; what is no longer NaN was written.
    from graphsafe._runtime.transient.coverage import Coverage

    x = _layout(layout).fill_(float("nan"))
    cov = Coverage(x)
    for _ in range(data.draw(st.integers(1, 6))):
        op, view, args = _draw_write(data, x)
        cov.write(view, x.storage_offset(), op, args, {})
        op(*args)
        written = ~x.isnan()
        assert cov.written == int(written.sum())
        assert cov.complete is bool(written.all())
        first = cov._first_unwritten()  # the one the stale reason names
        if first is not None:
            offset, index = first
            assert not written[index]
            assert offset == sum(i * s for i, s in zip(index, x.stride()))
