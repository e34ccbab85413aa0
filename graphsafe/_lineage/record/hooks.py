"""What a recording sees above the dispatcher: a few class-level hooks, installed while
any thread records and acting only for a thread that does.

A dispatch mode sees ops below autograd, where a number taken from a tensor is a copy
(`aten::_local_scalar_dense`) rather than the object the caller keeps, and never sees an
op registered `CompositeImplicitAutograd` (vLLM's `create_onednn_mm_handler`), which runs
as Python code above it. A function mode would see both, but it intercepts every torch
call and tensor method of the thread, and costs a load of small tensors half its
untracked time again. These hooks wrap only the calls through which a value leaves torch:

- `Tensor.item`, `__float__`, `__int__`, `__bool__`, `__index__` and `tolist` (the number
  the caller keeps), `numpy` and `__array__` (memory that leaves as a NumPy array): the
  recorder's `took`;
- `OpOverload.__call__` and `OpOverloadPacket.__call__` whose result is no tensor and no
  plain value (an int handle, an opaque object): the recorder's `returned`;
- `nn.Module.register_parameter` (which `setattr` of a parameter calls), and the
  `Tensor.data` setter (`p.data = packed`, which keeps the parameter object and binds
  new memory under it): a parameter bound in place of another
  (`Lineage.note_replaced`).

Each hook calls the original first, then, only in a thread whose recorder stack
(`enter`/`exit`) is not empty and only outside dynamo's tracing, hands the result to the
innermost recorder (taken off the stack meanwhile: what it reads is not recorded).
The first recorder to enter installs them; the last to exit puts the originals back
(a hook another library set over one since is left in place, passing through once
nothing records).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch._ops import OpOverload, OpOverloadPacket

from graphsafe._lineage.record.threads import remove_innermost

__all__ = ["NUMPY", "TAKEN", "TOLIST", "Hooks", "Watcher"]


class Watcher(Protocol):
    """What the hooks hand their results to (a `Recorder`)."""

    def took(self, func: Any, t: torch.Tensor, out: Any, frame: Any) -> None: ...

    def returned(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None: ...

    def replaced(self, old: torch.Tensor, new: torch.Tensor) -> None: ...


_TENSOR_METHODS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist",
                   "numpy", "__array__")

TAKEN = frozenset(getattr(torch.Tensor, name) for name in _TENSOR_METHODS[:5])
"""How a Python number is taken from a tensor (`.item()`, `float()`, `int()`, `bool()`,
an index), as the original methods."""
TOLIST = torch.Tensor.tolist
"""`Tensor.tolist`, the original: numbers read without any op."""
NUMPY = frozenset(getattr(torch.Tensor, name) for name in ("numpy", "__array__"))
"""How a tensor's memory leaves torch as a NumPy array (`np.asarray` calls `__array__`)."""

_LOCAL = threading.local()
_compiling = torch.compiler.is_compiling
_NOT_HANDLES = (bool, torch.Tensor, float, str, bytes, torch.dtype, torch.device,
                torch.Size)


def _stack() -> list[Watcher] | None:
    return getattr(_LOCAL, "stack", None)


def _tensor_hook(original: Any) -> Any:
    def hook(self: torch.Tensor, /, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        stack = getattr(_LOCAL, "stack", None)
        if stack and not _compiling():
            watcher = stack.pop()  # what it reads of tensors is not recorded
            try:
                watcher.took(original, self, out, sys._getframe(1))
            finally:
                stack.append(watcher)
        return out

    hook.__name__ = getattr(original, "__name__", "hook")
    hook.__doc__ = getattr(original, "__doc__", None)
    hook.__wrapped__ = original  # type: ignore[attr-defined]  # what a mode looks up by
    return hook


def _op_hook(original: Any) -> Any:
    def __call__(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if out is None or isinstance(out, _NOT_HANDLES):
            return out
        stack = getattr(_LOCAL, "stack", None)
        if stack and not _compiling():
            watcher = stack.pop()
            try:
                watcher.returned(self, args, kwargs, out)
            finally:
                stack.append(watcher)
        return out

    return __call__


def _register_parameter_hook(original: Any) -> Any:
    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        stack = getattr(_LOCAL, "stack", None)
        if stack and param is not None:
            old = module.__dict__.get("_parameters", {}).get(name)
            if isinstance(old, torch.Tensor) and old is not param:
                stack[-1].replaced(old, param)
        original(module, name, param)

    return register_parameter


def _data_hook(original: Any) -> Any:
    """`Tensor.data` as a property: reads pass through; a set in a recording thread tells
    the recorder the memory it replaced (the old memory, then the new)."""

    def set_(self: torch.Tensor, value: torch.Tensor) -> None:
        stack = getattr(_LOCAL, "stack", None)
        if not stack or _compiling() or not isinstance(value, torch.Tensor):
            original.__set__(self, value)
            return
        old = original.__get__(self)  # an alias of the memory it held
        original.__set__(self, value)
        watcher = stack.pop()
        try:
            watcher.replaced(old, value)
        finally:
            stack.append(watcher)

    return property(original.__get__, set_, doc=original.__doc__)  # reads: no Python frame


_SITES: tuple[tuple[type, str, Any], ...] = (
    *((torch.Tensor, name, _tensor_hook) for name in _TENSOR_METHODS),
    (OpOverload, "__call__", _op_hook),
    (OpOverloadPacket, "__call__", _op_hook),
    (nn.Module, "register_parameter", _register_parameter_hook),
    (torch.Tensor, "data", _data_hook),
)


class Hooks:
    """The hooks of the module: installed while any thread records."""

    _lock = threading.Lock()
    _active = 0
    _saved: ClassVar[list[tuple[type, str, bool, Any, Any]]] = []
    """Each hooked site: (class, name, whether the class itself defined it, the original,
    the hook)."""

    @classmethod
    def enter(cls, watcher: Watcher) -> list[Watcher]:
        """`watcher` records this thread until the matching `exit`; returns the thread's
        stack of watchers, for that `exit`."""
        stack = _stack()
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(watcher)
        with cls._lock:
            cls._active += 1
            if cls._active == 1:
                cls._install()
        return stack

    @classmethod
    def exit(cls, stack: list[Watcher], watcher: Watcher | None) -> None:
        """`watcher`, entered into `stack`, stops (from any thread: the innermost one of
        that stack that is `watcher`, whatever was entered after it)."""
        remove_innermost(stack, watcher)
        with cls._lock:
            cls._active -= 1
            if not cls._active:
                cls._uninstall()

    @staticmethod
    def recording() -> bool:
        """Whether this thread records now."""
        return bool(_stack())

    @classmethod
    def installed(cls) -> bool:
        """Whether the hooks are in place (some thread records)."""
        return bool(cls._saved)

    @classmethod
    def _install(cls) -> None:
        for owner, name, make in _SITES:
            own = name in owner.__dict__
            original = getattr(owner, name)
            hook = make(original)
            setattr(owner, name, hook)
            cls._saved.append((owner, name, own, original, hook))

    @classmethod
    def _uninstall(cls) -> None:
        while cls._saved:
            owner, name, own, original, hook = cls._saved.pop()
            if owner.__dict__.get(name) is not hook:
                continue  # another library hooked it since: ours passes through
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
