"""The `sglang.srt.plugins` entry point (`plugin`) and `enable`, which turns it on: once per
process, SGLang's model runner and weight updaters are patched (`install`)."""

from __future__ import annotations

import os

from graphsafe.integrations.sglang._patches import install
from graphsafe.integrations.sglang._registries import ENV, NO_REGISTRY, registries_from


def enable(*registries: str) -> None:
    """Turn the plugin on for engines started later by this process and its children.

    Whatever is named, graphsafe records the model's first load and checks what SGLang's
    own code derived from the weights there (`discovered`); the registries add the derived
    buffers you declare (`DEEPSEEK_MLA` names the one shipped for DeepSeek's MLA).

    Args:
        *registries: `"module:attribute"` names of `gs.Registry` objects (or of functions
            returning one), importable in every SGLang process. None: no declarations,
            only what is discovered (`GRAPHSAFE_SGLANG_REGISTRIES` names an empty registry).
    """
    os.environ[ENV] = ",".join(registries) or NO_REGISTRY
    plugin()


def plugin() -> None:
    """The `sglang.srt.plugins` entry point: does nothing unless `GRAPHSAFE_SGLANG_REGISTRIES`
    is set; then SGLang's classes are patched in this process.

    Raises:
        RegistrationError: A named registry does not resolve (SGLang logs a plugin's
            exception and goes on; the model runner raises it again when it attaches, and
            the engine does not start).
    """
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return
    install(spec)
    registries_from(spec)  # a name that does not resolve fails here, loudly
