"""The worker side of the engine tests: a worker extension and a weight-transfer backend.

`Extension` is what an RL framework's worker extension does through `collective_rpc`;
`InprocEngine` is a weight-transfer backend for one process on a CPU (vLLM's own `ipc`
and `nccl` backends need CUDA): the tensors travel by reference.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.layers.linear import QKVParallelLinear

import graphsafe as gs
from graphsafe.integrations import vllm as gsv


def _layerwise() -> tuple[Any, Any]:
    from vllm.model_executor.model_loader import reload

    return reload.initialize_layerwise_reload, reload.finalize_layerwise_reload


class Extension(gsv.WorkerExtension):
    """Methods the tests call with `llm.collective_rpc(name, args=...)`."""

    def t_load(self, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
        """An update through `model.load_weights`, inside vLLM's layerwise reload (its CPU
        backend packs weights after loading, so a bare load cannot write them again)."""
        model = self.model_runner.get_model()
        initialize, finalize = _layerwise()
        initialize(model)
        loaded = model.load_weights(weights=weights)
        finalize(model, self.model_config)
        return sorted(loaded)

    def t_tensors(self) -> dict[str, tuple[int, int]]:
        """Object identity and address of every parameter and buffer."""
        model = self.model_runner.get_model()
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return {n: (id(t), t.data_ptr()) for n, t in tensors}

    def t_shapes(self) -> dict[str, tuple[str, list[int]]]:
        """Dtype and shape of every parameter and buffer."""
        model = self.model_runner.get_model()
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors}

    def t_derived(self) -> dict[str, torch.Tensor]:
        model = self.model_runner.get_model()
        return {
            n: m.qkv_weight_t.clone()
            for n, m in model.named_modules()
            if isinstance(m, QKVParallelLinear)
        }

    def t_derived_lists(self) -> dict[str, list[Any]]:
        """`t_derived` as nested lists: tensors do not cross processes in an RPC's result."""
        return {n: t.tolist() for n, t in self.t_derived().items()}

    def t_rebind(self, name: str) -> None:
        """`param.data = new`: the rebinding a captured graph never sees."""
        p = self.model_runner.get_model().get_parameter(name)
        p.data = p.data.clone()

    def t_scale_in_place(self, name: str) -> None:
        """An in-place write outside any update: the derived buffers it feeds go stale."""
        with torch.no_grad():
            self.model_runner.get_model().get_parameter(name).mul_(2)

    def t_rebind_in_update(self, name: str) -> None:
        model = self.model_runner.get_model()
        with gs.weight_update(model):
            p = model.get_parameter(name)
            p.data = p.data.clone()

    def t_replace_module_in_update(self, name: str) -> None:
        """Bind a copy of the submodule `name` in its place, inside an update."""
        model = self.model_runner.get_model()
        parent, _, key = name.rpartition(".")
        with gs.weight_update(model):
            setattr(model.get_submodule(parent), key, copy.deepcopy(model.get_submodule(name)))

    def t_stash(self, name: str, source: str) -> None:
        """Keep a copy of a parameter on the model as a plain attribute, as an RL
        framework's extension may (a reference for a KL penalty): no forward reads it."""
        model = self.model_runner.get_model()
        setattr(model, name, model.get_parameter(source).detach().clone())

    def t_rebind_stash(self, name: str, in_update: bool = False) -> None:
        """Bind a new tensor under the attribute `t_stash` made (inside an update, or not)."""
        model = self.model_runner.get_model()
        with gs.weight_update(model) if in_update else contextlib.nullcontext():
            setattr(model, name, getattr(model, name).clone())


@dataclass
class InprocInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class InprocUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)


class InprocEngine(WeightTransferEngine[InprocInitInfo, InprocUpdateInfo]):
    init_info_cls = InprocInitInfo
    update_info_cls = InprocUpdateInfo

    def init_transfer_engine(self, init_info: InprocInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:  # as vLLM's ipc and nccl backends do
        _layerwise()[0](self.model)

    def receive_weights(self, update_info: InprocUpdateInfo) -> None:
        self.model.load_weights(list(zip(update_info.names, update_info.tensors)))

    def finish_weight_update(self) -> None:
        _layerwise()[1](self.model, self.model_config)

    def shutdown(self) -> None:
        pass


if "inproc" not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine("inproc", __name__, "InprocEngine")
