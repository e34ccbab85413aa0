"""The built library's self-check: before a process trusts the compiled checks, each gives
on a few tensors the answers the Python path gives (the flat checks, the remembered dict
sites, the trackers' taint, the observer, the strays hook, the recorder, the
fingerprint), or the
library is refused and the Python path runs."""

from __future__ import annotations

import _thread
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

__all__ = ["check", "only_thread"]


def only_thread() -> bool:
    """Whether this is the only thread Python knows of: the observer's kernels are taken
    back only then (no other thread can be running an op through one; see kernels.cpp)."""
    return threading.active_count() == 1


def check(module: Any) -> bool:
    """Whether the library gives the answers the Python path gives (else it is refused).
    Outside inference mode, wherever the first use is: its tensors need versions."""
    with torch.inference_mode(False):
        return _check(module)


def _check(module: Any) -> bool:
    a, b = torch.zeros(2, 3), torch.zeros(3)
    geo = module.geometry([a, b])
    ok = isinstance(geo, bytes) and module.same_geometry([a, b], geo)
    a.data = a.data.t()  # same storage, new strides: must show
    ok = ok and not module.same_geometry([a, b], geo)
    d = {"w": b}
    seen = bytearray(40)
    for _ in range(2):  # the second from what the first found
        ok = ok and module.same_witnesses([d], ["w"], [id(b)], [b.data_ptr()], [b._version], seen)
    b.add_(1)
    ok = ok and not module.same_witnesses(
        [d], ["w"], [id(b)], [b.data_ptr()], [b._version - 1], seen)
    ok = ok and module.same_items([d], ["w"], [b], bytearray(16))
    ok = ok and not module.same_items([d], ["w"], [a], bytearray(16))
    ok = ok and _dict_tag_check(module) and _steps_check(module, a, b)
    got = module.same_bindings([d], ["w"], [id(b)], [b.data_ptr()], [b.stride()])
    ok = ok and got == [b] and got[0] is b
    ok = ok and module.same_bindings([d], ["w"], [id(b)], [b.data_ptr()], [(2,)]) is None
    bound = bytearray(72)
    for _ in range(2):  # the second from what the first found
        ok = ok and module.same_bindings(
            [d], ["w"], [id(b)], [b.data_ptr()], [b.stride()], bound) == [b]
    ok = ok and _remembered_check(module)
    ids, ptrs, versions, keys = [0, 0], [0, 0], [0, 0], [0, 0]
    ok = ok and module.take_witnesses(  # site 1 holds nothing: left to the Python path
        [d, {}], ["w", "w"], [0, 1], ids, ptrs, versions, keys) == [1]
    ok = ok and [ids, ptrs, versions, keys] == [
        [id(b), 0], [b.data_ptr(), 0], [b._version, 0], [b.untyped_storage().data_ptr(), 0]]
    c = torch.zeros(4)
    tracker = module.tracker_new([b.untyped_storage().data_ptr(), c.untyped_storage().data_ptr()])
    module.tracker_sequence((tracker, [b.untyped_storage().data_ptr()]))
    module.tracker_push(tracker)
    try:
        with torch.no_grad():
            b.mul_(2)
            a.add_(1)  # not watched
            b.copy_(c[:3])
    finally:
        ok = module.tracker_pop(tracker) and ok
    ok = ok and module.tracker_written(tracker) == {b.untyped_storage().data_ptr()}
    ok = ok and module.tracker_ops(tracker) == {
        b.untyped_storage().data_ptr(): ["aten::mul_.Tensor", "aten::copy_"]}
    module.tracker_free(tracker)
    ok = ok and _taint_check(module, b)
    ok = ok and _observer_check(module, b, c) and _strays_check(module, torch.zeros(2, 3))
    return ok and _recorder_check(module, torch.zeros(2, 3)) and _fingerprint_check(module)


