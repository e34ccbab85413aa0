"""`gs.fingerprint` is the digest its definition says, on every path, in every process.

The definition is `graphsafe._fingerprint.digest`'s docstring, written out in plain Python
as `reference_digest`; the compiled kernel (each of its loops), the torch formulation
(`GRAPHSAFE_NATIVE=0`) and, on a GPU, the Triton kernel are held to it. The properties
that make it a check: it reads the logical values (views and copies agree), it covers
dtype and shape, and any flipped bit of the tensor changes it, while a flipped bit of
the same storage outside the tensor does not (the control: a digest of the storage, or
of anything but the tensor's bytes, fails one of the two).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsafe as gs
from graphsafe._fingerprint import gpu
from graphsafe._fingerprint.digest import Digests, Pieces, hexdigest, reference_digest
from graphsafe._fingerprint.torch_sums import torch_sums
from graphsafe._native import loader

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8,
          torch.uint8, torch.int64, torch.bool, torch.complex64)


def _native_or_skip() -> object:
    native = loader.get()
    if native is None:
        pytest.skip(f"the compiled kernel is not loaded here: {loader.describe()}")
    return native


def _paths() -> list[bool]:
    """The paths this process can take: the compiled one when it is built, and torch's."""
    return [True, False] if loader.get() is not None else [False]


def _fp(t: torch.Tensor, native: bool) -> str:
    with loader.using(native):
        return gs.fingerprint({"t": t})["t"]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of `dtype` with random bits (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 97), seed=st.integers(0, 2**16))
def test_every_path_gives_the_digest_of_the_definition(dtype: torch.dtype, n: int,
                                                        seed: int) -> None:
    t = _random(dtype, (n,), seed)
    want = reference_digest(_bytes(t), dtype, (n,))
    for native in _paths():
        assert _fp(t, native) == want, native


def test_every_loop_of_the_compiled_kernel_and_its_threads_agree_with_torch() -> None:
    native = _native_or_skip()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # tensors over 8 MiB are split between threads
    try:
        for nbytes in (0, 5, 64, 127, 129, 1000, 4096 * 8 + 13, (10 << 20) + 3):
            flat = _random(torch.uint8, (nbytes + 3,), nbytes)[3:]  # unaligned, too
            want = tuple(s & (2**64 - 1) for s in torch_sums(flat).tolist())
            for level in range(native.fingerprint_level() + 1):  # type: ignore[attr-defined]
                assert native.fingerprint_sums(flat, level) == want, (nbytes, level)  # type: ignore[attr-defined]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("native", _paths(), ids=lambda n: "native" if n else "torch")
def test_a_digest_reads_logical_values_and_covers_dtype_and_shape(native: bool) -> None:
    w = _random(torch.float32, (30, 17), 1)
    same = [w.t(), w.t().contiguous(), w.t().clone(memory_format=torch.contiguous_format)]
    assert len({_fp(t, native) for t in same}) == 1  # a view and its copies
    wide = _random(torch.bfloat16, (64, 33), 2)
    assert _fp(wide[:, 1:], native) == _fp(wide[:, 1:].contiguous(), native)  # odd offsets
    c = torch.randn(5, dtype=torch.complex64)
    assert _fp(c.conj(), native) == _fp(c.conj().resolve_conj(), native)
    # Control: the same bytes as another shape or dtype are another tensor.
    assert _fp(w, native) != _fp(w.reshape(17, 30), native)
    assert _fp(w, native) != _fp(w.view(torch.int32), native)
    assert _fp(w, native) != _fp(w.t(), native)


