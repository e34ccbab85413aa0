"""Random interleavings of loads, refreshes, captures and replays (hypothesis stateful).

Invariant: a guarded replay either equals eager on the current weights, computed from
the parameters alone, or raises a named graphsafe error; never a silent stale result.
And it must not refuse when nothing went wrong. Set HYPOTHESIS_PROFILE=long for a long
run.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch import nn

import graphsafe as gs

N, C, MIX = 3, 5, 6


@gs.graphsafe
class Block(nn.Module):
    """A first-layer-like block: a per-stream sum (fast path) feeding a scaled copy
    (slow path, no `out=`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fn = nn.Parameter(torch.randn(MIX, N * C), requires_grad=False)
        self.scale = nn.Parameter(torch.rand(MIX), requires_grad=False)

    @gs.derive("fn_sum", inputs=["fn"])
    def _fn_sum(self, fn, *, out=None):
        return torch.sum(fn.view(MIX, N, C), dim=1, out=out)

    @gs.derive("fn_scaled", inputs=["fn_sum", "scale"])
    def _fn_scaled(self, fn_sum, scale):
        return fn_sum * scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.fn_scaled.t())  # [T, MIX]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        scaled = self.fn.view(MIX, N, C).sum(1) * self.scale[:, None]
        return torch.tanh(x @ scaled.t())


@gs.graphsafe
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.proj = nn.Parameter(torch.randn(C, MIX), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b(x) for b in self.blocks) @ self.proj.t()  # [T, C]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return sum(b.reference(x) for b in self.blocks) @ self.proj.t()

    def load_weights(self, weights, *, rebind: bool = False) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "boom":
                raise RuntimeError("weight transfer failed midway")
            p = params[name]
            if p.shape != w.shape:
                raise ValueError(f"{name}: expected {tuple(p.shape)}, got {tuple(w.shape)}")
            if rebind:
                p.data = w.clone()  # the pre-fix loader: binds new storage
            else:
                p.data.copy_(w)


NAMES = [name for name, _ in Net().named_parameters()]


def _checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    net = Net()
    return [(n, torch.randn(p.shape, generator=g)) for n, p in net.named_parameters()]


class RefitMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.net = Net()
        self.net.load_weights(_checkpoint(seed))
        self.x = torch.randn(4, C)
        self.graph: gs.Graph | None = None
        self.out: torch.Tensor | None = None
        self.broken = False  # a tensor was rebound after the current graph was captured
        self.failed = False  # the last update raised: weights are half-loaded
        self.replays_ok = 0
        self.capture()

    def _load(self, weights, *, rebind: bool = False, should_fail: bool = False) -> None:
        try:
            self.net.load_weights(weights, rebind=rebind)
        except gs.GraphSafetyError:
            # After pin(), a rebinding loader is refused with a named error.
            assert self.broken or rebind
            return
        except (ValueError, RuntimeError):
            assert should_fail
            self.failed = True
            return
        assert not should_fail
        self.failed = False

    def _mark_rebind(self) -> None:
        if self.graph is not None:
            self.broken = True

    @rule(seed=st.integers(0, 2**16))
    def load_full(self, seed: int) -> None:
        self._load(_checkpoint(seed))

    @rule(seed=st.integers(0, 2**16), keep=st.sets(st.sampled_from(NAMES), min_size=1))
    def load_partial(self, seed: int, keep: set[str]) -> None:
        self._load([e for e in _checkpoint(seed) if e[0] in keep])

    @rule(seed=st.integers(0, 2**16), cuts=st.lists(st.integers(1, len(NAMES) - 1), max_size=3))
    def load_bucketed(self, seed: int, cuts: list[int]) -> None:
        ck = _checkpoint(seed)
        edges = [0, *sorted(set(cuts)), len(ck)]
        try:
            with gs.weight_update(self.net):
                for a, b in pairwise(edges):
                    self.net.load_weights(ck[a:b])
        except gs.GraphSafetyError:
            assert self.broken
            return
        self.failed = False

    @rule(seed=st.integers(0, 2**16), at=st.integers(0, len(NAMES)))
    def load_wrong_shape(self, seed: int, at: int) -> None:
        ck = _checkpoint(seed)
        ck.insert(at, (NAMES[0], torch.zeros(2, 2)))
        self._load(ck, should_fail=True)

    @rule(seed=st.integers(0, 2**16), at=st.integers(0, len(NAMES)))
    def load_raising_midway(self, seed: int, at: int) -> None:
        ck = _checkpoint(seed)
        ck.insert(at, ("boom", torch.zeros(1)))
        self._load(ck, should_fail=True)

    @rule(seed=st.integers(0, 2**16), name=st.sampled_from(NAMES))
    def load_rebinding(self, seed: int, name: str) -> None:
        self._mark_rebind()
        self._load([e for e in _checkpoint(seed) if e[0] == name], rebind=True)

    @rule()
    def refresh(self) -> None:
        try:
            gs.runtime(self.net).refresh()
        except gs.StorageMovedError:
            assert self.broken

    @rule()
    def capture(self) -> None:
        rt = gs.runtime(self.net)
        if self.graph is not None:
            self.graph.reset()  # releases its pin: a new capture takes the storage as it is now
        rt.refresh()
        self.graph = gs.Graph(backend="cpu", guard=self.net)
        with torch.no_grad(), self.graph.capture():
            self.out = self.net(self.x)
        self.broken = False

    @rule(seed=st.integers(0, 2**16))
    def new_static_input(self, seed: int) -> None:
        self.x.copy_(torch.randn(self.x.shape, generator=torch.Generator().manual_seed(seed)))

    @precondition(lambda self: self.graph is not None)
    @rule()
    def replay(self) -> None:
        assert self.graph is not None and self.out is not None
        try:
            self.graph.replay()
        except (gs.StorageMovedError, gs.StaleError):
            assert self.broken or self.failed, "the guard refused a healthy replay"
            return
        assert not (self.broken or self.failed), "a stale replay was not refused"
        with torch.no_grad():
            torch.testing.assert_close(self.out, self.net.reference(self.x))
        self.replays_ok += 1

    @invariant()
    def buffers_never_carry_autograd_history(self) -> None:
        for block in self.net.blocks:
            for name in ("fn_sum", "fn_scaled"):
                t = getattr(block, name, None)
                assert t is None or not t.requires_grad


class UnguardedMachine(RefitMachine):
    """The same machine with graphs captured without a guard: the control."""

    @rule()
    def capture(self) -> None:
        gs.runtime(self.net).refresh()
        self.graph = gs.Graph(backend="cpu")
        with torch.no_grad(), self.graph.capture():
            self.out = self.net(self.x)
        self.broken = False


# Three times the profile's examples: this is the test that ties everything together.
STEPS = settings(settings(), stateful_step_count=30, max_examples=3 * settings().max_examples)
TestRefitMachine = RefitMachine.TestCase
TestRefitMachine.settings = STEPS


def test_control_without_the_guard_a_stale_replay_is_found():
    with pytest.raises(AssertionError, match=r"stale replay was not refused|not close"):
        run_state_machine_as_test(
            UnguardedMachine, settings=settings(STEPS, max_examples=200, database=None)
        )
