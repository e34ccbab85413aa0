"""graphsafe's hot checks compiled: one C++ call per check instead of a Python call per field.

- `checks.cpp`: the guard's flat checks (`_memory.ledger`, `_memory.snapshot`) and the
  every-load rebinding check: the Python path costs about a microsecond per tensor (each
  metadata read is a Python call), the C++ one a few nanoseconds. Both answer the same
  question, and only "nothing changed" is taken from the C++ one: when it says something
  changed, or cannot tell, the Python path finds and names the change.
- `witnesses.cpp`: the witnesses' flat check and their taking (`_memory.snapshot`), the
  same way (`sites.h`: what it and `checks.cpp` share).
- `tracker.cpp`: the load-time write tracker (`_runtime.writes.tracking.NativeWriteTracker`), a
  RecordFunction callback instead of a Python dispatch mode, a fraction of a microsecond
  per op instead of about ten.
- `observer.cpp`, `kernels.cpp`: the process-wide write observer (`_runtime.writes.observer`),
  kernels at ADInplaceOrView (or a global RecordFunction callback) noting writes into
  pinned models' storages made outside any tracked load, in every thread. No Python
  dispatch mode can do that: modes are per thread.
- `strays.cpp`: while a recording runs, the ops of threads it does not follow that touch
  the recorded weights (`_lineage.record.threads`).
- `recorder.cpp`: the provenance recorder (`_lineage.record.native`), a thread-local
  RecordFunction callback that notes the ops that write, instead of a Python dispatch
  mode's call per op.
- `fingerprint.cpp`: the fingerprint's sums on a CPU (`_fingerprint`).
- `walk.cpp`: the walk over a model (`_memory.walk`), step for step as the Python walk,
  which it asks for what it does not enter itself.
- `model_map.cpp`: the model map's check that a walk still holds
  (`_runtime.bind.model_map`).
- `map_rows.cpp`: the model map's reading of a walk, of the modules' dicts and of the
  objects on the way into its rows, and every parameter and buffer by storage
  (`_lineage.resolve.sources_of`).
- `found.cpp`: the sites a recording wrote, each with the sources its writer read where
  one step decides them (`_lineage.resolve.find`).

A built library is trusted only once it passes its self-check (`selfcheck`).

They compile into one extension for the installed torch and Python, in
`$GRAPHSAFE_CACHE/native` (default `~/.cache/graphsafe/native`). The first use that needs
it (`get()`: a guard's snapshot, a tracked load, a pin, a fingerprint on the CPU; never
`import graphsafe` nor the command line's help or status) builds it when it is missing
and a C++ compiler is there, about a minute, saying so on stderr as it starts and ends;
`graphsafe native build` (which `scripts/setup` runs) builds it ahead. Where it cannot be
built (no compiler, the compiler fails, a cache that is not trusted) or loaded, the
Python path runs, with one `GraphSafetyWarning` per process saying what that loses (the
process-wide write observer, speed) and how to get it; a failed build is not tried again
in the same process. `GRAPHSAFE_NATIVE=0` turns it off: no build, no warning.
`GRAPHSAFE_NATIVE=build` means the default.

- The library's name hashes everything it is built from: the sources, the compiler (its
  path and `--version`), the compile and link flags, torch's version and git commit,
  Python's version and the platform. A change to any of them makes a new library.
- A build holds `build.lock` in the cache (`fcntl.flock`): processes that start at once
  compile once; the others wait and take what it built.
- Every process loads the library, so it is trusted as ssh trusts a key: the library, its
  directory and `$GRAPHSAFE_CACHE` must be owned by you (the effective uid) and not
  writable by group or others. Otherwise it is not loaded or built into (the guard takes
  its Python path, `graphsafe native status` says why). Directories the loader creates
  are mode 0o700.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Set
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Protocol, cast

import torch

from graphsafe._errors import GraphSafetyWarning
from graphsafe._native import cache, selfcheck

__all__ = [
    "Native", "NativeBuildError", "announced", "build", "describe", "get", "path", "timed_build",
    "using",
]

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "checks.cpp", _HERE / "witnesses.cpp", _HERE / "tracker.cpp",
            _HERE / "observer.cpp", _HERE / "strays.cpp", _HERE / "fingerprint.cpp",
            _HERE / "recorder.cpp", _HERE / "walk.cpp", _HERE / "model_map.cpp",
            _HERE / "map_rows.cpp", _HERE / "found.cpp", _HERE / "records.cpp",
            _HERE / "kernels.cpp")
_HEADERS = (_HERE / "records.h", _HERE / "ref.h", _HERE / "sites.h", _HERE / "tracker.h",
            _HERE / "observer.h")
# NDEBUG as torch was built: its headers' debug-only members and asserts must match the
# library's. -Wall is for our sources: torch's and Python's headers come in with -isystem.
_COMPILE_FLAGS = ("-O2", "-DNDEBUG", "-std=c++17", "-fPIC", "-Wall")
_LINK_FLAGS = ("-shared",)
_LIBS = ("-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python")


class Native(Protocol):
    """The compiled module's functions (see `checks.cpp`, `witnesses.cpp`, `tracker.cpp`,
    `observer.cpp`, `strays.cpp`, `recorder.cpp`, `fingerprint.cpp`, `walk.cpp`,
    `model_map.cpp`, `map_rows.cpp`, `found.cpp`)."""

    def geometry(self, tensors: list[Any], /) -> bytes | None: ...
    def same_geometry(self, tensors: list[Any], expected: bytes, /) -> bool: ...
    def same_items(
        self, holders: list[Any], keys: list[Any], objects: list[Any], cache: bytearray, /
    ) -> bool: ...
    def same_steps(self, holders: list[Any], steps: list[Any], objects: list[Any], /) -> bool: ...
    def alive(self, refs: list[Any], /) -> bool: ...
    def same_witnesses(
        self, containers: list[Any], keys: list[Any], ids: list[int], ptrs: list[int],
        versions: list[int], cache: bytearray, /,
    ) -> bool: ...
    def take_witnesses(
        self, holders: list[Any], keys: list[Any], indices: list[int], ids: list[int],
        ptrs: list[int], versions: list[int], storage_keys: list[int],
        cache: bytearray | None = None, /,
    ) -> list[int]: ...
    def same_bindings(
        self, containers: list[Any], keys: list[Any], ids: list[int], ptrs: list[int],
        strides: list[tuple[int, ...]], cache: bytearray | None = None, /,
    ) -> list[Any] | None: ...
    def same_tree(
        self, modules: list[Any], table_of: list[int], table_names: list[str],
        table_ids: list[int], holders: list[int], names: list[Any], ids: list[int],
        sizes: list[int], cache: bytearray | None = None, /,
    ) -> bool: ...
    def storage_rows(
        self, tensors: list[Any], /,
    ) -> list[tuple[int, int, int, tuple[int, ...]]] | None: ...
    def storage_ids(self, tensors: list[Any], /) -> list[int] | None: ...
    def storage_keys(self, tensors: list[Any], /) -> list[int] | None: ...
    def track_storages(
        self, modules: list[Any], keys: Set[int], tracked: dict[int, Any],
        key_of: dict[int, int], died: Callable[[Any], object], /,
    ) -> set[int] | None: ...
    def written_sites(
        self, sites: list[Any], among: Set[int], skip: dict[int, Any], /,
    ) -> list[tuple[int, int]] | None: ...
    def traced_sites(
        self, sites: list[Any], among: Set[int], sources: dict[int, Any],
        writers: dict[int, Any], arg_type: type, /,
    ) -> list[tuple[int, int, Any, tuple[Any, ...] | None]] | None: ...
    def same_refs(
        self, modules: list[Any], refs: list[Any], sizes: list[int], nested: list[Any],
        kinds: tuple[type, ...], /,
    ) -> bool: ...
    def map_sites(
        self, sites: list[Any], tables_at: dict[int, str], at: dict[int, int],
        from_dict: Callable[[Any], tuple[Any, tuple[Any, ...]]], /,
    ) -> tuple[dict[int, str], dict[str, int], list[str], set[int], list[Any],
               list[Any]] | None: ...
    def map_modules(
        self, modules: list[Any], internals: frozenset[str], /,
    ) -> tuple[dict[int, str], tuple[list[int], list[str]], list[dict[str, Any]],
               list[int], list[Any], list[int], list[int]] | None: ...
    def map_refs(
        self, refs: list[Any], tables_at: dict[int, str], at: dict[int, int],
        from_dict: Callable[[Any], tuple[Any, tuple[Any, ...]]], /,
    ) -> tuple[list[Any], list[int]]: ...
    def table_sources(
        self, prefixes: list[tuple[str, Any]], source: type, /,
    ) -> dict[int, Any] | None: ...
    def staged_sources(
        self, copied: dict[int, int], sources: dict[int, Any], foreign: dict[int, Any],
        source: type, /,
    ) -> dict[int, Any] | None: ...
    def walk_run(
        self, model: Any, modules: list[Any], each: list[tuple[str, Any]], wanted: Any,
        consts: tuple[Any, ...], needed: bool, /,
    ) -> tuple[list[Any], list[Any], list[Any]]: ...
    def tracker_new(self, watched: Iterable[int], /) -> int: ...
    def tracker_push(self, tracker: int, /) -> None: ...
    def tracker_pop(self, tracker: int, /) -> bool: ...
    def tracker_written(self, tracker: int, /) -> frozenset[int]: ...

    def tracker_sequence(self, arg: tuple[int, Iterable[int]], /) -> None: ...

    def tracker_ops(self, tracker: int, /) -> dict[int, list[str]]: ...
    def tracker_taint(self, arg: tuple[int, Iterable[int]], /) -> None: ...
    def tracker_tainted(self, tracker: int, /) -> dict[int, tuple[tuple[int, ...], str]]: ...
    def tracker_taken(
        self, tracker: int, /
    ) -> list[tuple[bool, object, tuple[int, ...], str]]: ...
    def tracker_free(self, tracker: int, /) -> None: ...
    def observer_watch(self, keys: Iterable[int], /) -> None: ...
    def observer_start(self, callback: bool = False, alone: bool = False, /) -> str: ...
    def observer_kernels(self) -> int: ...
    def observer_stop(self, alone: bool = False, /) -> None: ...
    def observer_running(self) -> bool: ...
    def observer_pending(self) -> bool: ...
    def observer_drain(self) -> tuple[dict[int, str], bool]: ...
    def observer_quiet(self, enter: bool, /) -> None: ...
    def observer_floor(
        self, on: bool, inputs: bool, outputs: bool = False, local: bool = False, /
    ) -> None: ...
    def observer_doors(self) -> tuple[str, ...]: ...
    def strays_watch(self, keys: Iterable[int], /) -> None: ...
    def strays_start(self) -> None: ...
    def strays_stop(self) -> None: ...
    def strays_follow(self, enter: bool, /) -> None: ...
    def strays_reads(self) -> list[tuple[int, str, tuple[int, ...], bool]]: ...
    def strays_tainted(self) -> dict[int, tuple[tuple[int, ...], str]]: ...
    def strays_forget(self) -> None: ...
    def recorder_setup(self, stand_in: object, /) -> None: ...
    def recorder_new(self) -> int: ...
    def recorder_push(self, arg: tuple[int, frozenset[int], frozenset[int], int], /) -> None: ...
    def recorder_pop(self, rec: int, /) -> bool: ...
    def recorder_quiet(self, enter: bool, /) -> None: ...
    def recorder_handle(self, arg: tuple[int, int, int], /) -> None: ...
    def recorder_op(self, index: int, /) -> tuple[str, str]: ...
    def recorder_drain(self, rec: int, /) -> list[tuple[Any, ...]]: ...
    def recorder_apply(self, arg: tuple[Any, ...], /) -> None: ...
    def recorder_limit(self, arg: tuple[int, int], /) -> None: ...
    def recorder_close(self, arg: tuple[int, bool], /) -> bool: ...
    def recorder_free(self, rec: int, /) -> None: ...
    def fingerprint_sums(self, tensor: Any, level: int, out: Any = None, first: int = 0, /
                         ) -> tuple[int, int]: ...
    def fingerprint_level(self) -> int: ...


class NativeBuildError(RuntimeError):
    """The extension was not built: no compiler, it failed, or the cache is not trusted."""


_UNSET: Any = object()
_loaded: Any = _UNSET  # the module, None (not available), or _UNSET (not looked for yet)
_forced: list[bool] = []  # `using(...)` overrides, innermost last
_first_use = threading.Lock()  # threads that reach `get()` first at once build once
_failed: dict[Path, str] = {}  # libraries whose build on first use failed here: why
_announced: list[str] = []  # the one warning of the Python path, once given


class _Toolchain(NamedTuple):
    """How the library is built: the compiler (None: none found) and its flags."""

    cxx: str | None
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...]


def _toolchain() -> _Toolchain:
    """The compiler ($CXX, else c++ or g++ on PATH) and the flags for this torch and Python."""
    cxx = os.environ.get("CXX")
    found = shutil.which(cxx) if cxx else shutil.which("c++") or shutil.which("g++")
    # torch.utils.cpp_extension's include and library paths for CPU, without importing it
    # (it imports setuptools, which a serving image may lack).
    torch_dir = Path(torch.__file__).parent
    includes = (
        torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include",
        Path(sysconfig.get_paths()["include"]),
    )
    libdir = torch_dir / "lib"
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return _Toolchain(
        cxx=found,
        compile_flags=(
            *_COMPILE_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(arg for d in includes for arg in ("-isystem", str(d))),
        ),
        link_flags=(*_LINK_FLAGS, f"-L{libdir}", f"-Wl,-rpath,{libdir}", *_LIBS),
    )


@functools.lru_cache(maxsize=8)
def _compiler_version(cxx: str, real: str, mtime_ns: int, size: int) -> str:
    """`cxx --version`, run once per compiler file as it is now (the arguments key the cache)."""
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return f"{done.returncode}|{done.stdout}"


def _compiler_identity(cxx: str | None) -> str:
    """The compiler as the cache key sees it: its path, the file it is, its `--version`."""
    if cxx is None:
        return "none"
    real = os.path.realpath(cxx)
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"{cxx}|{real}|unreadable ({exc})"
    return f"{cxx}|{real}|{_compiler_version(cxx, real, st.st_mtime_ns, st.st_size)}"


def _ident(tools: _Toolchain) -> str:
    """The library's name: a hash of everything the binary depends on."""
    h = hashlib.sha256()
    for file in (*_SOURCES, *_HEADERS):
        h.update(f"{file.name}|".encode() + file.read_bytes() + b"\0")
    for part in (
        _compiler_identity(tools.cxx), "\0".join(tools.compile_flags),
        "\0".join(tools.link_flags), torch.__version__, str(torch.version.git_version),
        sys.version, sysconfig.get_platform(),
    ):
        h.update(part.encode() + b"\0")
    return f"_graphsafe_native_{h.hexdigest()[:16]}"


