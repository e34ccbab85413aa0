"""The parts of `graphsafe.integrations.sglang` that need no SGLang: its model runner's
patches on a runner of plain torch (the integration against SGLang's real classes and CPU
engine is tested in `tests_sglang/`, `scripts/test-sglang`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe.integrations.sglang import _attachment
from graphsafe.integrations.sglang._patches import _patch_runner, runs_model, runs_op_by_op
from graphsafe.integrations.sglang._registries import NO_REGISTRY

_PACKED: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
"""A kernel library's process-wide prepacked-weight cache, keyed by address and shape."""


class CachedModel(nn.Module):
    """SGLang-shaped (`load_weights` writes in place); its forward reads `lin`'s weight
    through the library's cache, packed on first use: the model holds no packed copy."""

    def __init__(self, *, repack: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.repack = repack  # its post-load step writes the new packing into the cache

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)
        w = self.lin.weight  # SGLang's load_weights ends in its post-load step
        packed = _PACKED.get((w.data_ptr(), tuple(w.shape)))
        if self.repack and packed is not None:
            packed.copy_(w.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        key = (w.data_ptr(), tuple(w.shape))
        if key not in _PACKED:
            _PACKED[key] = w.t().contiguous()
        return x @ _PACKED[key] + self.lin.bias


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=g)) for n, p in CachedModel().named_parameters()]


class Mode:
    def __init__(self, idle: bool) -> None:
        self.idle = idle

    def is_idle(self) -> bool:
        return self.idle


class Runner:
    """The `ModelRunner` methods graphsafe patches, as SGLang's CPU engine calls them:
    `load_model`, then `init_cuda_graphs` (no graphs on a CPU), then `forward` per step
    (`repack`: as `CachedModel`'s)."""

    def __init__(self, *, repack: bool = False, **server_args: Any) -> None:
        self.server_args = SimpleNamespace(
            **{"device": "cpu", "enable_torch_compile": False, **server_args})
        self.decode_cuda_graph_runner = None
        self.prefill_cuda_graph_runner = None
        self.repack = repack
        self.input = torch.randn(2, 4, generator=torch.Generator().manual_seed(9))

    def load_model(self) -> None:
        self.model = CachedModel(repack=self.repack)
        self.model.load_weights(checkpoint(0))

    def init_cuda_graphs(self) -> None:
        pass

    def forward(self, forward_batch: Any) -> torch.Tensor | None:
        if forward_batch.forward_mode.is_idle():
            return None
        with torch.no_grad():
            return self.model(self.input)

    def reload(self, seed: int) -> None:
        self.model.load_weights(checkpoint(seed))  # graphsafe's load once attached


class Patched(Runner):
    pass


_patch_runner(Patched, NO_REGISTRY)


def _batch(*, idle: bool = False) -> Any:
    return SimpleNamespace(forward_mode=Mode(idle))


def _started(cls: type[Runner] = Patched, **kw: Any) -> Runner:
    _PACKED.clear()
    runner = cls(**kw)
    runner.load_model()
    runner.init_cuda_graphs()
    return runner


def _served(runner: Runner, seed: int) -> torch.Tensor:
    weights = dict(checkpoint(seed))
    return runner.input @ weights["lin.weight"].t() + weights["lin.bias"]


def test_the_server_arguments_decide_whether_the_first_forward_is_recorded() -> None:
    assert runs_op_by_op(Runner())
    assert not runs_op_by_op(Runner(enable_torch_compile=True))  # compiled code serves
    assert not runs_op_by_op(Runner(device="cuda"))  # CUDA graphs read by address
    cpu_graphs = Runner()
    cpu_graphs.decode_cuda_graph_runner = object()  # the CPU graph runner replays compiled code
    assert not runs_op_by_op(cpu_graphs)
    assert not runs_op_by_op(SimpleNamespace())  # nothing to read: not recorded
    assert runs_model((_batch(),), {}) and not runs_model((_batch(idle=True),), {})


def test_sglang_cpu_engine_guards_a_cache_outside_the_model_its_first_forward_reads() -> None:
    runner = _started()
    att = _attachment.attachment(runner.model)
    assert att is not None and att.recording
    runner.forward(_batch(idle=True))  # an idle batch runs nothing: not recorded
    assert att.recording and not gs.runtime(runner.model).discovered
    out = runner.forward(_batch())  # the first step packs the cache, and is recorded
    assert out is not None and torch.allclose(out, _served(runner, 0))
    assert att.recording  # made in that step: whether it is kept, the next one shows
    runner.forward(_batch())  # reads the packed copy as made before it
    assert not att.recording
    (found,) = gs.runtime(runner.model).discovered
    assert found.path.startswith(f"<outside the model> {__name__}._PACKED[(")
    assert found.sources == ("lin.weight",)
    assert att.status()["checked"] == len(list(runner.model.parameters()))  # the whole model
    runner.reload(1)  # in place: the cache keeps the old packing
    with pytest.raises(gs.StaleError, match=r"_PACKED\[\([\s\S]*lin\.weight"):
        runner.forward(_batch())


def test_control_unpatched_the_sglang_engine_serves_the_cached_old_weight() -> None:
    runner = _started(Runner)
    runner.forward(_batch())
    runner.forward(_batch())
    runner.reload(1)
    out = runner.forward(_batch())
    assert out is not None and not torch.allclose(out, _served(runner, 1))


def test_control_a_compiled_sglang_engine_records_no_forward_and_guards_no_cache() -> None:
    runner = _started(enable_torch_compile=True)
    att = _attachment.attachment(runner.model)
    assert att is not None and not att.recording
    runner.forward(_batch())
    runner.forward(_batch())
    assert not gs.runtime(runner.model).discovered  # what it cannot record, it does not match


def test_a_sglang_loader_that_repacks_the_cache_is_no_false_alarm() -> None:
    runner = _started(repack=True)
    runner.forward(_batch())
    runner.forward(_batch())
    runner.reload(1)
    out = runner.forward(_batch())
    assert out is not None and torch.allclose(out, _served(runner, 1))
