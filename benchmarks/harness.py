"""Measuring on a noisy machine: interleaved repeats, medians, synchronized clocks, peaks.

Every figure compares graphsafe with a baseline measured in the same process, in the same
loop: each repeat runs every case once (A, B, A, B, ...; the order flips on every other
repeat so that a slow drift of the machine hurts no case more than another), and a
figure reports medians. Nothing here holds a threshold: `run.py` compares the medians
with the targets and prints them; tests only check that the script runs.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import dataclasses
import gc
import pstats
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from graphsafe._lineage.window import end_here

__all__ = [
    "add_machine_args",
    "machine",
    "Clock",
    "Row",
    "Stat",
    "fmt_bytes",
    "gbps",
    "interleave",
    "paired",
    "paired_diff",
    "peak_extra_bytes",
    "profile_per_item",
    "why",
]


class Clock:
    """Wall time of a call; on CUDA, synchronized before and after.

    Args:
        device: Where the work runs.

    Example:
        >>> Clock(torch.device("cpu")).time(lambda: None) >= 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        """Wait for the device, so that the next clock read sees finished work."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any], number: int = 1) -> float:
        """Seconds per call of `fn`, over `number` back-to-back calls.

        Args:
            fn: What to time.
            number: Calls in one sample (for operations too short to time alone).

        Returns:
            Mean seconds per call within this sample.
        """
        self.sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        self.sync()
        return (time.perf_counter() - start) / number


@dataclasses.dataclass(frozen=True)
class Stat:
    """The samples of one case: median and quartiles, in seconds (or bytes)."""

    median: float
    q1: float
    q3: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: list[float]) -> Stat:
        """Summarize samples (at least one), keeping them in order of measurement."""
        if len(samples) == 1:
            return cls(samples[0], samples[0], samples[0], tuple(samples))
        q = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(statistics.median(samples), q[0], q[2], tuple(samples))

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median (0.05: quartiles 5% apart)."""
        return (self.q3 - self.q1) / self.median if self.median else 0.0


def paired(num: Stat | list[float], den: Stat | list[float]) -> float:
    """The median over repeats of `num_i / den_i`: the robust ratio of two cases.

    Sample `i` of each case comes from the same repeat of `interleave`, so the two were
    measured next to each other in time; a burst of load on the machine then inflates
    both, and their ratio much less than either.

    Args:
        num: The numerator's samples (a `Stat` or a list).
        den: The denominator's samples, as many (extra leading ones are dropped).

    Returns:
        The median of the per-repeat ratios.

    Example:
        >>> paired([2.0, 4.0, 30.0], [1.0, 2.0, 10.0])
        2.0
    """
    a = list(num.samples if isinstance(num, Stat) else num)
    b = list(den.samples if isinstance(den, Stat) else den)
    k = min(len(a), len(b))
    return statistics.median(x / y for x, y in zip(a[-k:], b[-k:]))


def paired_diff(a: Stat, b: Stat) -> float:
    """The median over repeats of `a_i - b_i` (see `paired`).

    Example:
        >>> paired_diff(Stat.of([3.0, 5.0, 40.0]), Stat.of([1.0, 2.0, 10.0]))
        3.0
    """
    return statistics.median(x - y for x, y in zip(a.samples, b.samples))


