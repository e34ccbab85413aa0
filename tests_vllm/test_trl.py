"""TRL's GRPO with vLLM colocated, graphsafe on in one line (`gs_trl.enable`).

`GRPOTrainer` runs 3 steps on a tiny random Llama made on the fly (float32, offline
tokenizer and dataset). Right after each of TRL's weight syncs the test checks: the sync
was one graphsafe update with nothing stale, every derived buffer equals its derivation
of the policy's weights, the engine serves the policy's weights bit for bit wherever
their names match (no fingerprint mismatch), and vLLM's greedy tokens equal Hugging
Face's on the policy. Controls: a rebinding inside the sync fails the training step with
graphsafe's error; the LM head's packed copy, left stale by TRL's sync when the LM-head
switch is off, is caught by name; an engine weight changed after the sync's load is
one fingerprint mismatch, named.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_util as eu
import pytest
import torch
import trl_util as tu

import graphsafe as gs
from graphsafe.integrations import trl as gs_trl
from graphsafe.integrations import vllm as gsv

pytest.importorskip("trl", reason="TRL is installed by scripts/test-vllm")

REGISTRY = "vllm_derivations:registry"
PACKED = "lm_head.cpu_linear.<closure handler>.handler_tensor"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tu.model_dir(tmp_path_factory.mktemp("trl") / "model")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No network; graphsafe's switches restored after each test; TRL's engine float32
    and op by op (`enforce_eager`): quicker to start than TRL's compiled default, and its
    greedy tokens equal Hugging Face's exactly, with no near-ties left to kernels."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in (gsv.ENV, gsv.CPU_KEEP_WEIGHTS, gsv.CPU_KEEP_LM_HEAD, gsv.LAZY_REFRESH):
        monkeypatch.setenv(name, "")
    restore = tu.float32_engine(enforce_eager=True)
    yield
    restore()
    gc.collect()


def _engine_model(generation: Any) -> Any:
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def _vllm_greedy(generation: Any) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=eu.N_NEW, detokenize=False, ignore_eos=True)
    out = generation.llm.generate([{"prompt_token_ids": eu.PROMPT}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _perturb(trainer: Any) -> None:
    """Move the policy off the served checkpoint, so that the first sync writes new
    values too (before any step, the policy is the checkpoint)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _hf_greedy(policy: Any) -> list[int]:
    """Hugging Face's greedy tokens on the policy, one full forward per token (its
    `generate` would suppress the tokenizer's end-of-sequence id, which vLLM's
    `ignore_eos` does not)."""
    ids = list(eu.PROMPT)
    with torch.no_grad():
        for _ in range(eu.N_NEW):
            ids.append(int(policy(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(eu.PROMPT):]


def _exact(generation: Any) -> dict[str, bool]:
    """Whether each layer's fused QKV derived buffer equals its derivation of the policy."""
    engine = _engine_model(generation)
    return {
        layer: torch.equal(engine.get_submodule(layer).qkv_weight_t, w)
        for layer, w in eu.qkv_weight_t(generation.model).items()
    }


def _check(generation: Any) -> dict[str, Any]:
    """What one sync left: its record, the derived buffers against the policy before and
    after the next step, and both engines' greedy tokens."""
    policy = generation.model
    records = gs_trl.syncs(generation)
    before = _exact(generation)
    status = gs_trl.engine_attachment(generation).status()  # type: ignore[union-attr]
    vllm = _vllm_greedy(generation)
    training = policy.training
    policy.eval()  # the policy as it generates (in training mode its greedy tokens differ)
    try:
        hf = _hf_greedy(policy)
    finally:
        policy.train(training)
    return {
        "record": records[-1] if records else None,
        "status": status,
        "exact_before_step": before,
        "exact": _exact(generation),
        "vllm": vllm,
        "hf": hf,
        "policy": {n: p.detach().clone() for n, p in policy.named_parameters()},
    }


def test_grpo_three_steps_each_sync_one_update_exact_and_greedy_equal(
    ckpt: Path, tmp_path: Path
) -> None:
    assert gs_trl.enable(REGISTRY)
    seen: list[dict[str, Any]] = []
    restore = tu.after_each_sync(lambda g: seen.append(_check(g)))
    try:
        trainer = tu.trainer(ckpt, tmp_path)
        _perturb(trainer)
        trainer.train()
    finally:
        restore()
    assert len(seen) == 3  # one sync before each step's generation
    for i, s in enumerate(seen):
        r = s["record"]
        assert (r.updates, r.refreshed, r.stale) == (1, 2, ()), (i, r)
        # Norms, o_proj, down_proj, embeddings and head: the names the fused engine shares.
        assert r.fingerprints_compared == 2 * 4 + 3 and r.fingerprint_mismatches == (), r
        assert s["status"]["stale"] == [] and s["status"]["updates"] == i + 1
        assert all(s["exact_before_step"].values()), (i, s["exact_before_step"])
        assert all(s["exact"].values()) and s["vllm"] == s["hf"], i
    # The policy moved between syncs: each check saw new weights.
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(seen[0]["policy"][name], seen[2]["policy"][name])
    # graphsafe's record reached TRL's logs, once per step.
    logged = [h for h in trainer.state.log_history if "graphsafe/updates" in h]
    assert [(h["graphsafe/updates"], h["graphsafe/stale"]) for h in logged] == [(1.0, 0.0)] * 3
    assert [h["graphsafe/fingerprint_mismatches"] for h in logged] == [0.0] * 3
    del trainer


def test_control_an_engine_weight_changed_after_the_load_is_one_fingerprint_mismatch(
    ckpt: Path, tmp_path: Path
) -> None:
    assert gs_trl.enable(REGISTRY)
    trainer = tu.trainer(ckpt, tmp_path, steps=1)
    engine = _engine_model(trainer.vllm_generation)
    load = engine.load_weights  # graphsafe's wrapper of vLLM's loader

    def tampering(weights: Any) -> Any:
        weights = list(weights)
        done = load(weights)
        if any(n == "model.norm.weight" for n, _ in weights):
            with torch.no_grad():
                engine.model.norm.weight[0] += 1.0  # in place: no rebinding, another value
        return done

    engine.load_weights = tampering  # what TRL's sync calls, once per parameter
    trainer.train()
    (record,) = gs_trl.syncs(trainer.vllm_generation)
    assert record.stale == () and record.fingerprints_compared == 2 * 4 + 3
    assert record.fingerprint_mismatches == ("model.norm.weight",)
    logged = [h["graphsafe/fingerprint_mismatches"] for h in trainer.state.log_history
              if "graphsafe/fingerprint_mismatches" in h]
    assert logged == [1.0]
    del trainer


def test_control_a_rebinding_inside_the_sync_fails_the_training_step(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the engine's graphs hold the addresses (vLLM's CPU engine captures none: it
    would follow the rebinding)."""
    eu.hold_graphs(monkeypatch)
    assert gs_trl.enable(REGISTRY)
    trainer = tu.trainer(ckpt, tmp_path)
    engine = _engine_model(trainer.vllm_generation)
    load = engine.load_weights  # graphsafe's wrapper of vLLM's loader

    def rebinding(weights: Any) -> Any:
        weights = list(weights)
        done = load(weights)
        if any(n == "model.norm.weight" for n, _ in weights):
            norm = engine.model.norm.weight
            norm.data = norm.data.clone()  # the same values in a new storage
        return done

    engine.load_weights = rebinding  # what TRL's sync calls, once per parameter
    with pytest.raises(gs.StorageMovedError, match=r"model\.norm\.weight"):
        trainer.train()
    assert gs_trl.syncs(trainer.vllm_generation) == []  # the sync did not complete
    del trainer


def test_control_the_packed_lm_head_left_stale_by_the_sync_is_caught_by_name(
    ckpt: Path, tmp_path: Path
) -> None:
    assert gs_trl.enable(REGISTRY, cpu_keep_lm_head=False)
    trainer = tu.trainer(ckpt, tmp_path)
    with pytest.raises(gs.StaleError, match=r"lm_head\.cpu_linear\.<closure handler>"):
        trainer.train()
    (record,) = gs_trl.syncs(trainer.vllm_generation)
    assert record.updates == 1 and PACKED in record.stale
    del trainer


@pytest.mark.parametrize("lazy", [False, True], ids=["control-per-call", "lazy-refresh"])
def test_without_the_trl_wrapper_each_parameter_is_an_update_lazy_refresh_runs_once(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lazy: bool
) -> None:
    """TRL's sync unwrapped: each `load_weights([(name, p)])` is an update of its own.
    Eager refresh recomputes the fused QKV buffer after q, k and v of each layer; lazy
    refresh recomputes nothing during the sync and each buffer once before the next step."""
    from trl.generation.vllm_generation import VLLMGeneration

    assert gs_trl.enable(REGISTRY, lazy_refresh=lazy)
    monkeypatch.setattr(VLLMGeneration, "sync_weights", VLLMGeneration.sync_weights.__wrapped__)
    trainer = tu.trainer(ckpt, tmp_path, steps=1)
    _perturb(trainer)
    generation = trainer.vllm_generation
    attached = gs_trl.engine_attachment(generation)
    assert attached is not None
    engine = _engine_model(generation)
    load = engine.load_weights
    refreshes: list[str] = []

    def counting(weights: Any) -> Any:
        before = attached.runtime.last_report
        done = load(weights)
        now = attached.runtime.last_report
        if now is not None and now is not before:
            refreshes.extend(now.refreshed)
        return done

    engine.load_weights = counting
    seen: list[dict[str, Any]] = []

    def check(g: Any) -> None:
        seen.append({"updates": attached.updates, **_check(g)})

    restore = tu.after_each_sync(check)
    try:
        trainer.train()
    finally:
        restore()
    (s,) = seen
    n_params = len(list(generation.model.named_parameters()))
    assert s["updates"] == n_params  # one update per parameter, not one per sync
    qkv = [f"model.layers.{i}.self_attn.qkv_proj.qkv_weight_t" for i in range(2)]
    if lazy:
        assert refreshes == [] and s["status"]["stale"] == qkv  # marked only
        assert not any(s["exact_before_step"].values())  # refreshed by the next step
    else:
        assert sorted(refreshes) == sorted(qkv * 3)  # after q, after k, after v
        assert s["status"]["stale"] == [] and all(s["exact_before_step"].values())
    # Either way, the step that follows serves the policy: buffers exact, greedy equal.
    assert all(s["exact"].values()) and s["vllm"] == s["hf"]
    assert attached.status()["stale"] == []
    del trainer
