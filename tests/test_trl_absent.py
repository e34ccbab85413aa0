"""`graphsafe.integrations.trl` where TRL is not installed (the main test environment):
it imports, and `enable` changes nothing. The TRL tests themselves run in vLLM's
environment (`tests_vllm/test_trl.py`, `scripts/test-vllm`)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from graphsafe.integrations import trl as gs_trl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is not None, reason="TRL is installed here"
)


def test_without_trl_enable_returns_false_and_changes_nothing() -> None:
    before = dict(os.environ)
    assert gs_trl.installed() is False
    assert gs_trl.enable("my_pkg.derived:registry", lazy_refresh=True) is False
    assert dict(os.environ) == before  # the vLLM plugin was not turned on


class _NoEngine:
    """A generation object without a colocated engine (TRL's server mode)."""


def test_without_trl_the_record_and_lookup_still_work() -> None:
    assert gs_trl.syncs(_NoEngine()) == []
    assert gs_trl.engine_attachment(_NoEngine()) is None  # no engine: nothing attached
    record = gs_trl.SyncRecord(updates=1, refreshed=2, stale=(), seconds=0.1,
                               refresh_seconds=0.01)
    with pytest.raises(ValueError, match="frozen"):
        record.updates = 2  # type: ignore[misc]


class _Generation:
    """What the comparison after a sync reads of TRL's `VLLMGeneration`: the policy, and
    its renaming of parameters to vLLM's names."""

    def __init__(self, model: object) -> None:
        self.model = model

    def _fix_param_name_to_vllm(self, name: str) -> str:
        return name.removeprefix("wrapped.")


def test_the_comparison_after_a_sync_takes_shared_names_and_shapes_and_control_a_change() -> None:
    import torch
    from torch import nn

    from graphsafe.integrations.trl._sync import _compare

    policy = nn.Module()
    policy.wrapped = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # type: ignore[assignment]
    engine = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))  # layer 1: another shape
    engine.register_buffer("fused", torch.zeros(7))  # no counterpart in the policy
    with torch.no_grad():
        engine[0].weight.copy_(policy.wrapped[0].weight)
        engine[0].bias.copy_(policy.wrapped[0].bias)
        engine.half()  # the engine's dtype: the policy's tensors are cast to it
    generation = _Generation(policy)
    assert _compare(generation, engine) == (2, ())  # 0.weight, 0.bias; not layer 1
    with torch.no_grad():  # control: the engine serves another value
        engine[0].bias[1] += 1
    assert _compare(generation, engine) == (2, ("0.bias",))
