"""The walk reaches every tensor a model keeps, the guard checks what the graph reads.

Each engine-style object below holds tensors a captured graph reads, off the module tree
(a kernel object on a non-Module `quant_method`, a quant-config dataclass, a
`functools.partial`, a closure, an attention impl, an MLA impl, a module in a plain
list). Rebuilding it after capture, as a post-load step does, must make the guarded
replay refuse with `StorageMovedError` naming the path; the control replays the same
capture unguarded and reads the old memory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import graphsafe as gs
from graphsafe import _native
from graphsafe._memory import walk as walk_module
from graphsafe._memory.ledger import Ledger
from graphsafe._memory.walk import Attr, walk, walk_tensors

C = 4


class Kernel:
    """A kernel object: a kernel-layout weight, a stride table, a workspace."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w_packed = w.t().contiguous()  # [C, C]
        self.strides = torch.tensor([C, 1])
        self.workspace = torch.zeros(C)


class QuantMethod:  # not an nn.Module, as vLLM's are not
    def __init__(self, w: torch.Tensor) -> None:
        self.kernel = Kernel(w)


@dataclasses.dataclass
class QuantConfig:
    scale: torch.Tensor


class AttnImpl:
    __slots__ = ("sinks",)

    def __init__(self, sinks: torch.Tensor) -> None:
        self.sinks = sinks.to(torch.float32)


class MLAImpl:
    def __init__(self, w: torch.Tensor) -> None:
        dequant = w.clone()  # a dequantized copy
        self.W_UV = dequant.t().contiguous()
        self.W_UK_T = dequant.contiguous()