def _dict_tag_check(module: Any) -> bool:
    """Whether every way of changing a dict's item shows to a check that passed it before
    (its version tag moved): the checks skip the lookup of a dict whose tag did not."""
    old, new = torch.zeros(1), torch.zeros(1)

    def set_it(d: dict[str, Any]) -> None:
        d["w"] = new

    def delete_then_set(d: dict[str, Any]) -> None:
        del d["w"]
        d["w"] = new

    def pop_then_default(d: dict[str, Any]) -> None:
        d.pop("w")
        d.setdefault("w", new)

    def update(d: dict[str, Any]) -> None:
        d.update(w=new)

    def clear_then_merge(d: dict[str, Any]) -> None:
        d.clear()
        d.update({"w": new})

    def popitem_then_set(d: dict[str, Any]) -> None:
        d.popitem()
        d["w"] = new

    changes: tuple[Callable[[dict[str, Any]], None], ...] = (
        set_it, delete_then_set, pop_then_default, update, clear_then_merge, popitem_then_set,
    )
    for change in changes:
        d: dict[str, Any] = {"w": old}
        seen = bytearray(16)
        if not module.same_items([d], ["w"], [old], seen):
            return False
        change(d)
        if module.same_items([d], ["w"], [old], seen):
            return False
    # An attribute set on an object whose `__dict__` the walk holds (a module's).
    holder = nn.Module()
    holder.w = old
    attrs = vars(holder)
    seen = bytearray(16)
    if not module.same_items([attrs], ["w"], [old], seen):
        return False
    holder.w = new
    return not module.same_items([attrs], ["w"], [old], seen)


