"""graphsafe inside vLLM's offline engine (tiny random Llama, CPU), through each of vLLM's
weight-update paths."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import engine_util as eu
import pytest
import torch

QKV = [f"model.layers.{i}.self_attn.qkv_proj.qkv_weight_t" for i in (0, 1)]


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("ckpt")
    return {s: (root / f"s{s}", eu.hf_model(root / f"s{s}", s)) for s in range(5)}


@pytest.fixture(scope="module")
def llm(hf: dict[int, tuple[Path, Any]]) -> Iterator[Any]:
    llm = eu.engine(hf[0][0], weight_transfer_config={"backend": "inproc"})
    yield llm
    llm.llm_engine.engine_core.shutdown()


def rpc(llm: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    return llm.collective_rpc(name, args=args, kwargs=kwargs)[0]


def check_serving(llm: Any, m: Any) -> None:
    """Derived buffers equal the new weights' and greedy tokens equal Hugging Face's."""
    derived = rpc(llm, "t_derived")
    want = eu.qkv_weight_t(m)
    assert derived.keys() == want.keys()
    for name, t in derived.items():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0)
    assert eu.generate(llm) == eu.hf_greedy(m)


def test_attached_at_load_and_pinned_after_warm_up(llm: Any, hf: dict[int, Any]) -> None:
    status = rpc(llm, "graphsafe_status")
    assert status["pinned"] and not status["stale"] and not status["read_set"]
    assert status["derived"] == QKV and status["updates"] == 0
    check_serving(llm, hf[0][1])
    # An eager engine narrows its guard to what the first forward read (test_engine_reads);
    # one that captures graphs keeps the whole model checked.
    after = rpc(llm, "graphsafe_status")
    assert after["read_set"] == (eu.default_run() == "eager")
    assert (after["checked"] < status["checked"]) == after["read_set"]


def update(llm: Any, how: str, path: Path, m: Any) -> None:
    if how == "collective_rpc load_weights":
        rpc(llm, "t_load", eu.weights(m))
    elif how == "reload_weights from disk":
        rpc(llm, "reload_weights", weights_path=str(path))
    elif how == "reload_weights from an iterator":
        rpc(llm, "reload_weights", weights_iterator=iter(eu.weights(m)))
    else:  # the weight-transfer API, streamed in two chunks
        w = eu.weights(m)
        llm.init_weight_transfer_engine({"init_info": {}})
        llm.start_weight_update()
        for chunk in (w[: len(w) // 2], w[len(w) // 2 :]):
            info = {"names": [n for n, _ in chunk], "tensors": [t for _, t in chunk]}
            llm.update_weights({"update_info": info})
        llm.finish_weight_update(weight_version="v1")


@pytest.mark.parametrize(
    ("how", "seed"),
    [
        ("collective_rpc load_weights", 1),
        ("reload_weights from disk", 2),
        ("reload_weights from an iterator", 3),
        ("weight transfer update_weights", 4),
    ],
)
def test_each_update_keeps_storage_and_refreshes_once(
    llm: Any, hf: dict[int, Any], how: str, seed: int
) -> None:
    before = rpc(llm, "t_tensors")
    old_tokens = eu.generate(llm)
    updates = rpc(llm, "graphsafe_status")["updates"]
    path, m = hf[seed]
    update(llm, how, path, m)
    assert rpc(llm, "t_tensors") == before  # every parameter and buffer: object and address
    status = rpc(llm, "graphsafe_status")
    assert status["updates"] == updates + 1 and not status["stale"]  # one refresh
    check_serving(llm, m)
    assert eu.generate(llm) != old_tokens  # the new weights changed what is served


def test_the_engines_fingerprints_equal_the_trainers_by_name_and_control_an_older_sync_differs(
    llm: Any, hf: dict[int, Any]
) -> None:
    """`collective_rpc("graphsafe_fingerprint")`: the trainer compares its own
    `gs.fingerprint` with the engine's wherever the names map one to one: the same name,
    dtype and shape (vLLM fuses q, k, v and gate, up under other names)."""
    import graphsafe as gs

    path, m = hf[1]
    update(llm, "collective_rpc load_weights", path, m)
    theirs = rpc(llm, "graphsafe_fingerprint")
    held = rpc(llm, "t_shapes")
    sent = {n: w for n, w in eu.weights(m)
            if n in held and held[n] == (str(w.dtype).removeprefix("torch."), list(w.shape))}
    mine = gs.fingerprint(sent)
    same = sorted(mine)
    assert len(same) >= 2 * 2 + 2 and "model.embed_tokens.weight" in same, (same, held)
    assert [n for n in same if mine[n] != theirs[n]] == [], {n: held[n] for n in same}
    assert rpc(llm, "graphsafe_fingerprint", same[:2]) == {n: theirs[n] for n in same[:2]}
    # Control: the trainer's fingerprints of another sync's weights differ exactly where
    # that sync's values differ (the projections and embeddings; the norms are ones in
    # both).
    other = dict(eu.weights(hf[2][1]))
    changed = [n for n in same if not torch.equal(other[n], sent[n])]
    assert "model.embed_tokens.weight" in changed and len(changed) < len(same)
    old = gs.fingerprint(other, same)
    assert [n for n in same if old[n] != theirs[n]] == changed


def test_vllm_loaded_graphsafes_plugin_from_its_entry_point() -> None:
    """CI installs graphsafe: the engine above found the plugin through the entry point."""
    import conftest
    from vllm.plugins import load_general_plugins

    from graphsafe.integrations import vllm as gsv

    if os.environ.get("GRAPHSAFE_TEST_VLLM_INSTALLED") == "1":  # set by scripts/test-vllm
        assert conftest.PLUGIN_INSTALLED
    if conftest.PLUGIN_INSTALLED:
        load_general_plugins()  # loaded once per process: the engine already did
        assert "worker" in gsv._DONE
    assert os.environ[gsv.ENV] == "vllm_derivations:registry"
