"""The seed bug, caught in the class it shipped in: vLLM's DeepSeek V4 `hc_attn_fn_broadcast`.

vLLM's `finalize_mhc_broadcast_weights` binds the first layer's broadcast weight on the
first load and, since the fix, copies into it afterwards; before the fix it bound a fresh
tensor on every load, and a captured CUDA graph kept reading the old one.
"""

from __future__ import annotations

from collections.abc import Iterator

import dsv4_tiny as dsv4
import pytest
import torch

import graphsafe as gs
from graphsafe.integrations import vllm as gsv

PATH = "model.layers.0.hc_attn_fn_broadcast"


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    with dsv4.tiny_world():
        yield


@pytest.fixture
def model(world: None) -> torch.nn.Module:
    m = dsv4.build_tiny()
    dsv4.load(m, dsv4.random_checkpoint(m, 0))  # vLLM's own first load binds the tensor
    return m


def test_graphsafe_adopts_vllms_tensor_and_matches_fold_streams(model: torch.nn.Module) -> None:
    layer = model.model.layers[0]
    vllms = layer.hc_attn_fn_broadcast
    att = gsv.attach(model, gsv.deepseek_v4_registry())
    assert layer._buffers["hc_attn_fn_broadcast"] is vllms  # adopted: object and storage
    assert att.status()["derived"] == [PATH]
    assert torch.equal(layer.hc_attn_fn_broadcast, dsv4.folded(layer))


def test_fixed_finalize_passes_pinned_with_no_false_alarm(model: torch.nn.Module) -> None:
    layer = model.model.layers[0]
    att = gsv.attach(model, gsv.deepseek_v4_registry())
    att.pin()
    ptr = layer.hc_attn_fn_broadcast.data_ptr()
    for seed in (1, 2):
        dsv4.load(model, dsv4.random_checkpoint(model, seed))  # one graphsafe update each
        with att.guard.replaying():  # what runs before each engine step
            pass
        assert layer.hc_attn_fn_broadcast.data_ptr() == ptr
        assert torch.equal(layer.hc_attn_fn_broadcast, dsv4.folded(layer))
    assert att.updates == 2 and not att.runtime.stale


def test_prefix_finalize_raises_storage_moved_naming_the_buffer(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    att = gsv.attach(model, gsv.deepseek_v4_registry())
    att.pin()
    monkeypatch.setattr(type(model.model), "finalize_mhc_broadcast_weights", dsv4.prefix_finalize)
    with pytest.raises(gs.StorageMovedError) as e:
        dsv4.load(model, dsv4.random_checkpoint(model, 1))
    assert PATH in str(e.value)
    assert att.guard is not None
    # And the engine's next step is refused.
    with pytest.raises(gs.StorageMovedError, match=PATH.replace(".", r"\.")), att.guard.replaying():
        pass


def test_control_without_graphsafe_the_prefix_finalize_moves_silently(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = model.model.layers[0]
    ptr = layer.hc_attn_fn_broadcast.data_ptr()
    monkeypatch.setattr(type(model.model), "finalize_mhc_broadcast_weights", dsv4.prefix_finalize)
    dsv4.load(model, dsv4.random_checkpoint(model, 1))  # no error from vLLM itself
    assert layer.hc_attn_fn_broadcast.data_ptr() != ptr  # a captured graph reads the old
