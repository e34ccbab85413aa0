"""A quantized model whose kernels drop the weight a derivation reads: vLLM's CPU W8A8
int8 kernel (compressed-tensors, asymmetric activations) packs each quantized linear
weight into a oneDNN handle and sets `weight` to None. A registry skips those layers with
`when=`; without it, binding refuses the first of them by name."""

from __future__ import annotations

from pathlib import Path

import engine_util as eu
import pytest
import torch

import graphsafe as gs
from graphsafe.integrations import vllm as gsv

KEPT = "model.layers.0."  # left unquantized: its linear layers keep their weights


def test_when_skips_the_layers_whose_weight_the_kernel_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gsv.ENV, "vllm_derivations:kept")  # qkv_weight_t, when weight is kept
    m = eu.w8a8_model(tmp_path / "w8a8", 0, keep=(KEPT,))
    llm = eu.engine(tmp_path / "w8a8")
    try:
        (status,) = llm.collective_rpc("graphsafe_status")
        assert status["derived"] == [f"{KEPT}self_attn.qkv_proj.qkv_weight_t"]
        assert status["pinned"] and status["stale"] == []
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        kept, dropped = (model.model.layers[i].self_attn.qkv_proj for i in (0, 1))
        assert dropped.weight is None and dropped.qkv_weight_t is None  # owns no buffer
        assert torch.equal(kept.qkv_weight_t, eu.qkv_weight_t(m)[KEPT + "self_attn.qkv_proj"])
        assert len(eu.generate(llm)) == eu.N_NEW
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_control_without_when_the_removed_weight_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gsv.ENV, "vllm_derivations:registry")  # the same derivation, no when=
    eu.w8a8_model(tmp_path / "w8a8", 0, keep=(KEPT,))
    dropped = r"input 'model\.layers\.1\.self_attn\.qkv_proj\.weight' is None"
    with pytest.raises(gs.RegistrationError, match=dropped):
        eu.engine(tmp_path / "w8a8")