@contextmanager
def _quiet_gc() -> Iterator[None]:
    """No garbage collection pauses inside timed loops (collected once before)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def interleave(
    cases: dict[str, Callable[[], float]], repeats: int, warmup: int = 1
) -> dict[str, Stat]:
    """Run the cases in turn, `repeats` times each, and summarize each case's samples.

    Each case is a callable that does its own untimed setup, times what it measures
    (usually with `Clock.time`) and returns seconds, so that a case can, for example,
    write inputs before timing a refresh, or read a refresh report.

    Args:
        cases: Name to case; insertion order is the order of the first repeat.
        repeats: Samples per case.
        warmup: Untimed rounds first (caches, lazy imports, allocator pools).

    Returns:
        Name to the summary of its samples.

    Example:
        >>> stats = interleave({"a": lambda: 1.0, "b": lambda: 2.0}, repeats=3)
        >>> stats["b"].median
        2.0
    """
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with _quiet_gc():
        for _ in range(warmup):
            for name in names:
                cases[name]()
                end_here()
        for r in range(repeats):
            for name in names if r % 2 == 0 else reversed(names):
                samples[name].append(cases[name]())
                # A recorded first load leaves its thread recording until the model's
                # first forward (the bring-up's tail): not into the next case's sample.
                end_here()
    return {name: Stat.of(s) for name, s in samples.items()}


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated by `fn` above what was allocated when it started, measured.

    On CUDA: `torch.cuda.max_memory_allocated` after a reset of the peak. On the CPU:
    the allocator's own events, recorded by `torch.profiler` with `profile_memory=True`:
    every allocation and free of the CPU allocator during `fn`, with its size, in time
    order; the peak is the maximum of their running sum. Memory that `fn` frees but had
    not allocated itself makes the running sum dip below zero; the peak is never below 0.

    Args:
        fn: The work to measure (called once).
        device: Where it allocates.

    Returns:
        Peak extra bytes during `fn`.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = getattr(torch.autograd, "DeviceType").CPU  # noqa: B009  (not re-exported in stubs)
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in (results.events() if results is not None else ())
        if e.name() == "[memory]" and e.device_type() == cpu
    )
    peak = live = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@dataclasses.dataclass
class Row:
    """One line of the results table.

    `value` is graphsafe's measurement and `baseline` the reference measured in the same
    run, both in `unit` ("s" or "B"); `ratio` is computed as `ratio_def` says, and
    passes when `ratio <op> target` (op is "<=" or ">="). A row without a target is
    informational; a row with `skipped` set could not be measured, and says why.
    """

    figure: str
    name: str
    value: float | None = None
    baseline: float | None = None
    baseline_name: str = ""
    ratio: float | None = None
    ratio_def: str = ""
    op: str = ""
    target: float | None = None
    unit: str = "s"
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    skipped: str = ""

    @property
    def passed(self) -> bool | None:
        """True or False against the target; None when there is none or no ratio."""
        if self.target is None or self.ratio is None or self.skipped:
            return None
        return self.ratio <= self.target if self.op == "<=" else self.ratio >= self.target

    def as_dict(self) -> dict[str, Any]:
        """The row as plain JSON-ready values."""
        out = dataclasses.asdict(self)
        out["passed"] = self.passed
        return out


def profile_per_item(
    fn: Callable[[], Any], count: int, what: str, item: str, rounds: int = 5, per: int = 1
) -> tuple[str, list[tuple[str, int, float]]]:
    """cProfile of `fn`, as self time per item (per derivation, per parameter, ...).

    Args:
        fn: What to profile (called `rounds` times).
        count: Items that one call of `fn` handles.
        what: Name of `fn` for the heading.
        item: Name of one item for the heading.
        rounds: Calls profiled.
        per: Report the self time of this many items (1000: per 1,000 inputs).

    Returns:
        The listing as text, and its top rows: (function, calls per call of `fn`, self
        microseconds per `per` items). A profiler inflates Python calls: read shares, not
        times. Garbage collection is paused, as in the timed samples (`interleave`): a
        collection would be charged to whichever function allocated when it ran.
    """
    prof = cProfile.Profile()
    with _quiet_gc():
        prof.enable()
        for _ in range(rounds):
            fn()
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    rows = []
    scale = per / count * 1e6 / rounds
    for (file, line, func), (_, ncalls, tottime, _, _) in stats.items():
        where = f"{file.rsplit('/', 1)[-1]}:{line}({func})" if line else func
        rows.append((where, ncalls // rounds, tottime * scale))
    rows.sort(key=lambda x: -x[2])
    top = rows[:14]
    unit = item if per == 1 else f"{per:,} {item}s"
    lines = [f"cProfile of {what} over {count:,} {item}s (self time per {unit}):"]
    lines += [f"  {us:7.2f} us  {calls:>7}x  {where}" for where, calls, us in top]
    lines.append(f"  {total * scale:7.2f} us  total under the profiler")
    return "\n".join(lines), [(w, c, round(us, 3)) for w, c, us in top]


def fmt_bytes(n: float) -> str:
    """`1.5 MiB`, `4 KiB`, `12 B`."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def gbps(nbytes: int, seconds: float) -> str:
    """Bandwidth in GB/s (10^9 bytes per second)."""
    return f"{nbytes / seconds / 1e9:.1f} GB/s"


def why(exc: BaseException) -> str:
    """One line: the exception's type, where it was raised, and its first line."""
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else ""
    return f"{type(exc).__name__}{where}: {str(exc).splitlines()[0] if str(exc) else ''}"


def add_machine_args(parser: argparse.ArgumentParser, *, device: bool = True) -> None:
    """The options every benchmark script takes: --quick, --threads and (where it can
    run on a GPU) --device."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    if device:
        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                            choices=["cpu", "cuda"], help="where to run (default: cuda if any)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on the CPU (default 1; 0: torch's default)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (default: keep freed memory, see "
                        "steady_malloc)")


def machine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> torch.device:
    """Apply the options of `add_machine_args`: the thread count, the allocator, and the
    device."""
    device = torch.device(getattr(args, "device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not args.default_malloc:
        steady_malloc()
    return device


MALLOC = ["default"]
"""How `steady_malloc` left the allocator (the scripts print it with their figures)."""


def steady_malloc() -> str:
    """Keep the memory a sample frees for the next one (glibc: `M_MMAP_THRESHOLD` 32 MiB,
    `M_TRIM_THRESHOLD` 1 GiB), so that every sample of a case runs on memory already
    faulted in. Left as it is, glibc returns some freed memory to the system and keeps
    the rest, as its heap happens to lie, and a sample that allocates what the last one
    freed pays the page faults of it at random: a first load of the flash preset (354
    MiB, and as much again copied by its post-load step) took 150 ms more in some
    samples of every case, graphsafe's or not, and a ratio of two samples paired across
    the two modes says nothing. Returns what it did ("default" where there is no glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return MALLOC[0]
    m_trim_threshold, m_mmap_threshold = -1, -3
    if mallopt(m_mmap_threshold, 32 << 20) == 1 and mallopt(m_trim_threshold, 1 << 30) == 1:
        MALLOC[0] = "glibc, freed memory kept (mmap threshold 32 MiB, trim threshold 1 GiB)"
    return MALLOC[0]
