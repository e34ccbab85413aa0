"""What vLLM's own classes derive from the weights, found with no registry at all: the
plugin on (`gsv.enable()`, nothing declared), a real engine on vLLM's CPU build.

After loading, vLLM's CPU build packs each linear weight into a oneDNN kernel
(`dispatch_cpu_unquantized_gemm`): `layer.cpu_linear` becomes a closure over a handler
whose `handler_tensor` holds the int `torch.ops._C.create_onednn_mm_handler` returned.
Where the weight is dropped (the decoder's linears), nothing can write it again; where it
stays (the LM head, and the embedding, whose forward reads the weight itself) a bare
`model.load_weights([(name, p)])`, as TRL syncs, writes the weight and leaves the packed
copy the forward reads as it was: the engine serves the old LM head, silently.

Each test starts an engine of its own, from the first load's weights.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import engine_util as eu
import pytest
import torch

import graphsafe as gs
from graphsafe.integrations import vllm as gsv

HEAD = "lm_head.weight"
PACKED = "lm_head.cpu_linear.<closure handler>.handler_tensor"
EMBED = "model.embed_tokens.weight"
EMBED_PACKED = "model.embed_tokens.cpu_linear.<closure handler>.handler_tensor"


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The served checkpoint (seed 0), a second one (seed 1), and the first with one
    tensor of the second: what serving must equal after a bare load of that tensor."""
    root = tmp_path_factory.mktemp("ckpt")
    base = eu.hf_model(root / "s0", 0)
    other = eu.hf_model(root / "s1", 1)
    out: dict[str, Any] = {"path": root / "s0", "base": base, "other": other}
    for name in (HEAD, EMBED):
        mixed = copy.deepcopy(base)
        mixed.get_parameter(name).data.copy_(other.get_parameter(name))
        out[name] = mixed
    return out


