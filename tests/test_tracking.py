"""Write tracking at the dispatcher (`graphsafe._tracking`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from graphsafe._tracking import WriteTracker, storage_key


def _param() -> nn.Parameter:
    return nn.Parameter(torch.arange(6.0).reshape(2, 3))


def test_param_data_copy_is_seen_although_version_does_not_move() -> None:
    p = _param()
    version = p._version
    with WriteTracker({storage_key(p): "p"}) as tracker:
        p.data.copy_(torch.ones(2, 3))
    assert tracker.written == {storage_key(p)}
    assert torch.equal(p, torch.ones(2, 3))
    # Why graphsafe cannot track by version counter: this real write left it unchanged.
    assert p._version == version


def test_control_version_counter_moves_only_for_writes_through_the_parameter() -> None:
    # The same write through the parameter itself does bump the version: a tracker based
    # on `_version` would see this loader and miss the `.data.copy_` one above.
    p = _param()
    version = p._version
    with torch.no_grad():
        p.copy_(torch.ones(2, 3))
    assert p._version > version


WRITES: dict[str, Callable[[torch.Tensor], object]] = {
    "data.copy_": lambda t: t.data.copy_(torch.ones_like(t)),
    "mul_": lambda t: t.data.mul_(2.0),
    "zero_": lambda t: t.data.zero_(),
    "out=": lambda t: torch.add(t.data, 1.0, out=t.data),
    "index_assign": lambda t: t.data.__setitem__((0, 1), 7.0),
    "view_copy_": lambda t: t.data.view(-1)[2:4].copy_(torch.zeros(2)),
    "foreach": lambda t: torch._foreach_add_([t.data], 1.0),
    "init.normal_": lambda t: nn.init.normal_(t.data),
    "set_": lambda t: t.data.set_(torch.zeros(2, 3)),
}


@pytest.mark.parametrize("op", sorted(WRITES))
def test_every_kind_of_write_is_seen(op: str) -> None:
    p = _param()
    key = storage_key(p)
    with WriteTracker({key: "p"}) as tracker:
        WRITES[op](p)
    assert tracker.written == {key}


def test_reads_and_unwatched_writes_are_not_reported() -> None:
    p = _param()
    other = torch.zeros(2, 3)
    with WriteTracker({storage_key(p): "p"}) as tracker:
        _ = p.sum(), p + 1, p.clone(), p.t().contiguous()
        torch.add(p.detach(), 1.0, out=other)  # reads p, writes other
        other.mul_(3.0)
    assert tracker.written == set()


def test_control_the_same_writes_into_a_watched_tensor_are_reported() -> None:
    # Pairs the test above: the tracker is not simply blind.
    p = _param()
    other = torch.zeros(2, 3)
    with WriteTracker({storage_key(other): "other"}) as tracker:
        torch.add(p.detach(), 1.0, out=other)
    assert tracker.written == {storage_key(other)}


def test_on_write_runs_before_the_write_and_can_refuse_it() -> None:
    p = _param()
    before = p.detach().clone()
    seen: list[str] = []

    def refuse(key: int, op: str) -> None:
        seen.append(op)
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"), WriteTracker(
        {storage_key(p): "p"}, refuse
    ):
        p.data.mul_(10.0)
    assert torch.equal(p, before)
    assert seen and "mul_" in seen[0]


def test_control_without_on_write_the_write_happens() -> None:
    p = _param()
    with WriteTracker({storage_key(p): "p"}):
        p.data.mul_(10.0)
    assert torch.equal(p, torch.arange(6.0).reshape(2, 3) * 10.0)


def test_storage_key_is_shared_by_views_and_differs_between_storages() -> None:
    t = torch.zeros(4, 4)
    assert storage_key(t[1:, 2]) == storage_key(t) == storage_key(t.t())
    assert storage_key(t.clone()) != storage_key(t)
    assert storage_key(torch.empty(0)) == 0


def test_tracker_does_not_change_results() -> None:
    a = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with WriteTracker({storage_key(a): "a"}):
        inside = (a @ a.t()).softmax(-1)
    assert torch.equal(inside, (a @ a.t()).softmax(-1))
