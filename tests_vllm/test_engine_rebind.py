"""A worker extension that rebinds a parameter (`param.data = new`), or writes one in place
outside any update, is caught, through the engine call that did it or the next one that
would serve from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_util as eu
import pytest

import graphsafe as gs


@pytest.fixture
def llm(tmp_path: Path) -> Iterator[Any]:
    eu.hf_model(tmp_path / "ckpt", 0)
    llm = eu.engine(tmp_path / "ckpt")
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize(
    "name", ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"]
)
def test_a_rebinding_in_an_update_raises_from_that_call(llm: Any, name: str) -> None:
    with pytest.raises(gs.StorageMovedError, match=name.replace(".", r"\.")):
        llm.collective_rpc("t_rebind_in_update", args=(name,))
    with pytest.raises(gs.GraphSafetyError):  # and the engine refuses to serve from it
        eu.generate(llm)


def test_a_rebinding_outside_any_update_is_refused_at_the_next_step(llm: Any) -> None:
    name = "model.embed_tokens.weight"
    assert eu.generate(llm)  # healthy first
    llm.collective_rpc("t_rebind", args=(name,))
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