def path() -> Path:
    """Where the extension for these sources, compiler, torch and Python lives (built or not).

    Returns:
        The path of the shared library.
    """
    return _path(_toolchain())


def _path(tools: _Toolchain) -> Path:
    root = Path(os.environ.get("GRAPHSAFE_CACHE") or Path.home() / ".cache" / "graphsafe")
    return root / "native" / f"{_ident(tools)}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _import(lib: Path) -> ModuleType:
    name = lib.name.split(".", 1)[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(lib))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _stamp(lib: Path) -> tuple[int, int] | None:
    """Which file is at `lib` (inode, mtime), to tell a library built meanwhile."""
    try:
        st = os.stat(lib)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def build(*, force: bool = False) -> Path:
    """Compile the extension for the installed torch and Python, if not built yet.

    Builds take the cache's lock: a build that finds another under way waits for it and
    takes its library instead of compiling again.

    Args:
        force: Compile even when the library exists (unless one is built while waiting).

    Returns:
        The path of the library.

    Raises:
        NativeBuildError: No C++ compiler, the compiler failed (its output attached), or
            the cache is owned by another user or writable by group or others.
    """
    tools = _toolchain()
    lib = _path(tools)
    _refuse_untrusted_directories(lib)
    before = _stamp(lib)
    if before is not None and not force and cache.untrusted(lib) is None:
        return lib
    if tools.cxx is None:
        tried = f"$CXX={os.environ['CXX']}" if os.environ.get("CXX") else "c++, g++"
        raise NativeBuildError(
            f"no C++ compiler found (tried {tried}); install one (e.g. g++) and run "
            "`graphsafe native build`, or leave it: the guard then uses its Python path"
        )
    cache.make_private_dirs(lib.parent)
    _refuse_untrusted_directories(lib)  # also one another process made meanwhile
    with cache.build_lock(lib.parent):
        now = _stamp(lib)
        if now is not None and (now != before or not force) and cache.untrusted(lib) is None:
            return lib  # built while we waited
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = _compile(tools, lib.name, Path(tmp))
            _checked(_import(out))
            os.replace(out, lib)  # atomic: a load sees all or nothing
    return lib


