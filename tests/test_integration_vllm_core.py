"""The parts of `graphsafe.integrations.vllm` that need no vLLM, on plain torch models.

The integration against vLLM's real engine and classes is tested in `tests_vllm/`
(`scripts/test-vllm`, run by CI in an environment with vLLM's CPU build).
"""

from __future__ import annotations

import enum
import importlib
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _python_dispatch

import graphsafe as gs
from graphsafe._graphs.reads import ReadTracker
from graphsafe._memory.walk import storage_key
from graphsafe.integrations import vllm as gsv
from graphsafe.integrations.vllm import _worker
from graphsafe.integrations.vllm._reads import StepReadTracker, captures_graphs, runs_op_by_op

registry = gs.Registry()


@registry.derive(nn.Linear, "weight_t", inputs=["weight"])
def weight_t(m: nn.Linear, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return w.t().contiguous() if out is None else out.copy_(w.t())


def make_registry() -> gs.Registry:
    return registry


class Model(nn.Module):
    """vLLM-shaped: a `load_weights` that writes in place, and a host scalar attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.emb = nn.Parameter(torch.zeros(5, 4))
        self.lin._k_scale_cpu = torch.tensor(1.0)  # as vLLM's Attention keeps it

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)
        return {n for n, _ in weights}


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=g)) for n, p in Model().named_parameters()]


def test_registries_resolve_by_name_object_or_factory() -> None:
    name = f"{__name__}:registry"
    assert gsv.registries_from(name) == [registry]
    assert gsv.registries_from(f"{__name__}:make_registry, {name}") == [registry, registry]
    assert gsv.registries_from([registry]) == [registry]


@pytest.mark.parametrize("spec", ["no_such_module:registry", f"{__name__}:Model", "x"])
def test_a_name_that_is_no_registry_is_refused_naming_it(spec: str) -> None:
    with pytest.raises(gs.RegistrationError, match="GRAPHSAFE_VLLM_REGISTRIES names") as e:
        gsv.registries_from(spec)
    assert repr(spec) in str(e.value)


def test_attach_materializes_and_load_weights_is_one_update_each() -> None:
    model = Model()
    model.load_weights(checkpoint(0))
    att = gsv.attach(model, registry)
    assert gsv.attach(model, registry) is att and gsv.attachment(model) is att
    assert torch.equal(model.lin.weight_t, model.lin.weight.t())
    att.pin()
    ptr = model.lin.weight_t.data_ptr()
    model.load_weights(checkpoint(1))  # the instance's wrapper: a graphsafe update
    assert att.updates == 1 and model.lin.weight_t.data_ptr() == ptr
    assert torch.equal(model.lin.weight_t, model.lin.weight.t())
    assert att.status() == {
        "pinned": True,
        "stale": [],
        "updates": 1,
        "derived": ["lin.weight_t"],
        "discovered": {},
        "last_refresh_bytes": 48,
        "read_set": False,  # pinned without recording: the whole model is checked
        "checked": 4,
        "recording": False,
        "inputs": 0,
        "graphs": True,  # pinned as after a graph capture: a move would be a fault
        "moved": {},
        "faults": {},
    }


def test_a_load_that_raised_before_writing_anything_owes_nothing() -> None:
    """vLLM rejects a bad first entry before it writes: the model keeps its weights."""
    model = Model()
    model.load_weights(checkpoint(0))
    att = gsv.attach(model, registry)
    att.pin()
    with pytest.raises(KeyError, match="nope"):
        model.load_weights([("nope", torch.zeros(1)), *checkpoint(1)])
    gs.runtime(model).assert_fresh()  # no debt, nothing stale: it may serve
    assert att.status()["stale"] == [] and att.updates == 0


def test_control_a_load_that_wrote_before_it_raised_owes_every_weight() -> None:
    model = Model()
    model.load_weights(checkpoint(0))
    att = gsv.attach(model, registry)
    att.pin()
    first = checkpoint(1)[0]  # lin.weight
    with pytest.raises(KeyError, match="nope"):
        model.load_weights([first, ("nope", torch.zeros(1))])
    with pytest.raises(gs.StaleError, match="holds a mix of old and new weights") as e:
        gs.runtime(model).assert_fresh()
    assert "emb" in str(e.value)  # owed, though this load never reached it


def test_a_rebinding_in_an_update_raises_at_its_end_for_any_pinned_tensor() -> None:
    model = Model()
    model.load_weights(checkpoint(0))
    att = gsv.attach(model, registry)
    att.pin()
    with pytest.raises(gs.StorageMovedError, match=r"\bemb\b"), gs.weight_update(model):
        model.emb.data = model.emb.data.clone()  # no derivation reads it: the ledger does


def test_control_unpinned_the_same_rebinding_passes_the_update() -> None:
    model = Model()
    model.load_weights(checkpoint(0))
    gsv.attach(model, registry)  # attached, not pinned: nothing to hold still yet
    with gs.weight_update(model):
        model.emb.data = model.emb.data.clone()


def test_host_scalar_attributes_are_not_pinned_but_everything_else_is() -> None:
    model = Model()
    model.load_weights(checkpoint(0))
    att = gsv.attach(model, registry)
    att.pin()
    assert att.guard is not None
    paths = att.guard.ledger.paths
    assert "lin._k_scale_cpu" not in paths
    assert {"lin.weight", "lin.bias", "emb", "lin.weight_t"} <= set(paths)
    model.lin._k_scale_cpu = torch.tensor(1.0)  # vLLM's reload binds it anew
    with att.guard.replaying():
        pass


def test_control_a_plain_graph_guard_pins_the_host_scalar_too() -> None:
    model = Model()
    model.load_weights(checkpoint(0))
    gs.runtime(model, registry).refresh()
    ledger = gs.Ledger.snapshot(model)
    assert "lin._k_scale_cpu" in ledger.paths
    model.lin._k_scale_cpu = torch.tensor(1.0)
    with pytest.raises(gs.StorageMovedError, match="_k_scale_cpu"):
        ledger.assert_stable()


class CountingParameter(nn.Parameter):
    """A parameter subclass with a `__torch_function__`, as vLLM's parameters have."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        CountingParameter.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_step_check_reads_subclass_parameters_without_their_torch_function() -> None:
    model = Model()
    model.load_weights(checkpoint(0))
    model.lin.weight = CountingParameter(model.lin.weight.detach().clone())
    att = gsv.attach(model, registry)
    att.pin()
    assert att.guard is not None
    # Another model's failed load poisons its own storage; this model's check is
    # still the flat one.
    from graphsafe._memory.journal import JOURNAL

    foreign = torch.zeros(3)
    JOURNAL.poison([foreign], "a failed load of another model")
    CountingParameter.calls = 0
    with att.guard.replaying():
        pass
    assert CountingParameter.calls == 0
    # Control: the same metadata read outside the check does go through it.
    model.lin.weight.data_ptr()
    assert CountingParameter.calls == 1
    # And the check still sees a rebinding of that parameter.
    model.lin.weight.data = model.lin.weight.data.clone()
    with pytest.raises(gs.StorageMovedError, match=r"lin\.weight"), att.guard.replaying():
        pass


class Mode(enum.Enum):
    """vLLM's `CompilationMode` and `CUDAGraphMode`, which graphsafe reads by name."""

    NONE = 0
    VLLM_COMPILE = 3


class Worker:
    """vLLM-shaped worker: the methods `instrument` wraps, over a `Model`, and its config.

    Its forward reads `lin` and `input` (a persistent input buffer, as vLLM's runner keeps
    them), never `emb`; each step notes the dispatch mode and profiler active in it.
    """

    def __init__(self, mode: Mode = Mode.NONE, traced: bool = False) -> None:
        self.model = Model()
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        self.vllm_config = SimpleNamespace(
            compilation_config=SimpleNamespace(mode=mode, cudagraph_mode=Mode.NONE)
        )
        self.input = torch.ones(4)
        self.traced = traced
        self.seen: list[tuple[object, object]] = []

    def load_model(self) -> None:
        self.model.load_weights(checkpoint(0))

    def compile_or_warm_up_model(self) -> None:
        pass

    def reload_weights(self, seed: int) -> None:
        self.model.load_weights(checkpoint(seed))

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, seed: int | None) -> None:
        if seed is None:
            raise RuntimeError("the transfer broke")
        self.model.load_weights(checkpoint(seed))

    def finish_weight_update(self) -> None:
        pass

    def execute_model(self, scheduler_output: Any = None) -> torch.Tensor | None:
        self.seen.append((_python_dispatch._get_current_dispatch_mode(), sys.getprofile()))
        if getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0:
            return None  # as vLLM's runner: no tokens, no forward
        if self.traced:  # FX code, as torch.compile runs: kernels no op names could be
            return torch.fx.symbolic_trace(self.model.lin)(self.input)
        return self.model.lin(self.input)


