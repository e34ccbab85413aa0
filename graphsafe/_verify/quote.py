"""How the verify report quotes an error: in one line, and whole.

An error whose summary ends in a list (`4 pinned tensors moved after graph capture (4
drifts):` and one line per tensor) loses what it names when only its first line is kept;
the report keeps each item of the list, without the details indented under it.
"""

from __future__ import annotations

from graphsafe._errors import GraphSafetyError, one_line

__all__ = ["quote"]


def quote(exc: BaseException) -> str:
    """`exc` as `Type: summary` in one line, with every item its summary lists.

    Args:
        exc: The error.

    Returns:
        The class name and the summary; the items of a list in the summary (its lines
        indented by two spaces) follow the colon that introduces them, joined by `; `.

    Examples:
        >>> quote(GraphSafetyError("2 tensors moved:\\n  a.w (A): storage moved\\n"
        ...                        "    expected: 0x1\\n  b.w (B): storage moved", fix="f"))
        'GraphSafetyError: 2 tensors moved: a.w (A): storage moved; b.w (B): storage moved'
    """
    if not isinstance(exc, GraphSafetyError):
        return one_line(exc)
    head, *rest = exc.summary.strip().splitlines() or [""]
    # Items of the list sit two spaces in; what is indented deeper details one of them.
    items = [line.strip() for line in rest if line.startswith("  ") and line[2:3] != " "]
    if not items:
        return f"{type(exc).__name__}: {head}"
    return f"{type(exc).__name__}: {head} {'; '.join(items)}"
