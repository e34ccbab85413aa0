"""Errors raised by graphsafe (kept importable under this name)."""

from graphsafe._errors import *  # noqa: F403
from graphsafe._errors import __all__ as __all__
