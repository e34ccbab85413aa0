"""DeepSeek V4 with mHC: the flagship reference model of graphsafe."""

from graphsafe.models.deepseek_v4 import model
from graphsafe.models.deepseek_v4.model import *  # noqa: F403  (its `__all__` is the list)

__all__ = model.__all__
