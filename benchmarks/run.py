"""graphsafe's performance figures, each measured side by side with its baseline.

    python benchmarks/run.py [--json] [--quick] [--device cpu|cuda] [--threads N]
                             [--only 1,2,4c] [--repeats N] [--profile]

Prints one table: per figure, graphsafe's median time (or bytes), the baseline measured
in the same run, their ratio, the target and whether it is met; the absolute numbers
follow under the table. `--json` prints the same as JSON, and nothing else, on stdout.
`--quick` is a smoke run of a few seconds with tiny sizes: its numbers mean nothing.
`--only` takes figures (`5`) and rows (`4c`: figure 4 measures that row alone), run in
the order named;
`--repeats` sets the samples per case (fewer: a shorter run, noisier medians).
The exit status is 0 whatever the figures measure, and 1 when one raised (it is printed
as SKIP, its traceback on stderr: an internal it reads may have moved); see README.md for
how to read each row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from audit import fig10
from figures import FIGURES as _FIGURES
from figures import Ctx, Sizes, warm
from fingerprint import fig13
from harness import MALLOC, Row, add_machine_args, fmt_bytes, machine, why
from observer import fig8
from provenance import fig11
from reach import fig9
from refresh_graph import fig14
from verify_oracle import fig12

import graphsafe

FIGURES = {**_FIGURES, "8": fig8, "9": fig9, "10": fig10, "11": fig11, "12": fig12,
           "13": fig13, "14": fig14}
"""Figure number to function, in order: figures.py's, the write observer's, the walk's,
the content audit's, provenance's, verify's oracle's, gs.fingerprint's, and the prototype
of a refresh captured as one CUDA graph."""


def parse_only(only: str) -> tuple[list[str], dict[str, set[str]]]:
    """`--only`'s figures in the order first named, and the rows asked of the figures
    named by row only.

    Args:
        only: Comma-separated figures and rows, e.g. "14,5d,5e,1"; "" for every figure in
            the order of `FIGURES`.

    Returns:
        (figures to run, figure -> rows asked of it); a figure also named whole is not in
        the second: it runs whole.

    Raises:
        ValueError: A figure that does not exist, or a row id that is not one.

    Example:
        >>> parse_only("5,4c")
        (['5', '4'], {'4': {'4c'}})
    """
    tokens = [t.strip() for t in only.split(",") if t.strip()]
    order: list[str] = []
    whole: set[str] = set()
    rows: dict[str, set[str]] = {}
    for token in tokens:
        figure = token.rstrip("abcdefghijklmnopqrstuvwxyz")
        if figure not in FIGURES or (figure != token and not token[len(figure):].isalpha()):
            raise ValueError(f"unknown figure or row {token!r}; figures: {list(FIGURES)}")
        if figure not in order:
            order.append(figure)
        if figure == token:
            whole.add(figure)
        else:
            rows.setdefault(figure, set()).add(token)
    for figure in whole:
        rows.pop(figure, None)
    return order or list(FIGURES), rows


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B":
        return fmt_bytes(value)
    for name, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {name}"
    return f"{value * 1e9:.3g} ns"


def _verdict(row: Row) -> str:
    if row.skipped:
        return "SKIP"
    if row.passed is None:
        return "info"
    return "pass" if row.passed else "MISS"


def emit(rows: list[Row], meta: dict[str, Any], *, as_json: bool) -> None:
    """Print the rows: as JSON and nothing else, or as the table."""
    if as_json:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, sys.stdout, indent=1,
                  default=str)
        sys.stdout.write("\n")
    else:
        print(table(rows, meta))


def table(rows: list[Row], meta: dict[str, Any]) -> str:
    """The results as one text table, then each row's absolute numbers and notes."""
    head = ("fig", "measure", "graphsafe", "baseline", "baseline is", "ratio =", "ratio",
            "target", "")
    lines: list[tuple[str, ...]] = []
    for r in rows:
        target = f"{r.op} {r.target:.3g}" if r.target is not None else "-"
        lines.append((
            r.figure, r.name, _fmt(r.value, r.unit), _fmt(r.baseline, r.unit),
            r.baseline_name or "-", r.ratio_def or "-",
            f"{r.ratio:.3f}" if r.ratio is not None else "-", target, _verdict(r),
        ))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]

    def fmt_line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [
        "graphsafe benchmarks: " + ", ".join(f"{k} {_detail(k, v)}" for k, v in meta.items()),
        "",
        fmt_line(head),
        fmt_line(tuple("-" * w for w in widths)),
    ]
    out += [fmt_line(x) for x in lines]
    out.append("")
    for r in rows:
        if r.skipped:
            out.append(f"{r.figure}: skipped: {r.skipped}")
            continue
        shown = {k: v for k, v in r.details.items() if k != "cprofile"}
        if shown:
            text = "; ".join(f"{k} {_detail(k, v)}" for k, v in shown.items())
            out.append(f"{r.figure}: {text}")
    return "\n".join(out)


