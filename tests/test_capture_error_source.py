"""A CaptureError raised inside a CPU graph's body names the user's line that caused it.

The error is raised deep inside torch (a dispatch or function mode), often under library
code (a torch or transformers helper the user called). The message's `where:` and
`.source` name the innermost frame of user code instead: this file's lines. Each test
marks the offending line with a `# <-` comment and looks its number up, so the tests do
not depend on line numbers. The controls show that the naive answer, the innermost
frame of the traceback (or the innermost frame outside graphsafe), is library code.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers.utils import to_py_obj

import graphsafe as gs

_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> int:
    """The number of the one line of this file that ends with `# <- marker`."""
    hits = [n for n, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, hits
    return hits[0]


def _capture(fn: nn.Module, x: torch.Tensor, match: str | None = None) -> gs.CaptureError:
    g = gs.Graph(backend="cpu")
    with pytest.raises(gs.CaptureError, match=match) as info, torch.no_grad(), g.capture():
        fn(x)
    return info.value


def _is_library(filename: str) -> bool:
    return any(
        Path(filename).resolve().is_relative_to(Path(m.__file__).resolve().parent)
        for m in (torch, gs, transformers)
    )


class ItemInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # [T, 4]
        scale = h.abs().max().item()  # <- item
        return h / scale


class BranchOnValue(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 0).all():  # <- bool
            return x
        return -x


class MaskIndexing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]  # <- mask


class ThroughTorch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.testing.assert_close(x, x.clone())  # <- torch helper
        return x


class ThroughTransformers(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = to_py_obj(x)  # <- transformers helper
        return x * len(values)


@pytest.mark.parametrize(
    ("module", "marker", "what"),
    [
        (ItemInForward(), "item", r"`\.item\(\)`"),
        (BranchOnValue(), "bool", r"`bool\(t\)`"),
        (MaskIndexing(), "mask", r"boolean-mask indexing"),
        (ThroughTorch(), "torch helper", r"reads a tensor's value"),
        (ThroughTransformers(), "transformers helper", r"`\.tolist\(\)`"),
    ],
    ids=["item", "bool", "mask", "torch-helper", "transformers-helper"],
)
def test_capture_error_names_the_user_line(module: nn.Module, marker: str, what: str) -> None:
    line = _line(marker)
    code = _SOURCE[line - 1].strip()
    where = rf"\n  where: +{re.escape(__file__)}:{line}, in forward: {re.escape(code)}\n"
    err = _capture(module, torch.randn(3, 4), match=rf"^[^\n]*{what}[^\n]*{where}")
    assert err.source is not None
    assert (err.source.filename, err.source.lineno, err.source.name) == (__file__, line, "forward")
    assert err.source.line == code


@pytest.mark.parametrize(
    ("module", "marker"),
    [
        (ItemInForward(), "item"),
        (ThroughTorch(), "torch helper"),
        (ThroughTransformers(), "transformers helper"),
    ],
    ids=["item", "torch-helper", "transformers-helper"],
)
def test_control_the_innermost_frames_are_library_code(module: nn.Module, marker: str) -> None:
    """The traceback's last frame is graphsafe's, and for a helper the innermost frame
    outside graphsafe is the helper's library: the user's line had to be searched for."""
    err = _capture(module, torch.randn(3, 4))
    frames = traceback.extract_tb(err.__traceback__)
    assert _is_library(frames[-1].filename)
    assert Path(frames[-1].filename).is_relative_to(Path(gs.__file__).parent)
    outside_graphsafe = next(
        f for f in reversed(frames) if not Path(f.filename).is_relative_to(Path(gs.__file__).parent)
    )
    if marker == "item":
        assert outside_graphsafe.lineno == _line(marker)  # graphsafe is all there is to skip
    else:
        assert _is_library(outside_graphsafe.filename)
        assert outside_graphsafe.lineno != _line(marker)


def test_capture_error_from_a_plain_body_names_its_line() -> None:
    x = torch.randn(3)
    g = gs.Graph(backend="cpu")
    with pytest.raises(gs.CaptureError) as info, g.capture():
        y = (x * 2).tolist()  # <- body
        del y
    assert info.value.source is not None
    assert info.value.source.lineno == _line("body")
    assert info.value.source.name == test_capture_error_from_a_plain_body_names_its_line.__name__


def test_capture_error_layout_change_names_its_line() -> None:
    buf = torch.zeros(4, 4)
    g = gs.Graph(backend="cpu")
    with (
        pytest.raises(gs.CaptureError, match=r"changes the storage or layout") as info,
        g.capture(),
    ):
        buf.t_()  # <- layout
    assert f"{__file__}:{_line('layout')}" in str(info.value)


def test_control_a_capture_error_outside_the_body_has_no_source() -> None:
    g = gs.Graph(backend="cpu")
    with pytest.raises(gs.CaptureError, match=r"replay\(\) before a successful capture") as info:
        g.replay()
    assert info.value.source is None
    assert "where:" not in str(info.value)


def test_control_a_body_without_value_reads_captures() -> None:
    module = ItemInForward()
    x = torch.randn(3, 4)
    g = gs.Graph(backend="cpu")
    with torch.no_grad(), g.capture():
        out = module.lin(x).abs()
    x.copy_(torch.randn(3, 4))
    g.replay()
    with torch.no_grad():
        assert torch.equal(out, module.lin(x).abs())


def test_the_frame_of_an_error_raised_inside_torch_is_the_users_line() -> None:
    # What the CUDA backend names when stream capture refuses an op: the user's line in
    # the traceback, past the library frames inside it.
    from graphsafe._graphs.source import user_frame_of

    def users_function() -> None:
        torch.testing.assert_close(torch.zeros(2), torch.ones(2))  # raises inside torch

    try:
        users_function()
    except AssertionError as err:
        frame = user_frame_of(err)
        assert frame is not None and frame.name == "users_function"
        assert frame.filename == __file__
        # Control: the innermost frame is torch's, which is what a bare traceback shows.
        innermost = traceback.extract_tb(err.__traceback__)[-1]
        assert innermost.filename != __file__ and "torch" in innermost.filename
    else:
        pytest.fail("assert_close did not raise")


def test_every_stage_of_graphsafe_is_library_code_and_the_tests_are_not() -> None:
    # graphsafe's stages live in subpackages: a frame in any of them is graphsafe's own,
    # never the user's line a capture error names.
    from graphsafe._graphs import source

    root = Path(gs.__file__).parent
    for stage in ("_runtime/runtime.py", "_memory/ledger.py", "_declare/spec.py",
                  "_graphs/cpu.py", "__init__.py"):
        assert source._is_library(str(root / stage)), stage
    # Control: this test's own file is user code.
    assert not source._is_library(__file__)
