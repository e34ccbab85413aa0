"""The runtime: materialize once, refresh in place, fail closed (`graphsafe._runtime.runtime`)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import Counter

import pytest
import torch
from helpers import Identity, expected_scaled, identities, identity, scaled_layer_class, write
from torch import nn

import graphsafe as gs

DERIVED = ("w_scaled", "col_sum", "bias2")


def _loaded(registry: gs.Registry | None = None) -> nn.Module:
    """A fresh `scaled_layer_class` instance whose buffers were materialized."""
    layer = scaled_layer_class(registry)()
    layer.load_weights([])
    layer.calls.clear()
    return layer


def _assert_correct(layer: nn.Module) -> None:
    for name, value in expected_scaled(layer).items():
        assert torch.equal(getattr(layer, name), value), name


def _snapshot(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, name).clone() for name in DERIVED}


# -- (1) allocate once, write in place forever after ----------------------------------


def test_buffers_are_non_persistent_never_require_grad_and_keep_their_storage() -> None:
    layer = _loaded()
    _assert_correct(layer)
    before = identities(layer, DERIVED)
    buffers = dict(layer.named_buffers())
    for name in DERIVED:
        assert buffers[name] is getattr(layer, name)
        assert not buffers[name].requires_grad
    assert set(layer.state_dict()) == {"w", "bias"}
    for value in (2.0, -1.0, 0.25):
        layer.load_weights([("w", torch.full((2, 3), value)), ("bias", torch.ones(3) * value)])
        _assert_correct(layer)
        assert identities(layer, DERIVED) == before


def test_load_state_dict_round_trips_without_derived_buffers() -> None:
    layer = _loaded()
    other = scaled_layer_class()()
    other.load_weights([])
    with torch.no_grad():
        layer.w.mul_(3.0)
    other.load_state_dict(layer.state_dict(), strict=True)
    assert torch.equal(other.w, layer.w)


def test_control_a_rebinding_implementation_fails_the_identity_check() -> None:
    # The naive post-load hook (`self.x = f(weights)`) gives correct values, but moves the
    # storage a captured graph reads: the identity comparison used above catches it.
    layer = _loaded()
    before = identities(layer, DERIVED)
    layer.w_scaled = layer.w.detach() * layer.scale
    assert identities(layer, DERIVED) != before


def test_identity_records_what_a_graph_depends_on() -> None:
    t = torch.zeros(2, 3)
    assert identity(t) == Identity(id(t), t.data_ptr(), (2, 3), (3, 1), torch.float32, t.device)
    assert identity(t.t()) != identity(t)


def test_refresh_twice_is_bit_identical() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.refresh()
    first = _snapshot(layer)
    rt.refresh()
    for name, value in first.items():
        assert torch.equal(getattr(layer, name), value)


def test_control_a_non_idempotent_fold_is_visible_to_the_bit_identity_check() -> None:
    # A transform folded in place into its own result (the failure the notes describe)
    # changes the buffer on every refresh; the comparison above would catch it.
    @gs.graphsafe
    class Folding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            if out is None:
                return w * 2
            return out.mul_(2)  # reads its previous result instead of the input

    m = Folding()
    rt = gs.runtime(m)
    rt.refresh()
    first = m.w2.clone()
    rt.refresh()
    assert not torch.equal(m.w2, first)


def test_derivations_run_under_no_grad() -> None:
    seen: list[bool] = []

    @gs.graphsafe
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            seen.append(torch.is_grad_enabled())
            return torch.mul(w, 2, out=out)

    m = M()
    rt = gs.runtime(m)
    rt.refresh()
    rt.refresh()
    assert seen == [False, False]
    assert not m.w2.requires_grad


# -- reports and introspection --------------------------------------------------------------


def test_report_per_derivation_and_json() -> None:
    layer = scaled_layer_class()()
    rt = gs.runtime(layer)
    first = rt.refresh()
    assert set(first.materialized) == set(DERIVED)
    assert first.bytes_written == 4 * (6 + 3 + 3)

    write(layer, "bias", torch.ones(3))
    report = rt.refresh(changed=["bias"])
    by_path = {e.path: e for e in report.entries}
    assert by_path["bias2"].action == "refreshed"
    assert by_path["bias2"].path_taken == "fast"
    assert by_path["bias2"].bytes_written == 12
    assert by_path["bias2"].storage_held
    assert by_path["bias2"].seconds >= 0
    assert by_path["w_scaled"].action == "skipped"
    assert by_path["w_scaled"].path_taken == "none"
    assert by_path["w_scaled"].bytes_written == 0
    assert report.ran == 1

    full = rt.refresh()
    assert set(full.refreshed) == set(DERIVED)
    assert full.slow_path == ("w_scaled",)  # the function without `out`
    data = json.loads(full.model_dump_json())
    assert data["seconds"] >= 0
    assert {e["path"] for e in data["entries"]} == set(DERIVED)
    assert {e["path_taken"] for e in data["entries"]} == {"fast", "slow"}
    assert set(data["entries"][0]) == {
        "path", "derivation", "outputs", "action", "path_taken", "bytes_written",
        "seconds", "storage_held",
    }


def test_a_function_with_out_that_returns_something_else_is_reported_slow() -> None:
    @gs.graphsafe
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(3.0))

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            return w * 2  # ignores `out`: still correct, but not the fast path

    m = M()
    rt = gs.runtime(m)
    rt.refresh()
    ptr = m.w2.data_ptr()
    write(m, "w", torch.ones(3))
    report = rt.refresh()
    assert report.slow_path == ("w2",)
    assert torch.equal(m.w2, torch.full((3,), 2.0))
    assert m.w2.data_ptr() == ptr


def test_derivations_describe_paths_inputs_shapes_dtypes_and_bytes() -> None:
    layer = scaled_layer_class()()
    rt = gs.runtime(layer)
    assert [d.shapes for d in rt.derivations] == [(), (), ()]
    assert set(rt.stale) == set(DERIVED)
    assert not rt.materialized
    rt.refresh()
    assert rt.materialized
    info = {d.outputs[0]: d for d in rt.derivations}
    assert info["w_scaled"].inputs == ("w", "scale")
    assert info["w_scaled"].shapes == ((2, 3),)
    assert info["w_scaled"].dtypes == ("torch.float32",)
    assert info["w_scaled"].nbytes == 24
    assert not info["w_scaled"].fast_path
    assert info["col_sum"].inputs == ("w_scaled",)
    assert info["col_sum"].fast_path
    assert info["col_sum"].module == ""
    assert info["col_sum"].module_class == "ScaledLayer"
    assert info["col_sum"].derivation == "ScaledLayer._col_sum"


def test_paths_in_a_module_tree_are_dotted_from_the_root() -> None:
    Layer = scaled_layer_class()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

    model = Model()
    rt = gs.runtime(model)
    rt.refresh()
    assert {d.outputs[0] for d in rt.derivations} == {
        f"layers.{i}.{n}" for i in (0, 1) for n in DERIVED
    }
    assert rt.derivations[0].inputs == ("layers.0.w", "layers.0.scale")
    write(model, "layers.1.bias", torch.zeros(3))
    assert rt.refresh(changed=["layers.1.bias"]).refreshed == ("layers.1.bias2",)
    assert gs.runtime(model.layers[0]) is rt  # a submodule shares its root's runtime


def test_one_runtime_per_model() -> None:
    layer = _loaded()
    assert gs.runtime(layer) is gs.runtime(layer)
    assert gs.runtime(layer) is not gs.runtime(_loaded())


def test_a_registry_passed_to_runtime_is_not_silently_ignored() -> None:
    # `gs.runtime(model, reg)` must bind `reg`'s derivations, or refuse loudly when the
    # model already has a runtime on another registry; returning the old runtime
    # without them leaves the derived buffers missing with no error.
    reg = gs.Registry()
    reg.register(nn.Linear, gs.Derivation(outputs="w_neg", inputs=["weight"], fn=lambda m, w: -w))
    lin = nn.Linear(3, 2)
    with gs.weight_update(lin):  # creates a runtime on the default registry
        pass
    try:
        rt = gs.runtime(lin, reg)
    except gs.GraphSafetyError:
        return
    rt.refresh()
    assert torch.equal(lin.w_neg, -lin.weight)


def test_weight_update_on_a_class_with_its_own_registry() -> None:
    # `gs.weight_update(model)` is the documented bucketed-sync entry point; on a class
    # decorated with `registry=reg` it must not bind the default registry and leave the
    # model without its derived buffers.
    Layer = scaled_layer_class(gs.Registry())
    layer = Layer()
    with gs.weight_update(layer):
        layer.load_weights([("w", torch.ones(2, 3))])
    layer.load_weights([])
    _assert_correct(layer)


# -- (2) incremental refresh ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "recomputed"),
    [
        ((), {}),
        (("bias",), {"bias2": 1}),
        (("w",), {"w_scaled": 1, "col_sum": 1}),
        (("scale",), {"w_scaled": 1, "col_sum": 1}),
        (("w", "bias"), {"w_scaled": 1, "col_sum": 1, "bias2": 1}),
    ],
)
def test_a_load_recomputes_exactly_what_is_downstream_of_its_writes(
    written: tuple[str, ...], recomputed: dict[str, int]
) -> None:
    layer = _loaded()
    layer.load_weights([(name, 3.0) for name in written])
    assert layer.calls == Counter(recomputed)
    _assert_correct(layer)


def test_a_load_that_only_reads_recomputes_nothing() -> None:
    @gs.graphsafe
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.calls = 0

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return w * 2

        def load_weights(self) -> float:
            return float(self.w.detach().sum())  # reads, never writes

    m = Reader()
    m.load_weights()
    assert m.calls == 1
    m.load_weights()
    assert m.calls == 1


def test_a_partial_write_through_a_view_counts_as_written() -> None:
    layer = _loaded()

    def load_one_row(self: nn.Module) -> None:
        self.w.data[1].copy_(torch.tensor([9.0, 9.0, 9.0]))

    gs.runtime(layer).run_load(load_one_row, layer, (), {})
    assert layer.calls == Counter({"w_scaled": 1, "col_sum": 1})
    _assert_correct(layer)


def _copy(m: nn.Module, w: torch.Tensor) -> None:
    m.w.data.copy_(w)


def _state_dict(m: nn.Module, w: torch.Tensor) -> None:
    m.load_state_dict({"w": w}, strict=False)


def _state_dict_assign(m: nn.Module, w: torch.Tensor) -> None:
    m.load_state_dict({"w": nn.Parameter(w.clone())}, strict=False, assign=True)


def _vector_to_parameters(m: nn.Module, w: torch.Tensor) -> None:
    nn.utils.vector_to_parameters(w.flatten(), [m.w])


def _setitem(m: nn.Module, w: torch.Tensor) -> None:
    with torch.no_grad():
        m.w[:] = w


@pytest.mark.parametrize(
    "loader", [_copy, _state_dict, _state_dict_assign, _vector_to_parameters, _setitem]
)
def test_common_loader_idioms_are_all_seen(loader: object) -> None:
    layer = _loaded()
    w = torch.arange(6.0).reshape(2, 3) - 2.5
    gs.runtime(layer).run_load(loader, layer, (w,), {})  # type: ignore[arg-type]
    assert torch.equal(layer.w, w)
    assert layer.calls == Counter({"w_scaled": 1, "col_sum": 1})
    _assert_correct(layer)


def test_rebinding_an_input_before_pin_counts_as_written() -> None:
    layer = _loaded()

    def rebind(self: nn.Module) -> None:
        self.w.data = torch.full((2, 3), 7.0)  # rebinds the parameter's storage
        self.scale = torch.ones(3)  # rebinds a plain attribute

    gs.runtime(layer).run_load(rebind, layer, (), {})
    assert layer.calls == Counter({"w_scaled": 1, "col_sum": 1})
    _assert_correct(layer)


def test_refresh_changed_recomputes_only_downstream_of_the_named_paths() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    write(layer, "w", 5.0)
    assert rt.refresh(changed=["w_scaled"]).refreshed == ("col_sum",)
    assert layer.calls == Counter({"col_sum": 1})
    assert rt.refresh(changed=["w"]).refreshed == ("w_scaled", "col_sum")
    _assert_correct(layer)
    assert rt.refresh(changed=[]).ran == 0


def test_refresh_changed_with_an_unknown_path_is_refused() -> None:
    layer = _loaded()
    with pytest.raises(gs.GraphSafetyError, match="'wieght', which is not a tensor") as e:
        gs.runtime(layer).refresh(changed=["wieght"])
    assert e.value.path == "wieght"
    assert "named_parameters" in str(e.value.fix)


def test_control_refresh_changed_with_a_tensor_no_derivation_reads_is_a_no_op() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = scaled_layer_class()()
            self.head = nn.Linear(3, 3)

    model = Model()
    rt = gs.runtime(model)
    rt.refresh()
    assert rt.refresh(changed=["head.weight"]).ran == 0


# -- (3) weight_update -------------------------------------------------------------------


def test_weight_update_refreshes_once_at_the_end() -> None:
    layer = _loaded()
    before = _snapshot(layer)
    with gs.weight_update(layer) as rt:
        layer.load_weights([("w", torch.full((2, 3), 2.0))])
        layer.load_weights([("scale", torch.ones(3))])
        layer.load_weights([("w", torch.full((2, 3), 4.0))])
        assert layer.calls == Counter()  # nothing refreshed mid-update
        for name, value in before.items():
            assert torch.equal(getattr(layer, name), value)
    assert rt is gs.runtime(layer)
    assert layer.calls == Counter({"w_scaled": 1, "col_sum": 1})
    _assert_correct(layer)


def test_weight_update_tracks_writes_outside_load_calls_too() -> None:
    layer = _loaded()
    with gs.runtime(layer).weight_update():
        write(layer, "bias", torch.zeros(3))
    assert layer.calls == Counter({"bias2": 1})
    _assert_correct(layer)


def test_weight_update_materializes_on_first_use() -> None:
    layer = scaled_layer_class()()
    with gs.weight_update(layer):
        layer.load_weights([("w", torch.ones(2, 3))])
        assert not hasattr(layer, "w_scaled")
    _assert_correct(layer)


def test_nested_weight_update_refreshes_once_at_the_outer_exit() -> None:
    layer = _loaded()
    with gs.weight_update(layer):
        with gs.weight_update(layer):
            layer.load_weights([("bias", torch.zeros(3))])
        assert layer.calls == Counter()
    assert layer.calls == Counter({"bias2": 1})


def test_an_exception_escaping_weight_update_leaves_what_was_written_stale() -> None:
    layer = _loaded()
    before = _snapshot(layer)
    rt = gs.runtime(layer)
    with pytest.raises(ConnectionError), gs.weight_update(layer):
        layer.load_weights([("w", torch.full((2, 3), 2.0))])
        raise ConnectionError("sync died")
    assert set(rt.stale) == {"w_scaled", "col_sum"}
    assert layer.calls == Counter()
    for name, value in before.items():
        assert torch.equal(getattr(layer, name), value)
    with pytest.raises(gs.StaleError):
        rt.assert_fresh()
    # A complete load heals the failure and retries the stale buffers.
    layer.load_weights([("w", layer.w.detach().clone()), ("bias", layer.bias.clone())])
    assert rt.stale == ()
    rt.assert_fresh()
    _assert_correct(layer)


# -- (4) fail closed ---------------------------------------------------------------------


def test_a_failing_load_leaves_stale_and_a_good_load_clears_it() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    before = _snapshot(layer)
    with pytest.raises(KeyError, match="unknown checkpoint entry"):
        layer.load_weights([("w", torch.full((2, 3), 2.0)), ("nope", 1.0)])
    assert set(rt.stale) == {"w_scaled", "col_sum"}
    assert layer.calls == Counter()  # nothing derived from a half-written state
    for name, value in before.items():
        assert torch.equal(getattr(layer, name), value)
    with pytest.raises(gs.StaleError, match=r"2 derived buffer\(s\) do not match") as e:
        rt.assert_fresh()
    assert set(e.value.paths) == {"w_scaled", "col_sum"}
    assert "w_scaled" in str(e.value.path)
    layer.load_weights([("w", torch.full((2, 3), 2.0)), ("bias", torch.zeros(3))])  # complete
    assert rt.stale == ()
    rt.assert_fresh()
    _assert_correct(layer)


def test_a_load_failing_before_any_write_still_makes_the_model_unusable() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    with pytest.raises(KeyError):
        layer.load_weights([("nope", 1.0)])
    assert rt.stale == ()
    with pytest.raises(gs.StaleError, match="the last weight update failed") as e:
        rt.assert_fresh()
    assert "KeyError" in str(e.value.got)
    layer.load_weights([("w", layer.w.detach().clone()), ("bias", layer.bias.clone())])
    rt.assert_fresh()


def test_stale_error_names_the_module_class_and_derivation() -> None:
    # The contract for every error: module class, dotted path and derivation, as
    # attributes and in the message.
    layer = _loaded()
    with pytest.raises(KeyError):
        layer.load_weights([("w", 2.0), ("nope", 1.0)])
    with pytest.raises(gs.StaleError) as e:
        gs.runtime(layer).assert_fresh()
    assert e.value.module_class == "ScaledLayer"
    # Every derivation whose buffers are stale, the first first (each buffer's own in `got`).
    assert e.value.derivation is not None
    assert e.value.derivation.split(", ")[0] == "ScaledLayer._w_scaled"
    assert "ScaledLayer" in str(e.value)


def test_control_assert_fresh_passes_on_a_fresh_model() -> None:
    layer = _loaded()
    gs.runtime(layer).assert_fresh()
    never_loaded = scaled_layer_class()()
    with pytest.raises(gs.StaleError, match="do not match their inputs"):
        gs.runtime(never_loaded).assert_fresh()


def test_a_raising_derivation_propagates_and_leaves_it_and_downstream_stale() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    before = _snapshot(layer)
    layer.fault = "raise"
    with pytest.raises(ValueError, match="derivation blew up"):
        layer.load_weights([("w", 2.0), ("bias", 0.0)])
    assert set(rt.stale) == {"w_scaled", "col_sum"}
    assert layer.calls["col_sum"] == 0  # never run on a failed input
    assert torch.equal(layer.bias2, layer.bias * 2)  # independent derivations still ran
    assert torch.equal(layer.col_sum, before["col_sum"])
    layer.fault = None
    layer.load_weights([])
    assert rt.stale == ()
    _assert_correct(layer)


@pytest.mark.parametrize(
    ("fault", "got"),
    [("wrong_shape", "shape (3, 2)"), ("wrong_dtype", "dtype torch.float64")],
)
def test_a_slow_path_result_that_does_not_fit_is_refused_before_any_write(
    fault: str, got: str
) -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    before = _snapshot(layer)
    ids = identities(layer, DERIVED)
    layer.fault = fault
    with pytest.raises(gs.DerivationDriftError, match="does not fit the buffer") as e:
        layer.load_weights([("w", torch.full((2, 3), 2.0))])
    err = e.value
    assert err.path == "w_scaled"
    assert err.derivation == "ScaledLayer._w_scaled"
    assert err.module_class == "ScaledLayer"
    assert "shape (2, 3), dtype torch.float32" in str(err.expected)
    assert got in str(err.got)
    assert "re-capture" in str(err.fix)
    assert "expected:" in str(err) and "got:" in str(err) and "fix:" in str(err)
    for name, value in before.items():
        assert torch.equal(getattr(layer, name), value), name  # nothing written
    assert identities(layer, DERIVED) == ids
    assert set(rt.stale) == {"w_scaled", "col_sum"}
    layer.fault = None
    layer.load_weights([])
    assert rt.stale == ()
    _assert_correct(layer)


def test_an_out_result_of_a_smaller_shape_restores_geometry_and_raises_drift() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    ids = identities(layer, DERIVED)
    layer.fault = "out_shrink"
    with pytest.raises(gs.DerivationDriftError, match="wrong shape for its buffer") as e:
        layer.load_weights([("w", torch.full((2, 3), 2.0))])
    assert e.value.path == "col_sum"
    assert "shape (3,)" in str(e.value.expected)
    assert "shape (2,)" in str(e.value.got)
    assert identities(layer, DERIVED) == ids  # shape, stride and storage as before
    assert rt.stale == ("col_sum",)
    layer.fault = None
    layer.load_weights([])
    assert rt.stale == ()
    _assert_correct(layer)


def test_an_out_result_of_a_larger_shape_raises_drift_and_keeps_storage() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    ids = identities(layer, DERIVED)
    layer.fault = "out_grow"
    with pytest.raises(gs.DerivationDriftError) as e:
        layer.load_weights([("w", torch.full((2, 3), 2.0))])
    assert e.value.path == "col_sum"
    assert identities(layer, DERIVED) == ids
    assert rt.stale == ("col_sum",)


def test_a_result_that_is_not_one_tensor_per_output_is_refused() -> None:
    @gs.graphsafe
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        @gs.derive(("a", "b"), inputs=["w"])
        def _ab(self, w: torch.Tensor) -> tuple[torch.Tensor]:
            return (w * 2,)

    m = M()
    with pytest.raises(gs.DerivationDriftError, match="one tensor per output") as e:
        gs.runtime(m).refresh()
    assert e.value.expected == "2 tensor(s) for ('a', 'b')"
    assert e.value.got == "tuple of 1"


# -- (5) purity --------------------------------------------------------------------------


def test_an_impure_derivation_is_refused_at_materialization_and_its_input_kept() -> None:
    layer = scaled_layer_class()()
    layer.fault = "impure"  # folds the scale into `w` with mul_
    w_before = layer.w.detach().clone()
    with pytest.raises(gs.ImpureDerivationError, match="wrote into 'w', a tensor of") as e:
        layer.load_weights([])
    err = e.value
    assert err.path == "w"
    assert err.derivation == "ScaledLayer._w_scaled"
    assert err.module_class == "ScaledLayer"
    assert "mul_" in str(err.got)
    assert "w * scale" in str(err.fix)
    assert torch.equal(layer.w, w_before)  # the write was refused
    assert "w_scaled" in gs.runtime(layer).stale


def test_a_derivation_writing_into_another_model_tensor_is_impure() -> None:
    @gs.graphsafe
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.other = nn.Linear(3, 3)

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor) -> torch.Tensor:
            self.other.bias.data.zero_()
            return w * 2

    m = M()
    bias = m.other.bias.detach().clone()
    with pytest.raises(gs.ImpureDerivationError, match=r"'other\.bias'"):
        gs.runtime(m).refresh()
    assert torch.equal(m.other.bias, bias)


def test_strict_runtime_checks_purity_on_every_refresh() -> None:
    layer = _loaded()
    layer.fault = "impure"
    rt = gs.runtime(layer, strict=True)
    w_before = layer.w.detach().clone()
    with pytest.raises(gs.ImpureDerivationError):
        rt.refresh()
    assert torch.equal(layer.w, w_before)
    assert "w_scaled" in rt.stale


def test_control_without_strict_an_impure_refresh_goes_unnoticed() -> None:
    # Why strict mode exists: after materialization, purity is not checked by default.
    layer = _loaded()
    layer.fault = "impure"
    rt = gs.runtime(layer, strict=False)
    w_before = layer.w.detach().clone()
    rt.refresh()
    assert not torch.equal(layer.w, w_before)


# -- pin / StorageMovedError ------------------------------------------------------------------


def test_pin_before_materialization_is_refused() -> None:
    layer = scaled_layer_class()()
    with pytest.raises(gs.StaleError, match="cannot pin: derived buffers were never") as e:
        gs.runtime(layer).pin()
    assert set(e.value.paths) == set(DERIVED)


def _rebind_param_data(m: nn.Module) -> None:
    m.w.data = torch.zeros(2, 3)


def _rebind_param(m: nn.Module) -> None:
    m.w = nn.Parameter(torch.zeros(2, 3))


def _rebind_attribute(m: nn.Module) -> None:
    m.scale = torch.ones(3)


def _set_(m: nn.Module) -> None:
    with torch.no_grad():
        m.w.set_(torch.zeros(2, 3))


def _reregister(m: nn.Module) -> None:
    m.register_buffer("bias", torch.zeros(3))


@pytest.mark.parametrize(
    ("rebind", "path", "consumers"),
    [
        (_rebind_param_data, "w", {"w_scaled", "col_sum"}),
        (_rebind_param, "w", {"w_scaled", "col_sum"}),
        (_rebind_attribute, "scale", {"w_scaled", "col_sum"}),
        (_set_, "w", {"w_scaled", "col_sum"}),
        (_reregister, "bias", {"bias2"}),
    ],
)
def test_rebinding_an_input_after_pin_is_reported(
    rebind: object, path: str, consumers: set[str]
) -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.pin()
    rebind(layer)  # type: ignore[operator]
    assert set(rt.stale) == consumers
    with pytest.raises(gs.StorageMovedError, match="rebound to new storage") as e:
        layer.load_weights([])
    err = e.value
    assert err.path == path
    assert tuple(d.path for d in err.drifts) == (path,)
    assert all(isinstance(d, gs.Drift) for d in err.drifts)
    assert err.module_class == "ScaledLayer"
    assert "(pinned)" in str(err.expected)
    assert "copy_" in str(err.fix)
    with pytest.raises(gs.StorageMovedError):
        rt.refresh()
    assert set(rt.stale) == consumers


def test_control_the_same_rebinding_before_pin_is_accepted() -> None:
    layer = _loaded()
    _rebind_param(layer)
    layer.load_weights([])
    _assert_correct(layer)


def test_unpin_allows_moving_again() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.pin()
    _rebind_param(layer)
    with pytest.raises(gs.StorageMovedError):
        rt.refresh()
    rt.unpin()
    rt.refresh()
    assert rt.stale == ()
    _assert_correct(layer)


def test_rebinding_a_derived_buffer_after_pin_is_reported() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.pin()
    layer.bias2 = torch.zeros(3)
    with pytest.raises(gs.StorageMovedError, match="rebound to new storage: bias2") as e:
        rt.refresh()
    assert e.value.path == "bias2"


def test_rebinding_a_derived_buffer_after_pin_is_reported_by_any_load() -> None:
    # A graph replays the old `bias2` memory while the model now reads the new tensor;
    # the next load must say so even when it does not write `bias2`'s inputs.
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.pin()
    layer.bias2 = torch.zeros(3)
    with pytest.raises(gs.StorageMovedError):
        layer.load_weights([("w", torch.ones(2, 3))])


def test_a_rebound_derived_buffer_after_pin_is_not_fresh() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.pin()
    layer.bias2 = torch.zeros(3)
    assert "bias2" in rt.stale
    with pytest.raises(gs.StaleError):
        rt.assert_fresh()


@pytest.mark.parametrize("name", ["w_scaled", "bias2"])  # slow path, fast path
def test_set_on_a_derived_buffer_after_pin_is_a_storage_move(name: str) -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.pin()
    buf = getattr(layer, name)
    buf.set_(torch.zeros_like(buf))  # same Python object, new storage
    with pytest.raises(gs.StorageMovedError):
        rt.refresh()


# -- (6) moving the model before pin ---------------------------------------------------------


def test_double_before_pin_then_loads_keep_working() -> None:
    layer = _loaded()
    layer.scale = layer.scale.double()  # plain attributes do not move with the module
    rt = gs.runtime(layer)
    layer.double()
    assert set(rt.stale) == set(DERIVED)
    layer.load_weights([("w", torch.full((2, 3), 3.0, dtype=torch.float64))])
    for name in DERIVED:
        assert getattr(layer, name).dtype == torch.float64
    _assert_correct(layer)
    assert rt.stale == ()
    rt.pin()
    ids = identities(layer, DERIVED)
    layer.load_weights([("w", torch.full((2, 3), 0.5, dtype=torch.float64)), ("bias", 1.0)])
    _assert_correct(layer)
    assert identities(layer, DERIVED) == ids


@pytest.mark.parametrize("takes_out", [True, False])
def test_the_first_refresh_after_a_move_writes_the_moved_buffer(takes_out: bool) -> None:
    @gs.graphsafe
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        if takes_out:

            @gs.derive("w2", inputs=["w"])
            def _w2(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> object:
                return torch.mul(w, 2.0, out=out)

        else:

            @gs.derive("w2", inputs=["w"])
            def _w2(self, w: torch.Tensor) -> torch.Tensor:
                return w * 2.0

        def load_weights(self, value: float) -> None:
            write(self, "w", value)

    m = M()
    m.load_weights(1.0)
    m.double()
    m.load_weights(3.0)
    assert m.w2.dtype == torch.float64
    assert torch.equal(m.w2, torch.full((3,), 6.0, dtype=torch.float64))
    assert gs.runtime(m).stale == ()


def test_control_moving_after_pin_is_reported() -> None:
    layer = _loaded()
    rt = gs.runtime(layer)
    rt.pin()
    layer.half()
    with pytest.raises(gs.StorageMovedError):
        layer.load_weights([])


def test_sizes_and_report_follow_a_move() -> None:
    layer = _loaded()
    layer.scale = layer.scale.double()
    rt = gs.runtime(layer)
    layer.double()
    report = rt.refresh()
    info = {d.outputs[0]: d for d in rt.derivations}
    assert info["w_scaled"].dtypes == ("torch.float64",)
    assert info["w_scaled"].nbytes == 48
    assert report.bytes_written == 8 * (6 + 3 + 3)


def test_the_report_says_when_a_move_reallocated_the_buffers() -> None:
    # `storage_held`: "whether every buffer kept its storage". After `.double()` none did
    # (which is allowed before pin: no graph holds the old storage).
    layer = _loaded()
    layer.scale = layer.scale.double()
    rt = gs.runtime(layer)
    layer.double()
    report = rt.refresh()
    # Before pin the buffers are made anew from the derivations, not converted.
    assert [e.action for e in report.entries] == ["materialized"] * 3
    assert [e.storage_held for e in report.entries] == [False, False, False]
    assert [e.storage_held for e in rt.refresh().entries] == [True, True, True]


# -- when ---------------------------------------------------------------------------------------


def _gated_class(calls: Counter[str]) -> type[nn.Module]:
    @gs.graphsafe
    class Gated(nn.Module):
        def __init__(self, quantized: bool) -> None:
            super().__init__()
            self.quantized = quantized
            self.w = nn.Parameter(torch.ones(2, 3))

        @gs.derive("w_scale", inputs=["w"], when=lambda m: m.quantized)
        def _w_scale(self, w: torch.Tensor) -> torch.Tensor:
            calls["w_scale"] += 1
            return w.abs().amax(dim=1)

        def load_weights(self) -> None:
            pass

    return Gated


def test_when_false_leaves_none_and_allocates_nothing() -> None:
    calls: Counter[str] = Counter()
    Gated = _gated_class(calls)
    off, on = Gated(False), Gated(True)
    off.load_weights()
    on.load_weights()
    assert off.w_scale is None
    assert "w_scale" not in dict(off.named_buffers())
    assert gs.runtime(off).derivations == ()
    assert calls["w_scale"] == 1  # only for `on`
    assert torch.equal(on.w_scale, torch.ones(2))
    assert "w_scale" not in on.state_dict() and "w_scale" not in off.state_dict()


def test_when_false_registers_the_none_buffer_as_torch_does() -> None:
    """The `None` buffer of a false `when` goes through `register_buffer`: its global hooks
    see it, and it is not persistent."""
    Gated = _gated_class(Counter())
    seen: list[tuple[str, object]] = []
    handle = torch.nn.modules.module.register_module_buffer_registration_hook(
        lambda module, name, tensor: seen.append((name, tensor)))
    try:
        off = Gated(False)
        seen.clear()  # the parameter's own registration is not this one
        off.load_weights()
    finally:
        handle.remove()
    assert seen == [("w_scale", None)]
    assert off._buffers["w_scale"] is None and "w_scale" in off._non_persistent_buffers_set


def test_when_false_without_hooks_leaves_what_register_buffer_leaves() -> None:
    """With no registration hook, the `None` buffer is put in place without calling
    `register_buffer` (a first load binds thousands of layers): the module ends as torch's
    call leaves it; a class with its own `register_buffer` still gets the call."""
    Gated = _gated_class(Counter())
    off, by_torch = Gated(False), Gated(False)
    off.load_weights()
    by_torch.register_buffer("w_scale", None, persistent=False)
    assert off._buffers == by_torch._buffers
    assert off._non_persistent_buffers_set == by_torch._non_persistent_buffers_set
    assert off.state_dict().keys() == by_torch.state_dict().keys()

    called: list[str] = []

    class Own(Gated):  # type: ignore[valid-type,misc]
        def register_buffer(self, name: str, tensor: object, persistent: bool = True) -> None:
            called.append(name)
            super().register_buffer(name, tensor, persistent)

    Own(False).load_weights()
    assert called == ["w_scale"]


def test_control_a_name_taken_by_a_parameter_is_refused_by_torch() -> None:
    """Control: the slot is taken ahead of `register_buffer` only where nothing has the name;
    a parameter named as the output still gets torch's refusal."""
    Gated = _gated_class(Counter())
    off = Gated(False)
    off.w_scale = nn.Parameter(torch.ones(2))
    with pytest.raises(KeyError, match="attribute 'w_scale' already exists"):
        off.load_weights()