def _lora(delta: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def apply(x: torch.Tensor) -> torch.Tensor:
        return x @ delta

    return apply


class Layer(nn.Module):
    """Reads its weight only through what `process_weights_after_loading` builds."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(C, C))
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        w = self.weight.detach()
        self.quant_method = QuantMethod(w)
        self.quant_config = QuantConfig(scale=w.abs().amax().reshape(1))
        self.kernel_fn = functools.partial(torch.matmul, w.t().contiguous())
        self.apply_lora = _lora(w * 0.5)
        self.impl = AttnImpl(w.sum(0))
        self.mla = MLAImpl(w)
        self.drafts = [nn.Linear(C, C)]  # a module kept in a plain list

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, C]
        k = self.quant_method.kernel
        y = x @ k.w_packed + k.workspace
        y = y * self.quant_config.scale
        y = y + self.kernel_fn(x.t()).t()
        y = y + self.apply_lora(x)
        y = y + self.impl.sinks
        y = y + x @ self.mla.W_UV + x @ self.mla.W_UK_T
        return y + self.drafts[0](x)


def _rebuild_kernel(m: Layer) -> None:
    m.quant_method = QuantMethod(m.weight.detach() * 2)


def _rebuild_config(m: Layer) -> None:
    m.quant_config = QuantConfig(scale=torch.full((1,), 3.0))


def _rebuild_partial(m: Layer) -> None:
    m.kernel_fn = functools.partial(torch.matmul, torch.randn(C, C))


def _rebuild_closure(m: Layer) -> None:
    m.apply_lora = _lora(torch.randn(C, C))


def _rebind_sinks(m: Layer) -> None:
    m.impl.sinks = torch.randn(C).to(torch.float32)  # vLLM PR #48251's FlashInfer bug


def _rebuild_mla(m: Layer) -> None:
    m.mla = MLAImpl(m.weight.detach() + 1)


def _rebuild_draft(m: Layer) -> None:
    m.drafts[0] = nn.Linear(C, C)


REBUILDS = [
    (_rebuild_kernel, "quant_method"),
    (_rebuild_config, "quant_config.scale"),
    (_rebuild_partial, "kernel_fn.args.0"),
    (_rebuild_closure, "apply_lora.<closure delta>"),
    (_rebind_sinks, "impl.sinks"),
    (_rebuild_mla, "mla"),
    (_rebuild_draft, "drafts.0"),
]


def test_the_walk_finds_every_tensor_the_layer_keeps() -> None:
    paths = {s.path for s in walk_tensors(Layer())}
    assert paths == {
        "weight", "quant_method.kernel.w_packed", "quant_method.kernel.strides",
        "quant_method.kernel.workspace", "quant_config.scale", "kernel_fn.args.0",
        "apply_lora.<closure delta>", "impl.sinks", "mla.W_UV", "mla.W_UK_T",
        "drafts.0.weight", "drafts.0.bias",
    }


def _capture(m: nn.Module, x: torch.Tensor, guard: bool) -> tuple[gs.Graph, torch.Tensor]:
    g = gs.Graph(backend="cpu", guard=m if guard else None)
    with torch.no_grad(), g.capture():
        y = m(x)
    return g, y


@pytest.mark.parametrize(("rebuild", "path"), REBUILDS, ids=[r.__name__ for r, _ in REBUILDS])
def test_an_object_rebuilt_after_capture_is_refused_by_name(
    rebuild: Callable[[Layer], None], path: str
) -> None:
    torch.manual_seed(0)
    m, x = Layer(), torch.randn(3, C)
    g, _ = _capture(m, x, guard=True)
    rebuild(m)
    with pytest.raises(gs.StorageMovedError, match=r"moved|replaced|rebound") as info:
        g.replay()
    assert path in {d.path for d in info.value.drifts}


@pytest.mark.parametrize(("rebuild", "path"), REBUILDS, ids=[r.__name__ for r, _ in REBUILDS])
def test_control_unguarded_replay_reads_the_old_objects(
    rebuild: Callable[[Layer], None], path: str
) -> None:
    torch.manual_seed(0)
    m, x = Layer(), torch.randn(3, C)
    g, y = _capture(m, x, guard=False)
    rebuild(m)
    g.replay()
    with torch.no_grad():
        assert not torch.allclose(y, m(x))  # stale: the graph still reads the old tensors


def test_writes_into_the_objects_tensors_are_no_drift() -> None:
    torch.manual_seed(0)
    m, x = Layer(), torch.randn(3, C)
    g, y = _capture(m, x, guard=True)
    with torch.no_grad():
        m.quant_method.kernel.w_packed.mul_(2)
        m.impl.sinks.add_(1)
    g.replay()
    with torch.no_grad():
        assert torch.allclose(y, m(x))


def test_an_object_replaced_by_one_holding_the_same_tensors_is_no_drift() -> None:
    m = Layer()
    ledger = Ledger.snapshot(m)
    old = m.quant_method
    new = QuantMethod.__new__(QuantMethod)
    new.kernel = old.kernel
    m.quant_method = new
    assert ledger.verify() == ()


def test_a_shared_object_is_entered_once_and_checked_at_every_reference() -> None:
    m = Layer()
    m.alias = m.quant_method  # a second reference to the same kernel object
    reach = walk(m)
    assert [s.path for s in reach.sites].count("quant_method.kernel.w_packed") == 1
    assert "alias" in {r.path for r in reach.refs}
    ledger = Ledger.snapshot(m)
    m.alias = QuantMethod(torch.zeros(C, C))
    assert "alias" in {d.path for d in ledger.verify()}


def test_cycles_end() -> None:
    m = Layer()
    a: list[object] = []
    a.append(a)
    m.loop = a
    m.quant_method.kernel.back = m.quant_method  # object cycle
    assert "quant_method.kernel.w_packed" in {s.path for s in walk_tensors(m)}


class _Runner:
    """Owns the model: a back-reference the walk does not enter."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.kv_cache = [torch.zeros(8)]
        self.input_ids = torch.zeros(4, dtype=torch.long)


class GroupCoordinator:
    def __init__(self) -> None:
        self.buffer = torch.zeros(4)


class _Lazy:
    def __init__(self) -> None:
        self.calls = 0

    @property
    def weight(self) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(1)


def test_what_the_walk_leaves_out() -> None:
    m = nn.Linear(2, 2)
    m.runner = _Runner(m)  # a back-reference into an engine's runner
    m.tp_group = GroupCoordinator()  # a process group wrapper
    m.lazy = _Lazy()  # properties are never called
    m.scale_cpu = 0.5  # a host scalar taken by value
    paths = {s.path for s in walk_tensors(m)}
    assert paths == {"weight", "bias"}
    assert m.lazy.calls == 0


def test_control_the_same_objects_are_walked_without_the_back_reference() -> None:
    m = nn.Linear(2, 2)
    runner = _Runner(nn.Linear(1, 1))  # owns another model: state like any other
    m.runner = runner
    assert "runner.kv_cache.0" in {s.path for s in walk_tensors(m)}


def test_a_stride_only_change_is_a_drift() -> None:
    """`.data = w.data.t()` of a square weight changes only its stride (same pointer,
    shape and dtype): the ledger must compare strides, on either path."""
    m = nn.Linear(4, 4, bias=False)
    x = torch.randn(2, 4)
    g, _ = _capture(m, x, guard=True)
    m.weight.data = m.weight.data.t()
    with pytest.raises(gs.StorageMovedError, match="stride") as info:
        g.replay()
    assert [(d.path, d.what) for d in info.value.drifts] == [("weight", "stride")]


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(C, C)
        self.b = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)  # the graph never reads `b`


