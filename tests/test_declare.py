"""Declaring derivations on classes: `gs.derive` and `gs.graphsafe`."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import expected_scaled, identities, scaled_layer_class, write
from torch import nn

import graphsafe as gs
from graphsafe._declare.decorators import is_marked

DERIVED = ("w_scaled", "col_sum", "bias2")


def test_derive_only_marks_nothing_is_registered_without_the_class_decorator() -> None:
    reg = gs.Registry()

    class Plain(nn.Module):
        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    assert is_marked(Plain._w2)
    assert reg.derivations_for(Plain) == ()
    assert gs.default_registry.derivations_for(Plain) == ()
    gs.graphsafe(registry=reg)(Plain)
    (d,) = reg.derivations_for(Plain)
    assert d.name == "Plain._w2"
    assert d.method == "_w2"
    assert d.outputs == ("w2",)


def test_derive_refuses_a_bare_string_of_inputs() -> None:
    with pytest.raises(gs.RegistrationError, match="takes a list of input paths") as e:
        gs.derive("w2", inputs="w")
    assert e.value.expected == "inputs=['w']"
    assert e.value.fix == "wrap the path in a list"


def test_derive_refuses_static_methods() -> None:
    with pytest.raises(gs.RegistrationError, match="marks plain methods"):

        class Bad(nn.Module):
            @gs.derive("w2", inputs=["w"])
            @staticmethod
            def _w2(w: torch.Tensor) -> torch.Tensor:
                return w * 2


def test_graphsafe_validates_signatures_when_the_class_is_created() -> None:
    with pytest.raises(gs.RegistrationError, match="signature that does not fit") as e:

        @gs.graphsafe(registry=gs.Registry())
        class Bad(nn.Module):
            @gs.derive("s", inputs=["a", "b"])
            def _s(self, a: torch.Tensor) -> torch.Tensor:
                return a

    assert e.value.module_class == "Bad"
    assert e.value.derivation == "Bad._s"


def test_graphsafe_with_an_explicit_missing_loader_is_refused() -> None:
    with pytest.raises(gs.RegistrationError, match="has no loading method 'load'") as e:

        @gs.graphsafe(load="load", registry=gs.Registry())
        class NoLoader(nn.Module):
            pass

    assert e.value.module_class == "NoLoader"


def test_control_graphsafe_without_a_loader_is_fine_bare() -> None:
    @gs.graphsafe
    class NoLoader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    m = NoLoader()
    gs.runtime(m).refresh()
    assert torch.equal(m.w2, torch.full((2,), 2.0))


def test_custom_loader_name_is_wrapped() -> None:
    @gs.graphsafe(load="load", registry=gs.Registry())
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

        def load(self, value: float) -> str:
            write(self, "w", value)
            return "loaded"

    m = Custom()
    assert m.load(3.0) == "loaded"
    assert torch.equal(m.w2, torch.full((2,), 6.0))
    assert Custom.load.__name__ == "load"  # functools.wraps


def test_first_load_materializes_later_loads_refresh_in_place() -> None:
    Layer = scaled_layer_class()
    layer = Layer()
    assert not hasattr(layer, "w_scaled")
    assert layer.load_weights([]) == 0  # the loader's return value passes through
    for name, value in expected_scaled(layer).items():
        assert torch.equal(getattr(layer, name), value)
    before = identities(layer, DERIVED)
    layer.load_weights([("w", torch.full((2, 3), 2.0)), ("bias", torch.ones(3))])
    for name, value in expected_scaled(layer).items():
        assert torch.equal(getattr(layer, name), value), name
    assert identities(layer, DERIVED) == before


def test_control_the_unwrapped_loader_does_not_refresh() -> None:
    # Shows the test above can fail: without the wrapper the buffers go stale.
    Layer = scaled_layer_class()
    layer = Layer()
    layer.load_weights([])
    Layer.load_weights.__wrapped__(layer, [("w", torch.full((2, 3), 2.0))])
    assert not torch.equal(layer.w_scaled, expected_scaled(layer)["w_scaled"])


def test_the_loader_materializes_the_whole_module_tree() -> None:
    reg = gs.Registry()

    @gs.graphsafe(registry=reg)
    class Leaf(nn.Module):
        def __init__(self, value: float) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((3,), value))

        @gs.derive("w_neg", inputs=["w"])
        def _w_neg(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> object:
            return torch.neg(w, out=out)

    @gs.graphsafe(registry=reg)
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Leaf(1.0), Leaf(2.0)])

        # Reads a derived buffer of a child: refreshed after it.
        @gs.derive("total", inputs=["layers.0.w_neg", "layers.1.w_neg"])
        def _total(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

        def load_weights(self, weights: list[tuple[str, float]]) -> None:
            for name, value in weights:
                write(self, name, value)

    root = Root()
    root.load_weights([])
    assert torch.equal(root.layers[0].w_neg, torch.full((3,), -1.0))
    assert torch.equal(root.total, torch.full((3,), -3.0))
    root.load_weights([("layers.1.w", 5.0)])
    assert torch.equal(root.layers[1].w_neg, torch.full((3,), -5.0))
    assert torch.equal(root.total, torch.full((3,), -6.0))


def test_nested_graphsafe_loaders_refresh_once() -> None:
    calls: Counter[str] = Counter()
    mid_load: list[int] = []
    reg = gs.Registry()

    @gs.graphsafe(registry=reg)
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor) -> torch.Tensor:
            calls["w2"] += 1
            return w * 2

        def load_weights(self, value: float) -> None:
            write(self, "w", value)

    @gs.graphsafe(registry=reg)
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Inner(), Inner()

        def load_weights(self, value: float) -> None:
            self.a.load_weights(value)
            mid_load.append(calls["w2"])  # the inner loader must not refresh on its own
            self.b.load_weights(value)

    outer = Outer()
    outer.load_weights(1.0)
    assert calls["w2"] == 2  # materialized once each
    calls.clear()
    outer.load_weights(3.0)
    assert calls["w2"] == 2  # one refresh each, not one per inner call and one at the end
    assert mid_load == [0, 0]
    assert torch.equal(outer.a.w2, torch.full((3,), 6.0))


# -- subclasses ---------------------------------------------------------------------------


def test_an_undecorated_subclass_inherits_derivations_and_the_loader() -> None:
    Base = scaled_layer_class()

    class Sub(Base):  # type: ignore[misc, valid-type]
        pass

    sub = Sub()
    sub.load_weights([("w", torch.full((2, 3), 4.0))])
    for name, value in expected_scaled(sub).items():
        assert torch.equal(getattr(sub, name), value)


def test_a_subclass_overriding_a_derivation_method_is_used() -> None:
    Base = scaled_layer_class()

    class Sub(Base):  # type: ignore[misc, valid-type]
        def _bias2(self, bias: torch.Tensor, *, out: torch.Tensor | None = None) -> object:
            return torch.mul(bias, 3.0, out=out)

    sub, base = Sub(), Base()
    sub.load_weights([])
    base.load_weights([])
    assert torch.equal(sub.bias2, sub.bias * 3.0)
    assert torch.equal(base.bias2, base.bias * 2.0)  # the base class is untouched
    sub.load_weights([("bias", torch.ones(3))])  # refresh uses the override too
    assert torch.equal(sub.bias2, torch.full((3,), 3.0))


def test_an_override_with_a_bad_signature_is_refused() -> None:
    Base = scaled_layer_class()

    class Sub(Base):  # type: ignore[misc, valid-type]
        def _bias2(self) -> torch.Tensor:  # type: ignore[override]
            return torch.zeros(3)

    with pytest.raises(gs.RegistrationError, match="signature that does not fit"):
        Sub().load_weights([])


def test_a_decorated_subclass_redeclaring_outputs_replaces_the_derivation() -> None:
    reg = gs.Registry()
    Base = scaled_layer_class(reg)

    @gs.graphsafe(registry=reg)
    class Sub(Base):  # type: ignore[misc, valid-type]
        @gs.derive("bias2", inputs=["bias", "scale"])
        def _bias_scaled(self, bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return bias * scale

    sub = Sub()
    sub.load_weights([])
    assert torch.equal(sub.bias2, sub.bias * sub.scale)
    assert sub.calls["bias2"] == 0
    assert sub.calls["w_scaled"] == 1  # still inherited, and the loader not wrapped twice


def test_a_subclass_overriding_the_loader_still_refreshes() -> None:
    # Users override `load_weights` (e.g. to rename checkpoint entries) without knowing
    # it was wrapped; their override must still keep the derived buffers correct.
    Base = scaled_layer_class()

    class Renaming(Base):  # type: ignore[misc, valid-type]
        def load_weights(self, weights):  # type: ignore[no-untyped-def]
            for name, value in weights:
                write(self, name.removeprefix("model."), value)
            return len(weights)

    layer = Renaming()
    assert layer.load_weights([("model.w", torch.full((2, 3), 2.0))]) == 1
    assert hasattr(layer, "w_scaled"), "the first load did not materialize"
    layer.load_weights([("model.w", torch.full((2, 3), 3.0))])
    for name, value in expected_scaled(layer).items():
        assert torch.equal(getattr(layer, name), value), name


def test_a_class_with_its_own_registry_keeps_loading_after_pin():
    # The loader of a class decorated with `registry=` must not try to add that registry
    # to a pinned runtime: it is found from the class when the runtime binds.
    reg = gs.Registry()

    @gs.graphsafe(registry=reg)
    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3), requires_grad=False)

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w, *, out=None):
            return torch.mul(w, 2, out=out)

        def load_weights(self, value: float) -> None:
            self.w.data.fill_(value)

    m = Own()
    gs.runtime(m).refresh()  # the runtime is created without naming the registry
    gs.runtime(m).pin()
    m.load_weights(3.0)
    assert torch.equal(m.w2, torch.full((3,), 6.0))
    assert Own not in gs.default_registry.classes()
