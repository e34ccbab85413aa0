"""The seed bug caught with no registry: vLLM's own DeepSeek V4 class, its first load
recorded (`graphsafe._lineage.record_lineage()`, as the plugin records an engine's), and
graphsafe attached with nothing declared (no `deepseek_v4_registry()`).

`finalize_mhc_broadcast_weights` computes the first layer's `hc_attn_fn_broadcast` from
`hc_attn_fn` at the end of every `load_weights`: provenance finds it, with its source.
"""

from __future__ import annotations

from collections.abc import Iterator

import dsv4_tiny as dsv4
import pytest
import torch

import graphsafe as gs
from graphsafe._lineage import record_lineage
from graphsafe.integrations import vllm as gsv

PATH = "model.layers.0.hc_attn_fn_broadcast"
SOURCE = "model.layers.0.hc_attn_fn"


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    with dsv4.tiny_world():
        yield


def loaded(*, recorded: bool) -> tuple[torch.nn.Module, gsv.Attachment]:
    """The class built and loaded by vLLM's own `load_weights`, then attached with no
    registry (given that load's lineage if `recorded`) and pinned, as after an engine's
    warm-up."""
    model = dsv4.build_tiny()
    with record_lineage() as lineage:
        dsv4.load(model, dsv4.random_checkpoint(model, 0))
    att = gsv.attach(model, lineage=lineage if recorded else None)
    att.pin()
    return model, att


def skip_finalize_write(model: torch.nn.Module) -> None:
    """A sync that writes `hc_attn_fn` itself (as a collective into the parameter would)
    and never runs vLLM's finalize: the broadcast weight keeps the old values."""
    layer = model.model.layers[0]
    with gs.weight_update(model), torch.no_grad():
        layer.hc_attn_fn.mul_(2)


def test_the_first_load_discovers_the_broadcast_weight_from_hc_attn_fn(world: None) -> None:
    model, att = loaded(recorded=True)
    s = att.status()
    assert s["derived"] == [] and s["stale"] == []
    assert s["discovered"] == {PATH: [SOURCE]}
    (d,) = gs.runtime(model).discovered
    assert d.module_class == "DeepseekV4DecoderLayer" and not d.opaque
    assert d.chain.endswith("aten.sum")


def test_the_fixed_finalize_re_derives_in_place_with_no_false_alarm(world: None) -> None:
    model, att = loaded(recorded=True)
    layer = model.model.layers[0]
    ptr = layer.hc_attn_fn_broadcast.data_ptr()
    assert att.guard is not None
    for seed in (1, 2):
        dsv4.load(model, dsv4.random_checkpoint(model, seed))  # one graphsafe update each
        with att.guard.replaying():  # what runs before each engine step
            pass
        assert layer.hc_attn_fn_broadcast.data_ptr() == ptr
        assert torch.equal(layer.hc_attn_fn_broadcast, dsv4.folded(layer))
    assert att.updates == 2 and att.status()["stale"] == []


def test_the_prefix_finalize_is_caught_without_the_registry(
    world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, att = loaded(recorded=True)
    monkeypatch.setattr(type(model.model), "finalize_mhc_broadcast_weights", dsv4.prefix_finalize)
    with pytest.raises(gs.StorageMovedError, match=PATH.replace(".", r"\.")):
        dsv4.load(model, dsv4.random_checkpoint(model, 1))
    assert att.guard is not None
    with pytest.raises(gs.StorageMovedError, match=PATH.replace(".", r"\.")), att.guard.replaying():
        pass  # and the engine's next step is refused


def test_control_without_graphsafe_the_prefix_finalize_moves_silently(
    world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = dsv4.build_tiny()
    dsv4.load(model, dsv4.random_checkpoint(model, 0))
    layer = model.model.layers[0]
    ptr = layer.hc_attn_fn_broadcast.data_ptr()
    monkeypatch.setattr(type(model.model), "finalize_mhc_broadcast_weights", dsv4.prefix_finalize)
    dsv4.load(model, dsv4.random_checkpoint(model, 1))  # no error from vLLM itself
    assert layer.hc_attn_fn_broadcast.data_ptr() != ptr  # a captured graph reads the old


def test_a_write_that_skips_the_finalize_is_refused_naming_the_broadcast(world: None) -> None:
    model, att = loaded(recorded=True)
    skip_finalize_write(model)
    assert att.status()["stale"] == [PATH]
    assert att.guard is not None
    with pytest.raises(gs.StaleError, match=PATH.replace(".", r"\.")) as e, att.guard.replaying():
        pass
    assert list(e.value.paths) == [PATH] and f"from {SOURCE}" in str(e.value)


def test_control_unrecorded_the_same_write_serves_a_stale_broadcast(world: None) -> None:
    """Without the first load's lineage (and no registry), nothing knows the broadcast
    weight comes from `hc_attn_fn`: the step runs on a broadcast of the old values."""
    model, att = loaded(recorded=False)
    assert att.status()["discovered"] == {}
    skip_finalize_write(model)
    assert att.guard is not None
    with att.guard.replaying():
        pass
    layer = model.model.layers[0]
    assert not torch.equal(layer.hc_attn_fn_broadcast, dsv4.folded(layer))