def _refuse_untrusted_directories(lib: Path) -> None:
    """Raise when the cache's directories are not trusted (an untrusted library is rebuilt)."""
    refusal = cache.untrusted(lib)
    if refusal is not None and refusal.path != lib:
        raise NativeBuildError(f"refusing to build into {lib.parent}: {refusal.lines()}")


def _compile(tools: _Toolchain, filename: str, tmp: Path) -> Path:
    """Compile the sources side by side into `tmp`, link them; the library's path."""
    assert tools.cxx is not None
    name = filename.split(".", 1)[0]
    names = (f"-DGRAPHSAFE_NATIVE_ID={name}", f'-DGRAPHSAFE_NATIVE_NAME="{name}"')
    objects = [tmp / f"{source.stem}.o" for source in _SOURCES]
    commands = [
        [tools.cxx, *tools.compile_flags, *names, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(_SOURCES, objects)
    ]
    running: list[subprocess.Popen[str]] = []
    try:
        for cmd in commands:
            running.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate()[1] for proc in running]
    finally:  # interrupted, or a compiler that would not start: stop the other
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for source, cmd, proc, err in zip(_SOURCES, commands, running, outputs):
        if proc.returncode != 0:
            raise NativeBuildError(
                f"compiling {source.name} failed (exit {proc.returncode}); the guard uses "
                f"its Python path.\ncommand: {' '.join(cmd)}\n{err[-4000:]}"
            )
    out = tmp / filename
    cmd = [tools.cxx, *map(str, objects), "-o", str(out), *tools.link_flags]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NativeBuildError(
            f"linking {filename} failed (exit {done.returncode}); the guard uses its Python "
            f"path.\ncommand: {' '.join(cmd)}\n{done.stderr[-4000:]}"
        )
    out.chmod(0o755)  # whatever the umask: a group-writable library would be refused
    return out