def started(instrumented: bool = True, **kw: Any) -> Worker:
    worker = Worker(**kw)
    if instrumented:
        gsv.instrument(worker, [registry])
    worker.load_model()
    worker.compile_or_warm_up_model()
    return worker


def test_an_instrumented_worker_attaches_pins_and_counts_each_update_once() -> None:
    worker = Worker()
    gsv.instrument(worker, [registry])
    worker.load_model()
    att = gsv.attachment(worker.model)
    assert att is not None and att.guard is None
    worker.compile_or_warm_up_model()
    assert att.guard is not None
    worker.reload_weights(1)
    assert att.updates == 1
    worker.start_weight_update()
    worker.update_weights(2)
    worker.update_weights(3)
    assert att.updates == 1  # the session is one update, still open
    worker.finish_weight_update()
    assert att.updates == 2
    assert torch.equal(worker.model.lin.weight_t, worker.model.lin.weight.t())
    worker.execute_model()
    assert gsv.WorkerExtension.graphsafe_status(worker) == att.status()  # type: ignore[arg-type]


def test_a_failed_transfer_fails_closed_until_a_session_completes() -> None:
    worker = started()
    worker.start_weight_update()
    with pytest.raises(RuntimeError, match="the transfer broke"):
        worker.update_weights(None)
    worker.finish_weight_update()
    with pytest.raises(gs.StaleError):
        worker.execute_model()
    worker.start_weight_update()
    worker.update_weights(2)
    worker.finish_weight_update()
    worker.execute_model()


