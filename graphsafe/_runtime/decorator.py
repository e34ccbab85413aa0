"""`gs.graphsafe`: declare a class's derivations (`declare`), make its loader a tracked load."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, overload

from graphsafe._declare.decorators import declare, is_wrapped_loader, mark_wrapped
from graphsafe._declare.registry import Registry, default_registry
from graphsafe._errors import RegistrationError
from graphsafe._runtime.runtime import runtime

__all__ = ["graphsafe"]

C = TypeVar("C", bound=type)


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
    If the class has the loading method (defined or inherited), its first call materializes
    the derived buffers of the instance's whole module tree, and every later call
    refreshes, in place, those whose inputs it wrote. The method may be a generator or
    an `async def` (or return a generator): the load then lasts its whole iteration or
    run.

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
        >>> from graphsafe import derive
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
    reg = registry if registry is not None else default_registry

    def apply(klass: C) -> C:
        _check_loader(klass, load, explicit=load != "load_weights")
        declare(klass, reg, functools.partial(_wrap_loader, load=load))
        return klass

    if cls is not None:
        return apply(cls)
    return apply


def _check_loader(klass: type, load: str, *, explicit: bool) -> None:
    if explicit and getattr(klass, load, None) is None:
        raise RegistrationError(
            f"{klass.__name__} has no loading method {load!r}",
            module_class=klass.__name__,
            expected=f"a method {klass.__name__}.{load}(...)",
            got="no such attribute",
            fix="pass the name of the method that writes the weights as `load=`",
        )


def _wrap_loader(klass: type, *, load: str) -> None:
    """Make `klass.<load>` run as a tracked load, if the class has it and it is not yet."""
    fn = getattr(klass, load, None)
    if fn is None or is_wrapped_loader(fn):
        return
    # A generator loader runs nothing until iterated, an async one until awaited: the
    # load is tracked over its whole iteration (run), and ends when it is exhausted
    # (returns). A plain loader that returns a generator is handled by `run_load`.
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def load_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await runtime(self).run_async_load(fn, self, args, kwargs)

        setattr(klass, load, mark_wrapped(load_async))
        return
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def load_gen(self: Any, *args: Any, **kwargs: Any) -> Any:
            return runtime(self).run_generator_load(fn, self, args, kwargs)

        setattr(klass, load, mark_wrapped(load_gen))
        return

    @functools.wraps(fn)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return runtime(self).run_load(fn, self, args, kwargs)

    setattr(klass, load, mark_wrapped(run))
