"""What an engine derives from its weights beyond tensors is guarded too: Python numbers
taken from the weights (`.item()`, `float()`, `int()`, `bool()`) that a captured graph
bakes in, and kernel handles of other kinds than an int (torch's prepacked
`ScriptObject`s).

Each model below is written the way serving engines are (a loader, then a post-load step
nobody declared). Each kind comes with its control: the same capture replayed unguarded
reads the stale value, so the refusal guards a real stale read.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import graphsafe as gs

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