def test_control_uninstrumented_the_failed_transfer_serves_on() -> None:
    worker = started(instrumented=False)
    worker.start_weight_update()
    with pytest.raises(RuntimeError, match="the transfer broke"):
        worker.update_weights(None)
    worker.finish_weight_update()
    worker.execute_model()


# -- the read set of an engine without graphs --------------------------------------------
# A rebinding is a fault only where graphs hold the addresses: the controls below that
# refuse one pin as after a graph capture (`hold_graphs`), to show what the read set
# leaves out of the check.


def rebind(t: torch.Tensor) -> None:
    t.data = t.data.clone()


@pytest.fixture
def hold_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_worker, "captures_graphs", lambda worker: True)


def test_an_engine_without_graphs_follows_a_moved_tensor_and_lists_it() -> None:
    worker = started()
    att = gsv.attachment(worker.model)
    assert att is not None and att.guard is not None and not att.guard.holds_addresses
    worker.execute_model()
    rebind(worker.model.lin.bias)  # read by every forward: the next reads the new one
    worker.execute_model()
    with gs.weight_update(worker.model):
        rebind(worker.model.lin.weight)  # an input: its derived buffer is refreshed
    assert torch.equal(worker.model.lin.weight_t, worker.model.lin.weight.t())
    worker.execute_model()
    status = att.status()
    assert status["graphs"] is False and status["faults"] == {} and status["stale"] == []
    assert status["moved"] == {"lin.bias": ["storage"], "lin.weight": ["storage"]}


def test_an_eager_engine_checks_only_what_its_first_forward_read() -> None:
    worker = started()
    att = gsv.attachment(worker.model)
    assert att is not None and att.guard is not None
    assert att.status()["read_set"] is False and att.status()["checked"] == 4
    worker.execute_model()
    status = att.status()
    assert (status["read_set"], status["checked"], status["inputs"]) == (True, 2, 1)
    assert set(att.guard.ledger.paths) == {"lin.weight", "lin.bias"}
    assert [t.data_ptr() for t in att.guard.inputs] == [worker.input.data_ptr()]
    rebind(worker.model.emb)  # never read by the forward: neither the step nor a load refuses
    worker.execute_model()
    worker.reload_weights(1)
    with gs.weight_update(worker.model):
        rebind(worker.model.emb)
    worker.execute_model()