def test_a_tensor_the_graph_never_reads_does_not_block_a_replay() -> None:
    m, x = TwoHeads(), torch.randn(2, C)
    g, _ = _capture(m, x, guard=True)
    m.b.weight.data = torch.zeros(C, C)  # rebound, but no graph reads it
    g.replay()
    assert g.reads is not None and m.a.weight.untyped_storage().data_ptr() in g.reads
    assert set(g.ledger.paths) == {"a.weight", "a.bias"}


def test_control_a_tensor_the_graph_reads_still_blocks() -> None:
    m, x = TwoHeads(), torch.randn(2, C)
    g, _ = _capture(m, x, guard=True)
    m.a.weight.data = torch.zeros(C, C)
    with pytest.raises(gs.StorageMovedError, match=r"a\.weight"):
        g.replay()


def test_graph_inputs_list_what_the_model_does_not_hold() -> None:
    m, x = TwoHeads(), torch.randn(2, C)
    cache = torch.zeros(2, C)
    g = gs.Graph(backend="cpu", guard=m)
    with torch.no_grad(), g.capture():
        y = m(x) + cache
    assert sorted(t.data_ptr() for t in g.inputs) == sorted([x.data_ptr(), cache.data_ptr()])
    assert y.shape == (2, C)


def _settable() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], None]]:
    t = torch.ones(C)

    def apply(x: torch.Tensor) -> torch.Tensor:
        return x + t

    def set_(new: torch.Tensor) -> None:
        nonlocal t
        t = new

    return apply, set_


class Held(nn.Module):
    """Tensors behind each kind of step the walk takes."""

    def __init__(self) -> None:
        super().__init__()
        self.apply_t, self.set_t = _settable()
        self.kw = functools.partial(torch.add, other=torch.ones(C))
        self.bound = AttnImpl(torch.ones(C)).__class__  # a class: nothing to enter
        self.defaults = _with_default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_t(x) + self.kw(x) + self.defaults(x)


def _with_default(x: torch.Tensor, w: torch.Tensor = torch.ones(C)) -> torch.Tensor:  # noqa: B008
    return x * w


def test_each_kind_of_step_is_walked_and_checked() -> None:
    m = Held()
    paths = {s.path for s in walk_tensors(m)}
    assert paths == {  # both closures hold the cell of `t`
        "apply_t.<closure t>", "set_t.<closure t>", "kw.keywords.other", "defaults.__defaults__.0",
    }
    g, _ = _capture(m, torch.randn(2, C), guard=True)
    m.set_t(torch.zeros(C))  # a closure cell rebound (nonlocal assignment)
    with pytest.raises(gs.StorageMovedError, match=r"apply_t\.<closure t>"):
        g.replay()