def _checked(module: Any) -> None:
    """Refuse a library that does not give the answers the Python path gives."""
    if not selfcheck.check(module):
        raise NativeBuildError("the built extension fails its self-check; not used")


def get() -> Native | None:
    """The loaded extension, or None where the guard takes its Python path.

    The first call of the process builds the extension when it is missing (see the
    module's docstring); when it is not there after that, it warns once.

    Returns:
        The module, when built for this torch and Python (now, if it was missing), not
        turned off with `GRAPHSAFE_NATIVE=0`, and in a cache only you can write.
    """
    global _loaded
    if _forced:
        return cast(Native, _load()) if _forced[-1] else None
    if _loaded is _UNSET:
        with _first_use:
            if _loaded is _UNSET:
                _loaded = _first_load()
    return cast("Native | None", _loaded)


def _setting() -> str:
    """`GRAPHSAFE_NATIVE`: "off" (0, off, false, no) or "on" (anything else, "build"
    included)."""
    value = os.environ.get("GRAPHSAFE_NATIVE", "1").strip().lower()
    return "off" if value in ("0", "off", "false", "no") else "on"


_modules: dict[Path, ModuleType | None] = {}


def _first_load() -> ModuleType | None:
    """What `get()` answers for the process: built now if missing, else one warning."""
    if _setting() == "off":
        return None
    module = _load(build_missing=True)
    if module is None:
        _warn_python_path(_why_not())
    return module


