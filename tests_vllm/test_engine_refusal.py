"""After graphsafe refuses a step, the engine serves again once the fix is applied.

The refusal is raised by the worker's `execute_model`, after vLLM's scheduler allocated
the step's KV blocks and before any forward wrote them. The plugin aborts the requests in
flight through vLLM's own abort path (`LLMEngine.abort_request`), which frees their
blocks, and resets the prefix cache those blocks were hashed into. Without that the
requests stay scheduled: the next `generate` never returns (the control shows the
blocks still held, without hanging).

A bare `load_weights` that vLLM rejects before writing anything (a packed layer's weight
on the CPU build) changed nothing: it is no failed update, and the engine serves on. A
bare load that wrote an entry before it raised still leaves the model owing every
weight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import engine_util as eu
import pytest
import torch
from vllm.v1.engine.llm_engine import LLMEngine

import graphsafe as gs

HANG = 300.0  # seconds: a generate that has not returned by then is hung, not slow
QKV = "model.layers.1.self_attn.qkv_proj.weight"
EMBED = "model.embed_tokens.weight"
PACKED = "model.layers.0.self_attn.o_proj.weight"  # the CPU build emptied it after packing


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"path": root / "s0", "base": eu.hf_model(root / "s0", 0),
            "other": eu.hf_model(root / "s1", 1)}


@pytest.fixture
def llm(hf: dict[str, Any]) -> Iterator[Any]:
    """An engine of its own that has served nothing yet: the refused step is the first
    to allocate the prompt's blocks."""
    llm = eu.engine(hf["path"])
    yield llm
    llm.llm_engine.engine_core.shutdown()


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def free_blocks(llm: Any) -> int:
    return int(scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks())


def greedy(llm: Any) -> list[int]:
    """`generate` as a user calls it: no prefix-cache reset of its own."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=eu.N_NEW, detokenize=False, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": eu.PROMPT}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def within_hang_limit(fn: Callable[[], list[int]]) -> list[int]:
    """`fn()`, failing the test instead of blocking CI if it does not return."""
    result: list[list[int]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG)
    if worker.is_alive():
        pytest.fail(f"generate did not return within {HANG:g} s: the engine hangs")
    if errors:
        raise errors[0]
    return result[0]


def refuse(llm: Any) -> None:
    """A step graphsafe refuses: a weight written in place outside any update."""
    llm.collective_rpc("t_scale_in_place", args=(QKV,))
    with pytest.raises(gs.StaleError, match=r"qkv_weight_t"):
        greedy(llm)


def test_a_refused_step_frees_its_requests_and_the_fix_serves_again(
    llm: Any, hf: dict[str, Any]
) -> None:
    free = free_blocks(llm)
    refuse(llm)
    # Aborted through vLLM's own path: nothing scheduled, nothing pending, blocks free.
    assert not scheduler(llm).requests and not llm.llm_engine.has_unfinished_requests()
    assert free_blocks(llm) == free
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(hf["path"])})  # the fix
    # No prefix-cache reset before it: the refused step's blocks, hashed for tokens no
    # forward computed, must not be served from.
    assert within_hang_limit(lambda: greedy(llm)) == eu.hf_greedy(hf["base"])


def test_control_without_the_abort_the_refused_request_keeps_its_blocks(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the test above guards against, shown without hanging: vLLM's step as it is
    leaves the refused request scheduled with its blocks, so the prefix cache cannot be
    reset and the next `generate` would wait for it forever."""
    monkeypatch.setattr(LLMEngine, "step", getattr(LLMEngine.step, "__wrapped__", LLMEngine.step))
    free = free_blocks(llm)
    refuse(llm)
    assert list(scheduler(llm).requests) and llm.llm_engine.has_unfinished_requests()
    assert free_blocks(llm) < free
    assert llm.reset_prefix_cache() is False  # "some blocks (2) are not freed yet"


def model_of(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def test_a_bare_load_vllm_rejects_before_writing_owes_nothing(
    llm: Any, hf: dict[str, Any]
) -> None:
    w = hf["other"].get_parameter(PACKED).detach().clone()
    with pytest.raises(AssertionError, match=r"into parameter \(torch\.Size\(\[0\]\)\)"):
        model_of(llm).load_weights([(PACKED, w)])
    (status,) = llm.collective_rpc("graphsafe_status")
    assert status["stale"] == [] and status["updates"] == 0
    gs.runtime(model_of(llm)).assert_fresh()  # nothing owed: the weights are as they were
    assert within_hang_limit(lambda: greedy(llm)) == eu.hf_greedy(hf["base"])


def test_control_a_bare_load_that_wrote_before_it_raised_owes_every_weight(
    llm: Any, hf: dict[str, Any]
) -> None:
    new = hf["other"].get_parameter(EMBED).detach().clone()
    w = hf["other"].get_parameter(PACKED).detach().clone()
    with pytest.raises(AssertionError):
        model_of(llm).load_weights([(EMBED, new), (PACKED, w)])
    assert torch.equal(model_of(llm).get_parameter(EMBED), new)  # written, then it raised
    with pytest.raises(gs.StaleError, match="holds a mix of old and new weights") as e:
        greedy(llm)
    assert "tensor(s) still owed" in str(e.value)

