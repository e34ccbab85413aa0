"""Tier 1: SGLang's real `LlamaForCausalLM` and `DeepseekV3ForCausalLM` (MLA; dense, and with
a fused-MoE layer and a shared expert) in this process, through each of SGLang's update
paths, with graphsafe attached and without it (the controls)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sglang_models as sm
import torch
from torch import nn

import graphsafe as gs
from graphsafe.integrations import sglang as gss

pytestmark = pytest.mark.usefixtures("patched")

KINDS = ["llama", "deepseek", "deepseek_dense"]


def loaded(
    kind: str, *, graphsafe: bool, registry: bool = True, graphs: bool = True
) -> tuple[nn.Module, Any]:
    """SGLang's model of `kind`, loaded from seed 0's checkpoint as SGLang's start-up loads
    it (`load_weights`, which ends in `post_load_weights`), and graphsafe attached after
    that load (with the shipped MLA registry, or only what it discovers) and pinned, as
    the plugin does in an engine (`graphs`: one that captured CUDA graphs); or not
    attached."""
    model = sm.sglang_model(kind)
    with gs.record_lineage() as lineage:
        model.load_weights(sm.checkpoint(kind, 0))
    if not graphsafe:
        return model, None
    names = [gss.DEEPSEEK_MLA] if registry else []
    att = gss.attach(model, *names, lineage=lineage)
    att.pin(graphs=graphs)
    return model, att


def sglang_names(kind: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """seed's weights under SGLang's own parameter names (fused qkv, gate-up, experts):
    what `load_format="direct"` takes."""
    ref = sm.sglang_model(kind)
    ref.load_weights(sm.checkpoint(kind, seed))
    return [(n, p.detach().clone()) for n, p in ref.named_parameters()]


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, and the MLA layers' `w_kc`/`w_vc` (plain attributes
    without graphsafe)."""
    out = {n: t for n, t in model.named_parameters()}
    out.update(model.named_buffers())
    for name, mod in model.named_modules():
        for attr in ("w_kc", "w_vc"):
            t = getattr(mod, attr, None)
            if isinstance(t, torch.Tensor):
                out[f"{name}.{attr}"] = t
    return out


def addresses(model: nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in state(model).items()}


def assert_weights(model: nn.Module, kind: str, seed: int) -> None:
    """The model's weights are exactly seed's, loaded by SGLang's own loader."""
    want = dict(sglang_names(kind, seed))
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


def forward_allowed(att: Any) -> None:
    with att.guarded():
        pass


# -- every update path: weights exact, derived buffers exact and in place ---------------


def _load_weights(model: nn.Module, kind: str, seed: int) -> None:
    model.load_weights(sm.checkpoint(kind, seed))


def _tensor(fmt: str | None) -> Any:
    def run(model: nn.Module, kind: str, seed: int) -> None:
        wu = sm.updater(model, **{"sglang_models.custom_loader": True})
        payload = sglang_names(kind, seed) if fmt == "direct" else sm.checkpoint(kind, seed)
        wu.begin_weight_update()
        assert wu.update_weights_from_tensor(payload, load_format=fmt) == (True, "Success")
        # SGLang's scheduler: post_load_weights only if no load ran in the session.
        wu.end_weight_update(run_post_load=False)

    return run


def _distributed(model: nn.Module, kind: str, seed: int) -> None:
    # What update_weights_from_distributed loads once the broadcast is received.
    wu = sm.updater(model)
    wu.begin_weight_update()
    ok, message = wu.load_weights_from_distributed(sm.checkpoint(kind, seed))
    assert ok, message
    wu.end_weight_update(run_post_load=False)


