"""The parts of `graphsafe.integrations.vllm` that need no vLLM, on plain torch models.

The integration against vLLM's real engine and classes is tested in `tests_vllm/`
(`scripts/test-vllm`, run by CI in an environment with vLLM's CPU build).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe.integrations import vllm as gsv

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
        "last_refresh_bytes": 48,
    }


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


class Worker:
    """vLLM-shaped worker: the methods `instrument` wraps, over a `Model`."""

    def __init__(self) -> None:
        self.model = Model()
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)

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

    def execute_model(self) -> torch.Tensor:
        return self.model.lin(torch.ones(4))


def started(instrumented: bool = True) -> Worker:
    worker = Worker()
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


def test_the_names_vllm_resolves_are_the_package_objects() -> None:
    """vLLM imports the worker extension and the plugin entry point by qualified name."""
    mod, _, name = gsv.EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(mod), name) is gsv.WorkerExtension
    eps: Any = entry_points(group="vllm.general_plugins", name="graphsafe")
    if not eps:
        pytest.skip("graphsafe is not installed: no entry point to resolve")
    assert next(iter(eps)).load() is gsv.plugin
