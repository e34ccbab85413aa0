"""Where a derivation's inputs live: the leaf tensors it reads, each through its holder.

An `Input` is read through the dict it lives in (`module._parameters`, `module._buffers`
or `module.__dict__`), so that rebinding the attribute is seen; its geometry (pointer,
shape, stride, offset) is recorded so that `param.data = view` on the same storage, which
moves no version counter, is seen too.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.dlpack import from_dlpack

from graphsafe._errors import RegistrationError

__all__ = ["Input", "describe", "geometry", "join", "pin_storage", "refuse_unversioned"]


def describe(t: torch.Tensor) -> str:
    return (
        f"shape {tuple(t.shape)}, stride {t.stride()}, dtype {t.dtype}, device {t.device}, "
        f"storage 0x{t.data_ptr():x}"
    )


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def pin_storage(t: torch.Tensor) -> torch.Tensor:
    """An alias of `t` whose storage cannot be resized.

    torch resizes an `out=` tensor of the wrong shape, reallocating its memory when it
    grows; on a non-resizable storage that raises instead, so the buffer never moves.
    """
    try:
        return from_dlpack(t)
    except Exception:  # dtypes DLPack cannot express: drift is still detected afterwards
        return t


class Input:
    """A leaf tensor (parameter, buffer or plain attribute) read by derivations."""

    __slots__ = (
        "consumers",
        "container",
        "geometry",
        "key",
        "owner",
        "path",
        "tensor",
        "transient",
    )

    def __init__(self, path: str, owner: nn.Module, container: dict[str, Any], key: str) -> None:
        self.path = path
        self.owner: weakref.ref[nn.Module] = weakref.ref(owner)
        self.container = container
        self.key = key
        self.tensor: torch.Tensor | None = container.get(key)
        refuse_unversioned(self.tensor, path, owner)
        self.geometry = geometry(self.tensor)
        self.consumers: list[int] = []
        self.transient = False
        """Held only while a load writes it: its pointer comes and goes."""

    def make_transient(self) -> None:
        """Declared transient by a reader: held only while a load writes it."""
        self.transient = True

    def add_consumer(self, index: int) -> None:
        """Derivation `index` reads this input (once per derivation)."""
        if index not in self.consumers:
            self.consumers.append(index)

    def moved(self) -> bool:
        """Whether the attribute now holds another tensor, or the same one elsewhere."""
        t = self.container.get(self.key)
        if t is not self.tensor or t is None:
            return True
        if self.transient:  # released and held again between loads: only the view counts
            return geometry(t)[1:] != self.geometry[1:]
        return geometry(t) != self.geometry

    def accept(self) -> None:
        """Take what the owner holds now as the input (before pin only).

        Raises:
            RegistrationError: The owner holds no tensor under the name any more.
        """
        owner = self.owner()
        name = self.key
        found = _find_container(owner, name) if owner is not None else None
        if found is None:
            raise RegistrationError(
                f"derivation input {self.path!r} is gone",
                module_class=type(owner).__name__ if owner is not None else None,
                path=self.path,
                expected=f"a parameter, buffer or tensor attribute {name!r}",
                got=_what_is_there(owner, name),
                fix="derivation inputs must stay tensors of the module: keep the parameter "
                "(write new values into it in place) or remove the derivation's class "
                "registration before changing the module",
            )
        refuse_unversioned(found[name], self.path, owner)
        self.container = found
        self.tensor = found[name]
        self.geometry = geometry(self.tensor)


def refuse_unversioned(t: object, path: str, owner: nn.Module | None) -> None:
    """Refuse an inference tensor as a derivation input: torch keeps no version for it, so
    an in-place write into it would be invisible to the guard.

    Raises:
        RegistrationError: `t` is an inference tensor.
    """
    if isinstance(t, torch.Tensor) and t.is_inference():
        raise RegistrationError(
            f"derivation input {path!r} is an inference tensor",
            module_class=type(owner).__name__ if owner is not None else None,
            path=path,
            expected="a tensor created outside torch.inference_mode(), whose in-place "
            "writes the guard can see",
            got=f"an inference tensor ({describe(t)}): torch keeps no version counter for it",
            fix="build and load the model under torch.no_grad() instead of "
            "torch.inference_mode() (graphs may still replay under inference_mode)",
        )


def geometry(t: torch.Tensor | None) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """Pointer, shape, stride and offset of `t` (zeros for None)."""
    if t is None:
        return (0, (), (), 0)
    return (t.data_ptr(), tuple(t.shape), t.stride(), int(t.storage_offset()))


def _find_container(owner: nn.Module, name: str) -> dict[str, Any] | None:
    for container in (owner._parameters, owner._buffers):
        if isinstance(container.get(name), torch.Tensor):
            return container
    if isinstance(owner.__dict__.get(name), torch.Tensor):
        return owner.__dict__
    return None


def _what_is_there(owner: nn.Module | None, name: str) -> str:
    if owner is None:
        return "the module was garbage-collected"
    parametrizations = owner._modules.get("parametrizations")
    if parametrizations is not None and name in parametrizations._modules:
        return f"{name!r} is parametrized (torch.nn.utils.parametrize): computed on access"
    for where, container in (("parameter", owner._parameters), ("buffer", owner._buffers)):
        if name in container:
            return f"the {where} {name!r} is None"
    if name in owner.__dict__:
        return f"{name!r} is {type(owner.__dict__[name]).__name__}, not a tensor"
    return f"{type(owner).__name__} has no attribute {name!r} any more"
