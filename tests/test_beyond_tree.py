"""State beyond one model's tree: what a model derives from another model's weights.

A speculative draft packs its head from the target's LM head, reached by reference (not a
shared submodule), or copies the target's head into its own weight when it loads; an RL
sync then writes the target only (SGLang #27718, vLLM-Ascend #13209, verl #6947). Each
case comes with its control: the same capture replayed unguarded reads the stale head.
"""

from __future__ import annotations

import contextlib
import re
import threading
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._runtime import runtime as runtime_module
from graphsafe._runtime.refresh.binder import Binder

C, V = 4, 6


def _head(seed: int) -> torch.Tensor:
    return torch.randn(V, C, generator=torch.Generator().manual_seed(seed))


@gs.graphsafe
class Target(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(C, V, bias=False)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)


@gs.graphsafe
class PackingDraft(nn.Module):
    """Packs its head from the target's, which its loader is handed by reference."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(C, C, bias=False)
        self.head_t = torch.zeros(C, V)

    def load_weights(self, weights: dict[str, torch.Tensor], target: Target) -> None:
        with torch.no_grad():
            self.proj.weight.copy_(weights["proj.weight"])
            self.head_t.copy_(target.lm_head.weight.t())  # [C, V], packed in place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ self.head_t


@gs.graphsafe
class CopyingDraft(nn.Module):
    """Copies the target's head into a weight of its own when it loads."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(C, C, bias=False)
        self.head = nn.Linear(C, V, bias=False)

    def load_weights(self, weights: dict[str, torch.Tensor], target: Target) -> None:
        with torch.no_grad():
            self.proj.weight.copy_(weights["proj.weight"])
            self.head.weight.copy_(target.lm_head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x))


def _draft_weights() -> dict[str, torch.Tensor]:
    return {"proj.weight": torch.eye(C)}


def _capture(m: nn.Module, *, guard: bool) -> tuple[gs.Graph, torch.Tensor]:
    g = gs.Graph(backend="cpu", guard=m if guard else None)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(2, C))
    return g, y


def _expected(head: torch.Tensor) -> torch.Tensor:
    return torch.ones(2, C) @ head.t()


@pytest.mark.parametrize("draft_class", [PackingDraft, CopyingDraft])
def test_a_draft_derived_from_the_target_is_stale_after_a_target_only_sync(
    draft_class: type[nn.Module],
) -> None:
    target, draft = Target(), draft_class()
    target.load_weights({"lm_head.weight": _head(0)})
    draft.load_weights(_draft_weights(), target)
    found = {d.path: d for d in gs.runtime(draft).discovered}
    path = "head_t" if draft_class is PackingDraft else "head.weight"
    assert found[path].sources == ("Target:lm_head.weight",)
    g, y = _capture(draft, guard=True)
    target.load_weights({"lm_head.weight": _head(1)})  # the RL sync writes the target only
    with pytest.raises(gs.StaleError, match=rf"{path}[\s\S]*Target:lm_head.weight"):
        g.replay()
    # The fix the error names: the draft's own load again, from the synced target.
    draft.load_weights(_draft_weights(), target)
    g.replay()
    assert torch.allclose(y, _expected(_head(1)))


def test_the_targets_weights_are_read_as_they_are_at_each_drafts_load() -> None:
    """A recording reads the other models' weights from their walk while it holds (one
    pass over every module of each is kept, not repeated per load); a head rebound since
    is read anew, and what a later draft packs from it is found."""
    target, first, second = Target(), PackingDraft(), PackingDraft()
    target.load_weights({"lm_head.weight": _head(0)})
    target.load_weights({"lm_head.weight": _head(0)})  # its bring-up over: its walk stays
    first.load_weights(_draft_weights(), target)  # the target's weights, read and kept
    assert [d.sources for d in gs.runtime(first).discovered] == [("Target:lm_head.weight",)]
    target.lm_head.weight.data = _head(2)  # another tensor, unknown to what was kept
    second.load_weights(_draft_weights(), target)
    assert [d.sources for d in gs.runtime(second).discovered] == [("Target:lm_head.weight",)]
    g, _ = _capture(second, guard=True)
    target.load_weights({"lm_head.weight": _head(1)})
    with pytest.raises(gs.StaleError, match=r"head_t[\s\S]*Target:lm_head.weight"):
        g.replay()