def _load(*, build_missing: bool = False) -> ModuleType | None:
    lib = path()
    if build_missing and not lib.exists() and lib not in _failed:
        try:
            _build_saying_so(lib)
        except (NativeBuildError, OSError, ImportError) as exc:  # ImportError: built, unloadable
            _failed[lib] = str(exc)
    if not lib.exists() or cache.untrusted(lib) is not None:
        return None
    if lib not in _modules:
        try:
            module: ModuleType | None = _import(lib)
            _checked(module)
        except (ImportError, OSError, NativeBuildError):
            module = None
        _modules[lib] = module
    return _modules[lib]


def _say(line: str) -> None:
    print(f"graphsafe: {line}", file=sys.stderr, flush=True)


def _build_saying_so(lib: Path) -> None:
    """`build()` on first use, with a line on stderr as it starts and one as it ends."""
    tools = _toolchain()
    _refuse_untrusted_directories(lib)
    if tools.cxx is None:
        build()  # raises, naming the compilers it tried
    _say(f"building the compiled checks for torch {torch.__version__} with {tools.cxx} "
         f"into {lib.parent} (once per torch and compiler, about a minute; "
         "GRAPHSAFE_NATIVE=0 skips it) ...")
    t0 = time.perf_counter()
    try:
        build()
    except (NativeBuildError, OSError, ImportError) as exc:
        _say(f"building the compiled checks failed after {time.perf_counter() - t0:.1f} s: "
             f"{str(exc).splitlines()[0]}")
        raise
    _say(f"compiled checks ready in {time.perf_counter() - t0:.1f} s ({lib.name})")


