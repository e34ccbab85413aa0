"""Declaring derivations on model classes: `gs.derive` marks, `declare` registers.

`gs.derive` only marks a method. `declare` (what `gs.graphsafe` calls on the class)
discovers the marks, validates them all at once and registers them, for the class and
each subclass; wrapping the loader is `graphsafe._runtime.decorator`'s part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

from graphsafe._declare.registry import Registry
from graphsafe._declare.spec import Derivation
from graphsafe._errors import NotMaterializedError, RegistrationError

__all__ = [
    "class_registries",
    "declare",
    "derive",
    "is_marked",
    "is_wrapped_loader",
    "mark_wrapped",
]

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__graphsafe_derive__"
_WRAPPED = "__graphsafe_load__"
# Set in a decorated class's own __dict__: the registry it declared into, and the
# decorator's arguments, which its subclasses inherit.
_APPLIED = "__graphsafe_applied__"


class _Mark(NamedTuple):
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]
    when: Callable[[Any], bool] | None
    transient: tuple[str, ...]


def derive(
    outputs: str | Sequence[str],
    *,
    inputs: Sequence[str],
    when: Callable[[Any], bool] | None = None,
    transient: Sequence[str] = (),
) -> Callable[[F], F]:
    """Mark a method of a module class as a derivation.

    The method is called as `method(self, *inputs, out=None)`. Nothing is registered
    until the class is decorated with `gs.graphsafe`.

    Args:
        outputs: The buffer name, or a tuple of names for several buffers.
        inputs: Dotted paths relative to the module: parameters, buffers, plain tensor
            attributes, or outputs of other derivations.
        when: Optional `when(module) -> bool`; where false the module owns no buffer and
            the attributes stay `None`.
        transient: Inputs (a subset of `inputs`) held only while a load writes them:
            checkpoint-format weights released once their outputs are refreshed.

    Returns:
        A decorator that marks the method and returns it unchanged.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class Layer(nn.Module):
        ...     @derive("w_sum", inputs=["w"])
        ...     def _w_sum(self, w, *, out=None):
        ...         return torch.sum(w, dim=0, out=out)
    """
    names = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    if isinstance(inputs, str):
        raise RegistrationError(
            "gs.derive takes a list of input paths",
            derivation=f"outputs {names}",
            expected=f"inputs=[{inputs!r}]",
            got=f"inputs={inputs!r}",
            fix="wrap the path in a list",
        )
    mark = _Mark(names, tuple(inputs), when, tuple(transient))

    def decorate(fn: F) -> F:
        if isinstance(fn, (staticmethod, classmethod)):
            raise RegistrationError(
                "gs.derive marks plain methods",
                derivation=f"outputs {names}",
                expected="def method(self, *inputs, out=None)",
                got=type(fn).__name__,
                fix="drop @staticmethod/@classmethod; the module is passed as `self`",
            )
        setattr(fn, _MARK, mark)
        return fn

    return decorate


def mark_wrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as a loading method wrapped by `gs.graphsafe`; returns it."""
    setattr(fn, _WRAPPED, True)
    return fn


def is_wrapped_loader(fn: object) -> bool:
    """Whether `fn` is a loading method wrapped by `gs.graphsafe`."""
    return bool(getattr(fn, _WRAPPED, False))


def _outputs_of(cls: type) -> frozenset[str]:
    names: set[str] = set()
    for reg in class_registries(cls):
        for d in reg.derivations_for(cls):
            names.update(d.outputs)
    return frozenset(names)


def _install_getattr(klass: type) -> None:
    """Reading a derived buffer that is not materialized names it and says why.

    `nn.Module.__getattr__` only runs when normal lookup failed, so this costs nothing
    once the buffers exist. The error is also an `AttributeError`, so `hasattr` and
    `getattr(m, name, default)` keep working.
    """
    base = klass.__getattr__  # type: ignore[attr-defined]

    def __getattr__(self: Any, name: str) -> Any:
        try:
            return base(self, name)
        except AttributeError:
            if name not in _outputs_of(type(self)):
                raise
        cls = type(self).__name__
        raise NotMaterializedError(
            f"derived buffer {cls}.{name} is read before it was materialized",
            paths=(name,),
            module_class=cls,
            path=name,
            expected="derived buffers materialized by a first load",
            got="no load has run on this model yet",
            fix="load the weights first (a method wrapped by @gs.graphsafe, a "
            "`gs.weight_update(model)` block, or gs.runtime(model).refresh()), then run "
            "the model or capture it",
        ) from None

    __getattr__.__graphsafe_getattr__ = True  # type: ignore[attr-defined]
    type.__setattr__(klass, "__getattr__", __getattr__)


def declare(klass: type, reg: Registry, then: Callable[[type], None]) -> None:
    """Register `klass`'s marked methods in `reg` (`RegistrationError` if one is invalid),
    then call `then(klass)` (the runtime wraps its loader); every subclass, when created, is
    declared the same way, so that it behaves like its decorated base."""
    if _APPLIED not in vars(klass):
        for attr_name, attr in list(vars(klass).items()):
            target = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            mark = getattr(target, _MARK, None)
            if not isinstance(mark, _Mark):
                continue
            if target is not attr:
                raise RegistrationError(
                    "gs.derive marks plain methods",
                    module_class=klass.__name__,
                    derivation=f"{klass.__name__}.{attr_name}",
                    expected="def method(self, *inputs, out=None)",
                    got=type(attr).__name__,
                    fix="drop @staticmethod/@classmethod; the module is passed as `self`",
                )
            reg.register(
                klass,
                Derivation(
                    outputs=mark.outputs,
                    inputs=mark.inputs,
                    fn=attr,
                    when=mark.when,
                    transient=mark.transient,
                    method=attr_name,
                    name=f"{klass.__name__}.{attr_name}",
                ),
            )
        type.__setattr__(klass, _APPLIED, (reg, then))
        _hook_subclasses(klass)
        if not getattr(klass.__getattr__, "__graphsafe_getattr__", False):  # type: ignore[attr-defined]
            _install_getattr(klass)
    then(klass)


def _hook_subclasses(klass: type) -> None:
    own = vars(klass).get("__init_subclass__")

    def __init_subclass__(sub: type, /, **kwargs: Any) -> None:
        if own is not None:
            own.__get__(None, sub)(**kwargs)
        else:
            super(cast(Any, klass), sub).__init_subclass__(**kwargs)
        reg, then = getattr(sub, _APPLIED)
        declare(sub, reg, then)

    type.__setattr__(klass, "__init_subclass__", classmethod(__init_subclass__))


def class_registries(cls: type) -> list[Registry]:
    """The registries `gs.graphsafe(registry=...)` named on `cls` and its bases, most
    derived first, without repeats."""
    found: list[Registry] = []
    for klass in cls.__mro__:
        applied = vars(klass).get(_APPLIED)
        if applied is not None and applied[0] not in found:
            found.append(applied[0])
    return found


def is_marked(fn: object) -> bool:
    """Whether `fn` carries a `gs.derive` mark."""
    return isinstance(getattr(fn, _MARK, None), _Mark)
