"""graphsafe's hot checks compiled: one C++ call per check instead of a Python call per field.

- The guard's flat checks (`_ledger`, `_journal`) and the every-load rebinding check
  (`_flat`): the Python path costs about a microsecond per tensor (each metadata read is
  a Python call), the C++ one a few nanoseconds. Both answer the same question, and only
  "nothing changed" is taken from the C++ one: when it says something changed, or cannot
  tell, the Python path finds and names the change.
- The load-time write tracker (`_tracking.NativeWriteTracker`): a RecordFunction callback
  instead of a Python dispatch mode, a fraction of a microsecond per op instead of about
  ten.

The extension is built for the installed torch and Python by `graphsafe native build`
(`scripts/setup` runs it; about half a minute with a C++ compiler) into
`$GRAPHSAFE_CACHE` (default `~/.cache/graphsafe`). graphsafe loads it when it is there
and uses the Python path when it is not. `GRAPHSAFE_NATIVE=0` turns it off;
`GRAPHSAFE_NATIVE=build` builds it on first use when missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, cast

import torch

__all__ = ["Native", "NativeBuildError", "build", "describe", "get", "path", "timed_build", "using"]

_SOURCE = Path(__file__).with_name("native.cpp")


class Native(Protocol):
    """The compiled module's functions (see `_native.cpp`)."""

    def geometry(self, tensors: list[Any], /) -> bytes | None: ...
    def same_geometry(self, tensors: list[Any], expected: bytes, /) -> bool: ...
    def same_items(self, holders: list[Any], keys: list[Any], objects: list[Any], /) -> bool: ...
    def same_witnesses(
        self, containers: list[Any], keys: list[Any], ids: list[int], ptrs: list[int],
        versions: list[int], /,
    ) -> bool: ...
    def same_bindings(
        self, containers: list[Any], keys: list[Any], ids: list[int], ptrs: list[int],
        strides: list[tuple[int, ...]], /,
    ) -> list[Any] | None: ...
    def tracker_new(self, watched: Iterable[int], /) -> int: ...
    def tracker_push(self, tracker: int, /) -> None: ...
    def tracker_pop(self, tracker: int, /) -> bool: ...
    def tracker_written(self, tracker: int, /) -> set[int]: ...
    def tracker_free(self, tracker: int, /) -> None: ...


class NativeBuildError(RuntimeError):
    """The extension could not be built (no compiler, or it failed); the message says why."""


_UNSET: Any = object()
_loaded: Any = _UNSET  # the module, None (not available), or _UNSET (not looked for yet)
_forced: list[bool] = []  # `using(...)` overrides, innermost last


