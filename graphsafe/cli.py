"""The `graphsafe` command line. Its main job is `graphsafe verify`."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

import torch

from graphsafe import __version__, _native
from graphsafe._errors import GraphSafetyError
from graphsafe._verify import (
    VerifyReport,
    VerifyTarget,
    format_report,
    load_target,
    run_verify,
    run_verify_pp,
)
from graphsafe._verify.pp.pipeline import DEFAULT_TIMEOUT
from graphsafe._verify.pp.processes import in_rank_process
from graphsafe._verify.target import BUILTIN_TARGETS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name; `sys.argv[1:]` by default.

    Returns:
        The exit status: 0 when verify passed.

    Examples:
        From a shell, `graphsafe verify --refits 1 --json` is `main(["verify",
        "--refits", "1", "--json"])`; it prints the report and returns 0 when it passed.
    """
    parser, commands = _parsers()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's own usage, not the top-level one
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "native":
        return _native_command(args.action)
    return _verify_command(args)


def _verify_command(args: argparse.Namespace) -> int:
    if args.refits < 1:
        return _usage("--refits must be at least 1")
    if args.seed < 0:
        # `random.Random` seeds with the absolute value: -1 would run as seed 1.
        return _usage(f"--seed must be 0 or more: expected an integer >= 0, got {args.seed}")
    if args.pp is not None and args.pp < 1:
        return _usage("--pp must be at least 1")
    if args.timeout is not None:
        if args.pp is None:
            return _usage("--timeout only applies with --pp: it is how long a pipeline "
                          "rank may wait for another (add --pp N, or drop --timeout)")
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            return _usage(f"--timeout must be a positive number of seconds, got "
                          f"{args.timeout:g} (e.g. --timeout 60)")
    try:
        target = load_target(args.target)
    except GraphSafetyError as exc:
        return _usage(f"--target: {exc}")
    if not target.presets:
        return _usage(f"--target: {target.name} has no presets; give its `presets` a name "
                      "build() accepts")
    if args.preset is None:  # the target's own first preset
        args.preset = target.presets[0]
    try:
        if args.preset not in target.presets:
            return _usage(f"unknown preset {args.preset!r} for {target.name}; "
                          f"choose one of {', '.join(target.presets)}")
        if args.backend == "cuda" and not torch.cuda.is_available():
            return _usage("--backend cuda needs a GPU; none is visible")
        report = _run(args, target)
    except GraphSafetyError as exc:
        if in_rank_process():
            # A `--pp` rank importing the caller's script again, which called this at its
            # top level: the rank must stop here, so that the run names the cause.
            raise
        print(f"graphsafe verify: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(report.model_dump_json(indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def _run(args: argparse.Namespace, target: VerifyTarget) -> VerifyReport:
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.pp is not None:
        return run_verify_pp(
            target, pp=args.pp, preset=args.preset, backend=args.backend,
            refits=args.refits, seed=args.seed, progress=say,
            timeout=DEFAULT_TIMEOUT if args.timeout is None else args.timeout,
            oracle=args.oracle, audit=args.audit,
        )
    return run_verify(
        target, preset=args.preset, backend=args.backend, refits=args.refits,
        seed=args.seed, oracle=args.oracle, audit=args.audit, progress=say,
    )


def _usage(message: str) -> int:
    print(f"graphsafe verify: {message}", file=sys.stderr)
    return 2


def _native_command(action: str) -> int:
    if action == "status":
        print(f"guard: {_native.describe()}")
        return 0
    try:
        lib, seconds = _native.timed_build()
    except _native.NativeBuildError as exc:
        print(f"graphsafe native build: {exc}", file=sys.stderr)
        return 1
    print(f"graphsafe native build: built {lib} in {seconds:.0f} s")
    return 0


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each subcommand's by name (for its own usage)."""
    parser = argparse.ArgumentParser(
        prog="graphsafe",
        description="Keep derived buffers correct under captured graphs across weight reloads.",
    )
    parser.add_argument("--version", action="version",
                        version=f"graphsafe {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="capture a model, refit it in buckets, replay, and compare to a fresh model",
        description="Capture the forward of a model as a graph, load new weights bucket by "
        "bucket several times; after each refit replay, audit the derived tensors, and "
        "compare with a model built fresh from the same checkpoint; then show that the "
        "naive variant goes stale and that the guard catches it. Exit 0 only if every "
        "refit is exact, nothing is stale, and the control is detected.",
    )
    verify.add_argument(
        "--target", "--model", default="deepseek_v4",
        help="model family: an entry point of group graphsafe.targets (deepseek_v4, llama), "
        "or module:attribute (default: deepseek_v4)",
    )
    verify.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto",
                        help="graph backend; auto: CUDA graphs when a GPU is present")
    verify.add_argument("--refits", type=int, default=3, help="number of refits (default 3)")
    verify.add_argument(
        "--preset", default=None,
        help=f"the target's size preset: {_builtin_presets()}; default: the target's first",
    )
    verify.add_argument("--seed", type=int, default=0,
                        help="seed of weights and buckets, 0 or more (default 0)")
    verify.add_argument(
        "--oracle", choices=("fresh", "self"), default="fresh",
        help="what each replay is compared with: fresh (default), a model built anew from "
        "the refit's checkpoint, its parameters and derived buffers compared too; self, "
        "the model's own eager forward, which reads the same derived state as the replay "
        "(the check before the fresh oracle: blind to writes graphsafe does not see)",
    )
    verify.add_argument("--no-audit", dest="audit", action="store_false",
                        help="skip the content audit (graphsafe.audit) after every refit")
    verify.add_argument("--json", action="store_true",
                        help="print the report as JSON on stdout, nothing else")
    verify.add_argument(
        "--pp", type=int, default=None, metavar="N",
        help="distributed mode: a trainer process and N pipeline-stage processes on "
        "loopback (gloo); the trainer syncs each refit's weights to the stages, which "
        "replay their graphs in order, and the last stage's logits are compared with the "
        "trainer's eager ones",
    )
    verify.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="only with --pp: seconds a rank may wait for another before it "
                        f"fails (default {DEFAULT_TIMEOUT:g}; a rank that dies is noticed at "
                        "once)")
    native = sub.add_parser(
        "native",
        help="build the guard's compiled checks, or say which path the guard takes",
        description="`build` compiles the guard's flat checks, the load-time write tracker "
        "and the process-wide write observer (C++, about a minute) for the installed torch "
        "and Python, now (the first use that needs them builds them when missing); the "
        "guard then costs nanoseconds per tensor instead of about a microsecond. Without "
        "them the guard takes its Python path, with the same answers. `status` says which "
        "path the guard takes here, and builds nothing.",
    )
    native.add_argument("action", choices=("build", "status"))
    return parser, {"verify": verify, "native": native}


def _builtin_presets() -> str:
    """graphsafe's own targets and their presets, for `verify --help`."""
    parts = []
    for name in BUILTIN_TARGETS:
        try:
            presets = load_target(name).presets
        except GraphSafetyError:  # not importable here: its presets are not known
            continue
        parts.append(f"{name}: {', '.join(presets)}")
    return "; ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