@pytest.mark.usefixtures("hold_graphs")
def test_control_a_tensor_the_first_forward_read_still_refuses() -> None:
    worker = started()
    worker.execute_model()
    rebind(worker.model.lin.bias)  # read, and no derivation's input: only the guard sees it
    with pytest.raises(gs.StorageMovedError, match=r"lin\.bias"):
        worker.execute_model()
    worker = started()
    worker.execute_model()
    with pytest.raises(gs.StorageMovedError, match=r"lin\.bias"), gs.weight_update(worker.model):
        rebind(worker.model.lin.bias)  # the load check reads the narrowed ledger too


@pytest.mark.usefixtures("hold_graphs")
def test_control_before_the_first_forward_the_same_rebinding_refuses() -> None:
    worker = started()
    rebind(worker.model.emb)
    with pytest.raises(gs.StorageMovedError, match=r"\bemb\b"):
        worker.execute_model()


def test_only_the_first_forward_runs_under_the_recorder() -> None:
    worker = started()
    for _ in range(3):
        worker.execute_model()
    (mode, profile), *later = worker.seen
    assert isinstance(mode, StepReadTracker) and profile is not None  # control: it can be seen
    assert later == [(None, None), (None, None)]  # later steps cost what they did


def test_a_step_that_schedules_no_tokens_is_not_recorded() -> None:
    worker = started()
    att = gsv.attachment(worker.model)
    assert att is not None
    worker.execute_model(SimpleNamespace(total_num_scheduled_tokens=0))
    assert worker.seen[-1][0] is None and att.recording and not att.status()["read_set"]
    worker.execute_model(SimpleNamespace(total_num_scheduled_tokens=3))
    assert isinstance(worker.seen[-1][0], StepReadTracker) and att.status()["read_set"]


@pytest.mark.usefixtures("hold_graphs")
@pytest.mark.parametrize(
    "kw", [{"mode": Mode.VLLM_COMPILE}, {"traced": True}], ids=["compiled by config", "fx code"]
)
def test_a_compiled_engine_keeps_the_whole_model_checked(kw: dict[str, Any]) -> None:
    """Compiled by its config: never recorded. FX code that ran under the recorder anyway:
    no read set. Either way the rebinding the eager engine lets through refuses."""
    worker = started(**kw)
    att = gsv.attachment(worker.model)
    assert att is not None
    worker.execute_model()
    worker.execute_model()
    assert not att.recording
    assert (att.status()["read_set"], att.status()["checked"]) == (False, 4)
    rebind(worker.model.emb)
    with pytest.raises(gs.StorageMovedError, match=r"\bemb\b"):
        worker.execute_model()
    recorded = isinstance(worker.seen[0][0], StepReadTracker)
    assert recorded == ("traced" in kw)  # the FX forward ran under it; the compiled did not


def test_the_worker_config_decides_whether_the_forward_is_recorded() -> None:
    assert runs_op_by_op(Worker())
    assert not runs_op_by_op(Worker(mode=Mode.VLLM_COMPILE))
    graphs = Worker()
    graphs.vllm_config.compilation_config.cudagraph_mode = Mode.VLLM_COMPILE
    assert not runs_op_by_op(graphs)
    assert not runs_op_by_op(SimpleNamespace())  # no config: not known, not recorded


def test_the_worker_config_decides_whether_graphs_hold_the_addresses() -> None:
    assert not captures_graphs(Worker())  # cudagraph_mode NONE (enforce_eager)
    assert not captures_graphs(Worker(mode=Mode.VLLM_COMPILE))  # compiled, no graphs
    graphs = Worker()
    graphs.vllm_config.compilation_config.cudagraph_mode = Mode.VLLM_COMPILE
    # CUDA graphs on, and no vLLM platform to say it is the CPU build: assumed held.
    assert captures_graphs(graphs)
    assert captures_graphs(SimpleNamespace())  # no config: assumed held, moves refused


# A vLLM-style opaque op: one op to the dispatcher, whose kernel reaches a model tensor by
# name (vLLM's attention reads its layer's KV cache through the forward context).
_HIDDEN: dict[str, torch.Tensor] = {}


@torch.library.custom_op("vllm::graphsafe_test_hidden_read", mutates_args=())
def _hidden_read(x: torch.Tensor, name: str) -> torch.Tensor:
    return x + _HIDDEN[name].sum()