def _steps_check(module: Any, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the ledger's odd links (a function's field, a closure cell) are read as
    `walk.step` reads them: each holds its object, and one that holds another does not."""
    def read() -> torch.Tensor:
        return held

    held = a
    defaults = read.__defaults__
    holders, steps = [read, read], [0, "__defaults__"]
    ok = bool(module.same_steps(holders, steps, [a, defaults]))
    held = b
    ok = ok and not module.same_steps(holders, steps, [a, defaults])
    ok = ok and not module.same_steps([read], [1], [a])  # no such cell
    gone = nn.Module()
    refs = [None, weakref.ref(read), weakref.ref(gone)]
    ok = ok and module.alive(refs)
    del gone
    return ok and not module.alive(refs)


def _remembered_check(module: Any) -> bool:
    """What the witness and rebinding checks remember of a site they passed (its dict's
    tag, its tensor's TensorImpl) does not hide a `.data =` view of the same storage, a
    `set_()` or a `torch.utils.swap_tensors` that gives the object another TensorImpl."""
    w = torch.zeros(2, 3)
    d = {"w": w}
    expected = ([d], ["w"], [id(w)], [w.data_ptr()])
    strides, version = [w.stride()], [w._version]
    bound, seen = bytearray(72), bytearray(40)
    swap = cast(Callable[[torch.Tensor, torch.Tensor], None], torch.utils.swap_tensors)

    def holds() -> tuple[bool, bool]:
        return (module.same_bindings(*expected, strides, bound) is not None,
                module.same_witnesses(*expected, version, seen))

    ok = holds() == holds() == (True, True)
    keep = w.data
    w.data = keep.t()  # same pointer and version: the bindings' strides show it
    ok = ok and holds() == (False, True)
    w.data = keep
    ok = ok and holds() == (True, True)
    other = torch.ones(2, 3)
    swap(w, other)  # same object and dict, another TensorImpl
    ok = ok and holds() == (False, False)
    swap(w, other)
    ok = ok and holds() == (True, True)
    w.set_(torch.zeros(6).untyped_storage(), 0, (2, 3), (3, 1))  # another storage
    return ok and holds() == (False, False)


def _taint_check(module: Any, weight: torch.Tensor) -> bool:
    """Whether a tracker following derivations taints what is computed from `weight`
    (through a view and a temporary, and by a boxed call: the results it asks for op by
    op reach it through both of the dispatcher's calls), and not what is not; a storage
    overwritten with loaded values is its own source."""
    key = weight.untyped_storage().data_ptr()
    tracker = module.tracker_new([])
    module.tracker_taint((tracker, [key]))
    module.tracker_push(tracker)
    try:
        with torch.no_grad():
            packed = (weight * 2).view(1, -1).expand(2, -1).contiguous()  # a clone
            boxed = torch.ops.aten.mul.Tensor(weight, 2)
            plain = torch.arange(3.0)  # no weight reaches it, and no load wrote it
            overwritten = weight * 3
            overwritten.copy_(plain)
    finally:
        ok = bool(module.tracker_pop(tracker))
    got = module.tracker_tainted(tracker)
    module.tracker_free(tracker)
    return (ok and got.get(packed.untyped_storage().data_ptr()) == ((key,), "aten::contiguous")
            and got.get(boxed.untyped_storage().data_ptr()) == ((key,), "aten::mul.Tensor")
            and plain.untyped_storage().data_ptr() not in got
            and got.get(overwritten.untyped_storage().data_ptr())
            == ((overwritten.untyped_storage().data_ptr(),), "aten::copy_"))


def _recorder_check(module: Any, weight: torch.Tensor) -> bool:
    """Whether the compiled recorder records what the dispatch mode sees: the `clone` a
    `contiguous` runs (not `contiguous`, nor what `clone` runs), with the weight it read
    and the storage it made; a copy of values it did not compute into a weight as a load;
    a boxed call's result, and a Python number passed to it as that number."""
    free = torch.UntypedStorage._free_weak_ref
    src = torch.ones(2, 3)
    rec = module.recorder_new()
    module.recorder_push(
        (rec, frozenset({weight.untyped_storage().data_ptr()}), frozenset(), 0))
    try:
        with torch.no_grad():
            packed = weight.t().contiguous()
            weight.copy_(src)
            boxed = torch.ops.aten.mul.Tensor(weight, 2)
    finally:
        ok = bool(module.recorder_pop(rec))
    records = module.recorder_drain(rec)
    module.recorder_free(rec)
    for r in records:  # the weak references handed over: (sid, ref) pairs and `keep`s
        for _, ref in r[11] if r[0] == 0 else r[-1]:
            free(ref)  # type: ignore[no-untyped-call]
        for _, _, t in r[5] if r[0] == 0 else ():
            if t[6]:
                free(t[6])  # type: ignore[no-untyped-call]
    sid = weight.untyped_storage()._cdata
    try:
        clone, load, mul = records
        return (ok and module.recorder_op(clone[1]) == ("aten::clone", "")
                and [(t[0], t[1]) for _, _, t in clone[5]] == [(sid, -1)]
                and [o[1][0] for o in clone[8]] == [packed.untyped_storage()._cdata]
                and load[:4] == (1, sid, src.untyped_storage()._cdata, True)
                and module.recorder_op(mul[1]) == ("aten::mul", "Tensor")
                and mul[3][1] == 2 and [t[0] for _, _, t in mul[5]] == [sid]
                and [o[1][0] for o in mul[8]] == [boxed.untyped_storage()._cdata])
    except (ValueError, TypeError, IndexError):
        return False


def _observer_check(module: Any, watched: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether the observer of a library not yet in use, through either door, sees a
    write into `watched` by any thread, and nothing else: not `other`, not a quiet
    scope's, not a tracked one's. Its kernels are checked only where no other thread
    runs (`only_thread`: else they could not be taken back after, and every op that
    writes would pass through them idle); the callback is checked always."""
    doors = (False, True) if only_thread() else (True,)
    return all(_observer_door_check(module, watched, other, callback) for callback in doors)


def _observer_door_check(
    module: Any, watched: torch.Tensor, other: torch.Tensor, callback: bool
) -> bool:
    key = watched.untyped_storage().data_ptr()
    tracker = module.tracker_new([key])
    module.observer_watch([key])
    module.observer_start(callback)
    try:
        with torch.no_grad():
            other.add_(1)  # not watched
            module.observer_quiet(True)
            watched.data.add_(1)  # graphsafe's own
            module.observer_quiet(False)
            module.tracker_push(tracker)
            watched.data.add_(1)  # a tracked load's
            module.tracker_pop(tracker)
            quiet_and_tracked = not module.observer_pending()
            worker = threading.Thread(target=watched.data.mul_, args=(2,))
            worker.start()
            worker.join()
    finally:
        module.observer_stop(True)
        module.observer_watch(())
        module.tracker_free(tracker)
    seen, blind = module.observer_drain()
    return (quiet_and_tracked and not blind and list(seen) == [key]
            and seen[key].startswith("aten::mul_") and not module.observer_running()
            and module.observer_kernels() == 0)


def _strays_check(module: Any, weight: torch.Tensor) -> bool:
    """Whether the ops of a thread that follows no recording over `weight` (2-d) are
    noted by their outermost op, and what they compute from it tainted; and a followed
    thread's ops are not."""
    key = weight.untyped_storage().data_ptr()
    made: dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        try:
            made["id"] = threading.get_native_id()
            made["packed"] = weight.t().contiguous()
        finally:
            done.set()

    module.strays_forget()
    module.strays_watch([key])
    module.strays_start()
    module.strays_follow(True)
    try:
        with torch.no_grad():
            _ = weight * 2  # followed
            # A bare thread: `threading.Thread.start` may be followed by a recording here.
            _thread.start_new_thread(work, ())
            done.wait()
    finally:
        module.strays_follow(False)
        module.strays_stop()
        module.strays_watch(())
    reads, tainted = module.strays_reads(), module.strays_tainted()
    module.strays_forget()
    packed = made.get("packed")
    return (packed is not None
            and reads == [(made["id"], "aten::t", (key,), False),
                          (made["id"], "aten::contiguous", (key,), False)]
            and tainted == {packed.untyped_storage().data_ptr(): ((key,), "aten::contiguous")}
            and not module.strays_reads())


# gs.fingerprint's sums of bytes 0, 1, ..., 36 (four words and a padded tail), from the
# definition in graphsafe/_fingerprint/digest.py: a known answer every loop must give.
_FINGERPRINT_KNOWN = (0x191C502A263F09FB, 0x3A99C44EDC285CC4)


def _fingerprint_check(module: Any) -> bool:
    """Whether every loop this CPU runs gives the known answer, and the same sums as the
    scalar loop over a buffer long enough for the vector loops, copying it or not, or in
    two pieces; and a transposed view's sums and copy are those of its logical bytes."""
    small = torch.arange(37, dtype=torch.uint8)
    large = torch.arange(4099, dtype=torch.int64).mul_(0x5851F42D).view(torch.uint8)[3:-2]
    want = module.fingerprint_sums(large, 0)
    copied = torch.empty_like(large)
    turned = large[:4095].view(315, 13).t()  # rows of 13 bytes: words across rows
    logical = turned.contiguous()
    turned_want = module.fingerprint_sums(logical, 0)
    turned_copy = torch.empty_like(logical)
    return all(
        module.fingerprint_sums(small, level) == _FINGERPRINT_KNOWN
        and module.fingerprint_sums(large, level) == want
        and module.fingerprint_sums(large, level, copied.zero_()) == want
        and torch.equal(copied, large)
        and _added(module.fingerprint_sums(large[:4096], level),
                   module.fingerprint_sums(large[4096:], level, None, 512)) == want
        and module.fingerprint_sums(turned, level, turned_copy.zero_()) == turned_want
        and torch.equal(turned_copy, logical)
        for level in range(module.fingerprint_level() + 1)
    )


def _added(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """Two pieces' sums added up, modulo 2**64: the sums of both pieces together."""
    mask = (1 << 64) - 1
    return (a[0] + b[0]) & mask, (a[1] + b[1]) & mask
