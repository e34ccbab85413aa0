"""vLLM's CPU MoE experts, found with no registry: the post-load step binds a prepacked copy
of each expert weight in its place (`CPUUnquantizedExperts.process_weights_after_loading`:
`replace_parameter(layer, "w13_weight", cpu_prepack_moe_weight(...))`), same shape, the
weight loader kept. A bare per-parameter sync, as TRL's, then writes checkpoint values
through that loader into the packed layout: vLLM serves wrong tokens and nothing was
stale. graphsafe takes each such weight as rewritten by the post-load step: the bare sync
is refused by name, and so is vLLM's own `reload_weights` there (vLLM 0.32's layerwise
reload copies the raw, unpacked values back into the packed storage: the control shows it
serves wrong tokens even when it reloads the very weights it serves). A load whose
post-load step binds a new packed copy computed from the loaded values is not refused
(`tests/test_bringup.py`, `Repacked`).

Each test starts an engine of its own, from a tiny random Mixtral (4 experts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_util as eu
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM

import graphsafe as gs
from graphsafe.integrations import vllm as gsv

EXPERT = "model.layers.0.block_sparse_moe.experts.1.w1.weight"  # a checkpoint name
PACKED = "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"  # vLLM's


def _mixtral(path: Path, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=256, vocab_size=256, max_position_embeddings=256,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        initializer_range=0.1, torch_dtype="float32",
    )
    MixtralForCausalLM(cfg).eval().save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The served checkpoint (seed 0), and the same with one expert weight of seed 1
    (saved: a fresh engine on it serves what a correct sync must)."""
    root = tmp_path_factory.mktemp("moe")
    base = _mixtral(root / "s0", 0)
    other = _mixtral(root / "s1", 1)
    mixed = {**base, EXPERT: other[EXPERT]}
    (root / "mixed").mkdir()
    for f in (root / "s0").iterdir():
        if f.suffix != ".safetensors":
            (root / "mixed" / f.name).write_bytes(f.read_bytes())
    save_file(mixed, str(root / "mixed" / "model.safetensors"))
    return {"path": root / "s0", "mixed_path": root / "mixed", "mixed": mixed,
            "new": other[EXPERT]}


@pytest.fixture(scope="module")
def expected(ckpt: dict[str, Any]) -> list[int]:
    """What a fresh engine serves from the checkpoint with the new expert weight."""
    llm = eu.engine(ckpt["mixed_path"], run="eager")
    try:
        return eu.generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def model_of(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def status(llm: Any) -> dict[str, Any]:
    (s,) = llm.collective_rpc("graphsafe_status")
    return dict(s)


@pytest.fixture
def discovering(ckpt: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An engine with the plugin on and no registry."""
    monkeypatch.setenv(gsv.ENV, "")
    gsv.enable()
    llm = eu.engine(ckpt["path"], run="eager")
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def plain(ckpt: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An engine without graphsafe."""
    monkeypatch.delenv(gsv.ENV)
    llm = eu.engine(ckpt["path"], run="eager")
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_control_without_graphsafe_a_bare_sync_or_a_reload_of_an_expert_serves_wrong_tokens(
    plain: Any, ckpt: dict[str, Any], expected: list[int]
) -> None:
    before = eu.generate(plain)
    assert model_of(plain).load_weights([(EXPERT, ckpt["new"].clone())]) == {PACKED}
    served = eu.generate(plain)  # raw values in the packed layout, silently
    assert served != expected and served != before
    plain.collective_rpc("reload_weights",
                         kwargs={"weights_iterator": iter(ckpt["mixed"].items())})
    raw = torch.cat([ckpt["mixed"][EXPERT], ckpt["mixed"][EXPERT.replace("w1", "w3")]])
    assert torch.equal(model_of(plain).get_parameter(PACKED)[1], raw)  # unpacked
    assert eu.generate(plain) != expected  # vLLM's own reload serves it wrong too


def test_the_prepacked_expert_weights_are_discovered_as_rewritten(discovering: Any) -> None:
    rewritten = {d.path: d for d in gs.runtime(model_of(discovering)).discovered
                 if d.kind == "rewritten"}
    assert set(rewritten) == {f"model.layers.{i}.block_sparse_moe.experts.routed_experts."
                              f"{w}_weight" for i in (0, 1) for w in ("w13", "w2")}
    assert "_C.prepack_moe_weight" in rewritten[PACKED].chain
    assert status(discovering)["stale"] == []


def test_a_bare_sync_of_an_expert_is_refused_naming_the_packed_weight(
    discovering: Any, ckpt: dict[str, Any]
) -> None:
    eu.generate(discovering)
    with pytest.raises(gs.StaleError, match=PACKED.replace(".", r"\.")) as e:
        model_of(discovering).load_weights([(EXPERT, ckpt["new"].clone())])
    assert "_C.prepack_moe_weight" in str(e.value) and "raw values" in str(e.value)
    assert status(discovering)["stale"] == [PACKED]
    with pytest.raises(gs.StaleError, match=PACKED.replace(".", r"\.")):
        eu.generate(discovering)  # the next step refuses too


def test_vllms_reload_weights_which_leaves_raw_values_is_refused(
    discovering: Any, ckpt: dict[str, Any]
) -> None:
    eu.generate(discovering)
    with pytest.raises(gs.StaleError, match=r"raw values where the model reads the output"):
        discovering.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(ckpt["mixed"].items())})
    with pytest.raises(gs.StaleError, match=PACKED.replace(".", r"\.")):
        eu.generate(discovering)
