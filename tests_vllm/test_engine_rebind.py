"""A worker extension that rebinds a parameter (`param.data = new`), or writes one in place
outside any update, is caught, through the engine call that did it or the next one that
would serve from it.

A rebinding is a fault where graphs hold the old address: `llm` is told it captures
graphs (`eu.hold_graphs`), as vLLM does on a GPU. vLLM's CPU engine captures none
(`eager`): there the rebinding is followed (the step reads the new tensor), and what was
derived from the old one is refreshed in an update or refused as stale outside one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_util as eu
import pytest
import torch

import graphsafe as gs


@pytest.fixture
def llm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    eu.hf_model(tmp_path / "ckpt", 0)
    eu.hold_graphs(monkeypatch)
    llm = eu.engine(tmp_path / "ckpt")
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def eager(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """An engine without graphs (vLLM's CPU engine), and the Hugging Face model it serves."""
    m = eu.hf_model(tmp_path / "ckpt", 0)
    llm = eu.engine(tmp_path / "ckpt", run="eager")
    yield llm, m
    llm.llm_engine.engine_core.shutdown()


def status(llm: Any) -> dict[str, Any]:
    (s,) = llm.collective_rpc("graphsafe_status")
    return dict(s)


@pytest.mark.parametrize(
    "name", ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"]
)
def test_a_rebinding_in_an_update_raises_from_that_call(llm: Any, name: str) -> None:
    assert status(llm)["graphs"] is True
    with pytest.raises(gs.StorageMovedError, match=name.replace(".", r"\.")):
        llm.collective_rpc("t_rebind_in_update", args=(name,))
    with pytest.raises(gs.GraphSafetyError):  # and the engine refuses to serve from it
        eu.generate(llm)


def test_a_rebinding_outside_any_update_is_refused_at_the_next_step(llm: Any) -> None:
    name = "model.embed_tokens.weight"
    assert eu.generate(llm)  # healthy first
    llm.collective_rpc("t_rebind", args=(name,))
    assert status(llm)["faults"] == {name: ["storage"]}
    with pytest.raises(gs.StorageMovedError, match=name.replace(".", r"\.")):
        eu.generate(llm)


def test_an_in_place_write_outside_any_update_is_refused_as_stale(llm: Any) -> None:
    assert eu.generate(llm)
    llm.collective_rpc("t_scale_in_place", args=("model.layers.1.self_attn.qkv_proj.weight",))
    with pytest.raises(gs.StaleError, match=r"model\.layers\.1\.self_attn\.qkv_proj") as e:
        eu.generate(llm)
    assert "qkv_weight_t" in str(e.value)


def test_control_without_the_guard_the_rebinding_serves_silently(llm: Any) -> None:
    """What the tests above guard against: vLLM itself accepts the rebinding (here, in
    eager mode, the new tensor is read; under a captured graph the old one would be)."""
    worker = llm.llm_engine.model_executor.driver_worker.worker
    worker._graphsafe["model"].guard = None  # the plugin's step check off
    llm.collective_rpc("t_rebind", args=("model.embed_tokens.weight",))
    assert eu.generate(llm)


QKV = "model.layers.0.self_attn.qkv_proj"


def test_without_graphs_a_rebinding_in_an_update_is_followed_and_refreshed(
    eager: tuple[Any, Any],
) -> None:
    llm, m = eager
    assert eu.generate(llm) == eu.hf_greedy(m)
    llm.collective_rpc("t_rebind_in_update", args=(f"{QKV}.weight",))  # not refused
    s = status(llm)
    assert s["graphs"] is False and s["faults"] == {} and s["stale"] == []
    assert s["moved"] == {f"{QKV}.weight": ["storage"]}
    (derived,) = llm.collective_rpc("t_derived")  # refreshed from the new tensor
    torch.testing.assert_close(derived[QKV], eu.qkv_weight_t(m)[QKV], rtol=0, atol=0)
    assert eu.generate(llm) == eu.hf_greedy(m)


def test_without_graphs_a_rebinding_outside_an_update_is_followed(
    eager: tuple[Any, Any],
) -> None:
    llm, m = eager
    assert eu.generate(llm) == eu.hf_greedy(m)
    llm.collective_rpc("t_rebind", args=("model.embed_tokens.weight",))
    assert eu.generate(llm) == eu.hf_greedy(m)  # the step reads the new tensor
    assert status(llm)["moved"] == {"model.embed_tokens.weight": ["storage"]}


def test_without_graphs_a_rebound_input_outside_an_update_is_refused_as_stale(
    eager: tuple[Any, Any],
) -> None:
    """What was derived from the old tensor is not known to fit the new one."""
    llm, _ = eager
    assert eu.generate(llm)
    llm.collective_rpc("t_rebind", args=(f"{QKV}.weight",))
    with pytest.raises(gs.StaleError, match=rf"{QKV}\.qkv_weight_t"):
        eu.generate(llm)
