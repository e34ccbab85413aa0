"""Compiled code that froze the model's weights into constants: refused at the pin.

`torch._inductor.config.freezing = True` makes `torch.compile` fold the parameters and
buffers a compiled graph reads into it as constants (and constant-fold what they feed: a
transposed or prepacked copy). A load writes the weights; the compiled code keeps the
values it was compiled with, and no write tracker, witness or ledger entry can reach
them. Inductor marks each weight it froze (`_is_frozen_param` on the tensor, set by
`torch._inductor.freezing_utils` when the constant is made), whichever function was
compiled, so the pin reads that mark on every weight of the model: one dict lookup each.
Compiled code that reads the weights as inputs (freezing off, the default) leaves no
mark and is guarded like eager code.
"""

from __future__ import annotations

import itertools

from torch import nn

from graphsafe._errors import FrozenWeightsError

__all__ = ["frozen_weights", "refuse_frozen"]

_MARK = "_is_frozen_param"  # torch._inductor.freezing_utils.is_frozen_param reads it


def frozen_weights(model: nn.Module) -> tuple[str, ...]:
    """The path of every parameter and buffer of `model` compiled code froze (tied
    weights at each path).

    Examples:
        >>> m = nn.Linear(2, 2)
        >>> frozen_weights(m)
        ()
        >>> m.bias._is_frozen_param = True  # as inductor's freezing marks it
        >>> frozen_weights(m)
        ('bias',)
    """
    tensors = itertools.chain(model.named_parameters(remove_duplicate=False),
                              model.named_buffers(remove_duplicate=False))
    return tuple(path for path, t in tensors if t.__dict__ and t.__dict__.get(_MARK))


def refuse_frozen(model: nn.Module) -> None:
    """Raise unless no compiled code froze a weight of `model`.

    Raises:
        FrozenWeightsError: Naming every weight frozen, with the fix.
    """
    paths = frozen_weights(model)
    if not paths:
        return
    shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
    raise FrozenWeightsError(
        f"compiled code froze {len(paths)} weight(s) of {type(model).__name__} into "
        "constants (torch._inductor.config.freezing): no load can reach them",
        module_class=type(model).__name__,
        path=paths[0],
        expected="compiled code that reads the weights as inputs, so that each load's "
        "writes reach it",
        got=f"{shown} marked frozen by inductor (`{_MARK}`): the compiled code keeps the "
        "values they had when it was compiled",
        fix="turn freezing off for reloaded models (torch._inductor.config.freezing = "
        "False) and compile again, or recompile after each sync and do not pin the model; "
        f"the mark outlives the frozen code (torch._dynamo.reset()): once none is left, "
        f"delete it from each weight (`del p.{_MARK}`)",
        paths=paths,
    )
