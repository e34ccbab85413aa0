"""Loaded by every Python process that has this folder on `PYTHONPATH` (the test process and
the scheduler and detokenizer processes an SGLang Engine starts): installs the stand-ins
for triton, torchvision and sgl_kernel (`sglang_stubs`)."""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import sglang_stubs

    sglang_stubs.install()