def test_an_opaque_vllm_op_without_a_forward_context_leaves_no_read_set() -> None:
    hidden, x = torch.ones(3), torch.zeros(3)
    _HIDDEN["kv"] = hidden
    with ReadTracker() as plain:
        torch.ops.vllm.graphsafe_test_hidden_read(x, "kv")
    # Control: the dispatcher shows the op, not what its kernel read.
    assert plain.reads is not None and storage_key(hidden) not in plain.reads
    with StepReadTracker() as rec:
        torch.ops.vllm.graphsafe_test_hidden_read(x, "kv")
    assert rec.opaque and rec.reads is None  # no vLLM forward context: not known


def test_the_names_vllm_resolves_are_the_package_objects() -> None:
    """vLLM imports the worker extension and the plugin entry point by qualified name."""
    mod, _, name = gsv.EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(mod), name) is gsv.WorkerExtension
    eps: Any = entry_points(group="vllm.general_plugins", name="graphsafe")
    if not eps:
        pytest.skip("graphsafe is not installed: no entry point to resolve")
    assert next(iter(eps)).load() is gsv.plugin


# -- a cache outside the model, read by an engine without graphs -----------------------

_PACKED: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
"""A kernel library's process-wide prepacked-weight cache, keyed by address and shape."""


class CachedModel(Model):
    """Its forward reads `lin`'s weight through the library's cache, packed on first use
    (the engine's warm-up): the model holds no packed copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        key = (w.data_ptr(), tuple(w.shape))
        if key not in _PACKED:
            _PACKED[key] = w.t().contiguous()
        return x @ _PACKED[key] + self.lin.bias


class CachedWorker(Worker):
    def __init__(self, *, repack: bool = False) -> None:
        super().__init__()
        self.model = CachedModel()
        self.repack = repack  # the loader writes the new packing into the cache too

    def compile_or_warm_up_model(self) -> None:
        with torch.no_grad():
            self.model(torch.zeros(4))  # the warm-up packs the weight

    def reload_weights(self, seed: int) -> None:
        super().reload_weights(seed)
        if self.repack:
            w = self.model.lin.weight
            _PACKED[(w.data_ptr(), tuple(w.shape))].copy_(w.t())

    def execute_model(self, scheduler_output: Any = None) -> torch.Tensor | None:
        with torch.no_grad():
            return self.model(self.input)


def _cached(*, instrumented: bool = True, repack: bool = False) -> CachedWorker:
    _PACKED.clear()
    worker = CachedWorker(repack=repack)
    if instrumented:
        gsv.instrument(worker, [registry])
    worker.load_model()
    worker.compile_or_warm_up_model()
    return worker


def _served(worker: CachedWorker, seed: int) -> torch.Tensor:
    weights = dict(checkpoint(seed))
    return worker.input @ weights["lin.weight"].t() + weights["lin.bias"]


def test_an_eager_engine_guards_a_cache_outside_the_model_its_first_forward_reads() -> None:
    worker = _cached()
    worker.execute_model()  # the first step: its reads narrow the guard
    (found,) = gs.runtime(worker.model).discovered
    assert found.path.startswith(f"<outside the model> {__name__}._PACKED[(")
    assert found.sources == ("lin.weight",)
    worker.reload_weights(1)  # in place: the cache keeps the old packing
    with pytest.raises(gs.StaleError, match=r"_PACKED\[\([\s\S]*lin\.weight"):
        worker.execute_model()


def test_control_uninstrumented_the_eager_engine_serves_the_cached_old_weight() -> None:
    worker = _cached(instrumented=False)
    worker.execute_model()
    worker.reload_weights(1)
    out = worker.execute_model()
    assert out is not None and not torch.allclose(out, _served(worker, 1))
    assert torch.allclose(out, worker.input @ dict(checkpoint(0))["lin.weight"].t()
                          + dict(checkpoint(1))["lin.bias"])


def test_an_eager_engine_whose_loader_repacks_the_cache_is_no_false_alarm() -> None:
    worker = _cached(repack=True)
    worker.execute_model()
    worker.reload_weights(1)
    out = worker.execute_model()
    assert out is not None and torch.allclose(out, _served(worker, 1))
