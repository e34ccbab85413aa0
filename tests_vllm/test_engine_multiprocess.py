"""vLLM's default layout: the engine core and its worker in processes of their own.

The plugin reaches the worker process through vLLM's entry point and the environment.
Errors cross the process boundary as vLLM reports them: the text of graphsafe's error
(what moved, where, the fix) inside vLLM's own exception type.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_util as eu
import pytest
import torch


@pytest.fixture
def llm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    eu.hf_model(tmp_path / "ckpt", 0)
    llm = eu.engine(tmp_path / "ckpt")
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_the_plugin_follows_a_worker_in_another_process(llm: Any, tmp_path: Path) -> None:
    (status,) = llm.collective_rpc("graphsafe_status")
    assert status["pinned"] and status["updates"] == 0 and len(status["derived"]) == 2
    new = eu.hf_model(tmp_path / "new", 2)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "new")})
    (status,) = llm.collective_rpc("graphsafe_status")
    assert status["updates"] == 1 and not status["stale"]
    assert eu.generate(llm) == eu.hf_greedy(new)
    # No graphs on the CPU engine: a rebinding is followed, and the status says so ...
    llm.collective_rpc("t_rebind_in_update", args=("model.embed_tokens.weight",))
    (status,) = llm.collective_rpc("graphsafe_status")
    assert status["graphs"] is False
    assert status["moved"] == {"model.embed_tokens.weight": ["storage"]}
    # ... and a refusal crosses the process boundary with graphsafe's text.
    with pytest.raises(Exception, match=r"module model\.norm was replaced") as e:
        llm.collective_rpc("t_replace_module_in_update", args=("model.norm",))
    assert "fix:" in str(e.value)


def test_every_tensor_parallel_worker_refreshes_its_own_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers (tensor parallel 2), each with its shard of the fused QKV weight."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    eu.hf_model(tmp_path / "old", 0)
    new = eu.hf_model(tmp_path / "new", 2)
    llm = eu.engine(tmp_path / "old", tensor_parallel_size=2)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "new")})
        statuses = llm.collective_rpc("graphsafe_status")
        assert [(s["pinned"], s["updates"], s["stale"]) for s in statuses] == [(True, 1, [])] * 2
        # Rank r holds query head r and the one key/value head, replicated.
        sd = new.state_dict()
        for rank, derived in enumerate(llm.collective_rpc("t_derived_lists")):
            for i in (0, 1):
                attn = f"model.layers.{i}.self_attn"
                q = sd[f"{attn}.q_proj.weight"][rank * 64 : (rank + 1) * 64]
                k, v = sd[f"{attn}.k_proj.weight"], sd[f"{attn}.v_proj.weight"]
                want = torch.cat([q, k, v]).t()
                got = torch.tensor(derived[f"{attn}.qkv_proj"])
                assert torch.equal(got, want)
        assert eu.generate(llm) == eu.hf_greedy(new)
    finally:
        llm.llm_engine.engine_core.shutdown()
