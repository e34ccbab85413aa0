"""What an engine derives from its weights beyond tensors is guarded too: Python numbers
taken from the weights (`.item()`, `float()`, `int()`, `bool()`) that a captured graph
bakes in, and kernel handles of other kinds than an int (torch's prepacked
`ScriptObject`s).

Each model below is written the way serving engines are (a loader, then a post-load step
nobody declared). Each kind comes with its control: the same capture replayed unguarded
reads the stale value, so the refusal guards a real stale read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._lineage.entries import Entry, PinnedValues

C = 4


def _weights(seed: int, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lin.weight": torch.randn(C, C, generator=g), **extra}


# -- Python numbers taken from the weights -------------------------------------------


@gs.graphsafe
class Scaled(nn.Module):
    """vLLM's attention keeps `layer._k_scale_float = layer.k_scale.item()` after loading;
    its kernels take the float as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.k_scale = nn.Parameter(torch.ones(()), requires_grad=False)
        self.zero_point = nn.Parameter(torch.zeros((), dtype=torch.int64),
                                       requires_grad=False)

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        if post:
            self._k_scale_float = self.k_scale.item()  # a float
            self.zp = int(self.zero_point)  # an int zero point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lin.weight.t() - self.zp) * self._k_scale_float


def _scaled(scale: float, zp: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    return _weights(seed, k_scale=torch.tensor(scale),
                    zero_point=torch.tensor(zp, dtype=torch.int64))


def _scaled_reference(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (x @ weights["lin.weight"].t() - weights["zero_point"]) * weights["k_scale"]


def _capture(m: nn.Module, *, guard: bool) -> tuple[gs.Graph, torch.Tensor]:
    g = gs.Graph(backend="cpu", guard=m if guard else None)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    return g, y


def test_a_number_taken_from_a_weight_is_discovered_with_its_source() -> None:
    m = Scaled()
    m.load_weights(_scaled(0.5, 3))
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {"_k_scale_float", "zp"}
    assert found["_k_scale_float"].kind == "scalar"
    assert found["_k_scale_float"].sources == ("k_scale",)
    assert found["zp"].sources == ("zero_point",)
    assert all(d.stale is None for d in found.values())


def test_a_number_changed_after_capture_is_refused_by_name() -> None:
    m = Scaled()
    m.load_weights(_scaled(0.5))
    g, _ = _capture(m, guard=True)
    m.load_weights(_scaled(2.0))  # the full load: the post-load step takes the new scale
    with pytest.raises(gs.StorageMovedError, match=r"_k_scale_float") as info:
        g.replay()
    message = str(info.value)
    assert "k_scale" in message and "0.5 at capture, now 2.0" in message
    assert "re-capture" in message
    assert [d.what for d in info.value.drifts] == ["value"]


def test_control_unguarded_the_graph_replays_the_number_it_baked_in() -> None:
    m = Scaled()
    m.load_weights(_scaled(0.5))
    g, y = _capture(m, guard=False)
    new = _scaled(2.0)
    m.load_weights(new)
    g.replay()
    x = torch.ones(2, C)
    assert torch.allclose(m(x), _scaled_reference(new, x))  # eager reads the new float
    assert not torch.allclose(y, _scaled_reference(new, x))  # the graph does not


def test_a_bare_sync_leaves_the_number_stale_and_the_replay_is_refused() -> None:
    m = Scaled()
    m.load_weights(_scaled(0.5))
    g, _ = _capture(m, guard=True)
    m.load_weights(_scaled(2.0), post=False)  # the weights only: no post-load step
    with pytest.raises(gs.StaleError, match=r"_k_scale_float") as info:
        g.replay()
    assert "k_scale" in str(info.value)
    stale = {d.path: d.stale for d in gs.runtime(m).discovered}
    assert stale["_k_scale_float"] is not None and stale["zp"] is None


def test_a_refused_number_says_how_it_was_taken_as_the_code_wrote_it() -> None:
    m = Scaled()
    m.load_weights(_scaled(0.5))
    g, _ = _capture(m, guard=True)
    m.load_weights(_scaled(2.0, 1), post=False)
    with pytest.raises(gs.StaleError) as info:
        g.replay()
    message = str(info.value)
    assert "number(s) the model derived" in message
    assert "expected:   every number computed from the weights" in message
    assert "k_scale -> Tensor.item()" in message  # `self.k_scale.item()`
    assert "zero_point -> int()" in message  # `int(self.zero_point)`
    assert "<method" not in message  # not the method object's repr


def test_a_number_the_new_weights_leave_as_it_was_is_no_false_alarm() -> None:
    m = Scaled()
    m.load_weights(_scaled(0.5, 3, seed=0))
    g, y = _capture(m, guard=True)
    new = _scaled(0.5, 3, seed=1)  # new weights, the same scale and zero point
    m.load_weights(new, post=False)
    g.replay()  # the numbers the graph baked in are still the ones the weights give
    assert torch.allclose(y, _scaled_reference(new, torch.ones(2, C)))
    m.load_weights(_scaled(0.5, 3, seed=2))  # the full load: a new float, the same value
    g.replay()


def _compiled_or_skip() -> None:
    """Skip where the compiled checks cannot be loaded (no C++ compiler built them)."""
    try:
        with _native.using(True):
            pass
    except _native.NativeBuildError as exc:
        pytest.skip(f"the compiled checks are not here: {exc}")


def _counting_moved(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every `Entry.moved` read from now on, by path."""
    read: list[str] = []
    moved = Entry.moved

    def counted(e: Entry) -> str | None:
        read.append(e.path)
        return moved(e)

    monkeypatch.setattr(Entry, "moved", counted)
    return read


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_the_numbers_a_graph_holds_are_read_one_by_one_only_once_one_moved(
    native: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before each replay the numbers a graph holds are checked in one compiled pass while
    none moved (each dict item is still the object pinned); only when one did, or on the
    Python path, is each read and compared. After replays that passed (which the pass
    remembers), an equal number set anew is no false alarm and a changed one is refused
    by name, on both paths."""
    if native:
        _compiled_or_skip()
    with _native.using(native):
        m = Scaled()
        m.load_weights(_scaled(0.5, 3))
        g, _ = _capture(m, guard=True)
        read = _counting_moved(monkeypatch)
        for _ in range(2):
            g.replay()
        assert read == ([] if native else ["_k_scale_float", "zp"] * 2)
        m._k_scale_float = float(str(m._k_scale_float))  # another float object, equal
        g.replay()
        m.zp = 4
        with pytest.raises(gs.StorageMovedError, match=r"zp") as info:
            g.replay()
        assert "3 at capture, now 4" in str(info.value)


def test_control_a_pass_that_read_no_dict_would_replay_a_changed_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control of the test above: the change it refuses shows only in the dict item
    the compiled pass reads. A pass that answered "held" without reading them, leaving
    nothing to read one by one, replays the graph over the number it baked in."""
    _compiled_or_skip()
    with _native.using(True):
        m = Scaled()
        m.load_weights(_scaled(0.5, 3))
        g, _ = _capture(m, guard=True)
        g.replay()
        monkeypatch.setattr(PinnedValues, "unmoved", lambda self: self.rest)
        m.zp = 4
        g.replay()  # silently stale: the graph computes with zp = 3


def test_a_number_the_post_load_step_takes_again_is_fresh_though_its_source_was_not_written(
) -> None:
    m = Scaled()
    m.load_weights(_scaled(0.5))
    m.load_weights(_scaled(2.0), post=False)  # a bare sync: the number is stale
    stale = {d.path: d.stale for d in gs.runtime(m).discovered}
    assert stale["_k_scale_float"] is not None  # control: what the next load must heal
    # A load of `lin.weight` alone whose post-load step takes the number again from the
    # scale the bare sync wrote: what the weights give now.
    m.load_weights({"lin.weight": torch.randn(C, C)})
    assert m._k_scale_float == 2.0
    assert all(d.stale is None for d in gs.runtime(m).discovered)
    g, y = _capture(m, guard=True)
    g.replay()  # before: StaleError, "its source k_scale was written"
    assert torch.allclose(y, _scaled_reference(
        {**_scaled(2.0), "lin.weight": m.lin.weight.detach()}, torch.ones(2, C)))


@gs.graphsafe
class Gated(nn.Module):
    """A `bool` that picks a branch at load: "the bias is all zeros: skip it"."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.skip_bias = False  # set before any load: only a load's value is derived

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        self.skip_bias = bool((self.lin.bias == 0).all())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.lin.weight.t()
        return y if self.skip_bias else y + self.lin.bias


def test_a_bool_that_picked_a_branch_is_refused_once_it_flips() -> None:
    m = Gated()
    m.load_weights(_weights(0, **{"lin.bias": torch.zeros(C)}))
    assert [(d.path, d.kind, d.sources) for d in gs.runtime(m).discovered] == [
        ("skip_bias", "scalar", ("lin.bias",))]
    g, _ = _capture(m, guard=True)
    m.load_weights(_weights(1, **{"lin.bias": torch.ones(C)}))
    with pytest.raises(gs.StorageMovedError, match=r"skip_bias.*lin\.bias"):
        g.replay()


def test_control_an_equal_bool_the_load_did_not_set_is_not_discovered() -> None:
    m = Gated()
    m.lin.fast = True  # a config value, set before the load and left as it was
    m.load_weights(_weights(0, **{"lin.bias": torch.zeros(C)}))  # skip_bias: True too
    assert [d.path for d in gs.runtime(m).discovered] == ["skip_bias"]
    m2 = Gated()
    m2.load_weights(_weights(0, **{"lin.bias": torch.zeros(C)}))
    g, y = _capture(m2, guard=False)
    new = _weights(1, **{"lin.bias": torch.ones(C)})
    m2.load_weights(new)
    g.replay()  # unguarded: the branch baked at capture skips the new bias
    assert torch.allclose(y, torch.ones(2, C) @ new["lin.weight"].t())


@gs.graphsafe
class Listed(nn.Module):
    """Per-channel scales read once as Python numbers (`scales.tolist()`): `tolist` reads
    the memory with no op, and the graph bakes the numbers in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.scales = nn.Parameter(torch.ones(C), requires_grad=False)

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        if post:
            self.host_scales = self.scales.tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor(self.host_scales)


def _listed(seed: int) -> dict[str, torch.Tensor]:
    return _weights(seed, scales=torch.arange(1.0, C + 1) * (seed + 1))


def _listed_reference(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (x @ weights["lin.weight"].t()) * weights["scales"]


def test_the_numbers_of_tolist_are_discovered_each_with_its_element() -> None:
    m = Listed()
    m.load_weights(_listed(0))
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {f"host_scales.{i}" for i in range(C)}
    assert all(d.kind == "scalar" and d.sources == ("scales",) for d in found.values())
    assert found["host_scales.2"].chain == "scales -> Tensor.tolist()[2]"


def test_a_bare_sync_leaves_the_tolist_numbers_stale_and_the_replay_is_refused() -> None:
    m = Listed()
    m.load_weights(_listed(0))
    g, _ = _capture(m, guard=True)
    m.load_weights(_listed(1), post=False)
    with pytest.raises(gs.StaleError, match=r"host_scales\.0 \(from scales"):
        g.replay()
    with pytest.raises(gs.StaleError, match=r"host_scales\.3"):
        gs.audit(m)  # the audit takes each number again and compares


def test_control_unguarded_the_graph_replays_the_tolist_numbers_it_baked_in() -> None:
    m = Listed()
    m.load_weights(_listed(0))
    g, y = _capture(m, guard=False)
    new = _listed(1)
    m.load_weights(new)  # the full load: eager reads the new numbers, the graph does not
    g.replay()
    x = torch.ones(2, C)
    assert torch.allclose(m(x), _listed_reference(new, x))
    assert not torch.allclose(y, _listed_reference(new, x))


def test_tolist_numbers_taken_again_after_capture_are_refused_and_before_it_are_fresh(
) -> None:
    m = Listed()
    m.load_weights(_listed(0))
    m.load_weights(_listed(1))  # before any capture: taken again, fresh
    gs.runtime(m).assert_fresh()
    assert gs.audit(m).discovered == tuple(f"host_scales.{i}" for i in range(C))
    g, _ = _capture(m, guard=True)
    m.load_weights(_listed(2))
    with pytest.raises(gs.StorageMovedError, match=r"host_scales\.0"):
        g.replay()  # the graph holds the numbers of capture


@gs.graphsafe
class ViaNumPy(Listed):
    """The same scales read through NumPy: what is made of the array is not followed."""

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        super().load_weights(weights, post=False)
        if post:
            self.host_scales = [float(v) for v in self.scales.numpy()]


def test_weights_read_as_numpy_are_warned_of_and_listed_unchecked_by_the_audit() -> None:
    m = ViaNumPy()
    with pytest.warns(gs.GraphSafetyWarning, match=r"ViaNumPy: .*NumPy arrays \(scales -> "
                      r"Tensor\.numpy\(\)\).*not followed"):
        m.load_weights(_listed(0))
    assert gs.runtime(m).discovered == ()  # nothing it could follow
    with pytest.warns(gs.GraphSafetyWarning, match="checked nothing"):
        report = gs.audit(m)
    assert [u.path for u in report.unchecked] == ["scales -> Tensor.numpy()"]
    assert "NumPy" in report.unchecked[0].why


@gs.graphsafe
class Inverted(Scaled):
    """A number computed in Python from one taken from a weight: `1.0 / k_scale.item()`."""

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        self.eps = 1e-6  # set before any number is taken: no derived state
        super().load_weights(weights, post=post)
        if post:
            self.inv_scale = 1.0 / self._k_scale_float


def test_a_number_computed_in_python_from_a_taken_one_is_warned_of_guarded_and_listed(
) -> None:
    m = Inverted()
    with pytest.warns(gs.GraphSafetyWarning, match=r"Inverted: its bring-up set inv_scale "
                      r"to floats computed in Python from numbers it took from k_scale"):
        m.load_weights(_scaled(0.5, 3))
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {"_k_scale_float", "zp", "inv_scale"}
    assert found["inv_scale"].kind == "scalar"
    assert set(found["inv_scale"].sources) == {"k_scale", "zero_point"}  # every number taken
    unchecked = {u.path: u.why for u in gs.audit(m).unchecked}
    assert list(unchecked) == ["inv_scale"] and "in Python" in unchecked["inv_scale"]


@gs.graphsafe
class Divided(Inverted):
    """Its kernel multiplies by the inverse computed in Python (the graph bakes it in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lin.weight.t()) * self.inv_scale


def _divided(*, guard: bool) -> tuple[Divided, gs.Graph, torch.Tensor]:
    m = Divided()
    with pytest.warns(gs.GraphSafetyWarning, match="computed in Python"):
        m.load_weights(_scaled(0.5))
    g, y = _capture(m, guard=guard)
    return m, g, y


def test_a_bare_sync_leaves_a_number_computed_in_python_stale_and_is_refused() -> None:
    m, g, _ = _divided(guard=True)
    m.load_weights(_scaled(2.0, seed=1), post=False)
    with pytest.raises(gs.StaleError, match=r"inv_scale"):
        g.replay()


def test_the_audit_reports_a_stale_number_computed_in_python_it_cannot_recompute() -> None:
    m, _, _ = _divided(guard=False)
    m.load_weights(_scaled(2.0, seed=1), post=False)
    with pytest.raises(gs.StaleError, match=r"inv_scale[\s\S]*held stale by the guard"):
        gs.audit(m)


def test_control_unguarded_the_number_computed_in_python_replays_stale() -> None:
    m, g, y = _divided(guard=False)
    new = _scaled(2.0, seed=1)
    m.load_weights(new, post=False)
    g.replay()
    fresh = torch.ones(2, C) @ new["lin.weight"].t()
    assert not torch.allclose(y, fresh * 0.5)  # 1 / 2.0, what a fresh engine computes
    assert torch.allclose(y, fresh * 2.0)  # the inverse of the old scale, baked in


def test_a_number_computed_in_python_again_by_the_full_post_load_step_is_no_false_alarm(
) -> None:
    m, g, y = _divided(guard=True)
    new = _scaled(0.5, seed=1)  # new weights, the same scale: the same inverse
    m.load_weights(new)
    g.replay()
    assert torch.allclose(y, (torch.ones(2, C) @ new["lin.weight"].t()) * 2.0)
    m.load_weights(_scaled(4.0, seed=2))  # a new scale: the graph holds the old inverse
    with pytest.raises(gs.StorageMovedError, match=r"inv_scale[\s\S]*2\.0 at capture"):
        g.replay()


def test_control_numbers_taken_or_set_before_any_is_taken_are_not_warned_of() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.GraphSafetyWarning)
        m = Inverted()
        m.load_weights(_scaled(0.5, 3), post=False)  # eps only: set before any number
        Scaled().load_weights(_scaled(0.5, 3))  # the numbers it took: followed


def test_control_numpy_of_what_no_weight_feeds_is_not_warned_of() -> None:
    import warnings

    @gs.graphsafe
    class Host(Listed):
        def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
            super().load_weights(weights, post=False)
            self.host_scales = [float(v) for v in torch.ones(C).numpy()]

    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.GraphSafetyWarning)
        Host().load_weights(_listed(0))


# -- handles of other kinds than an int -------------------------------------------------


@gs.graphsafe
class Prepacked(nn.Module):
    """torch's own quantized engines keep prepacked weights in a `ScriptObject`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        if post:
            self.packed = torch.ops.quantized.linear_prepack_fp16(self.lin.weight,
                                                                  self.lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


def _prepacked(seed: int) -> dict[str, torch.Tensor]:
    return _weights(seed, **{"lin.bias": torch.zeros(C)})


def test_a_script_object_handle_is_discovered_and_listed_unchecked_by_the_audit() -> None:
    m = Prepacked()
    m.load_weights(_prepacked(0))
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {"packed"}
    assert found["packed"].kind == "handle" and found["packed"].opaque
    assert set(found["packed"].sources) == {"lin.weight", "lin.bias"}
    report = gs.audit(m)
    assert [u.path for u in report.unchecked] == ["packed"]  # never passed unchecked
    assert "packed" not in report.checked


def test_a_handle_rebuilt_after_capture_is_refused_by_name() -> None:
    m = Prepacked()
    m.load_weights(_prepacked(0))
    g, _ = _capture(m, guard=True)
    m.load_weights(_prepacked(1))  # the post-load step packs anew: a new ScriptObject
    with pytest.raises(gs.StorageMovedError, match=r"packed") as info:
        g.replay()
    assert "ScriptObject" in str(info.value) and "lin.weight" in str(info.value)


def test_control_unguarded_the_graph_replays_the_old_handle() -> None:
    m = Prepacked()
    m.load_weights(_prepacked(0))
    g, y = _capture(m, guard=False)
    new = _prepacked(1)
    m.load_weights(new)
    g.replay()
    x = torch.ones(2, C)
    assert torch.allclose(m(x), x @ new["lin.weight"].t(), atol=1e-2)
    assert not torch.allclose(y, x @ new["lin.weight"].t(), atol=1e-2)


def test_a_bare_sync_leaves_the_handle_stale_and_the_replay_is_refused() -> None:
    m = Prepacked()
    m.load_weights(_prepacked(0))
    g, _ = _capture(m, guard=True)
    m.load_weights(_prepacked(1), post=False)
    with pytest.raises(gs.StaleError, match=r"packed"):
        g.replay()


def _probe(handle: Any, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.ones(2, C)
    return (torch.ops.quantized.linear_dynamic_fp16(x, handle),
            torch.nn.functional.linear(x, args[0], args[1]))


def test_a_registered_probe_audits_a_script_object_handle() -> None:
    gs.register_probe("quantized.linear_prepack_fp16", _probe, atol=1e-2, rtol=1e-2)
    try:
        m = Prepacked()
        m.load_weights(_prepacked(0))
        assert gs.audit(m).discovered == ("packed",)
        m.load_weights(_prepacked(1), post=False)  # the handle no longer fits the weight
        with pytest.raises(gs.StaleError, match=r"packed"):
            gs.audit(m)
    finally:
        from graphsafe._lineage.probes import PROBES

        PROBES.pop("quantized.linear_prepack_fp16", None)




# -- weights the post-load step rewrites in place ---------------------------------------


def _fold_scale(m: Folded) -> None:
    with torch.no_grad():
        m.lin.weight.mul_(m.scale[:, None])  # a per-channel scale folded into the weight


def _negate_exp(m: Folded) -> None:
    with torch.no_grad():
        m.lin.weight.copy_(-torch.exp(m.lin.weight))  # Mamba's A = -exp(A_log), in place


def _interleave(m: Folded) -> None:
    with torch.no_grad():  # gate/up rows interleaved for a fused kernel
        w = m.lin.weight
        w.copy_(torch.stack([w[: C // 2], w[C // 2 :]], dim=1).reshape(C, C))


REWRITES = [(_fold_scale, "aten::mul_.Tensor"), (_negate_exp, "aten::copy_"),
            (_interleave, "aten::copy_")]
REWRITE_IDS = ["scale-fold", "negate-exp", "interleave"]


@gs.graphsafe
class Folded(nn.Module):
    """The parameter is its own derived state: the post-load step rewrites it in place."""

    def __init__(self, rewrite: Callable[[Folded], None]) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.scale = nn.Parameter(torch.ones(C), requires_grad=False)
        self.rewrite = rewrite

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        if post:
            self.rewrite(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.lin.weight.t()


def _folded_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lin.weight": torch.randn(C, C, generator=g),
            "scale": torch.rand(C, generator=g) + 0.5}


def _folded(rewrite: Callable[[Folded], None], *, guard: bool
            ) -> tuple[Folded, gs.Graph, torch.Tensor]:
    """A `Folded` model loaded (and rewritten) once, then captured."""
    m = Folded(rewrite)
    m.load_weights(_folded_weights(0))
    g, y = _capture(m, guard=guard)
    return m, g, y


def _expected(rewrite: Callable[[Folded], None], weights: dict[str, torch.Tensor]
              ) -> torch.Tensor:
    """What a fresh model loaded with `weights` computes."""
    m = Folded(rewrite)
    m.load_weights(weights)
    return m(torch.ones(2, C))


@pytest.mark.parametrize(("rewrite", "op"), REWRITES, ids=REWRITE_IDS)
def test_a_weight_rewritten_in_place_is_discovered_with_its_ops(
    rewrite: Callable[[Folded], None], op: str
) -> None:
    m = Folded(rewrite)
    m.load_weights(_folded_weights(0))
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {"lin.weight"}
    assert found["lin.weight"].kind == "rewritten" and "lin.weight" in found["lin.weight"].sources
    assert found["lin.weight"].stale is None
    report = gs.audit(m)  # it cannot be recomputed: listed, never passed
    assert [u.path for u in report.unchecked] == ["lin.weight"]
    assert "rewrote in place" in report.unchecked[0].why


@pytest.mark.parametrize(("rewrite", "op"), REWRITES, ids=REWRITE_IDS)
def test_a_raw_sync_into_a_rewritten_weight_is_refused_by_name(
    rewrite: Callable[[Folded], None], op: str
) -> None:
    m, g, _ = _folded(rewrite, guard=True)
    with pytest.raises(gs.StaleError, match=r"lin\.weight") as info:
        m.load_weights(_folded_weights(1), post=False)  # raw values, no rewrite
    assert op in str(info.value) and "post-load" in str(info.value)
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        g.replay()  # the replay stays refused
    m.load_weights(_folded_weights(2))  # a whole load heals it
    g.replay()
    assert torch.allclose(m(torch.ones(2, C)), _expected(rewrite, _folded_weights(2)))


@pytest.mark.parametrize(("rewrite", "op"), REWRITES, ids=REWRITE_IDS)
def test_control_unguarded_a_raw_sync_replays_raw_values(
    rewrite: Callable[[Folded], None], op: str
) -> None:
    m, g, y = _folded(rewrite, guard=False)
    new = _folded_weights(1)
    gs.runtime(m).exempt("lin.weight", why="the control: nothing refuses")
    m.load_weights(new, post=False)
    g.replay()
    assert not torch.allclose(y, _expected(rewrite, new), atol=1e-4)


@pytest.mark.parametrize(("rewrite", "op"), REWRITES, ids=REWRITE_IDS)
def test_the_full_post_load_step_after_every_load_is_no_false_alarm(
    rewrite: Callable[[Folded], None], op: str
) -> None:
    m, g, y = _folded(rewrite, guard=True)
    for seed in (1, 2, 3):
        m.load_weights(_folded_weights(seed))
        g.replay()
        assert torch.allclose(y, _expected(rewrite, _folded_weights(seed)))


_OBSERVED = pytest.mark.skipif(
    _native.get() is None,
    reason="a `.data` write outside any load is seen by the compiled write observer",
)


@_OBSERVED
@pytest.mark.parametrize(("rewrite", "op"), REWRITES, ids=REWRITE_IDS)
def test_raw_values_copied_into_a_rewritten_weight_outside_any_load_are_refused(
    rewrite: Callable[[Folded], None], op: str
) -> None:
    """An RL framework's bare sync (`param.data.copy_(w)`, no version bump, no load):
    the process-wide observer sees it, and no load re-applied the rewrite."""
    m, g, _ = _folded(rewrite, guard=True)
    with torch.no_grad():
        m.lin.weight.data.copy_(_folded_weights(1)["lin.weight"])
    with pytest.raises(gs.StaleError, match=r"lin\.weight") as info:
        g.replay()
    message = str(info.value)
    assert "outside any tracked load" in message and "not re-applied" in message
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        g.replay()  # stays refused
    m.load_weights(_folded_weights(2))  # a whole load heals it
    g.replay()
    assert torch.allclose(m(torch.ones(2, C)), _expected(rewrite, _folded_weights(2)))


@_OBSERVED
def test_control_unguarded_raw_values_copied_outside_any_load_replay_raw() -> None:
    m, g, y = _folded(_fold_scale, guard=True)
    gs.runtime(m).exempt("lin.weight", why="the control: nothing refuses")
    new = _folded_weights(1)
    with torch.no_grad():
        m.lin.weight.data.copy_(new["lin.weight"])
    g.replay()
    assert not torch.allclose(y, _expected(_fold_scale, new), atol=1e-4)


def test_raw_values_written_in_place_through_a_rewritten_weight_are_refused() -> None:
    """The same outside any load through the parameter itself: its version moved (both
    guard paths)."""
    m, g, _ = _folded(_negate_exp, guard=True)
    with torch.no_grad():
        m.lin.weight.copy_(_folded_weights(1)["lin.weight"])
    with pytest.raises(gs.StaleError, match=r"lin\.weight[\s\S]*not re-applied"):
        g.replay()


def test_a_rewritten_weight_no_write_reached_after_a_load_is_no_false_alarm() -> None:
    m, g, y = _folded(_fold_scale, guard=True)
    m.load_weights(_folded_weights(1))
    for _ in range(3):
        g.replay()
    assert torch.allclose(y, _expected(_fold_scale, _folded_weights(1)))


def test_the_rewrite_re_run_over_a_weight_no_load_wrote_is_refused() -> None:
    m, g, y = _folded(_fold_scale, guard=True)
    # ROCm/ATOM #2028's shape: the post-load step runs again over weights the sync did
    # not write: the scale is folded in twice.
    with pytest.raises(gs.StaleError, match=r"applied twice"):
        gs.runtime(m).run_load(lambda mod: _fold_scale(mod), m, (), {})
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        g.replay()
    gs.runtime(m).exempt("lin.weight", why="the control: what the graph reads now")
    g.replay()
    assert not torch.allclose(y, _expected(_fold_scale, _folded_weights(0)))  # folded twice


def test_the_rewrite_alone_over_raw_values_a_refused_load_left_makes_the_weight_whole() -> None:
    """A raw sync is refused and leaves the loaded values; the post-load step run alone
    afterwards folds them once: whole, not "applied twice" (found by the state machine).
    The control is the test above: the rewrite alone over a rewritten weight is refused."""
    m, g, y = _folded(_fold_scale, guard=True)
    with pytest.raises(gs.StaleError, match=r"not re-apply"):
        m.load_weights(_folded_weights(1), post=False)
    gs.runtime(m).run_load(lambda mod: _fold_scale(mod), m, (), {})  # the rewrite alone
    g.replay()
    assert torch.allclose(y, _expected(_fold_scale, _folded_weights(1)))


def _affine(m: Folded) -> None:
    with torch.no_grad():
        m.lin.weight.copy_(1 + m.lin.weight)  # Gemma's `1 + w` folded into a norm weight


@pytest.mark.parametrize("rewrite", [_affine, _negate_exp], ids=["affine", "negate-exp"])
def test_a_rewrite_by_copy_alone_over_raw_values_a_refused_load_left_makes_it_whole(
    rewrite: Callable[[Folded], None],
) -> None:
    """A rewrite written back with `copy_` is told from a load's own `copy_` by what its
    source was computed from (the weights), so re-applied alone over the raw values a
    refused sync left, it makes the weight whole."""
    m = Folded(rewrite)
    m.load_weights(_folded_weights(0))
    (found,) = gs.runtime(m).discovered
    assert found.chain.endswith("aten.copy_")
    g, y = _capture(m, guard=True)
    with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*did not re-apply"):
        m.load_weights(_folded_weights(1), post=False)  # raw values, refused
    gs.runtime(m).run_load(rewrite, m, (), {})  # the rewrite alone over them
    g.replay()
    assert torch.allclose(y, _expected(rewrite, _folded_weights(1)))


@pytest.mark.parametrize("rewrite", [_affine, _negate_exp], ids=["affine", "negate-exp"])
def test_control_a_rewrite_by_copy_alone_over_its_own_output_is_refused(
    rewrite: Callable[[Folded], None],
) -> None:
    """The same rewrite run alone over a weight that is already whole applies it twice:
    refused naming the weight and the op, and what the graph would read is wrong."""
    m, g, y = _folded(rewrite, guard=True)
    with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*copy_ \(computed from the "
                       r"weights\)(.|\n)*applied twice"):
        gs.runtime(m).run_load(rewrite, m, (), {})
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        g.replay()
    gs.runtime(m).exempt("lin.weight", why="the control: what the graph reads now")
    g.replay()
    assert not torch.allclose(y, _expected(rewrite, _folded_weights(0)))  # applied twice


@pytest.mark.parametrize("rewrite", [_affine, _negate_exp], ids=["affine", "negate-exp"])
def test_a_rewrite_by_copy_after_each_bucket_is_judged_by_where_the_weight_came(
    rewrite: Callable[[Folded], None],
) -> None:
    """The post-load step after each bucket of one update: whole when the weight came in
    the last bucket (rewritten once after it), refused when a later bucket's step
    rewrote it again (the control: its values are wrong)."""
    new = _folded_weights(1)
    buckets = [{"scale": new["scale"]}, {"lin.weight": new["lin.weight"]}]
    for order, whole in ((buckets, True), (buckets[::-1], False)):
        m = Folded(rewrite)
        m.load_weights(_folded_weights(0))
        g, y = _capture(m, guard=True)
        if whole:
            with gs.weight_update(m):
                for bucket in order:
                    m.load_weights(bucket)
            g.replay()
            assert torch.allclose(y, _expected(rewrite, new))
            continue
        with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*applied again"), \
                gs.weight_update(m):
            for bucket in order:
                m.load_weights(bucket)
        assert not torch.allclose(m(torch.ones(2, C)), _expected(rewrite, new))


def test_the_trackers_name_a_copy_of_computed_values_apart_from_a_load() -> None:
    """Both write trackers name the rewrite's `copy_` as the recording does, and a copy of
    loaded values plainly: the order a rewritten weight is judged by."""
    from graphsafe._lineage.record.recorder import DERIVED_COPY
    from graphsafe._memory.walk import storage_key
    from graphsafe._runtime.writes.tracking import NativeWriteTracker, WriteTracker

    w = torch.randn(C, C)
    key = storage_key(w)
    trackers: list[Any] = [WriteTracker({key: "w"}, sequenced=frozenset((key,)))]
    native = _native.get()
    if native is not None:
        trackers.append(NativeWriteTracker({key: "w"}, native, frozenset((key,))))
    for tracker in trackers:
        tracker.taint(frozenset((key,)))
        with tracker:
            w.copy_(torch.ones(C, C))  # loaded values
            w.copy_(1 + w)  # computed from the weight
        assert tracker.ops[key] == ["aten::copy_", DERIVED_COPY], type(tracker)


def test_a_scale_the_rewrite_reads_bound_to_new_memory_without_the_rewrite_is_refused(
) -> None:
    """A loader that binds the scale to new memory (before a pin) and does not fold it
    in: refused naming the scale (found by the state machine); the control, the same
    load that also loads the weight and folds, is whole."""
    m = Folded(_fold_scale)
    m.load_weights(_folded_weights(0))
    new = _folded_weights(1)

    def rebind(mod: Folded) -> None:
        mod.scale.data = new["scale"].clone()

    with pytest.raises(gs.StaleError, match=r"scale, which the post-load rewrite"):
        gs.runtime(m).run_load(rebind, m, (), {})

    def rebind_and_fold(mod: Folded) -> None:
        rebind(mod)
        mod.load_weights({"lin.weight": new["lin.weight"]})

    fresh = Folded(_fold_scale)
    fresh.load_weights(_folded_weights(0))
    gs.runtime(fresh).run_load(rebind_and_fold, fresh, (), {})
    g, y = _capture(fresh, guard=True)
    g.replay()
    assert torch.allclose(y, _expected(_fold_scale, new))


def test_a_rewritten_weight_a_load_binds_to_new_memory_is_refused() -> None:
    m = Folded(_fold_scale)
    m.load_weights(_folded_weights(0))
    new = _folded_weights(1)

    def rebind(mod: Folded) -> None:  # raw values in new memory; the rewrite not re-run
        mod.lin.weight.data = new["lin.weight"].clone()

    # Before: accepted, the weight judged by the writes into its old memory (none).
    with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*bound to new memory"):
        gs.runtime(m).run_load(rebind, m, (), {})
    _, y = _capture(m, guard=False)  # the control: what a graph reads now is raw
    assert not torch.allclose(y, _expected(_fold_scale, new))
    guarded = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), guarded.capture():
        m(torch.ones(2, C))
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        guarded.replay()


def test_a_fold_applied_again_after_the_load_in_one_update_is_refused() -> None:
    m, g, _ = _folded(_fold_scale, guard=True)
    new = _folded_weights(1)
    with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*applied again"), \
            gs.weight_update(m):
        m.load_weights(new)  # loaded and folded ...
        _fold_scale(m)  # ... and folded again (a post-load step run after each bucket)
    assert not torch.allclose(m(torch.ones(2, C)), _expected(_fold_scale, new))  # control
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        g.replay()


def test_a_scale_the_rewrite_reads_loaded_without_the_rewrite_is_refused() -> None:
    m, g, _ = _folded(_fold_scale, guard=True)
    scale = _folded_weights(1)["scale"]
    with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*scale, which the post-load"):
        m.load_weights({"scale": scale}, post=False)
    want = _expected(_fold_scale, {**_folded_weights(0), "scale": scale})
    assert not torch.allclose(m(torch.ones(2, C)), want)  # control: folded the old scale
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        g.replay()


@pytest.mark.parametrize("load", [True, False], ids=["loaded-whole", "control-not-loaded"])
def test_a_rewritten_weight_whose_module_was_replaced_is_judged_where_it_is_now(
        load: bool) -> None:
    """The module holding the rewritten weight replaced before a pin: a load that writes
    the new weight and rewrites it leaves it whole (it was refused as bound to new
    memory, the old module's weight judged). The control: the new module's weight, no
    load since, holds values no load wrote and rewrote: listed stale, the replay refused."""
    m = Folded(_fold_scale)
    m.load_weights(_folded_weights(0))
    m.lin = nn.Linear(C, C, bias=False)
    new = _folded_weights(1)
    if load:
        m.load_weights(new)
    (found,) = gs.runtime(m).discovered
    assert found.path == "lin.weight" and found.kind == "rewritten"
    g, y = _capture(m, guard=True)
    if load:
        assert found.stale is None, found.stale
        g.replay()
        assert torch.allclose(y, _expected(_fold_scale, new))
        return
    assert found.stale is not None and "module was replaced" in found.stale, found.stale
    assert not torch.allclose(y, _expected(_fold_scale, _folded_weights(0)))  # control
    with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*module was replaced"):
        g.replay()


@gs.graphsafe
class Tied(nn.Module):
    """Another model holding `Folded`'s linear layer (a draft tied to its weights)."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def load_weights(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.lin.weight.copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.lin.weight.t()


def test_a_rewritten_weight_a_tied_model_loads_raw_is_refused_until_rewritten() -> None:
    m = Folded(_fold_scale)
    m.load_weights(_folded_weights(0))
    tied = Tied(m.lin)
    g, y = _capture(m, guard=True)
    raw = _folded_weights(1)["lin.weight"]
    tied.load_weights(raw)
    assert torch.equal(m.lin.weight, raw)  # control: the graph would read raw values
    with pytest.raises(gs.StaleError, match=r"lin\.weight(.|\n)*another model"):
        g.replay()
    gs.runtime(m).run_load(_fold_scale, m, (), {})  # the post-load step over them: whole
    g.replay()
    assert torch.allclose(y, _expected(_fold_scale, {**_folded_weights(0), "lin.weight": raw}))


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """A kernel's packed layout of the same shape: rows swapped in pairs (its own
    inverse, so the kernel unpacks with it)."""
    return w.reshape(C // 2, 2, C).flip(1).reshape(C, C).contiguous()


@gs.graphsafe
class Repacked(nn.Module):
    """vLLM's CPU MoE experts: the post-load step binds a prepacked copy of the loaded
    weight in its place (`replace_parameter`), the weight loader kept, so that a later
    load writes its values raw into the packed layout."""

    def __init__(self, *, by_data: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.lin.weight.weight_loader = _copy_loader
        self.by_data = by_data
        """Bind the packed memory under the same parameter (`p.data = packed`)."""

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        for name, w in weights.items():
            p = self.get_parameter(name)
            p.weight_loader(p, w)
        if post and self.by_data:
            self.lin.weight.data = _blocked(self.lin.weight.data)
        elif post:
            packed = nn.Parameter(_blocked(self.lin.weight.detach()), requires_grad=False)
            packed.weight_loader = self.lin.weight.weight_loader
            self.lin.weight = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _blocked(self.lin.weight).t()  # the kernel reads the packed layout


def _packed_weights(seed: int) -> dict[str, torch.Tensor]:
    return {"lin.weight": _folded_weights(seed)["lin.weight"]}


def _copy_loader(p: torch.Tensor, w: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(w)


BY = pytest.mark.parametrize("by_data", [False, True], ids=["replaced", "by-data"])


@BY
def test_a_weight_rebound_to_its_prepacked_copy_is_discovered_as_rewritten(
        by_data: bool) -> None:
    m = Repacked(by_data=by_data)
    m.load_weights(_packed_weights(0))
    (found,) = gs.runtime(m).discovered
    assert (found.path, found.kind, found.sources) == ("lin.weight", "rewritten",
                                                       ("lin.weight",))
    assert found.chain.startswith("lin.weight as loaded -> aten.")


@BY
def test_a_raw_sync_into_the_prepacked_weight_is_refused_by_name(by_data: bool) -> None:
    m = Repacked(by_data=by_data)
    m.load_weights(_packed_weights(0))
    g, _ = _capture(m, guard=True)
    with pytest.raises(gs.StaleError, match=r"lin\.weight: written by aten::copy_: raw "
                       r"values where the model reads the output of the post-load rewrite"):
        m.load_weights(_packed_weights(1), post=False)  # its loader writes in place
    with pytest.raises(gs.StaleError, match=r"lin\.weight"):
        g.replay()


@BY
def test_control_unguarded_a_raw_sync_into_the_prepacked_weight_serves_wrong_values(
        by_data: bool) -> None:
    m = Repacked(by_data=by_data)
    m.load_weights(_packed_weights(0))
    g, y = _capture(m, guard=False)
    new = _packed_weights(1)
    with pytest.raises(gs.StaleError):
        m.load_weights(new, post=False)  # refused after it wrote: what it left is served
    g.replay()
    assert not torch.allclose(y, torch.ones(2, C) @ new["lin.weight"].t())


def test_the_full_post_load_step_rebinding_a_new_prepacked_copy_is_no_false_alarm() -> None:
    m = Repacked()
    m.load_weights(_packed_weights(0))
    gs.runtime(m).pin(addresses=False)  # an engine without graphs: it reads what is bound
    new = _packed_weights(1)
    m.load_weights(new)  # loaded, then packed anew and bound in its place
    gs.runtime(m).assert_fresh()
    assert torch.allclose(m(torch.ones(2, C)), torch.ones(2, C) @ new["lin.weight"].t())


@gs.graphsafe
class Cast(nn.Module):
    """A post-load step that casts the loaded weight under the same parameter: the
    values in their own order, which a later load's `copy_` writes the same way."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        if post and self.lin.weight.dtype != torch.float64:
            self.lin.weight.data = self.lin.weight.data.to(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.double() @ self.lin.weight.t()).float()


def test_a_weight_cast_under_its_parameter_is_no_rewrite_and_a_raw_sync_replays() -> None:
    m = Cast()
    m.load_weights(_packed_weights(0))
    assert gs.runtime(m).discovered == ()
    g, y = _capture(m, guard=True)
    new = _packed_weights(1)
    m.load_weights(new, post=False)  # copy_ casts as the post-load step did
    g.replay()
    assert torch.allclose(y, torch.ones(2, C) @ new["lin.weight"].t())


def test_control_a_load_binding_raw_values_at_the_prepacked_weight_is_refused() -> None:
    m = Repacked()
    m.load_weights(_packed_weights(0))
    gs.runtime(m).pin(addresses=False)
    raw = _packed_weights(1)["lin.weight"].clone()
    with (pytest.raises(gs.StaleError, match=r"lin\.weight: bound to new memory"),
          gs.weight_update(m), torch.no_grad()):
        m.lin.weight.data = raw  # raw values, not packed


# -- state made outside any load: on first use, in a warm-up ---------------------------


@gs.graphsafe
class Lazy(nn.Module):
    """A kernel that packs its weight on first use, as engines do in their profile run or
    warm-up; `every` recomputes the packed copy in every forward instead."""

    def __init__(self, *, every: bool = False, keyed: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.every, self.keyed = every, keyed
        self.packed: torch.Tensor | None = None
        self.cache: dict[int, torch.Tensor] = {}
        self.rope: torch.Tensor | None = None

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)

    def _pack(self) -> torch.Tensor:
        w = self.lin.weight
        if self.keyed:  # a per-layer cache keyed by the weight's identity
            if id(w) not in self.cache:
                self.cache[id(w)] = w.t().contiguous()
            return self.cache[id(w)]
        if self.packed is None or self.every:
            self.packed = w.t().contiguous()
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rope is None:  # made on first use from the config: no weight feeds it
            self.rope = torch.arange(C, dtype=torch.float32, device=x.device).cos()
        return x @ self._pack() + self.rope


def _lazy_reference(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x @ weights["lin.weight"].t() + torch.arange(C, dtype=torch.float32).cos()


def _brought_up(m: Lazy, *, guard: bool, warmups: int = 1) -> tuple[gs.Graph, torch.Tensor]:
    m.load_weights(_weights(0))
    x = torch.ones(2, C)
    with torch.no_grad():
        for _ in range(warmups):  # the engine's profile run, its warm-up
            m(x)
    return _capture(m, guard=guard)


@pytest.mark.parametrize("keyed", [False, True], ids=["attribute", "keyed-by-id"])
def test_state_made_on_first_use_before_capture_is_discovered_and_guarded(
    keyed: bool,
) -> None:
    m = Lazy(keyed=keyed)
    g, _ = _brought_up(m, guard=True)
    found = {d.path: d for d in gs.runtime(m).discovered}
    path = next(iter(found))
    assert list(found) == [path] and path.startswith("cache." if keyed else "packed")
    assert found[path].sources == ("lin.weight",)  # not the rope: no weight feeds it
    m.load_weights(_weights(1))  # a sync: the packed copy is not made again
    with pytest.raises(gs.StaleError, match=r"packed|cache"):
        g.replay()


class LazyElsewhere(Lazy):
    """The kernel's first use hands the packing to the queue's worker (started long
    before): a thread the bring-up's recording does not follow."""

    def _pack(self) -> torch.Tensor:
        if self.packed is None:
            self.packed = _PACKER.run(_packed, self.lin.weight)
        return self.packed


def test_state_a_thread_not_followed_made_on_first_use_is_said_and_guarded() -> None:
    m = LazyElsewhere()
    if _native.get() is None:
        return  # not seen without the compiled build (said once per process, at the pin)
    with pytest.warns(gs.GraphSafetyWarning, match=(
            r"LazyElsewhere: .*thread 'packer'.*: lin\.weight\).*\(packed\) is guarded")):
        g, _ = _brought_up(m, guard=True)
    assert [(d.path, d.sources) for d in gs.runtime(m).discovered] == [
        ("packed", ("lin.weight",))]
    m.load_weights(_weights(1))  # a sync: the packed copy is not made again
    with pytest.raises(gs.StaleError, match=r"packed \(from lin\.weight"):
        g.replay()


def test_control_unguarded_state_a_thread_not_followed_made_replays_stale() -> None:
    m = LazyElsewhere()
    g, y = _brought_up(m, guard=False)
    m.load_weights(_weights(1))
    g.replay()
    assert not torch.allclose(y, _lazy_reference(_weights(1), torch.ones(2, C)))


def test_control_unguarded_state_made_on_first_use_replays_stale() -> None:
    m = Lazy()
    g, y = _brought_up(m, guard=False)
    m.load_weights(_weights(1))
    g.replay()
    assert torch.allclose(y, _lazy_reference(_weights(0), torch.ones(2, C)))
    assert not torch.allclose(y, _lazy_reference(_weights(1), torch.ones(2, C)))


def test_state_every_forward_makes_again_is_no_false_alarm() -> None:
    m = Lazy(every=True)
    g, y = _brought_up(m, guard=True, warmups=2)
    assert gs.runtime(m).discovered == ()  # the capture made it again: the graph does
    m.load_weights(_weights(1))
    g.replay()
    assert torch.allclose(y, _lazy_reference(_weights(1), torch.ones(2, C)))


def test_state_made_inside_the_capture_is_no_false_alarm() -> None:
    m = Lazy()
    g, y = _brought_up(m, guard=True, warmups=0)  # first used by the captured forward
    assert gs.runtime(m).discovered == ()
    m.load_weights(_weights(1))
    g.replay()
    assert torch.allclose(y, _lazy_reference(_weights(1), torch.ones(2, C)))


@gs.graphsafe
class LazyScale(nn.Module):
    """A kernel that takes its scale as a Python number on first use and keeps it: the
    graph bakes the number in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)
        self.taken: float | None = None

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.taken is None:
            self.taken = self.scale.item()
        return x @ self.lin.weight.t() * self.taken


def _lazy_scale(seed: int, scale: float) -> dict[str, torch.Tensor]:
    return {**_weights(seed), "scale": torch.tensor(scale)}


def _lazy_scaled(*, guard: bool, warmups: int) -> tuple[LazyScale, gs.Graph, torch.Tensor]:
    m = LazyScale()
    m.load_weights(_lazy_scale(0, 0.5))
    with torch.no_grad():
        for _ in range(warmups):
            m(torch.ones(2, C))
    g, y = _capture(m, guard=guard)
    return m, g, y


def test_a_number_taken_on_first_use_is_discovered_and_guarded() -> None:
    """Taken in a warm-up (a capture refuses `.item()`): the graph holds it, and no replay
    takes it again."""
    m, g, _ = _lazy_scaled(guard=True, warmups=1)
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {"taken"}
    assert (found["taken"].kind, found["taken"].sources) == ("scalar", ("scale",))
    m.load_weights(_lazy_scale(1, 2.0))
    with pytest.raises(gs.StaleError, match=r"number\(s\)[\s\S]*taken \(from scale"):
        g.replay()


def test_control_unguarded_a_number_taken_on_first_use_replays_stale() -> None:
    m, g, y = _lazy_scaled(guard=False, warmups=1)
    new = _lazy_scale(1, 2.0)
    m.load_weights(new)
    g.replay()
    assert torch.allclose(y, torch.ones(2, C) @ new["lin.weight"].t() * 0.5)  # the old scale


def test_a_sync_that_leaves_the_lazily_taken_numbers_source_alone_is_no_false_alarm() -> None:
    m, g, y = _lazy_scaled(guard=True, warmups=1)
    new = _weights(1)
    m.load_weights(new)  # the weight only: the scale the number came from is as it was
    g.replay()
    assert torch.allclose(y, torch.ones(2, C) @ new["lin.weight"].t() * 0.5)


def test_the_bring_up_ends_with_the_first_capture() -> None:
    m = Lazy()
    graph, _ = _brought_up(m, guard=True, warmups=0)
    m.packed = None  # made again after the capture, by a forward no graph captured
    with torch.no_grad():
        m(torch.ones(2, C))
    assert gs.runtime(m).discovered == ()  # not recorded: a dispatch mode costs every op
    assert not m._forward_pre_hooks and not m._forward_hooks
    assert graph.captured


# -- threads the post-load step starts ----------------------------------------------------

_POOL = __import__("concurrent.futures").futures.ThreadPoolExecutor(2)  # made before any load


class _Packer:
    """A worker thread an engine started long before any load, that runs what it is handed
    through a queue (and the caller waits for it)."""

    def __init__(self) -> None:
        import queue
        import threading

        self.jobs: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], queue.Queue[Any]]]
        self.jobs = queue.Queue()
        self._queue = queue.Queue
        self.thread = threading.Thread(target=self._serve, name="packer", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            fn, args, done = self.jobs.get()
            try:
                done.put((fn(*args), None))
            except BaseException as exc:  # handed back to the caller
                done.put((None, exc))

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        done: Any = self._queue()
        self.jobs.put((fn, args, done))
        out, exc = done.get()
        if exc is not None:
            raise exc
        return out


_PACKER = _Packer()  # started at import: before any load


def _packed(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


@torch.jit.script
def _t(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


@torch.jit.script
def _forked_t(w: torch.Tensor) -> torch.Tensor:
    return torch.jit.wait(torch.jit.fork(_t, w))


@gs.graphsafe
class Threaded(nn.Module):
    """A post-load step that packs its layers in worker threads."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(C, C, bias=False) for _ in range(3)])
        self.how = how

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        if not post:
            return

        def pack(layer: nn.Module) -> None:
            if "packed" in vars(layer):  # packed again in place, where it was
                with torch.no_grad():
                    layer.packed.copy_(layer.weight.t())
            else:
                layer.packed = layer.weight.t().contiguous()

        if self.how == "pool":  # a pool made long before
            list(_POOL.map(pack, self.layers))
        elif self.how == "queue":  # a worker that existed before, fed through a queue
            for layer in self.layers:
                made = _PACKER.run(_packed, layer.weight)
                if "packed" in vars(layer):  # handed back, copied in where it was
                    with torch.no_grad():
                        layer.packed.copy_(made)
                else:
                    layer.packed = made
        elif self.how == "queue-in-place":  # the same worker packs in place once packed
            for layer in self.layers:
                _PACKER.run(pack, layer)
        elif self.how == "fork":  # torch.jit.fork of a Python function: runs here
            for fut in [torch.jit.fork(pack, layer) for layer in self.layers]:
                torch.jit.wait(fut)
        elif self.how == "script":  # a scripted fork: on torch's inter-op pool
            for layer in self.layers:
                if "packed" in vars(layer):
                    with torch.no_grad():
                        layer.packed.copy_(_forked_t(layer.weight))
                else:
                    layer.packed = _forked_t(layer.weight)
        else:
            import threading

            threads = [threading.Thread(target=pack, args=(m,)) for m in self.layers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x @ layer.packed
        return x


def _threaded_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(C, C, generator=g) / 2 for i in range(3)}


@pytest.mark.parametrize("how", ["pool", "threads", "fork", "script"])
def test_what_worker_threads_pack_is_discovered_and_guarded(how: str) -> None:
    import warnings

    m = Threaded(how)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.GraphSafetyWarning)  # followed: nothing to say
        m.load_weights(_threaded_weights(0))
    found = gs.runtime(m).discovered
    assert sorted(d.path for d in found) == [f"layers.{i}.packed" for i in range(3)]
    assert not any("..." in d.chain for d in found)  # recorded op by op, in every thread
    g, _ = _capture(m, guard=True)
    m.load_weights(_threaded_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=r"layers\.0\.packed"):
        g.replay()
    m.load_weights(_threaded_weights(2))  # the full load packs again, in threads
    g.replay()


def test_a_torch_jit_fork_inside_a_script_runs_on_another_thread_and_is_recorded() -> None:
    import threading

    seen: set[int] = set()

    def note(w: torch.Tensor) -> torch.Tensor:
        seen.add(threading.get_native_id())
        return w

    # The scripted fork's task runs on torch's inter-op pool, not in the caller's thread
    # (what makes following it a question); the recording's mode travels with it.
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphsafe._lineage.record.recorder import Lineage, Recorder

    ran: set[int] = set()

    class Where(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            ran.add(threading.get_native_id())
            return func(*args, **(kwargs or {}))

    w = torch.randn(C, C)
    with Where():
        _forked_t(w)
    assert ran and threading.get_native_id() not in ran
    with Recorder(Lineage(), frozenset({w.untyped_storage().data_ptr()})) as rec:
        packed = _forked_t(w)
        seen.add(threading.get_native_id())
    assert packed.untyped_storage()._cdata in rec.lineage.writers
    assert rec.lineage.strays == []
    torch.jit.wait(torch.jit.fork(note, w))  # eager: the caller's own thread
    torch.jit.wait(torch.jit._fork(note, w))
    assert seen == {threading.get_native_id()}


@pytest.mark.parametrize("how", ["queue"])
def test_what_a_thread_the_recording_does_not_follow_packs_is_said_and_guarded(
        how: str) -> None:
    m = Threaded(how)
    if _native.get() is None:  # no observer to see it: said once per process, at the pin
        m.load_weights(_threaded_weights(0))
        assert gs.runtime(m).discovered == ()
        return
    with pytest.warns(gs.GraphSafetyWarning, match=(
            r"Threaded: while its bring-up was recorded, threads the recording does not "
            r"follow read or wrote its weights \(thread 'packer' \(OS thread \d+\) -> "
            r"aten\.t, aten\.contiguous: layers\.0\.weight, layers\.1\.weight, "
            r"layers\.2\.weight\).*\(layers\.0\.packed, layers\.1\.packed, "
            r"layers\.2\.packed\) is guarded.*Run that work in a thread the post-load step "
            r"starts or a ThreadPoolExecutor task")):
        m.load_weights(_threaded_weights(0))
    found = gs.runtime(m).discovered
    assert sorted(d.path for d in found) == [f"layers.{i}.packed" for i in range(3)]
    assert {d.sources for d in found} == {(f"layers.{i}.weight",) for i in range(3)}
    report = gs.audit(m)
    assert report.checked == ()  # nothing it could recompute: none passed
    unchecked = {u.path: u.why for u in report.unchecked}
    assert "thread 'packer'" in " ".join(unchecked)
    assert {f"layers.{i}.packed" for i in range(3)} <= unchecked.keys()
    g, _ = _capture(m, guard=True)
    m.load_weights(_threaded_weights(1), post=False)
    with pytest.raises(gs.StaleError, match=r"layers\.0\.packed \(from layers\.0\.weight"):
        g.replay()
    m.load_weights(_threaded_weights(2))  # the full load packs again, in the worker
    g.replay()


def test_a_thread_not_followed_that_packs_in_place_in_a_later_load_is_refused() -> None:
    """Fail closed: a later load is not recorded, so the worker's in-place pack is not
    seen as the packed copy made again; the replay is refused, never passed stale."""
    m = Threaded("queue-in-place")
    if _native.get() is None:
        return  # nothing discovered without the compiled build (the test above)
    with pytest.warns(gs.GraphSafetyWarning, match=r"thread 'packer'.*layers\.0\.packed"):
        m.load_weights(_threaded_weights(0))
    g, _ = _capture(m, guard=True)
    m.load_weights(_threaded_weights(1))  # packs again, in place, in the worker
    with pytest.raises(gs.StaleError, match=r"layers\.0\.packed"):
        g.replay()


@gs.graphsafe
class FoldedElsewhere(nn.Module):
    """A post-load step that has the queue's worker fold a scale into the weight in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        _PACKER.run(lambda w: w.detach().mul_(2), self.lin.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_weight_a_thread_not_followed_rewrites_in_place_is_said_by_name() -> None:
    m = FoldedElsewhere()
    if _native.get() is None:
        return  # not seen without the compiled build (said once per process, at the pin)
    with pytest.warns(gs.GraphSafetyWarning, match=(
            r"thread 'packer' \(OS thread \d+\) -> aten\.detach, aten\.mul_\.Tensor: "
            r"lin\.weight, wrote lin\.weight\)"
            r".*nothing the model keeps was seen made by them")):
        m.load_weights(_weights(0))
    report = gs.audit(m)
    assert [u.path for u in report.unchecked if "packer" in u.path] == [
        next(u.path for u in report.unchecked if "aten.mul_" in u.path)]


def test_control_without_the_stray_watch_what_the_queue_worker_packs_replays_stale(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The feature broken (the watch of threads not followed never starts): the worker's
    packed copies go unseen and the replay reads them stale, with nothing said."""
    import warnings

    from graphsafe._lineage.record import threads

    monkeypatch.setattr(threads.Strays, "_apply", lambda self, native: None)
    m = Threaded("queue")
    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.GraphSafetyWarning)
        m.load_weights(_threaded_weights(0))
    assert gs.runtime(m).discovered == ()
    g, y = _capture(m, guard=True)
    m.load_weights(_threaded_weights(1), post=False)
    g.replay()  # nothing refuses
    assert not torch.allclose(y, _threaded_reference(_threaded_weights(1)))


@gs.graphsafe
class Busy(Threaded):
    """The queue's worker also runs work that reads no weight, inside the recorded load."""

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        _PACKER.run(torch.ones(3).mul_, 2)  # not followed, but no weight: nothing to say
        super().load_weights(weights, post=post)


def test_control_a_thread_not_followed_that_reads_no_weight_is_not_said() -> None:
    import warnings

    m = Busy("pool")
    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.GraphSafetyWarning)
        m.load_weights(_threaded_weights(0))
    assert len(gs.runtime(m).discovered) == 3


def _threaded_reference(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    want = torch.ones(2, C)
    for i in range(3):
        want = want @ weights[f"layers.{i}.weight"].t()
    return want


@pytest.mark.parametrize("how", ["pool", "queue"])
def test_control_unguarded_what_threads_packed_replays_stale(how: str) -> None:
    m = Threaded(how)
    m.load_weights(_threaded_weights(0))
    g, y = _capture(m, guard=False)
    m.load_weights(_threaded_weights(1), post=False)
    g.replay()
    assert not torch.allclose(y, _threaded_reference(_threaded_weights(1)))


def test_the_thread_hooks_are_gone_once_nothing_records() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from graphsafe._lineage.record import threads

    m = Threaded("threads")
    m.load_weights(_threaded_weights(0))
    with torch.no_grad():
        m(torch.ones(2, C))  # ends the bring-up's tail, which records until then
    assert threading.Thread.start is threads._THREAD_START
    assert ThreadPoolExecutor.submit is threads._POOL_SUBMIT


# -- a compiled function inside the recorded load ----------------------------------------

_DEQUANT: dict[bool, Callable[[torch.Tensor], torch.Tensor]] = {}


def _dequantize(t: torch.Tensor, fullgraph: bool) -> torch.Tensor:
    if fullgraph not in _DEQUANT:  # made on first use: importing dynamo takes seconds
        # Two functions, not one: dynamo keeps what it decided per code object.
        fn = (lambda t: t * 2.0 + 1.0) if fullgraph else (lambda t: 1.0 + t * 2.0)
        _DEQUANT[fullgraph] = torch.compile(fn, fullgraph=fullgraph, backend="eager")
    return _DEQUANT[fullgraph](t)


@gs.graphsafe
class CompiledLoader(nn.Module):
    def __init__(self, fullgraph: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C, bias=False)
        self.fullgraph = fullgraph

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():  # dequantize-and-copy
                self.get_parameter(name).copy_(_dequantize(w, self.fullgraph))
        self.packed = self.lin.weight.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.packed


def test_a_compiled_function_inside_the_recorded_load_runs_and_is_recorded() -> None:
    m = CompiledLoader(fullgraph=False)
    m.load_weights(_weights(0))  # before: a raw dynamo error from graphsafe's recorder
    assert torch.equal(m.lin.weight, _weights(0)["lin.weight"] * 2.0 + 1.0)
    assert [d.path for d in gs.runtime(m).discovered] == ["packed"]


def test_a_fullgraph_compiled_function_runs_in_the_recorded_load_and_in_later_ones() -> None:
    m = CompiledLoader(fullgraph=True)
    if _native.get() is None:  # the Python write tracker is a dispatch mode dynamo refuses
        with pytest.raises(gs.GraphSafetyError, match=r"compiled tracker"):
            m.load_weights(_weights(0))
        return
    m.load_weights(_weights(0))  # before: dynamo skipped it under the recording ...
    m.load_weights(_weights(1))  # ... and remembered: "found no compiled frames" here
    assert torch.equal(m.lin.weight, _weights(1)["lin.weight"] * 2.0 + 1.0)


def _packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vLLM's `weight_packed_linear_cpu`: its output made first, then written (`out=`)."""
    out = torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype)  # [T, C]
    return torch.mm(x, w.t(), out=out)


class DynamicForward(Lazy):
    """A forward compiled with the token dimension dynamic, as vLLM compiles its model
    (the bring-up's first forwards, its profile run among them, are recorded)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.lin.weight)


def test_a_recorded_forward_traced_with_a_dynamic_dimension_keeps_it_dynamic() -> None:
    m = DynamicForward()
    m.load_weights(_weights(0))
    compiled = torch.compile(m, backend="eager")
    x = torch.ones(8, C)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():  # before: the recorder read the traced sizes and dynamo
        y = compiled(x)  # specialized the marked dimension (ConstraintViolationError)
    assert torch.equal(y, x @ m.lin.weight.t())
    with torch.no_grad():
        assert compiled(torch.ones(3, C)).shape == (3, C)


# -- views made anew over the same memory ------------------------------------------------


class _Impl:
    """vLLM's MLA impl: `W_UK_T` and `W_UV`, views of the absorbed weight."""


@gs.graphsafe
class Views(nn.Module):
    def __init__(self, *, clone: bool = False) -> None:
        super().__init__()
        self.kv = nn.Linear(C, 2 * C, bias=False)
        self.impl = _Impl()
        self.clone = clone

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.kv.weight.copy_(weights["kv.weight"])
        w = self.kv.weight.detach()
        if self.clone and hasattr(self.impl, "W_UV"):
            w = w.clone()  # the control: new memory
        self.impl.W_UK_T = w[:C].t()  # new view objects at every load
        self.impl.W_UV = w[C:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.impl.W_UK_T + x @ self.impl.W_UV.t()


def _kv(seed: int) -> dict[str, torch.Tensor]:
    return {"kv.weight": torch.randn(2 * C, C, generator=torch.Generator().manual_seed(seed))}


def test_views_made_anew_over_the_same_memory_replay_without_a_false_alarm() -> None:
    m = Views()
    m.load_weights(_kv(0))
    g, y = _capture(m, guard=True)
    for seed in (1, 2):
        m.load_weights(_kv(seed))
        g.replay()  # before: "another tensor object" on the compiled path
        assert torch.allclose(y, m(torch.ones(2, C)))


def test_control_views_over_new_memory_are_refused() -> None:
    m = Views(clone=True)
    m.load_weights(_kv(0))
    g, _ = _capture(m, guard=True)
    m.load_weights(_kv(1))
    with pytest.raises(gs.StorageMovedError, match=r"impl\.W_U"):
        g.replay()


# -- under real CUDA graphs ---------------------------------------------------------------

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@_CUDA
def test_cuda_a_number_changed_after_capture_is_refused_and_its_control_replays_it() -> None:
    for guard in (True, False):
        first = {k: v.cuda() for k, v in _scaled(0.5).items()}  # made on the host
        with torch.device("cuda"):
            m = Scaled()
        m.load_weights(first)
        g = gs.Graph(backend="cuda", guard=m if guard else None)
        x = torch.ones(2, C, device="cuda")
        with torch.no_grad(), g.capture():
            y = m(x)
        new = {k: v.cuda() for k, v in _scaled(2.0).items()}
        m.load_weights(new)
        if guard:
            with pytest.raises(gs.StorageMovedError, match=r"_k_scale_float"):
                g.replay()
            continue
        g.replay()  # the kernel's argument is the float baked in at capture
        torch.cuda.synchronize()
        assert not torch.allclose(y, _scaled_reference(new, x))


@_CUDA
def test_cuda_state_made_on_first_use_before_capture_is_guarded() -> None:
    first = {k: v.cuda() for k, v in _weights(0).items()}  # made on the host
    with torch.device("cuda"):
        m = Lazy()
    m.load_weights(first)
    x = torch.ones(2, C, device="cuda")
    with torch.no_grad():
        m(x)  # the warm-up packs
    g = gs.Graph(backend="cuda", guard=m)
    with torch.no_grad(), g.capture():
        m(x)
    assert [d.path for d in gs.runtime(m).discovered] == ["packed"]
    m.load_weights({k: v.cuda() for k, v in _weights(1).items()})
    with pytest.raises(gs.StaleError, match=r"packed"):
        g.replay()


def test_the_bring_up_ends_after_its_most_forwards_or_at_a_later_load() -> None:
    from graphsafe._lineage.window import FORWARDS

    m = Lazy()
    m.load_weights(_weights(0))
    x = torch.ones(2, C)
    with torch.no_grad():
        for _ in range(FORWARDS):  # a model no graph ever captures
            m(x)
    assert not m._forward_pre_hooks and not m._forward_hooks  # no recorder from here on
    assert [d.path for d in gs.runtime(m).discovered] == ["packed"]
    # A later load ends it too (what forwards after a sync make is no warm-up's).
    m2 = Lazy()
    m2.load_weights(_weights(0))
    assert m2._forward_pre_hooks
    m2.load_weights(_weights(1))
    assert not m2._forward_pre_hooks and gs.runtime(m2).discovered == ()
