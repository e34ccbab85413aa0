"""The detailed diff: which drift each pinned tensor, binding or holder shows now.

The ledger's flat check says only whether anything moved; when something did, these name
it. Each path is resolved again through what the model holds now (a tensor's container,
then by attribute; a holder through its chain) and compared field by field with its pin,
so every drift carries its path, the module class, and the expected and got values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphsafe._declare.spec import Drift, DriftKind
from graphsafe._memory.pins import CHECK_ERRORS, RESOLVE_ERRORS, Pin, SubmodulePin, has_storage
from graphsafe._memory.walk import Ref, step, storage_key

__all__ = ["holder_drift", "module_drift", "pin_drifts", "resolve_pin"]

_MISSING = object()


def module_drift(b: SubmodulePin) -> Drift | None:
    """A `module` drift when `b.parent` no longer binds `b.module` under `b.key`."""
    try:
        now: object = b.parent._modules[b.key]
    except RESOLVE_ERRORS:
        now = getattr(b.parent, b.key, _MISSING)
    if now is b.module:
        return None
    if now is _MISSING:
        new = "missing"
    elif now is None or isinstance(now, nn.Module):
        new = _describe(now)
    else:
        new = f"a {type(now).__name__}, not a module"
    return Drift(
        path=b.path,
        module_class=type(b.parent).__name__,
        what="module",
        old=_describe(b.module),
        new=new,
    )


def _describe(obj: object) -> str:
    """A module or tensor object by class and identity: `Linear (id 0x7f...)`."""
    return "None" if obj is None else f"{type(obj).__name__} (id 0x{id(obj):x})"



def holder_drift(r: Ref) -> Drift | None:
    """A `holder` drift when the object at `r.path` is no longer the one pinned."""
    try:
        attrs = vars(r.module)
        slot = next((n for n in ("_parameters", "_buffers") if attrs.get(n) is r.container),
                    None)  # a parameter holding attributes is held in its module's table
        value = (attrs if slot is None else attrs[slot])[r.key]
        for k in r.chain:
            value = step(value, k)
    except CHECK_ERRORS:
        value = _MISSING
    if value is r.obj:
        return None
    new = "missing" if value is _MISSING else _describe(value)
    return Drift(path=r.path, module_class=type(r.module).__name__, what="holder",
                 old=_describe(r.obj), new=new)


def _resolve(p: Pin) -> Any:
    """What the path holds now, through the container the module holds now."""
    s = p.site
    container = vars(s.module) if p.slot == "__dict__" else vars(s.module)[p.slot]
    value = container[s.key]
    for k in s.chain:
        value = step(value, k)
    return value


def resolve_pin(p: Pin) -> tuple[object, str]:
    """What the path holds now (or None, and why), through the container, then by
    attribute: a plain attribute that became a parameter (`m.x = nn.Parameter(...)`)
    leaves `__dict__` but is still `m.x`, and describing it beats reporting it removed."""
    try:
        return _resolve(p), ""
    except RESOLVE_ERRORS:
        pass
    s = p.site
    if not isinstance(s.key, str):
        return None, "missing"
    try:
        value: Any = getattr(s.module, s.key)
        for k in s.chain:
            value = step(value, k)
    except RESOLVE_ERRORS:
        return None, "missing"
    return value, ""


def pin_drifts(p: Pin) -> list[Drift]:
    """Every drift of the tensor pinned by `p`: removed, or each geometry field that changed,
    or, with all of them equal, a different tensor object."""
    value, why = resolve_pin(p)
    path = p.site.path
    cls = type(p.site.module).__name__
    if not isinstance(value, torch.Tensor) or not has_storage(value):
        old = f"tensor {p.shape} {p.dtype} on {p.device}"
        if isinstance(value, torch.Tensor):
            new = f"a tensor without storage (layout {value.layout})"
        else:
            new = why or ("None" if value is None else f"a {type(value).__name__}, not a tensor")
        return [Drift(path=path, module_class=cls, what="removed", old=old, new=new)]
    pairs: tuple[tuple[DriftKind, object, object], ...] = (
        ("storage", p.storage, storage_key(value)),
        ("offset", p.offset, value.storage_offset()),
        ("shape", p.shape, tuple(value.shape)),
        ("stride", p.stride, value.stride()),
        ("dtype", p.dtype, value.dtype),
        ("device", p.device, value.device),
    )
    drifts = [
        Drift(path=path, module_class=cls, what=what, old=_fmt(what, a), new=_fmt(what, b))
        for what, a, b in pairs
        if a != b
    ]
    if not drifts and value is not p.site.tensor:
        old, new = _describe(p.site.tensor), _describe(value)
        drifts.append(Drift(path=path, module_class=cls, what="object", old=old, new=new))
    return drifts


def _fmt(what: DriftKind, value: object) -> str:
    if what == "storage" and isinstance(value, int):
        return f"0x{value:x}"
    return str(value)
