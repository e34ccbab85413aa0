"""Declaring derivations on model classes: `gs.derive` and `gs.graphsafe`.

`gs.derive` only marks a method. `gs.graphsafe` discovers the marks when the class is
created, validates them all at once and registers them; on a class with a loading method
it also wraps that method so that derived buffers follow every load.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast, overload

from graphsafe._declare.registry import Registry, default_registry
from graphsafe._declare.spec import Derivation
from graphsafe._errors import NotMaterializedError, RegistrationError

__all__ = [
    "class_registries",
    "derive",
    "graphsafe",
    "is_marked",
    "is_wrapped_loader",
    "set_load_runner",
]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

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


# (loader, module, args, kwargs) -> result: set by the runtime when it is imported, so
# that declaring stays below running in the import graph.
_LoadRunner = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
_RUNNERS: list[_LoadRunner] = []


def set_load_runner(run: _LoadRunner, run_generator: _LoadRunner) -> None:
    """Install what wrapped loaders call (the runtime does, on import).

    Args:
        run: Runs a plain loading method as a tracked load.
        run_generator: Returns a generator that runs a generator loader as one.
    """
    _RUNNERS[:] = [run, run_generator]


def _wrap_loader(fn: Callable[..., Any]) -> Callable[..., Any]:
    # No registry is passed: the runtime finds the one each class was decorated with
    # when it binds. A generator loader runs nothing until iterated: the load is tracked
    # over its iteration, and ends when it is exhausted.
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def load_gen(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _RUNNERS[1](fn, self, args, kwargs)

        setattr(load_gen, _WRAPPED, True)
        return load_gen

    @functools.wraps(fn)
    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _RUNNERS[0](fn, self, args, kwargs)

    setattr(load, _WRAPPED, True)
    return load


def is_wrapped_loader(fn: object) -> bool:
    """Whether `fn` is a loading method wrapped by `gs.graphsafe`.

    Args:
        fn: Any object.

    Returns:
        True for wrapped loaders.
    """
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


@overload
def graphsafe(cls: C, /) -> C: ...


@overload
def graphsafe(
    *, load: str = "load_weights", registry: Registry | None = None
) -> Callable[[C], C]: ...


def graphsafe(
    cls: C | None = None,
    /,
    *,
    load: str = "load_weights",
    registry: Registry | None = None,
) -> C | Callable[[C], C]:
    """Class decorator: register the class's derivations and wrap its loading method.

    Usable bare (`@gs.graphsafe`) or with arguments (`@gs.graphsafe(load="load")`).
    Derivations marked with `gs.derive` in the class body are validated and registered.
    If the class has the loading method (defined or inherited), calls to it are wrapped:
    the first call materializes the derived buffers of the instance's whole module tree,
    and every later call refreshes, in place, those whose inputs it wrote.

    Args:
        cls: The class (when used bare).
        load: Name of the loading method to wrap.
        registry: Where to register; `gs.default_registry` by default.

    Returns:
        The same class, with derivations registered and the loader wrapped.

    Raises:
        RegistrationError: If a derivation is invalid, or `load` was given explicitly and
            the class has no such method.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> @graphsafe
        ... class Layer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(2, 3))
        ...     @derive("w_sum", inputs=["w"])
        ...     def _w_sum(self, w, *, out=None):
        ...         return torch.sum(w, dim=0, out=out)
        ...     def load_weights(self, weights):
        ...         for name, t in weights:
        ...             self.get_parameter(name).data.copy_(t)
        >>> layer = Layer()
        >>> layer.load_weights([("w", torch.full((2, 3), 2.0))])
        >>> layer.w_sum
        tensor([4., 4., 4.])
    """
    explicit_load = load != "load_weights"
    reg = registry if registry is not None else default_registry

    def apply(klass: C) -> C:
        _apply(klass, load, reg, explicit_load)
        return klass

    if cls is not None:
        return apply(cls)
    return apply


def _apply(klass: type, load: str, reg: Registry, explicit_load: bool) -> None:
    """Register `klass`'s marked methods, wrap its loader, and do the same for every
    subclass when it is created (a subclass behaves like its decorated base)."""
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
        type.__setattr__(klass, _APPLIED, (load, reg))
        _hook_subclasses(klass)
        if not getattr(klass.__getattr__, "__graphsafe_getattr__", False):  # type: ignore[attr-defined]
            _install_getattr(klass)
    loader = getattr(klass, load, None)
    if loader is None:
        if explicit_load:
            raise RegistrationError(
                f"{klass.__name__} has no loading method {load!r}",
                module_class=klass.__name__,
                expected=f"a method {klass.__name__}.{load}(...)",
                got="no such attribute",
                fix="pass the name of the method that writes the weights as `load=`",
            )
    elif not getattr(loader, _WRAPPED, False):
        setattr(klass, load, _wrap_loader(loader))


def _hook_subclasses(klass: type) -> None:
    own = vars(klass).get("__init_subclass__")

    def __init_subclass__(sub: type, /, **kwargs: Any) -> None:
        if own is not None:
            own.__get__(None, sub)(**kwargs)
        else:
            super(cast(Any, klass), sub).__init_subclass__(**kwargs)
        load, reg = getattr(sub, _APPLIED)
        _apply(sub, load, reg, explicit_load=False)

    type.__setattr__(klass, "__init_subclass__", classmethod(__init_subclass__))


def class_registries(cls: type) -> list[Registry]:
    """The registries that `gs.graphsafe(registry=...)` named on `cls` and its bases.

    Args:
        cls: A module class.

    Returns:
        The registries, most derived class first, without repeats.
    """
    found: list[Registry] = []
    for klass in cls.__mro__:
        applied = vars(klass).get(_APPLIED)
        if applied is not None and applied[1] not in found:
            found.append(applied[1])
    return found


def is_marked(fn: object) -> bool:
    """Whether `fn` carries a `gs.derive` mark.

    Args:
        fn: Any object.

    Returns:
        True for methods marked with `gs.derive`.
    """
    return isinstance(getattr(fn, _MARK, None), _Mark)