def _ident() -> str:
    """What the binary depends on: the source, torch, Python and the platform."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(f"{torch.__version__}|{sys.version}|{sysconfig.get_platform()}".encode())
    return f"_graphsafe_native_{h.hexdigest()[:16]}"


def path() -> Path:
    """Where the extension for this source, torch and Python lives (built or not).

    Returns:
        The path of the shared library.
    """
    root = Path(os.environ.get("GRAPHSAFE_CACHE") or Path.home() / ".cache" / "graphsafe")
    name = _ident()
    return root / "native" / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _import(lib: Path) -> ModuleType:
    name = lib.name.split(".", 1)[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(lib))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(*, force: bool = False) -> Path:
    """Compile the extension for the installed torch and Python, if not built yet.

    Args:
        force: Compile even when the library exists.

    Returns:
        The path of the library.

    Raises:
        NativeBuildError: No C++ compiler, or the compiler failed (its output attached).
    """
    from torch.utils import cpp_extension

    lib = path()
    if lib.exists() and not force:
        return lib
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise NativeBuildError(
            "no C++ compiler found (tried $CXX, c++, g++); install one (e.g. g++) and run "
            "`graphsafe native build`, or leave it: the guard then uses its Python path"
        )
    name = lib.name.split(".", 1)[0]
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libdirs = cpp_extension.library_paths()
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [
            # NDEBUG as torch was built: its headers' debug-only members and asserts
            # must match the library's.
            cxx, "-O2", "-DNDEBUG", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-DGRAPHSAFE_NATIVE_ID={name}", f'-DGRAPHSAFE_NATIVE_NAME="{name}"',
            *(f"-I{d}" for d in includes), str(_SOURCE), "-o", str(out),
            *(f"-L{d}" for d in libdirs), *(f"-Wl,-rpath,{d}" for d in libdirs),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NativeBuildError(
                f"compiling {_SOURCE.name} failed (exit {done.returncode}); the guard uses "
                f"its Python path.\ncommand: {' '.join(cmd)}\n{done.stderr[-4000:]}"
            )
        _check(_import(out))
        os.replace(out, lib)  # atomic: a concurrent build or load sees all or nothing
    return lib


def _check(module: Any) -> None:
    """Refuse a library that does not give the answers the Python path gives."""
    a, b = torch.zeros(2, 3), torch.zeros(3)
    geo = module.geometry([a, b])
    ok = isinstance(geo, bytes) and module.same_geometry([a, b], geo)
    a.data = a.data.t()  # same storage, new strides: must show
    ok = ok and not module.same_geometry([a, b], geo)
    d = {"w": b}
    ok = ok and module.same_witnesses([d], ["w"], [id(b)], [b.data_ptr()], [b._version])
    b.add_(1)
    ok = ok and not module.same_witnesses([d], ["w"], [id(b)], [b.data_ptr()], [b._version - 1])
    ok = ok and module.same_items([d], ["w"], [b]) and not module.same_items([d], ["w"], [a])
    got = module.same_bindings([d], ["w"], [id(b)], [b.data_ptr()], [b.stride()])
    ok = ok and got == [b] and got[0] is b
    ok = ok and module.same_bindings([d], ["w"], [id(b)], [b.data_ptr()], [(2,)]) is None
    c = torch.zeros(4)
    tracker = module.tracker_new([b.untyped_storage().data_ptr(), c.untyped_storage().data_ptr()])
    module.tracker_push(tracker)
    try:
        with torch.no_grad():
            b.mul_(2)
            a.add_(1)  # not watched
    finally:
        ok = module.tracker_pop(tracker) and ok
    ok = ok and module.tracker_written(tracker) == {b.untyped_storage().data_ptr()}
    module.tracker_free(tracker)
    if not ok:
        raise NativeBuildError("the built extension fails its self-check; not used")


def get() -> Native | None:
    """The loaded extension, or None where the guard takes its Python path.

    Returns:
        The module, when built for this torch and Python, not turned off with
        `GRAPHSAFE_NATIVE=0`, and (with `GRAPHSAFE_NATIVE=build`) built now if missing.
    """
    global _loaded
    if _forced:
        return cast(Native, _load()) if _forced[-1] else None
    if _loaded is _UNSET:
        _loaded = None if _setting() == "off" else _load(build_missing=_setting() == "build")
    return cast("Native | None", _loaded)


def _setting() -> str:
    """`GRAPHSAFE_NATIVE`: "off" (0, off, false, no), "build", or "on" (anything else)."""
    value = os.environ.get("GRAPHSAFE_NATIVE", "1").strip().lower()
    return "off" if value in ("0", "off", "false", "no") else value if value == "build" else "on"


_modules: dict[Path, ModuleType | None] = {}


def _load(*, build_missing: bool = False) -> ModuleType | None:
    lib = path()
    if not lib.exists() and build_missing:
        with contextlib.suppress(NativeBuildError, OSError):
            build()
    if not lib.exists():
        return None
    if lib not in _modules:
        try:
            module: ModuleType | None = _import(lib)
            _check(module)
        except (ImportError, OSError, NativeBuildError):
            module = None
        _modules[lib] = module
    return _modules[lib]


@contextlib.contextmanager
def using(enabled: bool) -> Iterator[None]:
    """Guards snapshotted inside take the C++ path (`True`) or the Python one.

    Args:
        enabled: Which path. `True` raises when the extension is not built.

    Yields:
        None.

    Raises:
        NativeBuildError: `enabled` and the extension is not built.
    """
    if enabled and _load() is None:
        raise NativeBuildError(
            f"the native guard is not built ({path()}); run `graphsafe native build`"
        )
    _forced.append(enabled)
    try:
        yield
    finally:
        _forced.pop()


def describe() -> str:
    """One line: which path the guard takes here, and why.

    Returns:
        E.g. `"native (~/.cache/graphsafe/native/...so)"` or `"python (not built: ...)"`.
    """
    lib = path()
    if get() is not None:
        return f"native ({lib})"
    if _setting() == "off":
        return "python (GRAPHSAFE_NATIVE=0)"
    if not lib.exists():
        return "python (not built: run `graphsafe native build`)"
    return f"python ({lib} does not load or fails its self-check)"


def timed_build() -> tuple[Path, float]:
    """`build(force=True)` with its time in seconds (for the command line).

    Returns:
        The library's path and the seconds it took.
    """
    t0 = time.perf_counter()
    lib = build(force=True)
    return lib, time.perf_counter() - t0
