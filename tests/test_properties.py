"""Properties over random models: random leaf tensors and random derivation DAGs.

A model has K leaf tensors (parameters, buffers, plain attributes, parameters of a child
module) and a DAG of derivations, each a sum, product or scaled sum of a random subset
of the leaves and earlier outputs, clamped to stay finite; some take `out=` (fast path),
some do not (slow path), some take `out=` but return a new tensor, some have two outputs.
After any sequence of loads (full, partial, bucketed in `weight_update`, direct writes
followed by `refresh(changed=...)`) every derived buffer must equal a recomputation from
the current leaves with the same ops (bit for bit), keep its storage identity, and the
derivations recomputed must be exactly those downstream of what was written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import identity, resolve, write
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import graphsafe as gs

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
LEAF_KINDS = ("param", "buffer", "attr", "child")
OPS = ("sum", "prod", "scaled")
MODES = ("fast", "slow", "ignores_out")
BOUND = 8.0


@dataclass(frozen=True)
class Node:
    """One derivation of the random DAG."""

    index: int
    inputs: tuple[int, ...]  # indices into `Dag.paths`
    op: str
    mode: str
    multi: bool


@dataclass(frozen=True)
class Dag:
    leaves: tuple[str, ...]  # leaf kinds
    nodes: tuple[Node, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def leaf_paths(self) -> tuple[str, ...]:
        prefix = {"param": "p", "buffer": "b", "attr": "a", "child": "child.c"}
        return tuple(f"{prefix[kind]}{i}" for i, kind in enumerate(self.leaves))

    def outputs(self, node: Node) -> tuple[str, ...]:
        return (f"d{node.index}", f"e{node.index}") if node.multi else (f"d{node.index}",)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every tensor a derivation may read: leaves, then outputs in order."""
        return self.leaf_paths + tuple(o for n in self.nodes for o in self.outputs(n))

    def downstream(self, written: set[str]) -> set[int]:
        """Indices of the nodes that read, directly or not, any of `written`."""
        dirty_paths = set(written)
        hit: set[int] = set()
        for n in self.nodes:  # already in dependency order
            if any(self.paths[i] in dirty_paths for i in n.inputs):
                hit.add(n.index)
                dirty_paths.update(self.outputs(n))
        return hit


@st.composite
def dags(draw: st.DrawFn) -> Dag:
    k = draw(st.integers(1, 4))
    leaves = tuple(draw(st.sampled_from(LEAF_KINDS)) for _ in range(k))
    available = k
    nodes = []
    for index in range(draw(st.integers(1, 5))):
        inputs = draw(
            st.lists(
                st.integers(0, available - 1), min_size=1, max_size=min(3, available), unique=True
            )
        )
        node = Node(
            index=index,
            inputs=tuple(inputs),
            op=draw(st.sampled_from(OPS)),
            mode=draw(st.sampled_from(MODES)),
            multi=draw(st.booleans()),
        )
        nodes.append(node)
        available += 2 if node.multi else 1
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    return Dag(leaves, tuple(nodes), shape, draw(st.sampled_from(DTYPES)))