def model_of(llm: Any) -> Any:
    """The model as TRL reaches it for its per-parameter sync."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def bare_load(llm: Any, name: str, source: Any) -> None:
    """TRL's sync of one parameter (`name`, from the Hugging Face model `source`): vLLM's
    `load_weights`, and no post-load step after it."""
    new = source.get_parameter(name).detach().clone()
    assert model_of(llm).load_weights([(name, new)]) == {name}
    assert torch.equal(model_of(llm).get_parameter(name), new)  # the weight is written


def head_error(llm: Any) -> float:
    """How far the LM head's output (vLLM's packed kernel) is from `hidden @ weight.T`."""
    head = model_of(llm).lm_head
    hidden = torch.randn(4, head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = head.cpu_linear(hidden, head.weight, None)
        return float((out - hidden @ head.weight.T).abs().max())


def status(llm: Any) -> dict[str, Any]:
    (s,) = llm.collective_rpc("graphsafe_status")
    return dict(s)


@pytest.fixture
def discovering(hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An engine with the plugin on and no registry."""
    monkeypatch.setenv(gsv.ENV, "")  # restored after the test
    gsv.enable()
    llm = eu.engine(hf["path"], run="eager")
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def plain(hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An engine without graphsafe."""
    monkeypatch.delenv(gsv.ENV)
    llm = eu.engine(hf["path"], run="eager")
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_control_without_graphsafe_a_bare_load_serves_the_old_lm_head(
    plain: Any, hf: dict[str, Any]
) -> None:
    assert plain.collective_rpc("graphsafe_status") == [None]
    tokens = eu.generate(plain)
    assert tokens == eu.hf_greedy(hf["base"])
    before = head_error(plain)
    bare_load(plain, HEAD, hf["other"])
    after = head_error(plain)
    print(f"LM head vs hidden @ weight.T: {before:.3g} before the bare load, {after:.3g} after")
    assert before < 1e-4 < 0.1 < after  # the packed copy kept the old weight
    # vLLM serves on, from the old LM head: the tokens of before, not the new weights'.
    assert eu.generate(plain) == tokens != eu.hf_greedy(hf[HEAD])


def test_the_first_load_discovers_the_packed_lm_head_from_its_weight(
    discovering: Any, hf: dict[str, Any]
) -> None:
    s = status(discovering)
    assert s["derived"] == [] and s["stale"] == [] and s["pinned"]
    assert s["discovered"] == {PACKED: [HEAD], EMBED_PACKED: [EMBED]}
    (head,) = (d for d in gs.runtime(model_of(discovering)).discovered if d.path == PACKED)
    assert head.module_class == "ParallelLMHead" and head.opaque  # a handle: left torch
    assert "_C.create_onednn_mm_handler" in head.chain and not head.stale
    # The LM head keeps its weight; a layer vLLM emptied has no source left to write.
    model = model_of(discovering)
    assert model.lm_head.weight.shape == (256, 128)
    assert model.get_parameter("model.layers.0.self_attn.qkv_proj.weight").numel() == 0
    assert eu.generate(discovering) == eu.hf_greedy(hf["base"])  # and no false alarm
    assert status(discovering)["read_set"]


def test_a_bare_per_parameter_load_refuses_the_next_step_naming_the_packed_copy(
    discovering: Any, hf: dict[str, Any]
) -> None:
    eu.generate(discovering)  # the read set: what the first forward read
    bare_load(discovering, HEAD, hf["other"])
    assert head_error(discovering) > 0.1  # what the next step would serve from
    assert status(discovering)["stale"] == [PACKED]
    with pytest.raises(gs.StaleError, match=PACKED.replace(".", r"\.")) as e:
        eu.generate(discovering)
    assert list(e.value.paths) == [PACKED]
    assert f"from {HEAD}" in str(e.value) and "post-load" in str(e.value)


def test_a_stale_packed_copy_the_forward_never_reads_blocks_nothing(
    discovering: Any, hf: dict[str, Any]
) -> None:
    """The embedding is packed too (its quant method is the LM head's), but its forward
    reads the weight itself: a bare load of it serves the new weight, stale copy or not."""
    eu.generate(discovering)
    bare_load(discovering, EMBED, hf["other"])
    assert status(discovering)["stale"] == [EMBED_PACKED]  # stale, and listed
    assert eu.generate(discovering) == eu.hf_greedy(hf[EMBED])


def test_control_before_the_first_forward_the_same_stale_copy_refuses(
    discovering: Any, hf: dict[str, Any]
) -> None:
    """No read set yet: every discovered tensor is checked, the unread one too."""
    bare_load(discovering, EMBED, hf["other"])
    with pytest.raises(gs.StaleError, match=EMBED_PACKED.replace(".", r"\.")):
        eu.generate(discovering)


def test_reload_weights_reruns_post_load_and_is_not_refused(
    discovering: Any, hf: dict[str, Any]
) -> None:
    """vLLM's `reload_weights` runs its post-load step again: a new handle is bound (no
    graph holds the old one on the CPU build), computed from the weights as loaded."""
    model = model_of(discovering)
    eu.generate(discovering)
    old = model.lm_head.cpu_linear
    bare_load(discovering, HEAD, hf["other"])  # stale ...
    discovering.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": iter(eu.weights(hf[HEAD]))}
    )  # ... and processed again
    assert model.lm_head.cpu_linear is not old and head_error(discovering) < 1e-4
    s = status(discovering)
    assert s["stale"] == [] and s["discovered"][PACKED] == [HEAD]  # the new handle
    assert eu.generate(discovering) == eu.hf_greedy(hf[HEAD])
    # The new handle is checked as the first was: the next bare load refuses again.
    bare_load(discovering, HEAD, hf["base"])
    with pytest.raises(gs.StaleError, match=PACKED.replace(".", r"\.")):
        eu.generate(discovering)


def test_an_exempted_packed_copy_is_not_checked(discovering: Any, hf: dict[str, Any]) -> None:
    eu.generate(discovering)
    (s,) = discovering.collective_rpc(
        "graphsafe_exempt", args=(PACKED, "this test means to serve the old LM head")
    )
    bare_load(discovering, HEAD, hf["other"])
    assert s["stale"] == [] and status(discovering)["stale"] == []
    assert eu.generate(discovering) == eu.hf_greedy(hf["base"])  # the old head, as meant