def test_every_path_gives_the_same_digests_for_a_module() -> None:
    model = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5))
    model.register_buffer("steps", torch.arange(3))
    model.register_buffer("derived", torch.ones(2), persistent=False)
    digests = [gs.fingerprint(model) if native is None else _with(native, model)
               for native in (None, *_paths())]
    assert all(d == digests[0] for d in digests)
    assert list(digests[0]) == list(model.state_dict())  # by state_dict name, in order
    assert "derived" not in digests[0]  # derived buffers are not checkpoint content
    before = digests[0]
    with torch.no_grad():
        model[1].bias[2] += 1
    after = gs.fingerprint(model)
    assert [n for n in before if before[n] != after[n]] == ["1.bias"]


def _with(native: bool, model: nn.Module) -> dict[str, str]:
    with loader.using(native):
        return dict(gs.fingerprint(model))


def _flipped(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    out = t.clone()
    out.view(torch.uint8).view(-1)[byte] ^= 1 << bit
    return out


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(DTYPES[:-1]), n=st.integers(1, 70), data=st.data())
def test_any_flipped_bit_changes_the_digest_and_control_a_bit_outside_the_tensor_does_not(
    dtype: torch.dtype, n: int, data: st.DataObject
) -> None:
    storage = _random(dtype, (n + 2,), n)  # the tensor is its middle n elements
    t = storage[1:-1]
    size = t.element_size()
    byte = data.draw(st.integers(0, n * size - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    for native in _paths():
        before = _fp(t, native)
        changed = _flipped(t, byte, bit)
        assert _fp(changed, native) != before, (native, byte, bit)
        # Control: the same flip in the storage just outside the tensor changes nothing.
        outside = storage.clone()
        around = [*range(size), *range((n + 1) * size, (n + 2) * size)]
        outside.view(torch.uint8)[data.draw(st.sampled_from(around), label="outside")] ^= (
            1 << bit)
        assert _fp(outside[1:-1], native) == before


_CHILD = """
import json, sys, torch
import graphsafe as gs
g = torch.Generator().manual_seed(7)
named = {
    "w": torch.randn(33, 17, generator=g).t(),
    "h": torch.randn(9, generator=g).to(torch.bfloat16),
    "q": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
    "i": torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
}
if sys.argv[1] == "flip":
    named["h"].view(torch.uint8)[5] ^= 1
print(json.dumps(dict(gs.fingerprint(named))))
"""


def _child(native: str, variant: str) -> dict[str, str]:
    env = dict(os.environ, GRAPHSAFE_NATIVE=native)
    done = subprocess.run([sys.executable, "-c", _CHILD, variant], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_digests_are_equal_across_processes_and_paths_and_control_one_flipped_bit_differs():
    same = [_child(native, "same") for native in ("1", "0")]
    assert same[0] == same[1]
    flip = _child("1", "flip")
    assert [n for n in same[0] if same[0][n] != flip[n]] == ["h"]  # the control


def test_some_names_of_a_module_in_their_order_and_an_unknown_name_is_named() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    every = gs.fingerprint(model)
    some = gs.fingerprint(model, ["1.bias", "0.weight"])
    assert list(some.items()) == [("1.bias", every["1.bias"]), ("0.weight", every["0.weight"])]
    with pytest.raises(KeyError, match=r"no entry '2\.weight'"):
        gs.fingerprint(model, ["0.weight", "2.weight"])


def test_what_has_no_fingerprint_is_named() -> None:
    with pytest.raises(TypeError, match=r"cannot fingerprint 'm': a meta tensor"):
        gs.fingerprint({"m": torch.empty(3, device="meta")})
    with pytest.raises(TypeError, match=r"cannot fingerprint 's': a torch.sparse_coo"):
        gs.fingerprint({"s": torch.eye(3).to_sparse()})
    with pytest.raises(ValueError, match="'a' appears twice"):
        gs.fingerprint([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(TypeError, match="got an item of type list"):
        gs.fingerprint([["a", torch.zeros(1)]])  # type: ignore[list-item]


def _by_pieces(t: torch.Tensor, cuts: list[int], order: list[int],
               at: dict[int, int] | None = None) -> str:
    """`t`'s digest from its bytes cut at `cuts`, the pieces added in `order` (`at`: a
    piece added at another byte than its own, the control)."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    edges = [0, *cuts, flat.numel()]
    pieces = Pieces(1)
    for k in order:
        lo, hi = edges[k], edges[k + 1]
        pieces.add(0, flat[lo:hi], (at or {}).get(k, lo))
    return hexdigest(pieces.done([(t.dtype, tuple(t.shape))])[0])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16), data=st.data())
def test_pieces_in_any_split_and_order_give_the_digest(n: int, seed: int,
                                                       data: st.DataObject) -> None:
    t = _random(torch.bfloat16, (n,), seed)
    words = -(-2 * n // 8)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, words - 1)), max_size=6)))
    cuts = [8 * c for c in cuts if 8 * c < 2 * n]
    order = data.draw(st.permutations(range(len(cuts) + 1)))
    for native in _paths():
        with loader.using(native):
            assert _by_pieces(t, cuts, order) == _fp(t, native), (native, cuts)


@pytest.mark.parametrize("native", _paths(), ids=lambda n: "native" if n else "torch")
def test_pieces_are_summed_at_their_positions_and_control_a_piece_misplaced_differs(
    native: bool,
) -> None:
    t = _random(torch.float32, (3 << 20,), 5)  # 12 MiB: the kernel's threads split it
    cuts = [4 << 20, (8 << 20) + 64]
    with loader.using(native):
        assert _by_pieces(t, cuts, [2, 0, 1]) == _fp(t, native)
        # Control: the same bytes, the first two pieces each summed at the other's place
        # (or both at byte 0: no position at all), are another digest.
        assert _by_pieces(t, [4 << 20, 8 << 20], [0, 1, 2], {0: 4 << 20, 1: 0}) != _fp(
            t, native)
        assert _by_pieces(t, cuts, [0, 1, 2], {1: 0, 2: 0}) != _fp(t, native)
        with pytest.raises(ValueError, match="starts at byte 12, inside a word"):
            Pieces(1).add(0, t.view(torch.uint8)[12:20], 12)


def _view_of(base: torch.Tensor, kind: str) -> torch.Tensor:
    """A view of `base` ([rows, cols]) the way trainers hand tensors to a sync."""
    rows, cols = base.shape
    return {
        "contiguous": base,
        "transposed": base.t(),
        "offset": base[1:, 1:] if rows > 1 and cols > 1 else base[:, 1:],
        "transposed offset": base[:, 1:].t(),
        "strided": base[::2, ::3],
        "permuted": base.reshape(rows, 1, cols).permute(2, 1, 0),
        "row": base[rows // 2],
        "column": base[:, cols // 2],
    }[kind]


def _packed(t: torch.Tensor, at: int, native: bool) -> tuple[str, torch.Tensor]:
    """`t` packed into a bucket at byte `at` with its fingerprint, as the sender packs an
    entry (`Digests.add(..., into=)`): the digest and the bucket."""
    bucket = torch.zeros(at + t.numel() * t.element_size() + 8, dtype=torch.uint8)
    slot = bucket[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    digests = Digests()
    with loader.using(native):
        digests.add(t, "t", into=slot)
    return hexdigest(digests.done()[0]), bucket


def _received(t: torch.Tensor, bucket: torch.Tensor, at: int) -> str:
    """The fingerprint a receiver takes of the entry's bytes in `bucket` (`Pieces`)."""
    pieces = Pieces(1)
    pieces.add(0, bucket[at : at + t.numel() * t.element_size()], 0)
    return hexdigest(pieces.done([(t.dtype, tuple(t.shape))])[0])


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                              torch.int8, torch.complex64)),
       rows=st.integers(2, 300), cols=st.integers(2, 300),
       kind=st.sampled_from(("contiguous", "transposed", "offset", "transposed offset",
                             "strided", "permuted", "row", "column")),
       at=st.sampled_from((0, 8, 64)), seed=st.integers(0, 2**16))
def test_packing_digests_the_logical_bytes_it_copies_and_control_a_flip_after_is_caught(
    dtype: torch.dtype, rows: int, cols: int, kind: str, at: int, seed: int
) -> None:
    """The sender's packing (one pass: read, copy into the bucket, digest) gives
    `gs.fingerprint` of the tensor and the tensor's logical bytes in the bucket, for views
    of every layout (the larger ones span several of the kernel's chunks, whose words
    straddle them); the receiver's fingerprint of the bucket equals it, until a byte of
    the bucket is flipped after packing (the control)."""
    t = _view_of(_random(dtype, (rows, cols), seed), kind)
    want = reference_digest(_bytes(t), dtype, tuple(t.shape)) if t.numel() < 4096 else None
    for native in _paths():
        digest, bucket = _packed(t, at, native)
        assert digest == _fp(t, native), (native, kind)
        assert want is None or digest == want
        assert _bytes(bucket[at : at + t.numel() * t.element_size()]) == _bytes(t)
        assert _received(t, bucket, at) == digest
        bucket[at + (seed % (t.numel() * t.element_size()))] ^= 0x10  # after packing
        assert _received(t, bucket, at) != digest, (native, kind)


def test_every_loop_packs_a_transposed_view_in_its_logical_order_and_control_memory_order(
) -> None:
    """Each loop of the compiled kernel, on torch's threads: the bucket gets the logical
    bytes and the sums are theirs; the control, the same bytes in memory order (what a
    kernel reading the storage straight would digest), is another digest."""
    native = _native_or_skip()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # tensors over 8 MiB are split between threads
    try:
        for t in (_random(torch.float32, (1500, 1501), 1).t(),  # 9 MiB, many chunks
                  _random(torch.int8, (3, 70001), 2)[:, 1:].t(),  # rows of 3 bytes
                  _random(torch.bfloat16, (5, 9000, 3), 3).permute(2, 0, 1)):
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            want = tuple(s & (2**64 - 1) for s in torch_sums(flat).tolist())
            for level in range(native.fingerprint_level() + 1):  # type: ignore[attr-defined]
                out = torch.zeros_like(flat)
                assert native.fingerprint_sums(t, level, out) == want, level  # type: ignore[attr-defined]
                assert torch.equal(out, flat)
                assert native.fingerprint_sums(t, level) == want, level  # type: ignore[attr-defined]
            memory = torch.as_strided(t, (t.numel(),), (1,)).view(torch.uint8)
            assert not torch.equal(memory, flat)
            assert tuple(s & (2**64 - 1) for s in torch_sums(memory).tolist()) != want
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fingerprint_cuda_paths_equal_the_cpu_digests() -> None:
    """The Triton kernel and the torch formulation on the device give the CPU's digests
    (only a GPU run confirms `gpu.py`)."""
    assert gpu.available(), "Triton is not importable: only the torch formulation ran"
    cases = [_random(dtype, (n,), n) for dtype in DTYPES for n in (0, 1, 7, 4099, 70001)]
    cases += [_random(torch.float32, (300, 257), 3).t(), _random(torch.bfloat16, (9999,))[3:]]
    cpu = [gs.fingerprint({"t": t})["t"] for t in cases]
    assert [gs.fingerprint({"t": t.cuda()})["t"] for t in cases] == cpu
    for t in cases:  # the torch formulation on the device: the same sums as the kernel
        flat = t.cuda().contiguous().reshape(-1).view(torch.uint8)
        assert torch_sums(flat).tolist() == gpu.sums(flat).tolist()
        assert torch_sums(flat[8:], 1).tolist() == gpu.sums(flat[8:], 1).tolist()
    t = cases[-3]  # pieces on the device, the Triton kernel's word offsets among them
    assert _by_pieces(t.cuda(), [8, 4096 * 8 + 64], [2, 0, 1]) == cpu[-3]
