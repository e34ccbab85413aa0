"""The one call instead of the plugin: `graphsafe_attach` on a running engine's worker."""

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
    monkeypatch.delenv("GRAPHSAFE_VLLM_REGISTRIES")  # this engine starts without graphsafe
    eu.hf_model(tmp_path / "ckpt", 0)
    llm = eu.engine(tmp_path / "ckpt")
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_attach_to_a_running_engine_then_update_and_catch(llm: Any, tmp_path: Path) -> None:
    assert llm.collective_rpc("graphsafe_status") == [None]
    (status,) = llm.collective_rpc("graphsafe_attach", args=(["vllm_derivations:norms"],))
    assert status["pinned"] and status["updates"] == 0
    assert "model.norm.weight_plus_one" in status["derived"]
    new = eu.hf_model(tmp_path / "new", 3)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "new")})
    (status,) = llm.collective_rpc("graphsafe_status")
    assert status["updates"] == 1 and not status["stale"]
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    torch.testing.assert_close(
        model.model.norm.weight_plus_one, new.model.norm.weight + 1, rtol=0, atol=0
    )
    assert eu.generate(llm) == eu.hf_greedy(new)
    # The CPU engine captures no graphs: a rebinding is followed (where graphs hold the
    # addresses it is refused: test_engine_rebind.py), and listed.
    llm.collective_rpc("t_rebind_in_update", args=("model.embed_tokens.weight",))
    (status,) = llm.collective_rpc("graphsafe_status")
    assert status["moved"] == {"model.embed_tokens.weight": ["storage"]}
    assert eu.generate(llm) == eu.hf_greedy(new)
    # Stale content is caught as ever.
    llm.collective_rpc("t_scale_in_place", args=("model.norm.weight",))
    with pytest.raises(gs.StaleError, match=r"model\.norm\.weight_plus_one"):
        eu.generate(llm)


def test_a_derivation_over_a_weight_the_cpu_backend_packed_is_refused_by_name(
    llm: Any,
) -> None:
    with pytest.raises(gs.RegistrationError, match="packed") as e:
        llm.collective_rpc("graphsafe_attach", args=(["vllm_derivations:registry"],))
    assert "model.layers.0.self_attn.qkv_proj.weight" in str(e.value)
    # Nothing was attached or pinned, and another registry still attaches.
    assert llm.collective_rpc("graphsafe_status") == [None]
    (status,) = llm.collective_rpc("graphsafe_attach", args=(["vllm_derivations:norms"],))
    assert status["pinned"] and "qkv_weight_t" not in str(status["derived"])
