"""A tensor vLLM rebuilds at a new address is a fault only where a captured graph holds the
old address: vLLM's CPU engine captures no graphs, so there graphsafe follows the move.

On a bf16 model on a CPU with AMX, vLLM's CPU build packs each linear weight for its
`weight_packed_linear` kernel (`dispatch_cpu_unquantized_gemm`): `layer.cpu_linear` becomes
a closure over the packed copy (`<closure packed_weight>`). vLLM's `reload_weights` runs
that post-load step again, so every closure and packed copy is new; the next step reads
the new ones. graphsafe follows them (pins them where they are, lists them in the status as
`moved`), and still refuses stale content: a bare load after the reload leaves the new
packed LM head stale and is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import engine_util as eu
import pytest
import torch

import graphsafe as gs
from graphsafe.integrations import vllm as gsv

HEAD = "lm_head.weight"
PACKED = "lm_head.cpu_linear.<closure packed_weight>"


def amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


pytestmark = pytest.mark.skipif(
    not amx(), reason="vLLM's CPU build packs bf16 weights for AMX only where the CPU has it"
)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"path": root / "s0", "base": eu.hf_model(root / "s0", 0),
            "other_path": root / "s1", "other": eu.hf_model(root / "s1", 1)}


def fresh_tokens(path: Any, run: str) -> list[int]:
    """What an engine started from `path` (as `start` starts them) serves: what a reload
    to it must serve."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(gsv.ENV, "")
        gsv.enable()
        llm = eu.engine(path, run=run, dtype="bfloat16")
        try:
            return eu.generate(llm)
        finally:
            llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def new_tokens(hf: dict[str, Any]) -> list[int]:
    """What an eager engine started from the second checkpoint serves."""
    return fresh_tokens(hf["other_path"], "eager")


def model_of(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def status(llm: Any) -> dict[str, Any]:
    (s,) = llm.collective_rpc("graphsafe_status")
    return dict(s)


def reload(llm: Any, m: Any) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(eu.weights(m))})


def head_error(llm: Any) -> float:
    """How far the LM head's packed kernel is from `hidden @ weight.T` (bf16)."""
    head = model_of(llm).lm_head
    hidden = torch.randn(4, head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(head.weight.dtype)
    with torch.no_grad():
        out = head.cpu_linear(hidden, head.weight, None).float()
        return float((out - (hidden @ head.weight.T).float()).abs().max())


def start(
    hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch, *, graphs: bool, run: str = "eager"
) -> Any:
    """A bf16 engine (eager: no torch.compile, no graphs), the plugin on and no registry;
    `graphs`: the integration is told that graphs hold the addresses (else it finds none)."""
    monkeypatch.setenv(gsv.ENV, "")
    if graphs:
        eu.hold_graphs(monkeypatch)
    gsv.enable()
    return eu.engine(hf["path"], run=run, dtype="bfloat16")


@pytest.fixture
def eager(hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    llm = start(hf, monkeypatch, graphs=False)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture
def believed_graphs(hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    llm = start(hf, monkeypatch, graphs=True)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_the_bf16_engine_packs_its_linears_for_amx(eager: Any) -> None:
    model = model_of(eager)
    assert model.lm_head.weight.dtype == torch.bfloat16
    s = status(eager)
    assert PACKED in s["discovered"] and s["discovered"][PACKED] == [HEAD]
    assert s["graphs"] is False and s["moved"] == {} and s["faults"] == {}


def test_reload_weights_rebuilds_the_packed_copies_and_is_followed(
    new_tokens: list[int], eager: Any, hf: dict[str, Any]
) -> None:
    first = eu.generate(eager)
    old = model_of(eager).lm_head.cpu_linear
    reload(eager, hf["other"])
    assert model_of(eager).lm_head.cpu_linear is not old  # rebuilt at a new address
    assert head_error(eager) < 0.1  # the new packed copy is the new weight's
    other = eu.generate(eager)  # served: not refused, the new weights exactly
    assert other == new_tokens != first
    s = status(eager)
    assert s["graphs"] is False and s["faults"] == {} and s["stale"] == []
    assert s["moved"][PACKED] == ["storage"] and s["moved"]["lm_head.cpu_linear"] == ["holder"]
    assert len(s["moved"]) == 18  # a closure and a packed copy per linear layer and LM head
    print(f"followed {len(s['moved'])} moved paths: {s['moved']}")
    reload(eager, hf["base"])  # and back: exactly the first weights' tokens
    assert eu.generate(eager) == first


def test_a_compiled_engine_follows_the_reload_and_serves_the_new_weights_exactly(
    hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch, compiled_env: None
) -> None:
    """vLLM's CPU build compiles by default (here dynamo, as its CPU CI runs it): its
    compiled code takes the rebuilt packed copies as inputs at each step, so it serves
    exactly what an engine started from the new weights serves."""
    want = fresh_tokens(hf["other_path"], "dynamo")
    llm = start(hf, monkeypatch, graphs=False, run="dynamo")
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode.name == "DYNAMO_TRACE_ONCE"
        first = eu.generate(llm)
        reload(llm, hf["other"])
        assert eu.generate(llm) == want != first
        assert PACKED in status(llm)["moved"]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_bare_load_after_the_followed_reload_is_refused_as_stale(
    eager: Any, hf: dict[str, Any]
) -> None:
    """The followed packed copy is checked as the first was: content staleness is still
    refused."""
    eu.generate(eager)
    reload(eager, hf["other"])
    eu.generate(eager)
    new = hf["base"].get_parameter(HEAD).detach().clone()
    assert model_of(eager).load_weights([(HEAD, new)]) == {HEAD}  # no post-load step
    assert head_error(eager) > 0.1  # what the next step would serve from
    assert PACKED in status(eager)["stale"]
    with pytest.raises(gs.StaleError, match=PACKED.replace(".", r"\.")):
        eu.generate(eager)


def test_control_where_graphs_hold_the_addresses_the_same_reload_is_refused(
    believed_graphs: Any, hf: dict[str, Any]
) -> None:
    eu.generate(believed_graphs)
    assert status(believed_graphs)["graphs"] is True
    with pytest.raises(gs.StorageMovedError, match=r"cpu_linear"):
        reload(believed_graphs, hf["other"])
    with pytest.raises(gs.GraphSafetyError):  # and no step is served from it
        eu.generate(believed_graphs)