def _why_not() -> str:
    """Why the extension is not loaded (setting on): the first line of the reason."""
    lib = path()
    if lib in _failed:
        return _failed[lib].splitlines()[0]
    refusal = cache.untrusted(lib)
    if refusal is not None:
        return refusal.line()
    if not lib.exists():
        return f"{lib} is not built"
    return f"{lib} does not load or fails its self-check"


def _warn_python_path(reason: str) -> None:
    """The one warning of the process that the Python path runs, what it loses, the fix."""
    if _announced:
        return
    _announced.append(reason)
    warnings.warn(
        "graphsafe takes its Python path: its compiled checks are not available here.\n"
        "expected: the compiled checks, built for this torch on first use\n"
        f"got: {reason}\n"
        "lost: the process-wide write observer (writes into pinned models outside tracked "
        "loads that move no version counter, such as `p.data.copy_(w)` in a script, fused "
        "optimizer steps and writes from other threads, go unseen unless declared with "
        "gs.mark_written), the ops of threads a recorded bring-up does not follow (one that "
        "existed before it and gets work through a queue, a C++ library's own threads: what "
        "they derive from the weights is neither discovered nor said), a post-load step run "
        "after the load returned (recorded until the model's first forward by the compiled "
        "recorder alone: what it derives from the weights is not discovered), and speed (the "
        "guard's checks and the load-time write tracker run in Python, several times "
        "slower)\n"
        "fix: install a C++ compiler (e.g. g++, or point CXX at one) and run `graphsafe "
        "native build`; GRAPHSAFE_NATIVE=0 takes the Python path without this warning",
        GraphSafetyWarning, stacklevel=4,
    )


def announced() -> bool:
    """Whether this process was told, by the warning of `get()`, that the Python path runs.

    Returns:
        True once that warning was given (other warnings about the same loss are then
        left out).
    """
    return bool(_announced)


@contextlib.contextmanager
def using(enabled: bool) -> Iterator[None]:
    """Guards snapshotted inside take the C++ path (`True`) or the Python one.

    Args:
        enabled: Which path. `True` raises when the extension is not built or refused.

    Yields:
        None.

    Raises:
        NativeBuildError: `enabled` and the extension is not built, or not trusted.
    """
    if enabled and _load() is None:
        refusal = cache.untrusted(path())
        if refusal is not None:
            raise NativeBuildError(f"the native guard is not loaded: {refusal.lines()}")
        raise NativeBuildError(
            f"the native guard is not built ({path()}); run `graphsafe native build`"
        )
    _forced.append(enabled)
    try:
        yield
    finally:
        _forced.pop()


def describe() -> str:
    """One line: which path the guard takes here, and why (it builds nothing).

    Returns:
        E.g. `"native (~/.cache/graphsafe/native/...so)"` or `"python (not built: ...)"`.
    """
    lib = path()
    if _setting() == "off" and not _forced:
        return "python (GRAPHSAFE_NATIVE=0)"
    module = get() if _forced or _loaded is not _UNSET else _load()
    if module is not None:
        return f"native ({lib})"
    if lib in _failed:
        return f"python (the build failed: {_failed[lib].splitlines()[0]})"
    refusal = cache.untrusted(lib)
    if refusal is not None:
        return f"python ({refusal.line()})"
    if not lib.exists():
        return ("python (not built yet: the first use builds it, or run `graphsafe native "
                "build`)")
    return f"python ({lib} does not load or fails its self-check)"


def timed_build() -> tuple[Path, float]:
    """`build(force=True)` with its time in seconds (for the command line).

    Returns:
        The library's path and the seconds it took.
    """
    t0 = time.perf_counter()
    lib = build(force=True)
    return lib, time.perf_counter() - t0
