"""The fingerprint's two sums in torch ops, on any device: the path without the compiled
kernel (`GRAPHSAFE_NATIVE=0`, no compiler) and on devices with neither it nor Triton.

Step by step the definition of `digest.py` in int64 tensor arithmetic, which wraps
modulo 2**64 as the definition's unsigned arithmetic does: the same bits. Shifts of a
signed word are arithmetic, so `hi32` masks after the shift. About ten passes over the
words instead of one, so several times slower than the compiled kernel; the words go
in chunks (in a CPU's cache; larger on a GPU, where each op is a kernel launch), so
the temporaries stay small whatever the tensor's size, and the keys `(i + 1) * P` of a
chunk are one addition to keys made once per device.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["tail_sums", "torch_sums"]

_P = 0x9E3779B97F4A7C15
_LOW32 = 0xFFFFFFFF
_CHUNK_CPU = 1 << 16  # words per chunk on a CPU: 512 KiB, the temporaries stay in cache
_CHUNK_DEVICE = 1 << 20  # elsewhere: 8 MiB, few launches


def _chunk(device: torch.device) -> int:
    return _CHUNK_CPU if device.type == "cpu" else _CHUNK_DEVICE


def _signed(word: int) -> int:
    """An unsigned 64-bit word as the int64 of the same bits."""
    word &= (1 << 64) - 1
    return word - (1 << 64) if word >> 63 else word


@functools.lru_cache(maxsize=8)
def _keys(device: torch.device, size: int) -> torch.Tensor:
    """`(j + 1) * P` for j < size: a chunk's keys, less its first word's `first * P`."""
    return torch.arange(1, size + 1, dtype=torch.int64, device=device).mul_(_signed(_P))


def torch_sums(flat: torch.Tensor, first: int = 0) -> torch.Tensor:
    """`S1` and `S2` of a flat, contiguous `uint8` tensor, as an int64 tensor of shape [2]
    on its device (not synchronized). With `first`, `flat` is a piece of a larger tensor
    that starts at its word `first`: its sums add up with the other pieces'."""
    n = flat.numel()
    m = n // 8
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    body = flat[: 8 * m]
    if body.storage_offset() % 8:  # int64 views need 8-byte aligned offsets
        body = body.clone()
    words = body.view(torch.int64)
    chunk = _chunk(flat.device)
    x = torch.empty(min(chunk, m), dtype=torch.int64, device=flat.device)
    hi = torch.empty_like(x)
    for at in range(0, m, chunk):
        total += _chunk_sums(words[at : at + chunk], first + at, x, hi)
    if n % 8:
        total += tail_sums(flat, first)
    return total


def tail_sums(flat: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Both sums of the last word of `flat` when it is partial: its bytes padded with
    zero bytes, at its index (`flat` starting at word `first`)."""
    m = flat.numel() // 8
    last = torch.zeros(8, dtype=torch.uint8, device=flat.device)
    last[: flat.numel() - 8 * m] = flat[8 * m :]
    x = torch.empty(1, dtype=torch.int64, device=flat.device)
    return _chunk_sums(last.view(torch.int64), first + m, x, torch.empty_like(x))


def _chunk_sums(words: torch.Tensor, first: int, x: torch.Tensor, hi: torch.Tensor
                ) -> torch.Tensor:
    """Both sums over `words`, the words `first, first + 1, ...` of the tensor (`x` and
    `hi`: scratch of at least their size)."""
    c = words.numel()
    x, hi = x[:c], hi[:c]
    keys = _keys(words.device, _chunk(words.device))[:c]
    torch.add(keys, _signed(first * _P), out=x)  # k_i = (i + 1) * P, wrapping
    x.bitwise_xor_(words)  # x_i = w_i ^ k_i
    s1 = x.sum()
    torch.bitwise_right_shift(x, 32, out=hi).bitwise_and_(_LOW32)  # hi32
    s2 = x.bitwise_and_(_LOW32).mul_(hi).sum()  # lo32 * hi32, wrapping as uint64 does
    return torch.stack([s1, s2])
