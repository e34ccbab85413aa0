"""`gs.fingerprint`: one digest per tensor, of its dtype, its shape and its values.

A digest is equal wherever the tensor is equal (other processes, hosts, devices; a
transposed view and its contiguous copy) and differs after any flipped bit. It is
defined here, and every path computes exactly this (the compiled kernel on a CPU,
`graphsafe/_native/fingerprint.cpp`; a Triton kernel on a CUDA device, `gpu.py`; the
torch formulation everywhere else, `torch_sums.py`); the tests hold them to each other
and to `reference_digest`, this definition written out in plain Python:

1. `B`: the tensor's elements in row-major order (its logical values), each element's
   bytes as torch stores them (little-endian: x86-64, aarch64 and CUDA devices).
2. Words: `B` padded with zero bytes to a multiple of 8, read as little-endian unsigned
   64-bit words `w_0 ... w_{m-1}`.
3. `x_i = w_i XOR k_i`, with the position key `k_i = (i + 1) * P mod 2**64`,
   `P = 0x9E3779B97F4A7C15` (the golden ratio's Weyl step).
4. `S1 = sum of x_i` and `S2 = sum of lo32(x_i) * hi32(x_i)`, both mod 2**64 (`lo32`,
   `hi32`: the low and high 32 bits).
5. `M`: the first 8 bytes (little-endian) of BLAKE2b-64 of `"<dtype>|<shape>"`, e.g.
   `"float32|24,256"` (`"float32|"` for a 0-d tensor).
6. `a = fmix64(S1 XOR M)`, `b = fmix64(S2 XOR a)`, with `fmix64` MurmurHash3's 64-bit
   finalizer; the digest is `a` then `b`, 32 lowercase hex digits.

What follows from it:

- A change confined to one 8-byte word (any bits flipped in it) always changes `S1`,
  hence `a`: XOR with `k_i`, a sum mod 2**64 and `fmix64` are bijections. Changes in
  several words are missed only if both sums collide, which the position keys and the
  product make unlikely for accidental damage (a swap of two words, a shifted or
  stale range, compensating flips of one bit position in two words).
- The sums commute, so any split of the words (threads, vector lanes, GPU blocks) gives
  the same digest; the kernels are free to parallelize.
- It is no cryptographic hash: it is made against accidental corruption (a flipped bit, a
  torn or short transfer, a stale buffer), not against someone choosing the bytes.
- Bit for bit: `-0.0` and `0.0`, or two NaNs of different payloads, differ; a tensor
  cast to another dtype is another tensor.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

import torch
from torch import nn

from graphsafe._fingerprint import gpu
from graphsafe._fingerprint.torch_sums import torch_sums
from graphsafe._native import loader

__all__ = ["Digests", "Pieces", "fingerprint", "hexdigest", "reference_digest"]

P = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1

Digest: TypeAlias = tuple[int, int]
"""A digest as two unsigned 64-bit words, `(a, b)`: what the weight sync sends."""


def _fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finalizer (a bijection on 64-bit words)."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    return k ^ (k >> 33)


@functools.lru_cache(maxsize=4096)
def _meta(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """`M`: the dtype and the shape, as one word."""
    text = f"{str(dtype).removeprefix('torch.')}|{','.join(map(str, shape))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _finish(s1: int, s2: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Digest:
    a = _fmix64((s1 & _MASK) ^ _meta(dtype, shape))
    return a, _fmix64((s2 & _MASK) ^ a)


def hexdigest(digest: Digest) -> str:
    """A digest as `gs.fingerprint` gives it: 32 lowercase hex digits."""
    return f"{digest[0]:016x}{digest[1]:016x}"


def reference_digest(data: bytes, dtype: torch.dtype, shape: Sequence[int]) -> str:
    """The definition in plain Python, over a tensor's bytes `data` (slow: for tests)."""
    padded = data + bytes(-len(data) % 8)
    s1 = s2 = 0
    for i in range(len(padded) // 8):
        x = int.from_bytes(padded[8 * i : 8 * i + 8], "little") ^ (((i + 1) * P) & _MASK)
        s1 += x
        s2 += (x & 0xFFFFFFFF) * (x >> 32)
    return hexdigest(_finish(s1, s2, dtype, tuple(shape)))


def _bytes_of(t: torch.Tensor, name: str) -> torch.Tensor:
    """The logical values of `t` as a flat, contiguous `uint8` tensor (a view when `t` is
    contiguous; a copy otherwise)."""
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"cannot fingerprint {name!r}: a {t.layout} tensor of {t.dtype}; "
                        "only dense tensors have a fingerprint")
    if t.device.type == "meta":
        raise TypeError(f"cannot fingerprint {name!r}: a meta tensor has no values")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _plain(t: torch.Tensor) -> bool:
    """Whether the compiled kernel can read `t`'s bytes as they are, in any strides: a
    plain tensor (a subclass may run code on reads), dense, with no lazy conjugate or
    negation."""
    return (type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
            and not t.is_quantized and not t.is_conj() and not t.is_neg())