def _everywhere() -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that keeps a tensor in each of its places: a closure cell, a default,
    a keyword-only default and an attribute (a packed copy stashed on a kernel)."""
    cell = torch.ones(C)

    def fn(x: torch.Tensor, d: torch.Tensor = torch.ones(C),  # noqa: B008
           *, kw: torch.Tensor = torch.ones(C)) -> torch.Tensor:  # noqa: B008
        return x + cell + d + kw

    fn.packed = torch.ones(C)  # type: ignore[attr-defined]
    return fn


class Everywhere(nn.Module):
    """A function, and tensors in a dict in a tuple in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.fn = _everywhere()
        self.nested = [({"k": (torch.ones(1), 2.0)}, None)]


EVERYWHERE = {
    "fn.<closure cell>", "fn.__defaults__.0", "fn.__kwdefaults__.kw", "fn.packed",
    "nested.0.0.k.0",
}


def test_every_place_a_function_or_container_keeps_is_walked() -> None:
    m = Everywhere()
    assert {s.path for s in walk_tensors(m)} == EVERYWHERE
    reach = walk(m, lambda v: type(v) is float)
    assert {s.path for s in reach.sites} == EVERYWHERE
    assert [s.path for s in reach.values] == ["nested.0.0.k.1"]


def test_control_a_walk_that_skips_a_functions_attributes_fails_the_test_above(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = walk_module._function_children
    monkeypatch.setattr(walk_module, "_function_children",
                        lambda fn: [(k, v) for k, v in real(fn) if type(k) is not Attr])
    with _native.using(False), pytest.raises(AssertionError):  # the Python walk's step
        test_every_place_a_function_or_container_keeps_is_walked()


def test_control_a_rebound_closure_cell_is_read_stale_unguarded() -> None:
    m, x = Held(), torch.randn(2, C)
    g, y = _capture(m, x, guard=False)
    m.set_t(torch.zeros(C))
    g.replay()
    with torch.no_grad():
        assert not torch.allclose(y, m(x))


class OnParameter(nn.Module):
    """Keeps its kernel-layout copy on the parameter object, as engines keep quantization
    state, next to a loader function and plain numbers (vLLM's `weight_loader`,
    `output_dim`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(C, C))
        self.weight.weight_loader = self.load_one  # type: ignore[attr-defined]
        self.weight.output_dim = 0  # type: ignore[attr-defined]
        self.weight.packed = self.weight.detach().t().contiguous()  # type: ignore[attr-defined]

    def load_one(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, C]
        return x @ self.weight.packed  # type: ignore[no-any-return]


def test_a_parameters_own_attributes_are_walked_and_a_rebound_one_is_refused() -> None:
    torch.manual_seed(0)
    m, x = OnParameter(), torch.randn(2, C)
    assert [s.path for s in walk_tensors(m)] == ["weight", "weight.packed"]
    g, _ = _capture(m, x, guard=True)
    m.weight.packed = m.weight.detach().t().contiguous() * 2  # type: ignore[attr-defined]
    with pytest.raises(gs.StorageMovedError, match=r"weight\.packed") as info:
        g.replay()
    assert [(d.path, d.what) for d in info.value.drifts] == [("weight.packed", "storage")]


def test_control_a_rebound_attribute_of_a_parameter_is_read_stale_unguarded() -> None:
    torch.manual_seed(0)
    m, x = OnParameter(), torch.randn(2, C)
    g, y = _capture(m, x, guard=False)
    m.weight.packed = m.weight.detach().t().contiguous() * 2  # type: ignore[attr-defined]
    g.replay()
    with torch.no_grad():
        assert not torch.allclose(y, m(x))


def test_the_model_map_of_parameters_holding_attributes_holds_until_one_is_rebound() -> None:
    from graphsafe._runtime.bind.model_map import ModelMap

    m = OnParameter()
    found = ModelMap(m)
    assert found.holds()  # no walk again before each load: nothing changed
    assert found.by_path.keys() == {"weight", "weight.packed"}
    assert found.weights == ("weight",)  # what the parameter holds is no weight
    m.weight.scale = torch.ones(1)  # type: ignore[attr-defined]  # a new attribute
    assert not found.holds()
    again = ModelMap(m)
    m.weight.packed = torch.zeros(C, C)  # type: ignore[attr-defined]
    assert not again.holds()
