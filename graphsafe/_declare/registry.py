"""The registry: which derivations each module class declares.

`gs.graphsafe` and `gs.derive` fill `default_registry`; `Registry.register` and
`Registry.derive` do the same for classes the user cannot edit. Everything that can be
checked without an instance is checked here, at registration.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from graphsafe._declare.forgotten import known
from graphsafe._declare.spec import Derivation
from graphsafe._errors import RegistrationError

__all__ = ["Registry", "accepts_out", "default_registry"]

F = TypeVar("F", bound=Callable[..., Any])


def accepts_out(fn: Callable[..., Any]) -> bool:
    """Whether `fn` can take `out=` (the fast path): an `out` parameter, or `**kwargs`.

    Examples:
        >>> accepts_out(lambda m, w, *, out=None: w), accepts_out(lambda m, w: w)
        (True, False)
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            return True
        if p.name == "out" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return True
    return False


def check_signature(fn: Callable[..., Any], derivation: Derivation, cls: type) -> None:
    """Check that graphsafe can call `fn(module, *inputs, out=None)`.

    Raises:
        RegistrationError: The positional parameters do not fit the module and inputs, or
            another parameter has no default.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: checked when first called
    positional = 0
    var_positional = False
    required_kw = []
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if p.name == "out" and positional >= 1 + len(derivation.inputs):
                if p.default is p.empty:
                    required_kw.append(p.name)
                continue
            positional += 1
        elif p.kind is p.VAR_POSITIONAL:
            var_positional = True
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            required_kw.append(p.name)
    want = 1 + len(derivation.inputs)
    if (positional < want and not var_positional) or positional > want or required_kw:
        params = ", ".join(["module", *derivation.inputs])
        raise RegistrationError(
            f"derivation {derivation.name!r} has a signature that does not fit its inputs",
            module_class=cls.__name__,
            derivation=derivation.name,
            expected=f"fn({params}, *, out=None)",
            got=f"fn{sig}",
            fix="take the module, then one positional parameter per input in the order of "
            "`inputs`, and optionally `out=None` (materialization calls it without `out`)",
        )


def _class_cycle(derivations: Sequence[Derivation]) -> list[str] | None:
    """A dependency cycle among derivations of one class, as a list of names, if any."""
    producer = {o: d for d in derivations for o in d.outputs}
    edges = {
        d.name: [producer[i].name for i in d.inputs if i in producer] for d in derivations
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for nxt in edges.get(name, ()):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[name] = 2
        return None

    for d in derivations:
        if d.name not in state and (cycle := visit(d.name)):
            return cycle
    return None


class Registry:
    """Derivations declared per module class: an instance has those of its class and its
    bases, where a subclass may redeclare a base derivation's outputs to replace it.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> reg = Registry()
        >>> @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
        ... def weight_t(module, weight, *, out=None):
        ...     return torch.transpose(weight, 0, 1).contiguous()
        >>> [d.outputs for d in reg.derivations_for(nn.Linear)]
        [('weight_t',)]
    """

    def __init__(self) -> None:
        caller = sys._getframe(1)
        self._made_at = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        """Where it was made, for the hint on a forward that reads an undeclared buffer."""
        self._own: dict[type, list[Derivation]] = {}
        self._cache: dict[type, tuple[Derivation, ...]] = {}
        self._lock = threading.Lock()

    def register(self, cls: type, derivation: Derivation) -> Derivation:
        """Register `derivation` for `cls` and its subclasses.

        Args:
            cls: The module class that owns the derived buffers.
            derivation: What to derive.

        Returns:
            The derivation, as registered.

        Raises:
            RegistrationError: On a bad signature, an output registered twice for the
                class, an output that names a class attribute, or a dependency cycle.
        """
        if not isinstance(cls, type):
            raise RegistrationError(
                "derivations are registered for a module class",
                derivation=derivation.name,
                expected="a class, e.g. MyLayer",
                got=repr(cls),
                fix="pass the class, not an instance",
            )
        fn = derivation.fn
        check_signature(fn, derivation, cls)
        with self._lock:
            own = self._own.setdefault(cls, [])
            taken = {o: d for d in own for o in d.outputs}
            for name in derivation.outputs:
                if name in taken:
                    raise RegistrationError(
                        f"output {name!r} is declared twice on {cls.__name__}",
                        module_class=cls.__name__,
                        derivation=derivation.name,
                        expected=f"one derivation producing {name!r}",
                        got=f"{taken[name].name!r} and {derivation.name!r}",
                        fix="rename one of the outputs or remove one declaration",
                    )
                attr = inspect.getattr_static(cls, name, None)
                if attr is not None:
                    raise RegistrationError(
                        f"output {name!r} collides with the class attribute "
                        f"{cls.__name__}.{name}",
                        module_class=cls.__name__,
                        derivation=derivation.name,
                        expected=f"a free attribute name for the buffer {name!r}",
                        got=f"{cls.__name__}.{name} = {attr!r}",
                        fix="rename the output or the class attribute",
                    )
            cycle = _class_cycle([*own, derivation])
            if cycle:
                raise RegistrationError(
                    f"derivations of {cls.__name__} depend on each other in a cycle",
                    module_class=cls.__name__,
                    derivation=derivation.name,
                    expected="an acyclic graph of derivations",
                    got=" -> ".join(cycle),
                    fix="break the cycle: a derivation cannot read its own outputs",
                )
            own.append(derivation)
            self._cache.clear()
        known(self, self._made_at)
        return derivation

    def derive(
        self,
        cls: type,
        outputs: str | Sequence[str],
        *,
        inputs: Sequence[str],
        when: Callable[[Any], bool] | None = None,
        transient: Sequence[str] = (),
    ) -> Callable[[F], F]:
        """Decorator form of `register` for a free function `fn(module, *inputs, out=None)`
        (see the class example).

        Args:
            cls: The module class that owns the derived buffers.
            outputs: One buffer name or several.
            inputs: Dotted paths relative to the owning module.
            when: Optional `when(module) -> bool` deciding ownership per instance.
            transient: Inputs held only while a load writes them.

        Returns:
            A decorator that registers the function and returns it unchanged.
        """

        def decorate(fn: F) -> F:
            self.register(
                cls,
                Derivation(
                    outputs=tuple([outputs] if isinstance(outputs, str) else outputs),
                    inputs=tuple(inputs),
                    fn=fn,
                    when=when,
                    transient=tuple(transient),
                ),
            )
            return fn

        return decorate

    def derivations_for(self, cls: type) -> tuple[Derivation, ...]:
        """The derivations an instance of `cls` has: its own and its bases', bases first.

        Args:
            cls: A module class.

        Returns:
            The derivations; a subclass's replaces a base's with the same outputs.

        Raises:
            RegistrationError: If a subclass derivation overlaps a base derivation's
                outputs without producing exactly the same ones.
        """
        cached = self._cache.get(cls)
        if cached is not None:
            return cached
        with self._lock:
            chosen: dict[tuple[str, ...], Derivation] = {}
            owner: dict[str, tuple[str, ...]] = {}
            for klass in reversed(cls.__mro__):
                for d in self._own.get(klass, ()):
                    for name in d.outputs:
                        prev = owner.get(name)
                        if prev is not None and prev != d.outputs:
                            raise RegistrationError(
                                f"{klass.__name__} redeclares output {name!r} of a base "
                                "class with different outputs",
                                module_class=klass.__name__,
                                derivation=d.name,
                                expected=f"outputs {prev}",
                                got=f"outputs {d.outputs}",
                                fix="redeclare all outputs of the base derivation together",
                            )
                    chosen[d.outputs] = d
                    for name in d.outputs:
                        owner[name] = d.outputs
            result = tuple(chosen.values())
            self._cache[cls] = result
        return result

    def classes(self) -> tuple[type, ...]:
        """Every class with derivations registered directly on it."""
        return tuple(self._own)


default_registry = Registry()
"""The registry that `gs.graphsafe` and `gs.derive` fill."""
