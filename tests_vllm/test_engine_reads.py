"""An engine that captures no graphs takes the guard's read set from its first forward: from
then on the step and load checks cover only the model's tensors that forward read.

A rebinding is a fault only where graphs hold the addresses (`test_engine_moves.py`): the
engines here are told they do (`eu.hold_graphs`), so that what the read set leaves out of
the check shows.

The worker extension keeps a copy of the embedding on the model (`STASH`, as an RL
framework may keep a reference for a KL penalty) and then attaches graphsafe
(`graphsafe_attach`): the copy is pinned with the rest, and no forward reads it. The
embedding itself (`READ`) every forward reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_util as eu
import pytest
from torch.utils import _python_dispatch

import graphsafe as gs
from graphsafe._graphs.reads import ReadTracker
from graphsafe._memory.walk import storage_key
from graphsafe.integrations.vllm._reads import StepReadTracker

STASH = "kl_reference"
READ = "model.embed_tokens.weight"
KV = "model.layers.0.self_attn.attn.kv_cache"


def attached(llm: Any) -> Any:
    """Stash the copy, attach graphsafe to the running engine; return the attachment."""
    llm.collective_rpc("t_stash", args=(STASH, READ))
    (status,) = llm.collective_rpc("graphsafe_attach", args=(["vllm_derivations:norms"],))
    assert status["pinned"] and not status["read_set"]
    worker = llm.llm_engine.model_executor.driver_worker.worker
    att = worker._graphsafe["model"]
    assert STASH in att.guard.ledger.paths  # pinned: before the first forward, checked
    return att


def status(llm: Any) -> dict[str, Any]:
    (s,) = llm.collective_rpc("graphsafe_status")
    return dict(s)


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("GRAPHSAFE_VLLM_REGISTRIES")  # the engines start without graphsafe
    eu.hold_graphs(monkeypatch)
    eu.hf_model(tmp_path / "ckpt", 0)
    return tmp_path / "ckpt"


@pytest.fixture
def eager(ckpt: Path) -> Iterator[Any]:
    llm = eu.engine(ckpt, run="eager")
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_after_the_first_forward_a_tensor_it_never_read_can_be_rebound(eager: Any) -> None:
    att = attached(eager)
    whole = status(eager)
    seen: list[object] = []
    hook = att.model.register_forward_pre_hook(
        lambda *_: seen.append(_python_dispatch._get_current_dispatch_mode())
    )
    try:
        with ReadTracker() as plain:  # around graphsafe's: what the dispatcher shows
            tokens = eu.generate(eager)  # a prefill, then a forward per new token
        first = seen[:]
        seen.clear()
        eu.generate(eager)
    finally:
        hook.remove()
    narrowed = status(eager)
    assert narrowed["read_set"] and 0 < narrowed["checked"] < whole["checked"]
    assert narrowed["inputs"] > 0  # vLLM's input buffers and attention metadata
    paths = att.guard.ledger.paths
    assert READ in paths and STASH not in paths
    # Only the first forward ran under graphsafe's recorder: later ones cost what they did.
    assert isinstance(first[0], StepReadTracker) and first[1:] == [plain] * (eu.N_NEW - 1)
    assert seen == [None] * eu.N_NEW
    # Attention reads its layer's KV cache inside one vLLM op, out of the dispatcher's
    # sight (control), and the read set counts it all the same.
    kv = att.model.get_submodule(KV.rpartition(".")[0]).kv_cache
    assert plain.reads is not None and storage_key(kv) not in plain.reads
    assert KV in paths
    # A rebinding of what the forward never reads refuses neither a step nor a load ...
    eager.collective_rpc("t_rebind_stash", args=(STASH,))
    assert eu.generate(eager) == tokens
    eager.collective_rpc("t_rebind_stash", args=(STASH, True))
    assert eu.generate(eager) == tokens
    # ... and one of what it reads still refuses, at the load's end (control).
    with pytest.raises(gs.StorageMovedError, match=READ.replace(".", r"\.")):
        eager.collective_rpc("t_rebind_in_update", args=(READ,))


def test_control_before_the_first_forward_the_same_rebinding_refuses(eager: Any) -> None:
    attached(eager)
    eager.collective_rpc("t_rebind_stash", args=(STASH,))
    with pytest.raises(gs.StorageMovedError, match=STASH):
        eu.generate(eager)


def test_a_compiled_engine_is_not_recorded_and_keeps_the_whole_model_checked(
    ckpt: Path, compiled_env: None
) -> None:
    """A compiled engine (dynamo, with its eager backend to start fast): dynamo refuses to
    run under a dispatch mode, so no forward is recorded, serving goes on, and the
    rebinding the eager engine lets through refuses."""
    llm = eu.engine(ckpt, run="dynamo")
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode.name == "DYNAMO_TRACE_ONCE"
        att = attached(llm)
        assert not att.recording
        assert eu.generate(llm) == eu.generate(llm)
        assert not status(llm)["read_set"] and STASH in att.guard.ledger.paths
        llm.collective_rpc("t_rebind_stash", args=(STASH,))
        with pytest.raises(gs.StorageMovedError, match=STASH):
            eu.generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
