"""`recipes.derive`: a recipe declared as a derivation in a `gs.graphsafe` class body."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from graphsafe._declare.decorators import derive as _derive
from graphsafe.recipes._recipe import Recipe

__all__ = ["derive"]


def derive(
    outputs: str | Sequence[str],
    *,
    inputs: Sequence[str],
    fn: Recipe,
    when: Callable[[Any], bool] | None = None,
) -> Recipe:
    """Declare a recipe as a derivation of a `gs.graphsafe` class, in its body.

    `recipes.derive(outputs, inputs=..., fn=recipe)` is `gs.derive(outputs, inputs=...)`
    on a fresh method calling `recipe(self, *inputs, out=out)`.

    Args:
        outputs: The buffer name, or a tuple of names for a recipe with several outputs.
        inputs: Dotted paths relative to the module, in the recipe's argument order.
        fn: The recipe (any `fn(module, *inputs, out=None)`).
        when: As for `gs.derive`.

    Returns:
        The marked method; bind it to a name in the class body.

    Examples:
        >>> import torch, graphsafe as gs
        >>> from graphsafe import recipes
        >>> @gs.graphsafe
        ... class Fused(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.wq, self.wk = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        ...     _wqk = recipes.derive("wqk", inputs=["wq.weight", "wk.weight"],
        ...                           fn=recipes.concat(0))
        >>> fused = Fused(); _ = gs.runtime(fused).refresh(); fused.wqk.shape
        torch.Size([6, 4])
    """

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    return _derive(outputs, inputs=inputs, when=when)(method)