def test_reading_a_buffer_whose_when_is_false_is_a_registration_error() -> None:
    calls: Counter[str] = Counter()
    Gated = _gated_class(calls)

    @gs.graphsafe
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Gated(False)

        @gs.derive("s", inputs=["child.w_scale"])
        def _s(self, s: torch.Tensor) -> torch.Tensor:
            return s * 2

    parent = Parent()
    with pytest.raises(gs.RegistrationError, match="a derived buffer this module does not") as e:
        gs.runtime(parent).refresh()
    assert e.value.path == "child.w_scale"


# -- registration errors found when binding to an instance -----------------------------------


def _bind_error(inputs: list[str], output: str = "y") -> gs.RegistrationError:
    reg = gs.Registry()

    @gs.graphsafe(registry=reg)
    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.register_buffer("b", torch.ones(3))
            self.lin = nn.Linear(3, 3)

    reg.register(
        Host, gs.Derivation(outputs=output, inputs=inputs, fn=lambda m, *xs: xs[0], name="f")
    )
    host = Host()
    with pytest.raises(gs.RegistrationError) as e:
        gs.runtime(host, reg).refresh()
    return e.value


def test_an_unknown_input_is_reported_with_what_exists() -> None:
    err = _bind_error(["wieght"])
    assert "unknown input path 'wieght'" in str(err)
    assert err.path == "wieght"
    assert err.derivation == "f"
    assert err.module_class == "Host"
    assert "w, b" in str(err.got)