class Digests:
    """The digests of several tensors, computed as they are added: on a CPU at once
    (without the GIL, so other threads run meanwhile), on a GPU queued on the current
    stream and read back together, with one synchronization, by `done`."""

    def __init__(self) -> None:
        self._items: list[tuple[Digest | torch.Tensor, torch.dtype, tuple[int, ...]]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, t: torch.Tensor, name: str = "tensor", *,
            into: torch.Tensor | None = None) -> None:
        """Take the digest of `t` (`name` is for errors); with `into`, a tensor of its
        shape and dtype, also copy `t` there. On a CPU with the compiled kernel the copy
        is made in the same pass, from the bytes the digest reads (a weight sync's
        packing), whatever `t`'s strides (a transposed view is gathered in its logical
        order, chunk by chunk in cache); elsewhere it is `into.copy_(t)` after the
        digest.

        Raises:
            TypeError: `t` is not a dense tensor with values (sparse, quantized, meta).
        """
        sums: Digest | torch.Tensor
        native = loader.get() if t.device.type == "cpu" else None
        if native is not None and _plain(t):  # the kernel reads its bytes as they are
            out = None
            if (into is not None and into.device.type == "cpu" and into.dtype == t.dtype
                    and into.shape == t.shape and _plain(into) and into.is_contiguous()):
                out, into = into, None
            sums = (native.fingerprint_sums(t, -1) if out is None
                    else native.fingerprint_sums(t, -1, out))
        else:
            flat = _bytes_of(t, name)
            if flat.device.type == "cpu":
                sums = (native.fingerprint_sums(flat, -1) if native is not None
                        and type(flat) is torch.Tensor else _words(torch_sums(flat)))
            elif flat.device.type == "cuda" and gpu.available():
                sums = gpu.sums(flat)
            else:
                sums = torch_sums(flat)
        if into is not None:
            with torch.no_grad():
                into.copy_(t)
        self._items.append((sums, t.dtype, tuple(t.shape)))

    def done(self) -> list[Digest]:
        """Every digest added, in order."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for sums, _, _ in self._items:
            if isinstance(sums, torch.Tensor):
                by_device.setdefault(sums.device, []).append(sums)
        read = {device: iter(torch.stack(sums).cpu().tolist())  # one synchronization each
                for device, sums in by_device.items()}
        out: list[Digest] = []
        for sums, dtype, shape in self._items:
            s1, s2 = next(read[sums.device]) if isinstance(sums, torch.Tensor) else sums
            out.append(_finish(s1, s2, dtype, shape))
        return out


class Pieces:
    """The digests of several tensors whose bytes are read in pieces, as they arrive (a
    weight sync's segments, each fingerprinted while the next ones are on the way): each
    piece's sums at its words' positions, added up. The sums commute, so the pieces may
    come in any order and any split; a tensor's digest is the one `Digests` gives once
    every piece of it was added.

    Args:
        count: How many tensors, numbered from 0.
    """

    def __init__(self, count: int) -> None:
        self._host = [[0, 0] for _ in range(count)]
        self._device: list[torch.Tensor | None] = [None] * count  # sums on a GPU

    def add(self, i: int, piece: torch.Tensor, at: int) -> None:
        """Add `piece`, the bytes of tensor `i` from its byte `at` on: a flat, contiguous
        `uint8` tensor, `at` a multiple of 8; only a tensor's last piece may end inside a
        word (it is padded with zero bytes, as the definition pads the tensor).

        Raises:
            ValueError: `at` is no multiple of 8.
        """
        if at % 8:
            raise ValueError(f"a piece of tensor {i} starts at byte {at}, inside a word; "
                             "pieces start at multiples of 8 bytes")
        native = loader.get() if piece.device.type == "cpu" else None
        if native is not None and type(piece) is torch.Tensor:
            s1, s2 = native.fingerprint_sums(piece, -1, None, at // 8)
        elif piece.device.type == "cpu":
            s1, s2 = _words(torch_sums(piece, at // 8))
        else:  # summed on the device, read back once by `done`
            sums = (gpu.sums(piece, at // 8) if piece.device.type == "cuda"
                    and gpu.available() else torch_sums(piece, at // 8))
            held = self._device[i]
            self._device[i] = sums if held is None else held + sums
            return
        host = self._host[i]
        host[0] += s1
        host[1] += s2

    def done(self, kinds: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[Digest]:
        """Every tensor's digest, in order, given each one's dtype and shape."""
        on_device = [(i, t) for i, t in enumerate(self._device) if t is not None]
        read = dict(zip((i for i, _ in on_device),
                        torch.stack([t.cpu() for _, t in on_device]).tolist()
                        if on_device else []))
        out: list[Digest] = []
        for i, (dtype, shape) in enumerate(kinds):
            s1, s2 = self._host[i]
            d1, d2 = read.get(i, (0, 0))
            out.append(_finish(s1 + d1, s2 + d2, dtype, shape))
        return out


def _words(sums: torch.Tensor) -> Digest:
    """The two int64 sums of `torch_sums` as unsigned ints."""
    s1, s2 = sums.tolist()
    return s1 & _MASK, s2 & _MASK


Weights: TypeAlias = "nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]"


def fingerprint(obj: Weights, names: Iterable[str] | None = None) -> Mapping[str, str]:
    """The digest of each named tensor: its dtype, shape and values, bit for bit.

    Equal tensors give equal digests in every process, on every host and device (a
    transposed view and its contiguous copy too); any flipped bit changes the digest. It
    reads each tensor once (a transposed or permuted view twice: made contiguous first):
    on a CPU with the compiled kernel (`graphsafe native build`; about the cost of
    copying the same bytes, on torch's intra-op threads), without it with torch ops
    (several times slower); on a CUDA device with one Triton kernel (torch ops without
    Triton). What a digest is, exactly: `graphsafe._fingerprint.digest`.

    Compare a trainer's weights with an engine's after a sync, by name, where the names
    map one to one (`docs/rl-weight-sync.md`, "What the sync checks").

    Args:
        obj: An `nn.Module` (its parameters and persistent buffers, by `state_dict`
            name: derived buffers, registered non-persistent, are left out), a mapping
            of names to tensors, or an iterable of `(name, tensor)` pairs.
        names: Only these entries of `obj`, in this order (None: every entry).

    Returns:
        Name to digest (32 hex digits), in the order given.

    Raises:
        TypeError: An item is not a `(str, Tensor)` pair, or a tensor has no values to
            read (sparse, quantized, meta).
        ValueError: A name appears twice.
        KeyError: `names` holds a name `obj` does not.

    Examples:
        >>> w = torch.arange(6.0).reshape(2, 3)
        >>> fingerprint({"w": w.t()})["w"] == fingerprint({"w": w.t().contiguous()})["w"]
        True
        >>> fingerprint({"w": w})["w"] == fingerprint({"w": w.t().contiguous()})["w"]
        False
    """
    items = _named(obj)
    if names is not None:
        held = dict(items)
        wanted = list(names)
        missing = [n for n in wanted if n not in held]
        if missing:
            raise KeyError(f"gs.fingerprint: no entry {missing[0]!r} (of {len(missing)} "
                           f"names asked for and missing); entries: {_shown(list(held))}")
        items = [(n, held[n]) for n in wanted]
    digests = Digests()
    for name, t in items:
        digests.add(t, name)
    return {name: hexdigest(d) for (name, _), d in zip(items, digests.done())}


def _shown(names: list[str]) -> str:
    return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5
                                              else "")


def _named(obj: Weights) -> list[tuple[str, torch.Tensor]]:
    """`obj`'s (name, tensor) pairs, checked."""
    if isinstance(obj, nn.Module):
        return [(k, v) for k, v in obj.state_dict(keep_vars=True).items()
                if isinstance(v, torch.Tensor)]  # `get_extra_state` entries are no tensors
    pairs = obj.items() if isinstance(obj, Mapping) else obj
    items: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2
                and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                "gs.fingerprint takes a module, a mapping of names to tensors or "
                f"(name, tensor) pairs; got an item of type {type(item).__name__}"
            )
        if item[0] in seen:
            raise ValueError(f"gs.fingerprint: {item[0]!r} appears twice")
        seen.add(item[0])
        items.append(item)
    return items
