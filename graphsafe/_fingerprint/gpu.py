"""The fingerprint's two sums on a CUDA device: one Triton kernel reads each word once.

Each program of the kernel takes `_BLOCK` consecutive words and writes its two partial
sums; a torch sum over the partials (a few KiB) adds them up. The kernel is the
definition of `digest.py` line for line in uint64 arithmetic (Triton's unsigned
multiply and shift wrap and shift as the definition's do), and the sums commute, so
the blocks' order does not matter. Where Triton is not installed the torch
formulation (`torch_sums.py`) runs on the device instead: the same digests, in about
ten kernels.

Only a run on a GPU confirms this module: `tests/test_fingerprint.py`'s CUDA test
(`scripts/gpu-check`) holds it to the CPU's digests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphsafe._fingerprint.torch_sums import tail_sums, torch_sums

__all__ = ["available", "sums"]

_BLOCK = 4096  # words per program: 32 KiB read per program


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    """The Triton kernel, or None where Triton cannot be imported (compiled on first use,
    not at graphsafe's import)."""
    from graphsafe._fingerprint.triton_kernel import fingerprint_sums

    return fingerprint_sums


def available() -> bool:
    """Whether the Triton kernel can run here."""
    return _kernel() is not None


def sums(flat: torch.Tensor, first: int = 0) -> torch.Tensor:
    """`S1` and `S2` of a flat, contiguous `uint8` CUDA tensor, as an int64 tensor of
    shape [2] on its device (queued on the current stream, not synchronized); `flat`
    starting at word `first` of a larger tensor (`torch_sums`)."""
    kernel = _kernel()
    n = flat.numel()
    m = n // 8
    if kernel is None or m == 0:
        return torch_sums(flat, first)
    body = flat[: 8 * m]
    if body.storage_offset() % 8:
        body = body.clone()
    words = body.view(torch.int64)
    programs = -(-m // _BLOCK)
    partials = torch.empty(programs, 2, dtype=torch.int64, device=flat.device)
    with torch.cuda.device(flat.device):
        kernel[(programs,)](words, m, first, partials, BLOCK=_BLOCK, num_warps=8)
    total = partials.sum(dim=0)  # int64 sums wrap: modulo 2**64
    if n % 8:
        total += tail_sums(flat, first)
    return total