def test_an_unknown_submodule_in_an_input_path_is_reported() -> None:
    err = _bind_error(["lin2.weight"])
    assert "unknown input path 'lin2.weight'" in str(err)
    assert "submodules: lin" in str(err.got)


def test_an_output_colliding_with_a_parameter_is_reported() -> None:
    err = _bind_error(["b"], output="w")
    assert "output 'w' collides with a parameter" in str(err)
    assert err.path == "w"


def test_control_the_same_derivation_with_valid_names_binds() -> None:
    reg = gs.Registry()

    class Host(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

    reg.register(Host, gs.Derivation(outputs="y", inputs=["lin.weight"], fn=lambda m, w: w * 1))
    m = Host()
    gs.runtime(m, reg).refresh()
    assert torch.equal(m.y, m.lin.weight)


def test_a_none_placeholder_for_the_output_is_allowed() -> None:
    # `self.w_t = None` in __init__ (for type checkers / readers) is a common idiom; the
    # runtime deliberately lets a None attribute through its collision check, so
    # materialization must then replace it instead of failing inside torch.
    @gs.graphsafe
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.w2: torch.Tensor | None = None

        @gs.derive("w2", inputs=["w"])
        def _w2(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    m = M()
    gs.runtime(m).refresh()
    assert torch.equal(m.w2, torch.full((3,), 2.0))


# -- multi-output derivations ------------------------------------------------------------------


def test_multi_output_fast_and_slow() -> None:
    @gs.graphsafe
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))

        @gs.derive(("lo", "hi"), inputs=["w"])
        def _minmax(
            self, w: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
        ) -> object:
            if out is None:
                return w.amin(0), w.amax(0)
            torch.amin(w, 0, out=out[0])
            torch.amax(w, 0, out=out[1])
            return out

        @gs.derive(("t", "neg"), inputs=["w"])
        def _tn(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return w.t(), -w  # `w.t()` is a view of the parameter: the buffer owns a copy

    m = M()
    rt = gs.runtime(m)
    rt.refresh()
    ids = identities(m, ("lo", "hi", "t", "neg"))
    assert m.t.data_ptr() != m.w.data_ptr()
    write(m, "w", torch.tensor([[5.0, -1.0, 2.0], [0.0, 4.0, -3.0]]))
    report = rt.refresh()
    assert report.slow_path == ("t",)
    assert report.entries[0].outputs == ("lo", "hi")
    assert torch.equal(m.lo, torch.tensor([0.0, -1.0, -3.0]))
    assert torch.equal(m.hi, torch.tensor([5.0, 4.0, 2.0]))
    assert torch.equal(m.t, m.w.t())
    assert torch.equal(m.neg, -m.w)
    assert identities(m, ("lo", "hi", "t", "neg")) == ids


# -- (7) concurrency ---------------------------------------------------------------------------


def _slow_counting_class() -> type[nn.Module]:
    @gs.graphsafe
    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.arange(6.0).reshape(2, 3))
            self.active = 0
            self.most_active = 0

        @gs.derive("s", inputs=["w"])
        def _s(self, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            time.sleep(0.001)  # widen the window in which an overlap would show
            result = torch.sum(w, 0, out=out)
            self.active -= 1
            return result

        def load_weights(self, value: float) -> None:
            write(self, "w", value)

    return Slow


def test_concurrent_refreshes_and_loads_serialize() -> None:
    m = _slow_counting_class()()
    m.load_weights(1.0)
    rt = gs.runtime(m)
    ptr = m.s.data_ptr()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                rt.refresh()
                m.load_weights(float(i))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert m.most_active == 1
    rt.refresh()
    assert torch.equal(m.s, m.w.sum(0))
    assert m.s.data_ptr() == ptr


def test_control_the_overlap_detector_sees_unserialized_calls() -> None:
    # Calling the derivation from threads without the runtime does overlap: the check in
    # the test above is able to fail.
    m = _slow_counting_class()()
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        with torch.no_grad():
            m._s(m.w)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.most_active > 1


@pytest.mark.parametrize("first_inside", [True, False])
def test_loads_inside_and_outside_inference_mode_mix(first_inside: bool) -> None:
    # Engines load under torch.inference_mode() and RL frameworks sync outside it (or the
    # other way round): a buffer made in one mode must stay writable in the other.
    layer = scaled_layer_class()()
    first = torch.inference_mode() if first_inside else contextlib.nullcontext()
    then = contextlib.nullcontext() if first_inside else torch.inference_mode()
    with first:
        write(layer, "w", torch.randn(2, 3))
        gs.runtime(layer).refresh()
    assert not layer.w_scaled.is_inference()
    with then:
        write(layer, "w", torch.randn(2, 3))
        gs.runtime(layer).refresh()
    _assert_correct(layer)


@gs.graphsafe
class _AssignsItsOutput(nn.Module):
    def __init__(self, assign: bool) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.randn(2, 3))
        self.wk = nn.Parameter(torch.randn(2, 3))
        self.assign = assign

    @gs.derive("wqk", inputs=["wq", "wk"])
    def _wqk(self, wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
        if self.assign:
            self.wqk = torch.cat([wq, wk])  # the mistake: rebinds its own output
            return self.wqk
        return torch.cat([wq, wk])

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            gs.load_into(self.get_parameter(name), w, name=name)


def test_a_derivation_that_assigns_its_own_output_is_refused_at_the_load() -> None:
    m = _AssignsItsOutput(assign=True)
    m.load_weights([])
    held = m.wqk
    with pytest.raises(gs.ImpureDerivationError, match=r"_wqk assigned its own output 'wqk'"):
        m.load_weights([("wq", torch.randn(2, 3))])
    assert m._buffers["wqk"] is held  # the buffer graphs captured is where it was
    assert torch.equal(held, torch.cat([m.wq, m.wk]).detach())
    # Control: the same derivation returning its result refreshes in place, silently.
    ok = _AssignsItsOutput(assign=False)
    ok.load_weights([])
    before = ok.wqk
    ok.load_weights([("wq", torch.randn(2, 3))])
    assert ok.wqk is before and gs.runtime(ok).last_report is not None
    assert all(e.storage_held for e in gs.runtime(ok).last_report.entries)


def test_a_stale_error_over_several_derivations_labels_each_buffer_with_its_own() -> None:
    reg = gs.Registry()

    @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
    def _weight_t(m: nn.Linear, w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous()

    @reg.derive(nn.LayerNorm, "weight_plus_one", inputs=["weight"])
    def _plus_one(m: nn.LayerNorm, w: torch.Tensor) -> torch.Tensor:
        return w + 1.0

    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    rt = gs.runtime(model, reg)
    rt.refresh()
    with torch.no_grad():
        model[0].weight.mul_(2.0)
        model[1].weight.mul_(2.0)
    with pytest.raises(gs.StaleError) as info:
        rt.assert_fresh()
    message = str(info.value)
    assert re.search(r"0\.weight_t \(Linear, \S*_weight_t\)", message)
    assert re.search(r"1\.weight_plus_one \(LayerNorm, \S*_plus_one\)", message)
    assert info.value.module_class == "Linear, LayerNorm"
    # Control: one derivation alone keeps the short form.
    with torch.no_grad():
        rt.refresh()
        model[0].weight.mul_(2.0)
    with pytest.raises(gs.StaleError, match=r"got:\s+0\.weight_t: ") as one:
        rt.assert_fresh()
    assert one.value.derivation is not None and one.value.derivation.endswith("_weight_t")
