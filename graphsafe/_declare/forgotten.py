"""A forward that reads a derived buffer its model never got: say which registry declares it.

A derived buffer exists once the model's runtime binds the derivation that makes it. A
registry nobody attached (`gs.runtime(model, registry)` forgotten), or a forward run before
the first load, leaves the module without the attribute, and the forward fails with torch's
bare `AttributeError: 'LlamaRMSNorm' object has no attribute 'weight_plus_one'`. `hint`
reads such an error (the module and the name are the locals of the `__getattr__` that
raised it) and says which registry declares that name for the module's class, where the
registry was made, and the line that attaches it; `annotate` adds that to the error as a
note.

Nothing here runs on the forward's path: `nn.Module.__getattr__` serves every parameter
read, so it is never wrapped. The note is added where the error passes graphsafe (a
`gs.Graph` capture, `graphsafe verify`) and, for an error nothing catches, by the process's
`sys.excepthook` (chained to the one before it, installed with the first declaration).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from graphsafe._declare.registry import Registry

__all__ = ["ATTACHED", "Attached", "annotate", "arm", "hint", "hinting", "known"]

_KNOWN: weakref.WeakKeyDictionary[Registry, str] = weakref.WeakKeyDictionary()
"""Every registry that declared something -> where it was made (`file:line`)."""
_ARMED = [False]
_LOCK = threading.Lock()

Attached = Callable[[nn.Module, "Registry"], "bool | None"]
"""Whether the runtime bound to a module consults a registry (None: no runtime has the
module); passed down by the runtime (`ATTACHED`)."""

ATTACHED: list[Attached] = []
"""The runtime's answer to "is this registry attached to this module's model" (one entry,
set when the runtime stage is imported: lower stages never import it)."""

_NOTE = "graphsafe: "


def known(registry: Registry, made_at: str) -> None:
    """`registry` declared a derivation; `made_at` is where it was made."""
    _KNOWN.setdefault(registry, made_at)
    arm()


def arm() -> None:
    """Chain `sys.excepthook` once, so an uncaught error gets its hint."""
    with _LOCK:
        if _ARMED[0]:
            return
        _ARMED[0] = True
        previous = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException,
                 tb: TracebackType | None) -> None:
            if isinstance(error, AttributeError):
                annotate(error)
            previous(kind, error, tb)

        sys.excepthook = hook


def annotate(error: BaseException) -> None:
    """Add `hint(error)` to `error` as a note, once (nothing if there is none)."""
    if not isinstance(error, AttributeError):
        return
    notes = getattr(error, "__notes__", ())
    if any(str(n).startswith(_NOTE) for n in notes):
        return
    text = hint(error)
    if text is not None:
        error.add_note(text)


@contextlib.contextmanager
def hinting() -> Iterator[None]:
    """Code under it that fails on a derived buffer's name gets the hint as a note."""
    try:
        yield
    except AttributeError as error:
        annotate(error)
        raise


def hint(error: AttributeError) -> str | None:
    """What a registry says about the attribute `error` failed to find, or None when no
    known registry declares it for that module's class."""
    found = _raised_by(error)
    if found is None:
        return None
    module, name = found
    cls = type(module)
    declaring = []  # (attached, where it was made, the derivation)
    for registry, made_at in list(_KNOWN.items()):
        derivation = next((d for d in registry.derivations_for(cls) if name in d.outputs),
                          None)
        if derivation is not None:
            attached = ATTACHED[0](module, registry) if ATTACHED else None
            declaring.append((attached, made_at, derivation))
    if not declaring:
        return None
    # The registry the model consults comes first: the others are not this model's.
    attached, made_at, derivation = max(declaring, key=lambda a: bool(a[0]))
    declared = (f"{cls.__name__}.{name} is a derived buffer that the registry made at "
                f"{made_at} declares (derivation {derivation.name!r})")
    if not attached:
        how = ("this model has no graphsafe runtime" if attached is None
               else "this model's runtime does not consult that registry")
        return (f"{_NOTE}{declared}, and {how}.\n  fix: attach the registry before "
                "the first load: gs.runtime(model, registry) with that registry")
    if derivation.when is not None and not derivation.when(module):
        return (f"{_NOTE}{declared}; its when= excludes this module, so it has no "
                f"{name!r}.\n  fix: read {name!r} only where when= holds, or widen when=")
    return (f"{_NOTE}{declared}, and the model's runtime consults it, but the buffer is "
            "not materialized yet.\n  fix: load the weights first (the first observed "
            "load materializes it), or rt.refresh()")


def _raised_by(error: AttributeError) -> tuple[nn.Module, str] | None:
    """The module and the name whose lookup raised `error`: the locals of the innermost
    `__getattr__` of an `nn.Module` in its traceback."""
    for frame in reversed(list(_frames(error.__traceback__))):
        if frame.f_code.co_name != "__getattr__":
            continue
        local = frame.f_locals
        module, name = local.get("self"), local.get("name")
        if isinstance(module, nn.Module) and isinstance(name, str):
            return module, name
        return None
    return None


def _frames(tb: TracebackType | None) -> Iterator[Any]:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next
