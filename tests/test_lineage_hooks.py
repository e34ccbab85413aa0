"""What a recording sees above the dispatcher (`graphsafe._lineage.record.hooks`): the numbers a
thread that records takes, through hooks on a few tensor methods, never a function mode
over every call; nothing of the threads that do not record; the methods put back after."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from torch._ops import OpOverload, OpOverloadPacket

from graphsafe._lineage import record_lineage
from graphsafe._lineage.record.hooks import Hooks
from graphsafe._lineage.record.recorder import sid_of

_METHODS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy",
            "__array__")


def _sites() -> dict[str, object]:
    """What each hooked site is now: the class's own attribute, or absent."""
    out = {f"Tensor.{n}": torch.Tensor.__dict__.get(n) for n in _METHODS}
    out["OpOverload.__call__"] = OpOverload.__dict__.get("__call__")
    out["OpOverloadPacket.__call__"] = OpOverloadPacket.__dict__.get("__call__")
    out["Module.register_parameter"] = torch.nn.Module.__dict__.get("register_parameter")
    return out


def _taken(lineage: object, value: object) -> bool:
    return id(value) in lineage.values  # type: ignore[attr-defined]


def test_a_recording_runs_no_function_mode_and_sees_the_numbers_its_thread_takes() -> None:
    w = torch.full((2,), 3.5)
    with record_lineage() as lin:
        assert not torch.overrides._get_current_function_mode_stack()
        scale = w[0].item()
        firsts = w.tolist()
    assert _taken(lin, scale)
    assert all(_taken(lin, x) for x in firsts)
    (call, _), = lin.values[id(scale)]
    assert call.args[0].sid == sid_of(w)


def test_control_a_number_taken_outside_the_recording_is_not_in_it() -> None:
    w = torch.full((2,), 3.5)
    before = w[0].item()
    with record_lineage() as lin:
        pass
    after = w[1].item()
    assert not _taken(lin, before) and not _taken(lin, after)


def test_a_thread_that_does_not_record_takes_numbers_unseen_while_another_records() -> None:
    """The hooks are class-wide while any thread records; they act only for threads whose
    recorder stack is not empty (a server thread that existed before the recording)."""
    w = torch.full((2,), 7.25)
    asks: queue.Queue[torch.Tensor | None] = queue.Queue()
    answers: queue.Queue[float] = queue.Queue()

    def serve() -> None:
        while (t := asks.get()) is not None:
            answers.put(t.item())

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with record_lineage() as lin:
            assert Hooks.installed() and Hooks.recording()
            asks.put(w[0])
            theirs = answers.get(timeout=10)
            mine = w[1].item()
    finally:
        asks.put(None)
        server.join(10)
    assert theirs == mine == 7.25
    assert not _taken(lin, theirs)
    assert _taken(lin, mine)  # control: the recording thread's own number is seen


def test_the_hooked_methods_are_put_back_when_the_last_recording_ends() -> None:
    untouched = _sites()
    w = torch.ones(())
    with record_lineage():
        with record_lineage():
            hooked = _sites()
        still = _sites()  # the inner one's end keeps them for the outer
    assert still == hooked
    assert all(hooked[k] is not untouched[k] for k in untouched)
    assert _sites() == untouched
    with pytest.raises(RuntimeError, match="boom"), record_lineage():
        w.item()
        raise RuntimeError("boom")
    assert _sites() == untouched
    assert not Hooks.installed() and not Hooks.recording()


def test_a_hook_another_library_set_over_one_while_recording_is_left_in_place() -> None:
    untouched = torch.Tensor.__dict__.get("item")
    theirs_seen: list[object] = []
    with record_lineage() as lin:
        ours = torch.Tensor.item

        def theirs(self: torch.Tensor) -> object:
            out = ours(self)
            theirs_seen.append(out)
            return out

        torch.Tensor.item = theirs  # type: ignore[method-assign,assignment]
        x = torch.ones(()).item()
    try:
        assert torch.Tensor.item is theirs
        assert _taken(lin, x)
        torch.ones(()).item()  # ours, under theirs, passes through: nothing records
        assert len(theirs_seen) == 2
    finally:
        if untouched is None:
            del torch.Tensor.item
        else:
            torch.Tensor.item = untouched  # type: ignore[method-assign]
