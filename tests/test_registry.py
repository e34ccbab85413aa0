"""The registry and the `Derivation` spec."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pydantic
import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe._declare.registry import accepts_out


def _t(module: nn.Module, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return torch.transpose(w, 0, 1).contiguous()
    return out.copy_(w.t())


def _two(module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


class Host(nn.Module):
    """A plain module class to register derivations for."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.v = nn.Parameter(torch.ones(3))


# -- the Derivation spec --------------------------------------------------------------


def test_derivation_takes_one_output_name_or_several() -> None:
    assert gs.Derivation(outputs="w_t", inputs=["w"], fn=_t).outputs == ("w_t",)
    d = gs.Derivation(outputs=("a", "b"), inputs=["w", "v"], fn=_two)
    assert d.outputs == ("a", "b")
    assert d.inputs == ("w", "v")


def test_derivation_name_defaults_to_the_function_qualname() -> None:
    assert gs.Derivation(outputs="w_t", inputs=["w"], fn=_t).name == "_t"
    assert gs.Derivation(outputs="w_t", inputs=["w"], fn=_t, name="X.y").name == "X.y"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"outputs": "w_t", "inputs": "w"}, "inputs must be a list of paths"),
        ({"outputs": (), "inputs": ["w"]}, "at least one output"),
        ({"outputs": "w_t", "inputs": []}, "at least one input"),
        ({"outputs": "not-a-name", "inputs": ["w"]}, "not a Python identifier"),
        ({"outputs": "class", "inputs": ["w"]}, "not a Python identifier"),
        ({"outputs": ("a", "a"), "inputs": ["w"]}, "output names repeat"),
        ({"outputs": "w_t", "inputs": ["lin..weight"]}, "not a dotted path"),
        ({"outputs": "w_t", "inputs": ["lin/weight"]}, "not a dotted path"),
    ],
)
def test_derivation_rejects_malformed_specs(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        gs.Derivation(fn=_t, **kwargs)  # type: ignore[arg-type]


def test_derivation_accepts_numeric_path_parts() -> None:
    d = gs.Derivation(outputs="w_t", inputs=["layers.0.weight"], fn=_t)
    assert d.inputs == ("layers.0.weight",)


def test_derivation_is_frozen_and_forbids_extra_fields() -> None:
    d = gs.Derivation(outputs="w_t", inputs=["w"], fn=_t)
    with pytest.raises(pydantic.ValidationError):
        d.outputs = ("x",)  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        gs.Derivation(outputs="w_t", inputs=["w"], fn=_t, bogus=1)  # type: ignore[call-arg]


def test_accepts_out() -> None:
    assert accepts_out(_t)
    assert accepts_out(lambda m, w, out=None: w)
    assert accepts_out(lambda m, w, **kw: w)
    assert not accepts_out(_two)
    assert not accepts_out(lambda m, *ws: ws[0])


# -- Registry.register / Registry.derive ----------------------------------------------


def test_register_and_look_up() -> None:
    reg = gs.Registry()
    d = reg.register(Host, gs.Derivation(outputs="w_t", inputs=["w"], fn=_t))
    assert reg.derivations_for(Host) == (d,)
    assert reg.classes() == (Host,)
    # Registries are independent of each other and of the default one.
    assert gs.Registry().derivations_for(Host) == ()
    assert gs.default_registry.derivations_for(Host) == ()


def test_derive_decorator_returns_the_function_unchanged() -> None:
    reg = gs.Registry()

    def w_t(module: nn.Module, w: torch.Tensor, *, out: torch.Tensor | None = None) -> object:
        return _t(module, w, out=out)

    assert reg.derive(nn.Linear, "w_t", inputs=["weight"])(w_t) is w_t
    (d,) = reg.derivations_for(nn.Linear)
    assert d.fn is w_t
    assert d.outputs == ("w_t",)
    assert d.inputs == ("weight",)
    assert d.when is None


def test_register_refuses_an_instance() -> None:
    with pytest.raises(gs.RegistrationError, match="registered for a module class") as e:
        gs.Registry().register(Host(), gs.Derivation(outputs="w_t", inputs=["w"], fn=_t))  # type: ignore[arg-type]
    assert e.value.fix is not None and "class" in e.value.fix


def test_an_output_declared_twice_is_refused() -> None:
    reg = gs.Registry()
    reg.register(Host, gs.Derivation(outputs="w_t", inputs=["w"], fn=_t, name="first"))
    with pytest.raises(gs.RegistrationError, match="'w_t' is declared twice on Host") as e:
        reg.register(Host, gs.Derivation(outputs=("x", "w_t"), inputs=["w"], fn=_t, name="second"))
    err = e.value
    assert err.module_class == "Host"
    assert err.derivation == "second"
    assert "first" in str(err.got) and "second" in str(err.got)
    assert "rename" in str(err.fix)
    # Nothing of the refused derivation was registered.
    assert [d.name for d in reg.derivations_for(Host)] == ["first"]


def test_an_output_colliding_with_a_class_attribute_is_refused() -> None:
    class WithMethod(Host):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(gs.RegistrationError, match="collides with the class attribute") as e:
        gs.Registry().register(
            WithMethod, gs.Derivation(outputs="forward", inputs=["w"], fn=_t)
        )
    assert e.value.module_class == "WithMethod"
    assert "WithMethod.forward" in str(e.value)


def test_a_derivation_reading_its_own_output_is_a_cycle() -> None:
    with pytest.raises(gs.RegistrationError, match="cycle") as e:
        gs.Registry().register(
            Host, gs.Derivation(outputs="w_t", inputs=["w_t"], fn=_t, name="self_loop")
        )
    assert "self_loop -> self_loop" in str(e.value.got)


def test_a_cycle_between_two_derivations_is_refused_and_named() -> None:
    reg = gs.Registry()
    reg.register(Host, gs.Derivation(outputs="a", inputs=["b"], fn=_t, name="make_a"))
    with pytest.raises(gs.RegistrationError, match="depend on each other in a cycle") as e:
        reg.register(Host, gs.Derivation(outputs="b", inputs=["a"], fn=_t, name="make_b"))
    assert "make_a" in str(e.value.got) and "make_b" in str(e.value.got)
    assert e.value.expected == "an acyclic graph of derivations"
    assert len(reg.derivations_for(Host)) == 1


def test_control_a_chain_is_not_a_cycle() -> None:
    reg = gs.Registry()
    reg.register(Host, gs.Derivation(outputs="a", inputs=["w"], fn=_t, name="make_a"))
    reg.register(Host, gs.Derivation(outputs="b", inputs=["a"], fn=_t, name="make_b"))
    assert [d.name for d in reg.derivations_for(Host)] == ["make_a", "make_b"]


def _too_few(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    return w


def _too_many(module: nn.Module, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> object:
    return a


def _required_kw(module: nn.Module, a: torch.Tensor, b: torch.Tensor, *, eps: float) -> object:
    return a


@pytest.mark.parametrize("fn", [_too_few, _too_many, _required_kw])
def test_a_signature_that_does_not_fit_the_inputs_is_refused(fn: object) -> None:
    d = gs.Derivation(outputs="s", inputs=["w", "v"], fn=fn)  # type: ignore[arg-type]
    with pytest.raises(gs.RegistrationError, match="signature that does not fit") as e:
        gs.Registry().register(Host, d)
    assert e.value.expected == "fn(module, w, v, *, out=None)"
    assert "one positional parameter per input" in str(e.value.fix)


@pytest.mark.parametrize(
    "fn",
    [
        _two,
        lambda m, *xs: xs[0],
        lambda m, a, b, out=None: a,
        lambda m, a, b, *, out=None, eps=1e-6: a,
    ],
)
def test_control_signatures_that_fit_are_accepted(fn: object) -> None:
    gs.Registry().register(Host, gs.Derivation(outputs="s", inputs=["w", "v"], fn=fn))  # type: ignore[arg-type]


def test_a_required_keyword_out_is_refused_at_registration() -> None:
    # graphsafe calls the function without `out` when it first materializes the buffer,
    # so `out` must have a default; a signature check that lets this through fails only at
    # the first load, with a bare TypeError.
    def needs_out(module: nn.Module, w: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        return torch.mul(w, 2.0, out=out)

    with pytest.raises(gs.RegistrationError, match="signature that does not fit"):
        gs.Registry().register(Host, gs.Derivation(outputs="s", inputs=["w"], fn=needs_out))


# -- inheritance ------------------------------------------------------------------------


def test_subclasses_get_their_bases_derivations() -> None:
    class Sub(Host):
        pass

    reg = gs.Registry()
    d = reg.register(Host, gs.Derivation(outputs="w_t", inputs=["w"], fn=_t))
    assert reg.derivations_for(Sub) == (d,)


def test_a_subclass_redeclaring_the_same_outputs_replaces_the_base_derivation() -> None:
    class Sub(Host):
        pass

    reg = gs.Registry()
    base = reg.register(Host, gs.Derivation(outputs="w_t", inputs=["w"], fn=_t, name="base"))
    sub = reg.register(Sub, gs.Derivation(outputs="w_t", inputs=["w"], fn=_t, name="sub"))
    assert reg.derivations_for(Host) == (base,)
    assert reg.derivations_for(Sub) == (sub,)


def test_registering_on_a_base_later_reaches_subclasses_already_looked_up() -> None:
    class Sub(Host):
        pass

    reg = gs.Registry()
    assert reg.derivations_for(Sub) == ()
    d = reg.register(Host, gs.Derivation(outputs="w_t", inputs=["w"], fn=_t))
    assert reg.derivations_for(Sub) == (d,)


def test_a_subclass_overlapping_base_outputs_differently_is_refused() -> None:
    class Sub(Host):
        pass

    reg = gs.Registry()
    reg.register(Host, gs.Derivation(outputs=("a", "b"), inputs=["w"], fn=_t, name="base"))
    reg.register(Sub, gs.Derivation(outputs="a", inputs=["w"], fn=_t, name="sub"))
    with pytest.raises(gs.RegistrationError, match="redeclares output 'a' of a base") as e:
        reg.derivations_for(Sub)
    assert e.value.module_class == "Sub"
    assert e.value.derivation == "sub"
    assert "redeclare all outputs" in str(e.value.fix)


# -- the registry route end to end (third-party classes) -------------------------------


def test_registry_route_on_nn_linear() -> None:
    reg = gs.Registry()

    @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
    def weight_t(module: nn.Module, w: torch.Tensor, *, out: torch.Tensor | None = None) -> object:
        return _t(module, w, out=out)

    lin = nn.Linear(3, 2)
    rt = gs.runtime(lin, reg)
    first = rt.refresh()
    assert first.materialized == ("weight_t",)
    assert torch.equal(lin.weight_t, lin.weight.t())
    assert not lin.weight_t.requires_grad
    ptr = lin.weight_t.data_ptr()

    with torch.no_grad():
        lin.weight.data.copy_(torch.arange(6.0).reshape(2, 3))
    report = rt.refresh(changed=["weight"])
    assert report.refreshed == ("weight_t",)
    assert report.slow_path == ()
    assert torch.equal(lin.weight_t, torch.arange(6.0).reshape(2, 3).t())
    assert lin.weight_t.data_ptr() == ptr
    assert "weight_t" not in lin.state_dict()


def test_control_a_linear_without_a_registry_gets_no_buffer() -> None:
    lin = nn.Linear(3, 2)
    assert gs.runtime(lin, gs.Registry()).refresh().entries == ()
    assert not hasattr(lin, "weight_t")


def test_registry_route_with_when_and_a_derivation_spec() -> None:
    reg = gs.Registry()
    reg.register(
        nn.Linear,
        gs.Derivation(
            outputs="bias_neg",
            inputs=["bias"],
            fn=lambda m, b: -b,
            when=lambda m: m.bias is not None,
        ),
    )
    with_bias, without = nn.Linear(3, 2), nn.Linear(3, 2, bias=False)
    gs.runtime(with_bias, reg).refresh()
    gs.runtime(without, reg).refresh()
    assert torch.equal(with_bias.bias_neg, -with_bias.bias)
    assert without.bias_neg is None


def test_an_input_set_to_none_is_named_as_such_with_the_when_fix() -> None:
    reg = gs.Registry()

    @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
    def weight_t(m: nn.Linear, w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous()

    lin = nn.Linear(3, 2)
    lin.weight = None  # a quantized kernel removed it after loading
    with pytest.raises(gs.RegistrationError, match=r"input 'weight' is None") as info:
        gs.runtime(lin, reg).refresh()
    message = str(info.value)
    assert "when=lambda m: m.weight is not None" in message
    assert "tensors there: bias" in message and "tensors there: weight" not in message


# -----------------------------------------------------------------------------
# A forward that reads a buffer of a registry nobody attached


class _PlusOneNorm(nn.Module):
    """A norm whose forward reads `weight_plus_one`, which only a registry declares."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight_plus_one  # type: ignore[operator]


def _plus_one_registry() -> gs.Registry:
    reg = gs.Registry()
    reg.register(_PlusOneNorm, gs.Derivation(
        outputs=("weight_plus_one",), inputs=("weight",), fn=lambda m, w: w + 1))
    return reg


def _notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", ()))


def test_a_forgotten_registry_is_named_where_the_capture_fails() -> None:
    reg = _plus_one_registry()
    model = _PlusOneNorm()
    with (pytest.raises(AttributeError, match="weight_plus_one") as caught,
          torch.no_grad(), gs.Graph(backend="cpu").capture()):
        model(torch.ones(4))
    notes = _notes(caught.value)
    assert "_PlusOneNorm.weight_plus_one is a derived buffer" in notes
    assert f"{__file__}:" in notes  # where the registry was made
    assert "gs.runtime(model, registry)" in notes
    # Attached, it works: the note pointed at the fix.
    gs.runtime(model, reg).refresh()
    with torch.no_grad():
        assert torch.equal(model(torch.ones(4)), torch.full((4,), 2.0))


def test_control_an_attribute_no_registry_declares_gets_no_note() -> None:
    _plus_one_registry()  # declares weight_plus_one, not what this forward reads

    class Other(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight_minus_one  # type: ignore[operator]

    with (pytest.raises(AttributeError) as caught,
          torch.no_grad(), gs.Graph(backend="cpu").capture()):
        Other()(torch.ones(4))
    assert _notes(caught.value) == ""


def test_a_runtime_without_that_registry_and_one_not_loaded_are_told_apart() -> None:
    from graphsafe._declare.forgotten import hint

    reg = _plus_one_registry()
    model = _PlusOneNorm()
    gs.runtime(model)  # a runtime, but consulting the default registry only
    with pytest.raises(AttributeError) as caught:
        model(torch.ones(4))
    assert "does not consult that registry" in (hint(caught.value) or "")

    other = _PlusOneNorm()
    rt = gs.Runtime(other, reg)  # attached, never loaded: nothing materialized yet
    with pytest.raises(AttributeError) as caught:
        other(torch.ones(4))
    assert "not materialized yet" in (hint(caught.value) or "")
    rt.refresh()
    other(torch.ones(4))


def test_an_uncaught_error_prints_the_hint(tmp_path: Path) -> None:
    """Where nothing of graphsafe's is on the stack, the process's excepthook adds it;
    the control, without the declaration, prints torch's error alone."""
    script = textwrap.dedent("""
        import torch
        from torch import nn
        import graphsafe as gs

        class Norm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(4))

            def forward(self, x):
                return x * self.weight_plus_one

        reg = gs.Registry()
        if DECLARE:
            reg.register(Norm, gs.Derivation(outputs=("weight_plus_one",),
                                             inputs=("weight",), fn=lambda m, w: w + 1))
        Norm()(torch.ones(4))
    """)
    for declare in (True, False):
        path = tmp_path / f"forgot_{declare}.py"
        path.write_text(script.replace("DECLARE", str(declare)))
        done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 1
        assert "AttributeError: 'Norm' object has no attribute 'weight_plus_one'" in done.stderr
        made = f"the registry made at {path}:14 declares (derivation '<lambda>')"
        assert (made in done.stderr) is declare, done.stderr
        assert ("graphsafe:" in done.stderr) is declare