def _combine(op: str, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Everything but the final clamp (which the fast path writes with `out=`)."""
    acc = xs[0] * 0.5 if op == "scaled" else xs[0]
    for x in xs[1:]:
        acc = acc * x if op == "prod" else acc + x
    return acc


def reference(op: str, xs: Sequence[torch.Tensor], multi: bool) -> tuple[torch.Tensor, ...]:
    r = _combine(op, xs).clamp(-BOUND, BOUND)
    return (r, torch.neg(r)) if multi else (r,)


def _derivation(node: Node, calls: Counter[int]) -> Callable[..., Any]:
    def apart(xs: Sequence[torch.Tensor]) -> Any:
        rs = reference(node.op, xs, node.multi)
        return rs if node.multi else rs[0]

    if node.mode == "slow":

        def slow(self: nn.Module, *xs: torch.Tensor) -> Any:
            calls[node.index] += 1
            return apart(xs)

        return slow

    def fast(self: nn.Module, *xs: torch.Tensor, out: Any = None) -> Any:
        calls[node.index] += 1
        if out is None or node.mode == "ignores_out":
            return apart(xs)
        acc = _combine(node.op, xs)
        if node.multi:
            torch.clamp(acc, -BOUND, BOUND, out=out[0])
            torch.neg(out[0], out=out[1])
            return out
        return torch.clamp(acc, -BOUND, BOUND, out=out)

    return fast


def build(dag: Dag, registry: gs.Registry) -> tuple[nn.Module, Counter[int]]:
    """A fresh model class for `dag` (registered in `registry`) and one instance."""
    calls: Counter[int] = Counter()

    def __init__(self: nn.Module) -> None:
        nn.Module.__init__(self)
        self.child = nn.Module()
        for i, kind in enumerate(dag.leaves):
            t = torch.zeros(dag.shape, dtype=dag.dtype)
            if kind == "param":
                setattr(self, f"p{i}", nn.Parameter(t))
            elif kind == "buffer":
                self.register_buffer(f"b{i}", t)
            elif kind == "attr":
                setattr(self, f"a{i}", t)
            else:
                setattr(self.child, f"c{i}", nn.Parameter(t))

    def load_weights(self: nn.Module, entries: Sequence[tuple[str, torch.Tensor]]) -> None:
        for path, value in entries:
            write(self, path, value)

    namespace: dict[str, Any] = {"__init__": __init__, "load_weights": load_weights}
    for node in dag.nodes:
        inputs = [dag.paths[i] for i in node.inputs]
        namespace[f"_derive{node.index}"] = gs.derive(dag.outputs(node), inputs=inputs)(
            _derivation(node, calls)
        )
    cls = gs.graphsafe(registry=registry)(type("DagModel", (nn.Module,), namespace))
    return cls(), calls


def expected(model: nn.Module, dag: Dag) -> dict[str, torch.Tensor]:
    values = {p: resolve(model, p).detach() for p in dag.leaf_paths}
    with torch.no_grad():
        for node in dag.nodes:
            xs = [values[dag.paths[i]] for i in node.inputs]
            for name, r in zip(dag.outputs(node), reference(node.op, xs, node.multi)):
                values[name] = r
    return values


def values_for(dag: Dag, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Halves of small integers: exact in every dtype tested, so products stay exact.
    return (torch.randint(-4, 5, dag.shape, generator=g) * 0.5).to(dag.dtype)


# One step of a weight sync: (kind, leaves written (bitmask), seed of the values).
STEP = st.tuples(
    st.sampled_from(("load", "bucketed", "refresh", "refresh_changed")),
    st.lists(st.integers(0, 15), min_size=1, max_size=3),
    st.integers(0, 2**16),
)


def _pick(dag: Dag, mask: int) -> list[str]:
    return [p for i, p in enumerate(dag.leaf_paths) if mask >> i & 1]


def _check(model: nn.Module, dag: Dag, rt: gs.Runtime, ids: dict[str, Any]) -> None:
    for name, value in expected(model, dag).items():
        got = resolve(model, name)
        assert torch.equal(got, value), name
        if name in ids:
            assert identity(got) == ids[name], name
            assert not got.requires_grad
    assert rt.stale == ()


@given(dag=dags(), steps=st.lists(STEP, min_size=1, max_size=5), first=st.integers(0, 15))
def test_buffers_equal_a_fresh_recompute_and_keep_their_storage(
    dag: Dag, steps: list[tuple[str, list[int], int]], first: int
) -> None:
    registry = gs.Registry()
    model, calls = build(dag, registry)
    rt = gs.runtime(model, registry)
    derived = [o for n in dag.nodes for o in dag.outputs(n)]
    all_nodes = Counter({n.index: 1 for n in dag.nodes})

    model.load_weights([(p, values_for(dag, first + i)) for i, p in enumerate(_pick(dag, first))])
    assert calls == all_nodes  # the first load materializes everything, once
    ids = {name: identity(resolve(model, name)) for name in derived}
    assert not any(name in model.state_dict() for name in derived)
    _check(model, dag, rt, ids)

    for kind, masks, seed in steps:
        calls.clear()
        if kind == "load":
            written = _pick(dag, masks[0])
            model.load_weights([(p, values_for(dag, seed + i)) for i, p in enumerate(written)])
            assert calls == Counter({i: 1 for i in dag.downstream(set(written))})
        elif kind == "bucketed":
            touched: set[str] = set()
            with gs.weight_update(model):
                for b, mask in enumerate(masks):
                    bucket = _pick(dag, mask)
                    touched.update(bucket)
                    model.load_weights([(p, values_for(dag, seed + b)) for p in bucket])
                    assert calls == Counter()  # nothing refreshed mid-update
            assert calls == Counter({i: 1 for i in dag.downstream(touched)})
        elif kind == "refresh":
            report = rt.refresh()
            assert calls == all_nodes
            assert set(report.refreshed) == {dag.outputs(n)[0] for n in dag.nodes}
        else:
            written = _pick(dag, masks[0])
            for i, p in enumerate(written):
                write(model, p, values_for(dag, seed + i))
            rt.refresh(changed=written)
            assert calls == Counter({i: 1 for i in dag.downstream(set(written))})
        _check(model, dag, rt, ids)


@given(dag=dags(), seed=st.integers(0, 2**16))
def test_refresh_is_idempotent(dag: Dag, seed: int) -> None:
    registry = gs.Registry()
    model, _ = build(dag, registry)
    rt = gs.runtime(model, registry)
    model.load_weights([(p, values_for(dag, seed + i)) for i, p in enumerate(dag.leaf_paths)])
    derived = [o for n in dag.nodes for o in dag.outputs(n)]
    first = {name: resolve(model, name).clone() for name in derived}
    for _ in range(2):
        rt.refresh()
        for name in derived:
            assert torch.equal(resolve(model, name), first[name]), name


@given(dag=dags(), seed=st.integers(0, 2**16))
def test_the_report_names_exactly_the_slow_path_derivations(dag: Dag, seed: int) -> None:
    # A function without `out`, or one that takes `out` but returns a new tensor, is
    # computed apart and copied in: the report must say so, on every refresh.
    registry = gs.Registry()
    model, _ = build(dag, registry)
    rt = gs.runtime(model, registry)
    model.load_weights([])
    slow = {dag.outputs(n)[0] for n in dag.nodes if n.mode != "fast"}
    for i in range(2):
        write(model, dag.leaf_paths[0], values_for(dag, seed + i))
        report = rt.refresh()
        assert set(report.slow_path) == slow
        fast = {e.path for e in report.entries if e.path_taken == "fast"}
        assert fast == {dag.outputs(n)[0] for n in dag.nodes} - slow


@pytest.mark.parametrize("mode", MODES)
def test_control_a_rebinding_runtime_fails_the_storage_property(mode: str) -> None:
    # The property above is able to fail: replace a derived buffer by a new tensor with
    # the right values (what a naive post-load hook does) and `_check` rejects it.
    dag = Dag(("param",), (Node(0, (0,), "scaled", mode, False),), (3,), torch.float32)
    registry = gs.Registry()
    model, _ = build(dag, registry)
    rt = gs.runtime(model, registry)
    model.load_weights([("p0", values_for(dag, 1))])
    ids = {"d0": identity(model.d0)}
    _check(model, dag, rt, ids)
    model.d0 = model.d0.clone()
    with pytest.raises(AssertionError, match="d0"):
        _check(model, dag, rt, ids)


def test_control_a_stale_buffer_fails_the_value_property() -> None:
    dag = Dag(("param",), (Node(0, (0,), "sum", "fast", False),), (3,), torch.float32)
    registry = gs.Registry()
    model, _ = build(dag, registry)
    rt = gs.runtime(model, registry)
    model.load_weights([("p0", values_for(dag, 1))])
    ids = {"d0": identity(model.d0)}
    write(model, "p0", values_for(dag, 2))  # outside any load: not refreshed
    with pytest.raises(AssertionError, match="d0"):
        _check(model, dag, rt, ids)


def test_downstream_of_the_model_under_test() -> None:
    # The oracle for "exactly what is downstream" is itself right on a known DAG.
    dag = Dag(
        ("param", "attr", "child"),
        (
            Node(0, (0,), "sum", "fast", True),  # d0, e0 <- p0
            Node(1, (4, 1), "prod", "slow", False),  # d1 <- e0, a1
            Node(2, (2,), "scaled", "fast", False),  # d2 <- child.c2
        ),
        (2,),
        torch.float32,
    )
    assert dag.paths == ("p0", "a1", "child.c2", "d0", "e0", "d1", "d2")
    assert dag.downstream({"p0"}) == {0, 1}
    assert dag.downstream({"a1"}) == {1}
    assert dag.downstream({"child.c2"}) == {2}
    assert dag.downstream(set()) == set()