def test_a_recorded_load_reads_the_other_models_weights_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the recording is given as it begins (a copy from them is a derivation) is what
    its end settles with: the other models are not checked again."""
    target, draft = Target(), PackingDraft()
    target.load_weights({"lm_head.weight": _head(0)})
    target.load_weights({"lm_head.weight": _head(0)})
    reads: list[str] = []
    foreign = Binder.foreign
    monkeypatch.setattr(Binder, "foreign",
                        lambda self: reads.append(type(self.model).__name__) or foreign(self))
    draft.load_weights(_draft_weights(), target)
    assert reads.count("Target") == 1  # other tests' models may be alive too
    assert [d.sources for d in gs.runtime(draft).discovered] == [("Target:lm_head.weight",)]


@gs.graphsafe
class WaitingDraft(PackingDraft):
    """Runs `meanwhile` (another thread's work, waited for) before it packs."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        super().__init__()
        self.meanwhile = meanwhile

    def load_weights(self, weights: dict[str, torch.Tensor], target: Target) -> None:
        self.meanwhile()
        super().load_weights(weights, target)


@pytest.mark.parametrize("as_it_began", [False, True])
def test_a_model_loading_as_the_recording_began_is_read_again_at_its_end(
    as_it_began: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's load, in another thread, holds its runtime as the draft's recorded
    load begins, and rebinds its head before the draft packs from it: the target's
    weights are read as they are as the draft's load begins, and again as it ends.
    Control (`as_it_began`: the weights as the load began kept): the head the draft
    packed from is no weight of any model, and nothing is found."""
    target = Target()
    target.load_weights({"lm_head.weight": _head(0)})
    target.load_weights({"lm_head.weight": _head(0)})
    if as_it_began:
        read = runtime_module.foreign_of
        monkeypatch.setattr(runtime_module, "foreign_of",
                            lambda other, loading=False: read(other))
    held, rebind, rebound = threading.Event(), threading.Event(), threading.Event()

    def target_loading() -> None:
        with gs.runtime(target)._lock:
            held.set()
            if rebind.wait(30):
                target.lm_head.weight.data = _head(2)
                rebound.set()

    def meanwhile() -> None:
        rebind.set()
        assert rebound.wait(30)

    draft = WaitingDraft(meanwhile)
    thread = threading.Thread(target=target_loading)
    thread.start()
    try:
        assert held.wait(30)
        draft.load_weights(_draft_weights(), target)
    finally:
        rebind.set()
        thread.join()
    found = [d.sources for d in gs.runtime(draft).discovered]
    assert found == ([] if as_it_began else [("Target:lm_head.weight",)])


@pytest.mark.parametrize("draft_class", [PackingDraft, CopyingDraft])
def test_control_unguarded_the_draft_replays_the_old_head(draft_class: type[nn.Module]) -> None:
    target, draft = Target(), draft_class()
    target.load_weights({"lm_head.weight": _head(0)})
    draft.load_weights(_draft_weights(), target)
    g, y = _capture(draft, guard=False)
    target.load_weights({"lm_head.weight": _head(1)})
    g.replay()
    assert torch.allclose(y, _expected(_head(0)))  # stale: the old head
    assert not torch.allclose(y, _expected(_head(1)))


class SharingDraft(nn.Module):
    """Holds the target's head submodule itself: nothing is derived, nothing goes stale."""

    def __init__(self, target: Target) -> None:
        super().__init__()
        self.proj = nn.Linear(C, C, bias=False)
        self.lm_head = target.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.proj(x))


def test_a_draft_that_shares_the_targets_submodule_is_no_false_alarm() -> None:
    target = Target()
    target.load_weights({"lm_head.weight": _head(0)})
    draft = SharingDraft(target)
    with gs.runtime(draft).weight_update(), torch.no_grad():
        draft.proj.weight.copy_(torch.eye(C))
    assert gs.runtime(draft).discovered == ()
    g, y = _capture(draft, guard=True)
    target.load_weights({"lm_head.weight": _head(1)})
    g.replay()  # the draft reads the target's head itself
    assert torch.allclose(y, _expected(_head(1)))


def test_a_draft_loaded_from_its_own_checkpoint_is_no_false_alarm() -> None:
    """A weight the draft loads from its own checkpoint is loaded, whatever the target
    does afterwards."""
    target, draft = Target(), CopyingDraft()
    target.load_weights({"lm_head.weight": _head(0)})

    def own_load(weights: dict[str, torch.Tensor]) -> None:
        with gs.runtime(draft).weight_update(), torch.no_grad():
            for name, w in weights.items():
                draft.get_parameter(name).copy_(w)

    own_load({**_draft_weights(), "head.weight": _head(5)})
    assert gs.runtime(draft).discovered == ()
    g, y = _capture(draft, guard=True)
    target.load_weights({"lm_head.weight": _head(1)})
    g.replay()
    assert torch.allclose(y, _expected(_head(5)))


# -- a cache outside any model -------------------------------------------------------

_PACKED: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
"""A kernel library's process-wide prepacked-weight cache, keyed by address and shape."""


def _packed(w: torch.Tensor) -> torch.Tensor:
    key = (w.data_ptr(), tuple(w.shape))
    if key not in _PACKED:
        _PACKED[key] = w.t().contiguous()  # packed on first use
    return _PACKED[key]


@gs.graphsafe
class CachedLinear(nn.Module):
    """Reads its weight through the library's cache: the model holds no packed copy."""

    def __init__(self, *, cached: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(C, V, bias=False)
        self.cached = cached

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _packed(self.lin.weight) if self.cached else self.lin.weight.t()
        return x @ w


def _cached_capture(*, guard: bool) -> tuple[CachedLinear, gs.Graph, torch.Tensor]:
    _PACKED.clear()
    m = CachedLinear()
    m.load_weights({"lin.weight": _head(0)})
    with torch.no_grad():
        m(torch.ones(2, C))  # the warm-up packs the weight into the cache
    g, y = _capture(m, guard=guard)
    return m, g, y


def test_a_cache_outside_the_model_is_guarded_named_by_its_key() -> None:
    m, g, _ = _cached_capture(guard=True)
    (found,) = gs.runtime(m).discovered
    assert found.path.startswith(f"<outside the model> {__name__}._PACKED[(")
    assert found.sources == ("lin.weight",)
    m.load_weights({"lin.weight": _head(1)})  # in place: the cache keeps the old packing
    with pytest.raises(gs.StaleError, match=r"_PACKED\[\([\s\S]*lin\.weight"):
        g.replay()


@pytest.mark.skipif(_native.get() is None,
                    reason="a `.data` write outside any load is seen by the compiled observer")
def test_a_caches_source_written_outside_any_load_after_the_capture_is_refused() -> None:
    """The cache is found at the capture, after the pin: the observer watches its source
    from then on (a bare sync by `param.data.copy_`, which no version counter sees)."""
    m, g, _ = _cached_capture(guard=True)
    with torch.no_grad():
        m.lin.weight.data.copy_(_head(1))
    with pytest.raises(gs.StaleError, match=r"_PACKED\[[\s\S]*outside any tracked load"):
        g.replay()


def test_control_unguarded_the_cache_replays_the_old_weight() -> None:
    m, g, y = _cached_capture(guard=False)
    m.load_weights({"lin.weight": _head(1)})
    g.replay()
    assert torch.allclose(y, _expected(_head(0)))
    assert not torch.allclose(y, _expected(_head(1)))


def test_a_cache_refreshed_in_place_by_the_load_is_no_false_alarm() -> None:
    """A load that writes the new packing into the cached tensor itself keeps it fresh."""
    m, g, y = _cached_capture(guard=True)
    weights = {"lin.weight": _head(1)}

    def load_and_repack() -> None:
        with gs.runtime(m).weight_update(), torch.no_grad():
            m.lin.weight.copy_(weights["lin.weight"])
            _PACKED[(m.lin.weight.data_ptr(), (V, C))].copy_(m.lin.weight.t())

    load_and_repack()
    g.replay()
    assert torch.allclose(y, _expected(_head(1)))


_SCALES: dict[str, float] = {}
"""A kernel library's registry of per-layer scales, keyed by the layer's name."""


class Kernel:
    """A kernel class that keeps its alpha as a class attribute."""

    alpha = 1.0


@gs.graphsafe
class Registered(nn.Module):
    """Its post-load step keeps numbers taken from its weights outside the model: in a
    module's registry and on a kernel class; its forward reads them there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, V, bias=False)
        self.k_scale = nn.Parameter(torch.ones(()), requires_grad=False)
        self.alpha = nn.Parameter(torch.ones(()), requires_grad=False)

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
        _SCALES["eps"] = 1e-6  # a number no weight feeds
        if post:
            _SCALES["lin"] = self.k_scale.item()
            Kernel.alpha = float(self.alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (_SCALES["lin"] * Kernel.alpha + _SCALES["eps"])


def _registered(seed: int) -> dict[str, torch.Tensor]:
    return {"lin.weight": _head(seed), "k_scale": torch.tensor(0.5 + seed),
            "alpha": torch.tensor(2.0 + seed)}


def _registered_expected(w: dict[str, torch.Tensor]) -> torch.Tensor:
    return _expected(w["lin.weight"]) * (w["k_scale"] * w["alpha"] + 1e-6)


def test_numbers_kept_outside_the_model_are_discovered_named_where_they_are_kept() -> None:
    m = Registered()
    m.load_weights(_registered(0))
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {f"<outside the model> {__name__}._SCALES['lin']",
                          f"<outside the model> {__name__}.Kernel.alpha"}
    assert found[f"<outside the model> {__name__}._SCALES['lin']"].sources == ("k_scale",)
    assert all(d.kind == "scalar" for d in found.values())
    g, _ = _capture(m, guard=True)
    m.load_weights(_registered(1), post=False)  # the weights only
    with pytest.raises(gs.StaleError, match=r"_SCALES\['lin'\] \(from k_scale"):
        g.replay()


def test_numbers_kept_outside_the_model_taken_again_after_capture_are_refused() -> None:
    m = Registered()
    m.load_weights(_registered(0))
    m.load_weights(_registered(1))  # before the capture: taken again, fresh
    gs.runtime(m).assert_fresh()
    g, _ = _capture(m, guard=True)
    m.load_weights(_registered(2))
    with pytest.raises(gs.StorageMovedError, match=r"Kernel\.alpha"):
        g.replay()  # the graph holds the numbers of capture


def test_control_unguarded_numbers_kept_outside_the_model_replay_stale() -> None:
    m = Registered()
    m.load_weights(_registered(0))
    g, y = _capture(m, guard=False)
    new = _registered(1)
    m.load_weights(new)
    g.replay()
    with torch.no_grad():
        assert torch.allclose(m(torch.ones(2, C)), _registered_expected(new))
    assert not torch.allclose(y, _registered_expected(new))


def test_state_no_weight_feeds_outside_the_model_is_no_false_alarm() -> None:
    m = CachedLinear(cached=False)
    m.load_weights({"lin.weight": _head(0)})
    scale = torch.full((V,), 2.0)  # made outside the model, from no weight

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = m

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * scale

    outer = Scaled()
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = outer(torch.ones(2, C))
    assert gs.runtime(m).discovered == ()
    m.load_weights({"lin.weight": _head(1)})
    g.replay()
    assert torch.allclose(y, 2 * _expected(_head(1)))


# -- state a later load creates in a new place ----------------------------------------

R = 2  # the adapter's rank


@gs.graphsafe
class Adapted(nn.Module):
    """A base linear; a later load adds a LoRA adapter and merges it into a kernel-layout
    copy the forward reads from then on (SGLang #29874: stale adapter after a reload)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, V, bias=False)
        self.kernel: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: dict[str, torch.Tensor], *, merge: bool = True) -> None:
        with torch.no_grad():
            for name, w in weights.items():
                if name.startswith("lora_") and not hasattr(self, name):
                    self.register_parameter(name, nn.Parameter(w.clone(), requires_grad=False))
                else:
                    self.get_parameter(name).copy_(w)
            if merge and hasattr(self, "lora_a"):
                merged = (self.lin.weight + self.lora_b @ self.lora_a).t()  # [C, V]
                if "merged_t" in self.kernel:
                    self.kernel["merged_t"].copy_(merged)
                else:
                    self.kernel["merged_t"] = merged.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "merged_t" in self.kernel:
            return x @ self.kernel["merged_t"]
        return self.lin(x)


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"lora_a": torch.randn(R, C, generator=g), "lora_b": torch.randn(V, R, generator=g)}


def _merged_reference(head: torch.Tensor, adapter: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.ones(2, C) @ (head + adapter["lora_b"] @ adapter["lora_a"]).t()


def _adapted_capture(*, guard: bool) -> tuple[Adapted, gs.Graph, torch.Tensor]:
    m = Adapted()
    m.load_weights({"lin.weight": _head(0)})  # the first load, recorded
    m.load_weights(_adapter(3))  # a later load, not recorded: adds and merges the adapter
    g, y = _capture(m, guard=guard)
    return m, g, y


def test_state_a_later_load_creates_in_a_new_place_is_found_and_guarded() -> None:
    m, g, y = _adapted_capture(guard=True)
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found["kernel.merged_t"].sources) == {"lin.weight", "lora_a", "lora_b"}
    gs.runtime(m).adopt("kernel.merged_t")  # its ops are not known: it cannot be
    (again,) = (d for d in gs.runtime(m).discovered if d.path == "kernel.merged_t")
    assert "a later load that was not recorded" in (again.refused or "")
    m.load_weights({"lin.weight": _head(1)}, merge=False)  # a base sync, no re-merge
    with pytest.raises(gs.StaleError, match=r"kernel\.merged_t[\s\S]*lin\.weight"):
        g.replay()
    m.load_weights({"lin.weight": _head(1)})  # the fix: the load that merges again
    g.replay()
    assert torch.allclose(y, _merged_reference(_head(1), _adapter(3)), atol=1e-6)


def test_control_unguarded_a_later_loads_merge_replays_the_old_base() -> None:
    m, g, y = _adapted_capture(guard=False)
    m.load_weights({"lin.weight": _head(1)}, merge=False)
    g.replay()
    assert torch.allclose(y, _merged_reference(_head(0), _adapter(3)), atol=1e-6)
    assert not torch.allclose(y, _merged_reference(_head(1), _adapter(3)), atol=1e-6)


def test_an_adapter_swap_without_a_merge_is_refused_too() -> None:
    """The adapter's own weights, created by the later load, are sources as well."""
    m, g, _ = _adapted_capture(guard=True)
    m.load_weights(_adapter(4), merge=False)
    with pytest.raises(gs.StaleError, match=r"kernel\.merged_t[\s\S]*lora_"):
        g.replay()


def test_state_a_later_load_makes_from_no_weight_is_no_false_alarm() -> None:
    m = Adapted()
    m.load_weights({"lin.weight": _head(0)})
    with gs.runtime(m).weight_update(), torch.no_grad():
        m.lin.weight.copy_(_head(1))
        m.kernel["positions"] = torch.arange(4.0)  # a cache no weight feeds
    assert gs.runtime(m).discovered == ()


# -- numbers and handles a later load creates in a new place ----------------------------


class Attn(nn.Module):
    """vLLM's attention keeps `_k_scale_float = k_scale.item()` for its kernels' arguments
    (1.0 until a checkpoint brings a scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.k_scale = nn.Parameter(torch.ones(()), requires_grad=False)
        self.zero_point = nn.Parameter(torch.zeros((), dtype=torch.int64), requires_grad=False)
        self._k_scale_float = 1.0
        self.zp = 0


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()


@gs.graphsafe
class Later(nn.Module):
    """Its first load brings the linear only; a later one brings the KV-cache scale, and
    its post-load step takes the number (and, `packed`, prepacks the linear into a
    `ScriptObject` handle): both made in a new place by a load that was not recorded."""

    def __init__(self, *, packed: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer()])
        self.pack = packed

    def attn(self) -> Attn:
        layer = self.layers[0]
        assert isinstance(layer, Layer)
        return layer.attn

    def load_weights(self, weights: dict[str, torch.Tensor], *, post: bool = True) -> None:
        attn = self.attn()
        with torch.no_grad():
            for name, w in weights.items():
                self.get_parameter(name).copy_(w)
            if post and "layers.0.attn.k_scale" in weights:
                attn._k_scale_float = attn.k_scale.item()
                attn.zp = int(attn.zero_point)
                attn.eps = float(torch.tensor(1e-5))  # a number no weight feeds
            if post and self.pack and "layers.0.attn.k_scale" in weights:
                attn.packed = torch.ops.quantized.linear_prepack_fp16(attn.lin.weight,
                                                                      attn.lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attn()
        if self.pack and hasattr(attn, "packed"):
            y = torch.ops.quantized.linear_dynamic_fp16(x, attn.packed)
        else:
            y = attn.lin(x)
        return (y - attn.zp) * attn._k_scale_float


def _linear(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.attn.lin.weight": torch.randn(C, C, generator=g),
            "layers.0.attn.lin.bias": torch.zeros(C)}


def _scales(scale: float, zp: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    return {**_linear(seed), "layers.0.attn.k_scale": torch.tensor(scale),
            "layers.0.attn.zero_point": torch.tensor(zp)}


def _later_reference(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    y = torch.ones(2, C) @ weights["layers.0.attn.lin.weight"].t()
    return (y - weights["layers.0.attn.zero_point"]) * weights["layers.0.attn.k_scale"]


SCALE = "layers.0.attn._k_scale_float"


def _later(*, packed: bool = False) -> Later:
    m = Later(packed=packed)
    m.load_weights(_linear(0))  # the first load, recorded: no scale yet
    m.load_weights(_scales(0.5))  # a later load, not recorded: takes the numbers
    return m


def test_a_number_a_later_load_takes_in_a_new_place_is_found_with_its_weight() -> None:
    m = _later()
    found = {d.path: d for d in gs.runtime(m).discovered}
    assert set(found) == {SCALE, "layers.0.attn.zp"}  # not `eps`: no weight feeds it
    assert found[SCALE].kind == "scalar"
    assert found[SCALE].sources == ("layers.0.attn.k_scale",)
    assert found["layers.0.attn.zp"].sources == ("layers.0.attn.zero_point",)
    assert "_local_scalar_dense" in found[SCALE].chain


def test_a_bare_sync_leaves_a_later_loads_number_stale_and_the_replay_is_refused() -> None:
    m = _later()
    g, _ = _capture(m, guard=True)
    m.load_weights(_scales(0.25), post=False)  # the scale written, the number not retaken
    with pytest.raises(gs.StaleError, match=r"layers\.0\.attn\._k_scale_float[\s\S]*k_scale"):
        g.replay()


def test_control_unguarded_a_later_loads_number_replays_stale() -> None:
    m = _later()
    g, y = _capture(m, guard=False)
    m.load_weights(_scales(0.25), post=False)
    g.replay()
    assert torch.allclose(y, _later_reference(_scales(0.5)))
    assert not torch.allclose(y, _later_reference(_scales(0.25)))


def test_a_later_loads_number_changed_after_capture_is_refused_by_name() -> None:
    m = _later()
    g, _ = _capture(m, guard=True)
    m.load_weights(_scales(0.25))  # the post-load step takes the new number
    with pytest.raises(gs.StorageMovedError, match=re.escape(SCALE)) as info:
        g.replay()
    assert "layers.0.attn.k_scale" in str(info.value) and "0.25" in str(info.value)


def test_a_number_first_taken_after_the_capture_is_refused_against_what_the_graph_baked(
) -> None:
    """The graph baked the default 1.0; a load after the capture takes 0.5 from the new
    scale in that place: refused. Its control: a scale of 1.0 gives what was baked."""
    m = Later()
    m.load_weights(_linear(0))
    g, y = _capture(m, guard=True)
    m.load_weights(_scales(1.0, zp=0))
    g.replay()  # the numbers the graph baked (1.0, no zero point): no alarm
    assert torch.allclose(y, _later_reference(_scales(1.0, zp=0)))
    m.load_weights(_scales(0.5, zp=0))
    with pytest.raises(gs.StorageMovedError, match=re.escape(SCALE)):
        g.replay()
    gs.runtime(m).exempt(SCALE, why="the control: what the graph replays")
    g.replay()
    assert not torch.allclose(y, _later_reference(_scales(0.5, zp=0)))


def test_a_number_retaken_on_every_load_is_no_false_alarm() -> None:
    m = _later()
    g, y = _capture(m, guard=True)
    for seed in (1, 2):  # new weights, the same scale and zero point, taken again
        m.load_weights(_scales(0.5, seed=seed))
        g.replay()
        assert torch.allclose(y, _later_reference(_scales(0.5, seed=seed)))


def test_a_later_loads_number_is_listed_unchecked_by_the_audit() -> None:
    m = _later()
    report = gs.audit(m)
    unchecked = {u.path: u.why for u in report.unchecked}
    assert SCALE in unchecked and "not recorded" in unchecked[SCALE]
    assert SCALE not in report.checked


def test_state_no_weight_feeds_a_later_load_keeps_is_no_false_alarm() -> None:
    m = Later()
    m.load_weights(_linear(0))
    with gs.runtime(m).weight_update(), torch.no_grad():
        m.attn().lin.weight.copy_(_linear(1)["layers.0.attn.lin.weight"])
        m.attn().eps = torch.tensor(1e-6).item()  # taken from no weight
        m.attn().flag = bool(torch.tensor(1.0))
    assert gs.runtime(m).discovered == ()


def test_a_handle_a_later_load_makes_in_a_new_place_is_found_and_guarded() -> None:
    m = _later(packed=True)
    found = {d.path: d for d in gs.runtime(m).discovered}
    packed = found["layers.0.attn.packed"]
    assert packed.kind == "handle"
    assert set(packed.sources) == {"layers.0.attn.lin.weight", "layers.0.attn.lin.bias"}
    report = gs.audit(m)
    assert "layers.0.attn.packed" in {u.path for u in report.unchecked}
    g, _ = _capture(m, guard=True)
    m.load_weights(_scales(0.5, seed=1), post=False)  # the linear written, not prepacked
    with pytest.raises(gs.StaleError, match=r"layers\.0\.attn\.packed[\s\S]*lin\.weight"):
        g.replay()


def test_control_unguarded_a_later_loads_handle_replays_the_old_linear() -> None:
    m = _later(packed=True)
    g, y = _capture(m, guard=False)
    m.load_weights(_scales(0.5, seed=1), post=False)
    g.replay()
    assert torch.allclose(y, _later_reference(_scales(0.5)), atol=1e-2)
    assert not torch.allclose(y, _later_reference(_scales(0.5, seed=1)), atol=1e-2)


def test_a_later_loads_handle_rebuilt_after_capture_is_refused_by_name() -> None:
    m = _later(packed=True)
    g, _ = _capture(m, guard=True)
    m.load_weights(_scales(0.5, seed=1))  # prepacked anew: a new ScriptObject
    with pytest.raises(gs.StorageMovedError, match=r"layers\.0\.attn\.packed") as info:
        g.replay()
    assert "ScriptObject" in str(info.value)


class _LazyMapping(dict):  # type: ignore[type-arg]
    """A module-level dict whose `items` imports what it maps and raises (as transformers'
    lazy auto mappings do when a model class is missing)."""

    def items(self):  # type: ignore[no-untyped-def,override]
        raise ValueError("Could not find SomeModel in transformers")


_LAZY = _LazyMapping(name="model")


def test_a_module_dict_whose_items_raise_does_not_break_naming_a_cache() -> None:
    m, _, _ = _cached_capture(guard=True)
    (found,) = gs.runtime(m).discovered
    assert found.path.startswith(f"<outside the model> {__name__}._PACKED[(")
    with pytest.raises(ValueError, match="Could not find"):
        _LAZY.items()  # the control: read through its own `items`, it raises


# -- a dtype view of a weight: the weight itself, not a derived copy ----------------------


@gs.graphsafe
class BitsKernel(nn.Module):
    """Its post-load step hands the kernel the head's bits as int32: a dtype view of the
    weight (the same memory), or, with `copy`, a packed copy of those bits."""

    def __init__(self, *, copy: bool = False) -> None:
        super().__init__()
        self.lm_head = nn.Linear(C, V, bias=False)
        self.copy = copy
        self.bits = torch.zeros(V, C, dtype=torch.int32)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.lm_head.weight.copy_(weights["lm_head.weight"])
        bits = self.lm_head.weight.detach().view(torch.int32)  # [V, C]
        self.bits = bits.clone() if self.copy else bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.bits.view(torch.float32).t()


@pytest.mark.parametrize("copy", [False, True], ids=["view", "control-copy"])
def test_a_dtype_view_of_a_weight_is_no_false_alarm(copy: bool) -> None:
    model = BitsKernel(copy=copy)
    model.load_weights({"lm_head.weight": _head(0)})
    found = [d.path for d in gs.runtime(model).discovered]
    assert found == (["bits"] if copy else [])  # a view is the weight, not derived from it
    g, y = _capture(model, guard=True)
    with torch.no_grad():  # a bare sync of the head, in place
        model.lm_head.weight.copy_(_head(1))
    if copy:  # control: a packed copy of the bits is stale, and refused
        with pytest.raises(gs.StaleError, match="bits"):
            g.replay()
        return
    g.replay()  # the view reads the new weight: correct, and no alarm
    assert torch.allclose(y, _expected(_head(1)))


# -----------------------------------------------------------------------------
# Expert layouts from a balancer: physical slots written in checkpoint order

NE, NP, DE = 3, 5, 2  # logical experts, physical slots, expert width
INITIAL = [[0, 3], [1, 4], [2, -1]]  # slot s serves expert s % NE: the checkpoint's order
MOVED = [[2, 4], [0, 1], [3, -1]]  # after a rebalance


class _Experts(nn.Module):
    """vLLM's `FusedMoE` as the balancer sees it: stacked weights by physical slot and
    the map beside them (`set_eplb_state`)."""

    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(NP, DE, DE), requires_grad=False)
        self.logical_to_physical_map = torch.tensor(INITIAL)
        self.logical_replica_count = torch.tensor([2, 2, 1])

    def forward(self, x: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        slot = self.logical_to_physical_map[logical, 0]  # [T]: each token's physical slot
        return torch.einsum("td,tde->te", x, self.w13_weight[slot])  # [T, DE]


class _MoEModel(nn.Module):
    """Loads the checkpoint's experts (`experts.{e}.w`) into the physical slots: in
    checkpoint order (the initial placement, prime-rl #3583), or through the map."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Experts()])

    def forward(self, x: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x, logical)

    def load_weights(self, weights: dict[str, torch.Tensor], via: str = "checkpoint") -> None:
        ex = self.layers[0]
        w, l2p, count = ex.w13_weight.data, ex.logical_to_physical_map, ex.logical_replica_count
        if via == "gather":  # every slot at once, gathered through the map
            p2l = torch.zeros(NP, dtype=torch.long)
            for e in range(NE):
                p2l[l2p[e, : count[e]]] = e
            w.copy_(torch.stack([weights[f"experts.{e}.w"] for e in range(NE)])[p2l])
            return
        for e in range(NE):
            t = weights[f"experts.{e}.w"]
            if via == "tolist":  # the slots the map gives the expert
                slots = l2p[e].tolist()[: count.tolist()[e]]
            elif via == "item":
                slots = [int(l2p[e, r].item()) for r in range(int(count[e].item()))]
            else:  # the initial placement: slot s <- expert s % NE
                slots = [s for s in range(NP) if s % NE == e]
            for s in slots:
                w[s].copy_(t)


@gs.graphsafe
class EplbModel(_MoEModel):
    pass


def _moe_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"experts.{e}.w": torch.randn(DE, DE, generator=g) for e in range(NE)}


def _right(ckpt: dict[str, torch.Tensor]) -> torch.Tensor:
    """What each token is served: token t routed to logical expert t."""
    return torch.stack([torch.ones(DE) @ ckpt[f"experts.{e}.w"] for e in range(NE)])


def _rebalance(m: _MoEModel, new: list[list[int]]) -> Callable[[], None]:
    """The balancer's move while serving: each slot's contents from the old slot of its
    expert, then the map, together. The moves are planned first (from the balancer's own
    record), so the move itself reads no map."""
    ex = m.layers[0]
    old = ex.logical_to_physical_map.tolist()
    moves = [(p, old[e][0]) for e, row in enumerate(new) for p in row if p >= 0]

    def move() -> None:
        w = ex.w13_weight.data
        held = w.clone()
        for dst, src in moves:
            w[dst].copy_(held[src])
        ex.logical_to_physical_map.copy_(torch.tensor(new))

    return move


def _moe_capture(model_class: type[_MoEModel], *, moved: bool
                 ) -> tuple[_MoEModel, gs.Graph, torch.Tensor]:
    m = model_class()
    m.load_weights(_moe_checkpoint(0))
    guard = m if isinstance(m, EplbModel) else None
    g = gs.Graph(backend="cpu", guard=guard)
    with torch.no_grad(), g.capture():
        y = m(torch.ones(NE, DE), torch.arange(NE))
    if moved:
        move = _rebalance(m, MOVED)
        with gs.weight_update(m) if guard is not None else contextlib.nullcontext():
            move()
    return m, g, y


def test_a_sync_in_checkpoint_order_under_a_moved_map_is_refused_by_name() -> None:
    m, g, _ = _moe_capture(EplbModel, moved=True)
    with pytest.raises(gs.StaleError, match=(
            r"(?s)\(layers\.0\) under a balancer's map.*tensor: +layers\.0\.w13_weight.*"
            r"never read the map layers\.0\.logical_to_physical_map.*slot 0 from expert 1 "
            r"\(checkpoint order: 0\).*fix:.*place_experts.*write through the map")):
        m.load_weights(_moe_checkpoint(1))
    with pytest.raises(gs.StaleError, match="written in checkpoint order"):
        g.replay()  # refused until a load writes through the map


def test_control_unguarded_a_sync_in_checkpoint_order_serves_the_wrong_expert() -> None:
    m, g, y = _moe_capture(_MoEModel, moved=True)
    g.replay()
    assert torch.allclose(y, _right(_moe_checkpoint(0)))  # the rebalance itself is right
    m.load_weights(_moe_checkpoint(1))
    g.replay()
    assert not torch.allclose(y[0], _right(_moe_checkpoint(1))[0])  # expert 1 for token 0


@pytest.mark.parametrize("via", ["tolist", "item", "gather"])
def test_a_sync_through_the_map_is_no_false_alarm(via: str) -> None:
    m, g, y = _moe_capture(EplbModel, moved=True)
    m.load_weights(_moe_checkpoint(1), via=via)
    g.replay()
    assert torch.allclose(y, _right(_moe_checkpoint(1)))


def test_a_sync_through_the_map_lifts_the_refusal() -> None:
    m, g, y = _moe_capture(EplbModel, moved=True)
    with pytest.raises(gs.StaleError):
        m.load_weights(_moe_checkpoint(1))
    m.load_weights(_moe_checkpoint(2), via="tolist")
    g.replay()
    assert torch.allclose(y, _right(_moe_checkpoint(2)))


@pytest.mark.parametrize("inside", [True, False], ids=["in-an-update", "outside-any-load"])
def test_a_rebalance_in_place_while_serving_is_no_false_alarm(inside: bool) -> None:
    m, g, y = _moe_capture(EplbModel, moved=False)
    m.load_weights(_moe_checkpoint(1))  # the initial placement: checkpoint order is right
    g.replay()
    assert torch.allclose(y, _right(_moe_checkpoint(1)))
    move = _rebalance(m, MOVED)
    with gs.weight_update(m) if inside else contextlib.nullcontext():
        move()
    g.replay()
    assert torch.allclose(y, _right(_moe_checkpoint(1)))
    # The control: the map moved, so the same sync in checkpoint order is refused now.
    with pytest.raises(gs.StaleError, match="checkpoint order"):
        m.load_weights(_moe_checkpoint(2))


@pytest.mark.parametrize("first", [False, True], ids=["after-a-load", "first-call"])
def test_a_load_state_dict_of_the_slots_under_a_moved_map_is_refused(first: bool) -> None:
    if first:  # bound, but no load found the layout before
        m: _MoEModel = EplbModel()
        assert gs.runtime(m).derivations == ()
        m.layers[0].logical_to_physical_map.copy_(torch.tensor(MOVED))
    else:
        m, _, _ = _moe_capture(EplbModel, moved=True)
    w = torch.stack([_moe_checkpoint(1)[f"experts.{s % NE}.w"] for s in range(NP)])
    with pytest.raises(gs.StaleError, match=r"load_state_dict wrote layers\.0\.w13_weight"):
        m.load_state_dict({"layers.0.w13_weight": w})


class _RoutedExperts(nn.Module):
    """An engine that keeps the map under a name of its own, on a dispatch object."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NE, DE, DE), requires_grad=False)
        self.dispatch = types.SimpleNamespace(slot_expert=torch.arange(NE))

    def forward(self, x: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        slot = torch.argsort(self.dispatch.slot_expert)[logical]  # [T]
        return torch.einsum("td,tde->te", x, self.w[slot])


@gs.graphsafe
class DeclaredModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = _RoutedExperts()

    def forward(self, x: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        return self.moe(x, logical)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for e in range(NE):  # slot e <- expert e: checkpoint order
            self.moe.w.data[e].copy_(weights[f"experts.{e}.w"])


@pytest.mark.parametrize("declared", ["by-name", "by-callable", None],
                         ids=["by-name", "by-callable", "control-undeclared"])
def test_a_map_under_another_name_is_guarded_once_declared(declared: str | None) -> None:
    m = DeclaredModel()
    m.load_weights(_moe_checkpoint(0))
    if declared:
        gs.runtime(m).expert_layout("moe", physical_to_logical="dispatch.slot_expert"
                                    if declared == "by-name" else
                                    lambda: m.moe.dispatch.slot_expert)
    m.moe.dispatch.slot_expert.copy_(torch.tensor([2, 0, 1]))  # a permutation of slots
    m.moe.w.data.copy_(m.moe.w.data[[2, 0, 1]].clone())  # moved with it
    assert torch.allclose(m(torch.ones(NE, DE), torch.arange(NE)), _right(_moe_checkpoint(0)))
    if declared:
        where = r"moe\.dispatch\.slot_expert" if declared == "by-name" else r"moe \(declared"
        with pytest.raises(gs.StaleError, match="moe\\.w with loaded values and never read "
                           f"the map {where}"):
            m.load_weights(_moe_checkpoint(1))
    else:  # unrefused, and wrong: nothing told graphsafe of the map
        m.load_weights(_moe_checkpoint(1))
        y = m(torch.ones(NE, DE), torch.arange(NE))
        assert not torch.allclose(y, _right(_moe_checkpoint(1)))


def test_declaring_a_layout_refuses_what_is_not_one() -> None:
    m = DeclaredModel()
    rt = gs.runtime(m)
    with pytest.raises(gs.GraphSafetyError, match="no module at 'mo'"):
        rt.expert_layout("mo", physical_to_logical="dispatch.slot_expert")
    with pytest.raises(gs.GraphSafetyError, match=r"(?s)not a 1-D integer.*got: +nothing"):
        rt.expert_layout("moe", physical_to_logical="dispatch.nothing")
    with pytest.raises(gs.GraphSafetyError, match="holds no tensor 'w2'"):
        rt.expert_layout("moe", physical_to_logical="dispatch.slot_expert", weights=["w2"])


@gs.graphsafe
class EpRank(nn.Module):
    """One expert-parallel rank of two (vLLM's `FusedMoE` with `expert_map`): global
    physical slots 3r..3r+2 are its local slots 0..2."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(NE, DE, DE), requires_grad=False)
        local = torch.full((2 * NE,), -1)
        local[rank * NE:(rank + 1) * NE] = torch.arange(NE)
        self.register_buffer("_expert_map", local, persistent=False)
        self.logical_to_physical_map = torch.tensor([[0, 5], [1, 3], [2, 4]])  # moved rank 1
        self.logical_replica_count = torch.tensor([2, 2, 2])
        self.rank = rank

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for j in range(NE):  # the initial placement: global slot g <- expert g % NE
            self.w13_weight.data[j].copy_(weights[f"experts.{(self.rank * NE + j) % NE}.w"])


@pytest.mark.parametrize("rank", [1, 0], ids=["moved-rank", "control-rank-not-moved"])
def test_the_slots_of_an_expert_parallel_rank_are_judged_by_its_own_map(rank: int) -> None:
    m = EpRank(rank)
    if rank == 0:  # the map left its slots where the checkpoint's order puts them
        m.load_weights(_moe_checkpoint(1))
        return
    with pytest.raises(gs.StaleError, match=r"slot 0 from expert 1 \(checkpoint order: 0\), "
                       r"slot 1 from expert 2 \(checkpoint order: 1\)"):
        m.load_weights(_moe_checkpoint(1))


@gs.graphsafe
class LogicalOrderMoE(nn.Module):
    """Keeps the experts in logical order and reads them through the map at each forward:
    a raw load in checkpoint order is right here."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NE, DE, DE), requires_grad=False)
        self.physical_to_logical_map = torch.tensor([2, 0, 1])

    def forward(self, x: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        return torch.einsum("td,tde->te", x, self.w[logical])

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for e in range(NE):
            self.w.data[e].copy_(weights[f"experts.{e}.w"])


@pytest.mark.parametrize("opted_out", [True, False], ids=["weights=[]", "control-found"])
def test_weights_in_logical_order_beside_a_known_map_opt_out_by_declaring_none(
        opted_out: bool) -> None:
    m = LogicalOrderMoE()
    if opted_out:
        gs.runtime(m).expert_layout("", physical_to_logical="physical_to_logical_map",
                                    weights=[])
        m.load_weights(_moe_checkpoint(1))
        assert torch.allclose(m(torch.ones(NE, DE), torch.arange(NE)),
                              _right(_moe_checkpoint(1)))
    else:
        with pytest.raises(gs.StaleError, match="checkpoint order"):
            m.load_weights(_moe_checkpoint(1))
