"""Stand-ins for the three packages SGLang imports that have no CPU build on PyPI.

SGLang's code runs for real on the CPU (`SGLANG_USE_CPU_ENGINE=1`); these only get it past
its imports:

- `triton`: SGLang's own mock (`sglang/_platform_stubs.py`, made for Apple silicon), built
  here on Linux from the same pieces: kernel definitions stay valid, none is compiled.
- `torchvision`: imported by SGLang's multimodal configs. PyPI's build does not load beside
  torch's CPU build. The mock has no version and no file, so transformers' availability
  check takes it for absent and never uses it.
- `sgl_kernel`: SGLang's compiled kernels (its CPU build is not on PyPI). Strict: calling
  anything of it with a tensor raises, so a test never passes through a kernel that is
  not there.

`install()` runs in every process SGLang starts, through `sitecustomize.py` on
`PYTHONPATH` (this folder).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

_done = False


def _load_platform_stubs() -> Any:
    """SGLang's `_platform_stubs` module, loaded from its file without importing the
    `sglang` package (whose import pulls in torch and transformers)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "_platform_stubs.py")
    file_spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    if file_spec is None or file_spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(file_spec)
    sys.modules["_sglang_platform_stubs"] = mod
    file_spec.loader.exec_module(mod)
    return mod


def _triton(ps: Any) -> None:
    sys.meta_path.insert(0, ps._TritonFinder())
    triton = ps._make_mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv = ps._cdiv
    triton.next_power_of_2 = ps._next_power_of_2
    triton.Config = ps._Config

    class _constexpr:
        def __init__(self, value: Any = None) -> None:
            self.value = value

    tl = ps._make_mock("triton.language")
    tl.constexpr = _constexpr
    triton.language = tl
    extra = ps._make_mock("triton.language.extra")
    tl.extra = extra
    extra.libdevice = ps._make_mock("triton.language.extra.libdevice")
    runtime = ps._make_mock("triton.runtime")
    triton.runtime = runtime
    jit = ps._make_mock("triton.runtime.jit")
    jit.JITFunction = type("JITFunction", (), {})
    jit.KernelInterface = type("KernelInterface", (ps._StubBase,), {})
    runtime.jit = jit
    cache = ps._make_mock("triton.runtime.cache")
    cache.triton_key = ps._triton_key
    runtime.cache = cache
    autotuner = ps._make_mock("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
    autotuner.PTXASError = type("PTXASError", (Exception,), {})
    runtime.autotuner = autotuner
    compiler_root = ps._make_mock("triton.compiler")
    compiler_root.CompiledKernel = type("CompiledKernel", (ps._StubBase,), {})
    compiler = ps._make_mock("triton.compiler.compiler")
    compiler.ASTSource = type("ASTSource", (ps._StubBase,), {})
    compiler.triton_key = ps._triton_key
    compiler_root.compiler = compiler
    triton.compiler = compiler_root
    runtime.driver = ps._make_mock("triton.runtime.driver")
    triton.testing = ps._make_mock("triton.testing")
    tools = ps._make_mock("triton.tools")
    triton.tools = tools
    tools.tensor_descriptor = ps._make_mock("triton.tools.tensor_descriptor")
    backends = ps._make_mock("triton.backends")
    triton.backends = backends
    bc = ps._make_mock("triton.backends.compiler")
    bc.GPUTarget = type("GPUTarget", (ps._StubBase,), {})
    backends.compiler = bc


class _Hidden(types.ModuleType):
    """A package whose every attribute is another one (classes for capitalised names);
    no `__file__` and no `__version__`, so availability checks take it for absent."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value: Any = type(name, (), {"__module__": self.__name__}) if name[:1].isupper() \
            else _child(self, full)
        setattr(self, name, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 and callable(args[0]) else None


class _Strict(_Hidden):
    """`sgl_kernel`: any call with a tensor argument raises."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise RuntimeError(
                f"{self.__name__} is a stub (SGLang's compiled kernels are not installed on "
                "this machine); the code path under test must not call it"
            )
        return super().__call__(*args, **kwargs)


def _child(parent: _Hidden, full: str) -> _Hidden:
    mod = type(parent)(full)
    sys.modules[full] = mod
    return mod


class _Finder:
    """Serves `import <root>.x.y` from the stub `roots`."""

    def __init__(self, roots: dict[str, type[_Hidden]]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        root = fullname.partition(".")[0]
        kind = self.roots.get(root)
        if kind is None or (fullname == "torchvision" and _availability_check()):
            return None
        mod = sys.modules.get(fullname)
        if mod is None:
            mod = kind(fullname)
            sys.modules[fullname] = mod
            parent, _, child = fullname.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, mod)
        # The import system returns the spec of a module already in sys.modules.
        mod.__spec__ = _Loader.spec(fullname, mod)
        return mod.__spec__


def _availability_check() -> bool:
    """Whether transformers' package check (`_is_package_available`) is asking."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_is_package_available" and "transformers" in code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Loader(importlib.machinery.BuiltinImporter):
    @staticmethod
    def spec(name: str, mod: types.ModuleType) -> importlib.machinery.ModuleSpec:
        s = importlib.machinery.ModuleSpec(name, _Existing(mod), is_package=True)
        s.submodule_search_locations = []
        return s


class _Existing:
    def __init__(self, mod: types.ModuleType) -> None:
        self.mod = mod

    def create_module(self, spec: Any) -> types.ModuleType:
        return self.mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Install the three stand-ins (once per process, and only where the real packages are
    absent)."""
    global _done
    if _done:
        return
    _done = True
    if importlib.util.find_spec("triton") is None:
        ps = _load_platform_stubs()
        if ps is not None:
            _triton(ps)
    roots: dict[str, type[_Hidden]] = {}
    if importlib.util.find_spec("torchvision") is None:
        roots["torchvision"] = _Hidden
    if importlib.util.find_spec("sgl_kernel") is None:
        roots["sgl_kernel"] = _Strict
    if roots:
        sys.meta_path.insert(0, _Finder(roots))
