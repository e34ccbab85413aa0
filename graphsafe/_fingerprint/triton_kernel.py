"""The Triton kernel of the fingerprint's sums, imported on first use on a CUDA device
(`gpu.sums`; None where Triton is not installed): Triton resolves the names a kernel
reads among its module's globals, so `tl` is imported here, at the top, and the
kernel's parameters carry no annotations but the `constexpr` one Triton reads (a name
such as `Any` in an annotation is a global it refuses).
"""

# mypy: allow-untyped-defs

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton here: `gpu.sums` takes the torch formulation
    triton = None

__all__ = ["fingerprint_sums"]

fingerprint_sums: Any = None


if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def _sums(words, m, first, partials, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """Per program of `BLOCK` 8-byte words: `S1` and `S2` of its words into
        `partials[pid]` (`graphsafe._fingerprint.digest` defines them); `words` are
        words `first, first + 1, ...` of the tensor."""
        pid = tl.program_id(0)
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # word indices
        live = i < m
        w = tl.load(words + i, mask=live, other=0).to(tl.uint64, bitcast=True)
        k = (i + first + 1).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15  # mod 2**64
        x = tl.where(live, w ^ k, tl.zeros_like(w))
        s1 = tl.sum(x, axis=0)
        s2 = tl.sum((x & 0xFFFFFFFF) * (x >> 32), axis=0)  # lo32 * hi32, mod 2**64
        tl.store(partials + 2 * pid, s1.to(tl.int64, bitcast=True))
        tl.store(partials + 2 * pid + 1, s2.to(tl.int64, bitcast=True))

    fingerprint_sums = _sums