def _detail(key: str, value: Any) -> str:
    """A detail's value; keys ending in `_s` hold seconds."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {_detail(k, v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return _fmt(value, "s") if key.endswith("_s") else f"{value:.4g}"
    return str(value)


def _progress(fig: str, seconds: float, rows: list[Row]) -> None:
    """One line on stderr per figure as it ends, so that a run cut short still shows what
    it measured."""
    got = ", ".join(
        f"{r.figure} SKIP" if r.skipped else f"{r.figure} {r.ratio:.3g}" if r.ratio is not None
        else f"{r.figure} {_fmt(r.value, r.unit)}" for r in rows
    )
    print(f"run.py: figure {fig} took {seconds} s: {got}", file=sys.stderr, flush=True)


def _loadavg() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:  # not available on this platform
        return "?"


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the figures, print the table or the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only, on stdout")
    add_machine_args(parser)
    parser.add_argument("--only", default="",
                        help="comma-separated figures and rows, e.g. 1,4c,5 (rows: that "
                        "figure measures those rows alone)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="samples per case (default 21, 3 with --quick)")
    parser.add_argument("--profile", action="store_true",
                        help="also print cProfiles: figure 2's refresh, 4's loads, 5c's guard, "
                        "11a/11b's recorded first loads")
    args = parser.parse_args(argv)
    device = machine(args, parser)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats: at least 1")
    sizes = (Sizes.quick() if args.quick else Sizes.full()).with_repeats(args.repeats)
    try:
        wanted, asked = parse_only(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    ctx = Ctx(device=device, sizes=sizes, profile=args.profile, rows=asked)
    rows: list[Row] = []
    raised = False
    load_before = _loadavg()
    start = time.perf_counter()
    warm(ctx)
    per_figure: dict[str, float] = {}
    for i, fig in enumerate(wanted):
        began = time.perf_counter()
        try:
            got = FIGURES[fig](ctx)
        except Exception as exc:  # one broken figure must not hide the others
            traceback.print_exc(file=sys.stderr)
            got = [Row(fig, f"figure {fig}", skipped=why(exc))]
            raised = True
        except KeyboardInterrupt:  # SIGINT, e.g. `timeout -s INT`: report what was measured
            rows.append(Row(fig, f"figure {fig}", skipped=(
                f"interrupted after {time.perf_counter() - began:.1f} s; not run: "
                f"{', '.join(wanted[i:])}")))
            raised = True
            break
        ctx.clock.sync()
        per_figure[fig] = round(time.perf_counter() - began, 1)
        # A figure measures only the rows asked of it; rows measured together (1a with
        # 1b) are kept only when asked for too.
        got = [r for r in got if ctx.wants(r.figure)]
        skipped_whole = any(r.figure == fig and r.skipped for r in got)  # says why itself
        for row_id in sorted(ctx.rows.get(fig, set()) - {r.figure for r in got}):
            if skipped_whole:
                break
            rows_of = ", ".join(r.figure for r in got) or "none"
            got.append(Row(row_id, "no such row", skipped=(
                f"figure {fig} gave no row {row_id} (it gave: {rows_of})")))
            raised = True
        rows += got
        _progress(fig, per_figure[fig], got)
    raised = raised or bool(ctx.failed)
    cpu = f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "torch": torch.__version__,
        "graphsafe": graphsafe.__version__,
        "mode": "quick" if args.quick else "full",
        "repeats": sizes.repeats,
        "seconds": round(time.perf_counter() - start, 1),
        "seconds_per_figure": per_figure,
        # Other processes' load before / after (1-minute average; vs the core count).
        "loadavg": f"{load_before} / {_loadavg()} on {os.cpu_count()} cores",
        "malloc": MALLOC[0],
    }
    emit(rows, meta, as_json=args.json)
    if not args.json:
        for text in ctx.profiles if args.profile else ():
            print()
            print(text)
    sys.stdout.flush()
    return 1 if raised else 0


if __name__ == "__main__":
    sys.exit(main())