PATHS = {
    "load_weights": _load_weights,
    "tensor": _tensor(None),
    "tensor_direct": _tensor("direct"),
    "tensor_custom": _tensor("sglang_models.custom_loader"),
    "distributed_load": _distributed,
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", KINDS)
def test_update_path_keeps_addresses_and_refreshes(kind: str, path: str) -> None:
    model, att = loaded(kind, graphsafe=True)
    before = addresses(model)
    PATHS[path](model, kind, 1)
    assert addresses(model) == before  # nothing moved
    assert_weights(model, kind, 1)
    if kind != "llama":
        assert sm.mla_fresh(model)
    status = att.status()
    assert status["stale"] == [] and status["updates"] == 1
    forward_allowed(att)


@pytest.mark.parametrize("kind", ["deepseek", "deepseek_dense"])
def test_session_without_a_load_runs_post_load_weights(kind: str) -> None:
    """A session that loads nothing through SGLang (P2P/RDMA writes the weights): its end
    runs `post_load_weights`; graphsafe's update covers the writes made in it."""
    model, att = loaded(kind, graphsafe=True)
    before = addresses(model)
    wu = sm.updater(model)
    wu.begin_weight_update()
    with torch.no_grad():
        for name, w in sm.checkpoint(kind, 1):
            if "kv_b_proj" in name:
                dict(model.named_parameters())[name].copy_(w)  # an external writer
    wu.end_weight_update(run_post_load=True)
    assert addresses(model) == before
    assert sm.mla_fresh(model)
    assert att.status()["stale"] == []
    forward_allowed(att)


# -- the direct path skips post_load_weights -----------------------------------------


def _direct_kv_b(model: nn.Module, kind: str) -> None:
    payload = [(n, w) for n, w in sglang_names(kind, 1) if "kv_b_proj" in n]
    wu = sm.updater(model)
    wu.begin_weight_update()
    assert wu.update_weights_from_tensor(payload, load_format="direct") == (True, "Success")
    wu.end_weight_update(run_post_load=False)
    for name, w in payload:  # the weights were written
        assert torch.equal(dict(model.named_parameters())[name], w)


def test_direct_update_leaves_mla_stale_without_graphsafe() -> None:
    """The control: SGLang alone serves `w_kc`/`w_vc` of the old `kv_b_proj`."""
    model, _ = loaded("deepseek", graphsafe=False)
    assert sm.mla_fresh(model)
    _direct_kv_b(model, "deepseek")
    assert not any(
        torch.equal(a.w_kc, sm.expected_mla(a)[0]) for a in sm.mla_layers(model)
    )


def test_direct_update_refreshes_mla_with_the_registry() -> None:
    """With the shipped registry the update is one graphsafe update: its end refreshes
    `w_kc`/`w_vc` in place."""
    model, att = loaded("deepseek", graphsafe=True)
    before = sm.mla_addresses(model)
    _direct_kv_b(model, "deepseek")
    assert sm.mla_fresh(model)
    assert sm.mla_addresses(model) == before
    assert att.status()["last_refresh_bytes"] > 0
    forward_allowed(att)


def test_direct_update_refused_by_name_when_only_discovered() -> None:
    """Without the registry graphsafe finds `w_kc`/`w_vc` from the first load's lineage;
    after the direct update they are stale and the next forward is refused, by name,
    until a load that runs `post_load_weights` recomputes them."""
    model, att = loaded("deepseek", graphsafe=True, registry=False)
    found = att.status()["discovered"]
    for i in range(2):
        src = [f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        assert found[f"model.layers.{i}.self_attn.w_kc"] == src
        assert found[f"model.layers.{i}.self_attn.w_vc"] == src
    assert att.status()["derived"] == []
    _direct_kv_b(model, "deepseek")
    assert not sm.mla_fresh(model)
    with pytest.raises(gs.StaleError, match=r"model\.layers\.0\.self_attn\.w_kc"):
        forward_allowed(att)
    _tensor(None)(model, "deepseek", 1)  # load_weights ends in post_load_weights
    assert sm.mla_fresh(model)
    forward_allowed(att)


# -- the rebinding post_load_weights once did ------------------------------------------


@pytest.fixture
def rebinding(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SGLang's `bind_or_assign` patched back to rebinding (`w_kc = new tensor`)."""
    from sglang.srt.models.deepseek_common import deepseek_weight_loader

    monkeypatch.setattr(deepseek_weight_loader, "bind_or_assign", lambda target, source: source)
    yield


@pytest.mark.usefixtures("rebinding")
def test_rebinding_moves_mla_without_graphsafe() -> None:
    """The control: every load moves all four `w_kc`/`w_vc` tensors."""
    model, _ = loaded("deepseek", graphsafe=False)
    for seed in (1, 2):
        before = sm.mla_addresses(model)
        model.load_weights(sm.checkpoint("deepseek", seed))
        after = sm.mla_addresses(model)
        assert all(a != b for a, b in zip(before, after))


@pytest.mark.usefixtures("rebinding")
def test_rebinding_is_caught_by_the_guard() -> None:
    model, att = loaded("deepseek", graphsafe=True)
    wu = sm.updater(model)
    # An entry point that returns to SGLang's scheduler refuses, never raises: alone ...
    ok, message = wu.update_weights_from_tensor(sm.checkpoint("deepseek", 1))
    assert not ok
    assert "graphsafe refused" in message and "StorageMovedError" in message
    assert "self_attn.w_kc" in message
    with pytest.raises(gs.StorageMovedError, match=r"self_attn\.w_kc"):
        forward_allowed(att)
    # ... and in a session, at its end (the scheduler's end_weight_update returns it).
    model, att = loaded("deepseek", graphsafe=True)
    wu = sm.updater(model)
    wu.begin_weight_update()
    assert wu.update_weights_from_tensor(sm.checkpoint("deepseek", 1))[0]
    wu.end_weight_update(run_post_load=False)
    refused = att.take_refusal()  # what the scheduler's end reports, once
    assert refused is not None and "self_attn.w_kc" in refused and att.take_refusal() is None
    with pytest.raises(gs.StorageMovedError, match=r"self_attn\.w_kc"):
        forward_allowed(att)
    # Through model.load_weights directly: raised by the load that rebound it.
    model2, _ = loaded("deepseek", graphsafe=True)
    with pytest.raises(gs.StorageMovedError, match=r"self_attn\.w_kc"):
        model2.load_weights(sm.checkpoint("deepseek", 1))


@pytest.mark.usefixtures("rebinding")
@pytest.mark.parametrize("registry", [True, False], ids=["registry", "discovered"])
def test_without_graphs_the_rebinding_is_followed(registry: bool) -> None:
    """An engine that captured no CUDA graphs (SGLang's CPU engine, `disable_cuda_graph`)
    reads what is bound at each forward: the same rebinding is followed and listed, and
    `w_kc`/`w_vc` are those of the new weights. Its control is the test above: pinned as
    under graphs, the same update is refused."""
    model, att = loaded("deepseek", graphsafe=True, registry=registry, graphs=False)
    before = sm.mla_addresses(model)
    ok, message = sm.updater(model).update_weights_from_tensor(sm.checkpoint("deepseek", 1))
    assert ok, message
    assert all(a != b for a, b in zip(before, sm.mla_addresses(model)))  # they moved
    assert sm.mla_fresh(model)
    forward_allowed(att)
    s = att.status()
    assert s["graphs"] is False and s["faults"] == {} and s["stale"] == []
    mla = {f"model.layers.{i}.self_attn.{w}" for i in range(2) for w in ("w_kc", "w_vc")}
    assert mla <= set(s["moved"])


# -- refusals: SGLang's own, and a failed SGLang update --------------------------------


def test_sglang_own_refusal_stays_in_force() -> None:
    """A module carrying `_derived_weight_cache_error`: SGLang refuses the update before
    writing anything, with graphsafe attached as without it; graphsafe opens no update."""
    model, att = loaded("deepseek", graphsafe=True)
    model.model.layers[0].self_attn._derived_weight_cache_error = "cache kept by the layer"
    before = {n: p.clone() for n, p in model.named_parameters()}
    ok, message = sm.updater(model).update_weights_from_tensor(sm.checkpoint("deepseek", 1))
    assert (ok, message) == (False, "cache kept by the layer")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert att.status()["updates"] == 0
    forward_allowed(att)


@pytest.mark.parametrize("in_session", [False, True])
def test_failed_sglang_update_fails_closed_until_a_load_completes(in_session: bool) -> None:
    """SGLang reports a failed distributed load (`(False, message)`: "partially updated"),
    alone or inside a session; the next forward is refused until a load of every weight
    completes."""
    model, att = loaded("deepseek", graphsafe=True)
    wu = sm.updater(model)
    wrong = ("model.layers.1.self_attn.kv_b_proj.weight", torch.ones(3, 3))  # wrong shape
    half = [*sm.checkpoint("deepseek", 1)[:5], wrong]
    if in_session:
        wu.begin_weight_update()
    ok, message = wu.load_weights_from_distributed(half)
    assert not ok and "partially updated" in message
    if in_session:
        wu.end_weight_update(run_post_load=False)
    with pytest.raises(gs.StaleError):
        forward_allowed(att)
    assert wu.load_weights_from_distributed(sm.checkpoint("deepseek", 2))[0]
    assert sm.mla_fresh(model)
    forward_allowed(att)


# -- the plugin (on and off in a real engine: tests_sglang/test_engine.py) ------------


def test_a_registry_name_that_does_not_resolve_is_refused() -> None:
    with pytest.raises(gs.RegistrationError, match="GRAPHSAFE_SGLANG_REGISTRIES"):
        gss.registries_from("no_such_module:registry")
