"""One runtime per model: `gs.Runtime(model)` is `gs.runtime(model)`, or refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsafe as gs


def _counting_registry(calls: list[str]) -> gs.Registry:
    reg = gs.Registry()

    @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
    def weight_t(m: nn.Linear, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        calls.append("weight_t")
        t = w.t().contiguous()
        return t if out is None else out.copy_(t)

    return reg


def test_runtime_construction_returns_the_models_one_runtime() -> None:
    calls: list[str] = []
    reg = _counting_registry(calls)
    lin = nn.Linear(3, 2)
    rt = gs.runtime(lin, reg)
    assert gs.Runtime(lin) is rt
    assert gs.Runtime(lin, reg) is rt
    assert gs.Runtime(lin, reg, strict=False) is rt
    assert isinstance(rt, gs.Runtime)
    # A load refreshes the buffer once: a second live runtime would refresh it again.
    with gs.weight_update(lin):
        lin.weight.data.copy_(torch.randn(2, 3))
    calls.clear()
    with gs.weight_update(lin):
        lin.weight.data.copy_(torch.randn(2, 3))
    assert calls == ["weight_t"]
    assert torch.equal(lin.weight_t, lin.weight.t())


def test_runtime_construction_first_makes_the_runtime_runtime_returns() -> None:
    lin = nn.Linear(3, 2)
    rt = gs.Runtime(lin, strict=True)
    assert gs.runtime(lin) is rt and rt.strict


def test_a_submodules_runtime_is_its_models() -> None:
    calls: list[str] = []
    model = nn.Sequential(nn.Linear(3, 2))
    rt = gs.runtime(model, _counting_registry(calls))
    rt.refresh()
    assert gs.Runtime(model[0]) is rt


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [({"registry": "other"}, "a registry it does not consult"), ({"strict": True}, "strict=True")],
)
def test_runtime_construction_that_conflicts_refuses_and_says_to_call_runtime(
    kwargs: dict[str, object], what: str
) -> None:
    lin = nn.Linear(3, 2)
    rt = gs.runtime(lin)
    if kwargs.get("registry") == "other":
        kwargs = {"registry": gs.Registry()}
    with pytest.raises(gs.GraphSafetyError, match=r"(?s)already has a runtime.*" + what
                       + r".*fix: +call gs\.runtime\(model"):
        gs.Runtime(lin, **kwargs)  # type: ignore[arg-type]
    assert gs.runtime(lin) is rt  # nothing was made


def test_control_two_runtimes_of_one_model_would_both_refresh_it() -> None:
    # What a second runtime does (the bug the identity rule prevents): each binds and
    # refreshes the same model on its own, so every load runs the derivation twice.
    calls: list[str] = []
    reg = _counting_registry(calls)
    lin = nn.Linear(3, 2)
    first = gs.runtime(lin, reg)
    second = type.__call__(gs.Runtime, lin, reg)  # bypasses the one-per-model rule
    assert second is not first
    first.refresh()
    second.refresh()
    calls.clear()
    with first.weight_update():
        lin.weight.data.copy_(torch.randn(2, 3))
    assert calls == ["weight_t", "weight_t"]
