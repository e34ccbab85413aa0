"""Recipes: derivations that turn checkpoint weights into the layouts kernels read.

Each factory returns a derivation function `fn(module, *inputs, out=None)` for any
declaration path: `gs.Derivation(fn=...)`, `Registry.derive`, a marked method that calls
it (`return self.quantize(self, w, out=out)`), or `recipes.derive` in a class body.
Without `out` it returns new tensors; with `out` (a tuple for several outputs) it checks
the fit, raising `gs.DerivationDriftError` before writing anything, then writes in place.
"""

from graphsafe.recipes._derive import derive
from graphsafe.recipes._experts import place_experts
from graphsafe.recipes._fp8 import (
    dequantize_fp8,
    fp8_quantize,
)
from graphsafe.recipes._layout import (
    concat,
    transpose,
)
from graphsafe.recipes._lora import lora_merge
from graphsafe.recipes._mhc import fold_streams
from graphsafe.recipes._mla import mla_absorb
from graphsafe.recipes._recipe import Recipe

# In the order of the API reference (docs/api.md renders by `__all__`).
__all__ = [
    "Recipe",
    "concat",
    "transpose",
    "fold_streams",
    "lora_merge",
    "place_experts",
    "mla_absorb",
    "fp8_quantize",
    "dequantize_fp8",
    "derive",
]
