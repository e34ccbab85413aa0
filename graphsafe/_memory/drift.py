"""How drifts are told: the text of a `StorageMovedError` from the ledger's drifts.

One drift gives a one-line summary with its expected and got values; several give a
list, one entry per path. The fix says how to write new values without rebinding, and,
for a replaced module, how to load into the module already there.
"""

from __future__ import annotations

from graphsafe._declare.spec import Drift
from graphsafe._errors import StorageMovedError

__all__ = ["moved_error"]

_FIX = (
    "write new values into the existing tensor with `copy_` (e.g. "
    "`module.weight.data.copy_(new)`, or `module.x.copy_(new)` under `torch.no_grad()`) "
    "instead of rebinding it; if the tensor must change storage, re-capture the graph "
    "(which takes a new snapshot)"
)
_FIX_MODULE = (
    "load new weights into the module already there (`module.load_state_dict(new)`, or "
    "`copy_` into its tensors) instead of replacing it; if the module must change, "
    "re-capture the graph (which takes a new snapshot)"
)


_FIX_HOLDER = (
    "keep the object and write new values into the tensors it holds (`copy_`) instead of "
    "building a new one after each load (an engine's post-load step, such as vLLM's "
    "`process_weights_after_loading`, must update its kernel objects in place); if it "
    "must be rebuilt, re-capture the graph (which takes a new snapshot)"
)


def _values(d: Drift) -> tuple[str, str]:
    """The expected and got lines of one drift."""
    if d.what in ("removed", "object", "module", "holder"):
        return d.old, d.new
    return f"{d.what} {d.old}", f"{d.what} {d.new}"


def _summary(d: Drift, label: str) -> str:
    if d.what == "removed":
        return f"{d.path} was removed after {label}"
    if d.what == "module":
        return f"module {d.path} was replaced after {label}"
    if d.what == "object":
        return f"{d.path} was rebound after {label}: it holds another tensor object"
    if d.what == "holder":
        return (f"{d.path} was replaced after {label}: the graph reads the tensors the "
                "old one held")
    return f"{d.path} was rebound after {label}: its {d.what} moved"


def _change(d: Drift) -> str:
    """What happened to one path, in the list of several drifts."""
    if d.what in ("removed", "module", "holder"):
        return {"removed": "removed", "module": "module replaced"}.get(d.what, "replaced")
    return "another tensor object" if d.what == "object" else f"{d.what} moved"


def _fix(drifts: tuple[Drift, ...]) -> str:
    if any(d.what == "holder" for d in drifts):
        return _FIX_HOLDER
    modules = any(d.what == "module" for d in drifts)
    tensors = any(d.what != "module" for d in drifts)
    if modules and tensors:
        return f"{_FIX}; for a replaced module, {_FIX_MODULE}"
    return _FIX_MODULE if modules else _FIX


def moved_error(drifts: tuple[Drift, ...], label: str) -> StorageMovedError:
    """The error (not raised) naming every drift with its expected and got values, and the
    fix; `label` is what took the snapshot ("graph capture")."""
    paths = list(dict.fromkeys(d.path for d in drifts))
    if len(drifts) == 1:
        (d,) = drifts
        expected, got = _values(d)
        return StorageMovedError(
            _summary(d, label),
            drifts=drifts,
            module_class=d.module_class,
            path=d.path,
            expected=expected,
            got=got,
            fix=_fix(drifts),
        )
    noun = "path" if any(d.what == "module" for d in drifts) else "tensor"
    noun += "" if len(paths) == 1 else "s"
    lines = [f"{len(paths)} pinned {noun} moved after {label} ({len(drifts)} drifts):"]
    for d in drifts:
        expected, got = _values(d)
        lines.append(f"  {d.path} ({d.module_class}): {_change(d)}")
        lines.append(f"    expected: {expected}")
        lines.append(f"    got:      {got}")
    return StorageMovedError(
        "\n".join(lines),
        drifts=drifts,
        path=paths[0] if len(paths) == 1 else None,
        fix=_fix(drifts),
    )
