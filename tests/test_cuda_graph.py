"""The CUDA backend: real `torch.cuda.CUDAGraph` capture and replay (`graphsafe._graphs.cuda`).

The same capture -> write -> replay checks as the CPU backend's, on a GPU. Skipped where
CUDA is absent; every test has "cuda" in its name so `pytest -k cuda` (scripts/gpu-check)
selects them all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from graphsafe._errors import CaptureError, StorageMovedError
from graphsafe._graphs.graph import Graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[1]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("b", torch.randn(4))
        self.scale = torch.rand(4) + 0.5
        self.cache = [torch.randn(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.t() + self.b) * self.scale + self.cache[0]  # [N, 4]


def _setup(backend: str = "cuda", guard: bool = False) -> tuple[Tiny, torch.Tensor, Graph]:
    torch.manual_seed(0)
    device = "cuda" if backend == "cuda" else "cpu"
    model = Tiny()
    model.scale = model.scale.to(device)
    model.cache = [t.to(device) for t in model.cache]
    model = model.to(device)
    x = torch.randn(3, 4).to(device)  # drawn on the CPU: the same on every backend
    return model, x, Graph(backend=backend, guard=model if guard else None)  # type: ignore[arg-type]


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _capture(model: nn.Module, x: torch.Tensor, g: Graph) -> torch.Tensor:
    with torch.no_grad(), g.capture(warmup=lambda: model(x)):
        out = model(x)
    g.replay()  # on CUDA, captured kernels run only at replay
    return out


def test_cuda_replay_equals_eager_and_sees_in_place_writes() -> None:
    model, x, g = _setup()
    out = _capture(model, x, g)
    assert torch.equal(out, _eager(model, x))
    before = out.clone()
    with torch.no_grad():
        model.w.data.copy_(torch.randn(4, 4, device="cuda"))
        model.b.mul_(2.0)
        model.scale.fill_(3.0)
        model.cache[0].add_(1.0)
    x.copy_(torch.randn(3, 4, device="cuda"))
    expected = _eager(model, x)
    assert not torch.equal(expected, before)
    g.replay()
    torch.testing.assert_close(out, expected)


def _rebind_param_data(m: Tiny) -> None:
    m.w.data = torch.randn(4, 4, device="cuda")


def _rebind_attribute(m: Tiny) -> None:
    m.scale = torch.full((4,), 3.0, device="cuda")


def _replace_list_item(m: Tiny) -> None:
    m.cache[0] = torch.zeros(4, device="cuda")


REBINDINGS = [_rebind_param_data, _rebind_attribute, _replace_list_item]


@pytest.mark.parametrize("rebind", REBINDINGS, ids=[r.__name__ for r in REBINDINGS])
def test_cuda_rebinding_is_a_stale_read(rebind: Callable[[Tiny], None]) -> None:
    model, x, g = _setup()
    # Hold the old tensors: otherwise their blocks go back to the caching allocator
    # and the graph reads whatever is allocated there next.
    keep = (model.w.data, model.scale, model.cache[0])
    out = _capture(model, x, g)
    old = out.clone()
    rebind(model)
    assert not torch.equal(_eager(model, x), old)
    g.replay()
    assert torch.equal(out, old)
    del keep


def test_cuda_rebinding_matches_the_cpu_backend() -> None:
    results = []
    for backend in ("cpu", "cuda"):
        model, x, g = _setup(backend)
        out = _capture(model, x, g)
        old_w = model.w.data
        new_w = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
        model.w.data = new_w.to(old_w.device)  # stale on both
        with torch.no_grad():
            model.b.add_(1.0)  # seen on both
        g.replay()
        results.append(out.cpu())
    torch.testing.assert_close(results[0], results[1])


def test_cuda_outputs_keep_their_identity_and_memory() -> None:
    model, x, g = _setup()
    out = _capture(model, x, g)
    obj, ptr = id(out), out.data_ptr()
    for _ in range(3):
        x.mul_(1.5)
        g.replay()
        assert (id(out), out.data_ptr()) == (obj, ptr)
        torch.testing.assert_close(out, _eager(model, x))


@pytest.mark.parametrize("rebind", REBINDINGS, ids=[r.__name__ for r in REBINDINGS])
def test_cuda_guard_raises_on_rebinding_instead_of_replaying(
    rebind: Callable[[Tiny], None],
) -> None:
    model, x, g = _setup(guard=True)
    assert g.backend == "cuda"  # auto would pick it too: the model is on the GPU
    out = _capture(model, x, g)
    out.fill_(123.0)
    rebind(model)
    with pytest.raises(StorageMovedError, match="was rebound after graph capture"):
        g.replay()
    assert torch.equal(out, torch.full_like(out, 123.0))


def test_cuda_guard_replays_a_model_updated_in_place() -> None:
    model, x, g = _setup(guard=True)
    out = _capture(model, x, g)
    for _ in range(3):
        with torch.no_grad():
            model.w.data.copy_(torch.randn(4, 4, device="cuda"))
        g.replay()
        torch.testing.assert_close(out, _eager(model, x))


def test_cuda_auto_backend_follows_the_guarded_model() -> None:
    assert Graph(guard=nn.Linear(2, 2).cuda()).backend == "cuda"
    assert Graph(guard=nn.Linear(2, 2)).backend == "cpu"
    assert Graph().backend == "cuda"


def test_cuda_graphs_share_a_memory_pool() -> None:
    x = torch.randn(8, device="cuda")
    g1 = Graph(backend="cuda")
    with g1.capture():
        y1 = x * 2
    g2 = Graph(backend="cuda", pool=g1.pool())
    with g2.capture():
        y2 = y1 + 1
    x.fill_(3.0)
    g1.replay()
    g2.replay()
    assert torch.equal(y2, torch.full((8,), 7.0, device="cuda"))


def test_cuda_warmup_runs_before_capture_on_a_side_stream() -> None:
    model, x, g = _setup()
    streams: list[torch.cuda.Stream] = []

    def warmup() -> None:
        streams.append(torch.cuda.current_stream())
        model(x)

    with torch.no_grad(), g.capture(warmup=warmup, warmup_iters=2):
        out = model(x)
    assert len(streams) == 2
    assert streams[0] != torch.cuda.default_stream()
    g.replay()
    torch.testing.assert_close(out, _eager(model, x))


def test_cuda_mlp_replay_matches_eager_after_in_place_updates() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10), nn.Softmax(-1)
    ).cuda()
    x = torch.randn(16, 64, device="cuda")
    g = Graph(backend="cuda", guard=model)
    out = _capture(model, x, g)
    for p in model.parameters():
        with torch.no_grad():
            p.mul_(0.9).add_(0.01)
        g.replay()
        torch.testing.assert_close(out, _eager(model, x))
    assert torch.equal(out.sum(-1).round(), torch.ones(16, device="cuda"))


def test_cuda_capturing_twice_and_replaying_before_capture_raise() -> None:
    g = Graph(backend="cuda")
    with pytest.raises(CaptureError, match=r"replay\(\) before a successful capture"):
        g.replay()
    x = torch.ones(2, device="cuda")
    with g.capture():
        x + 1
    with pytest.raises(CaptureError, match="already captured"), g.capture():
        pass


def test_cuda_item_during_capture_raises_capture_error() -> None:
    # A failed stream capture can leave the CUDA context unusable for the rest of the
    # process, so this runs in a child process.
    # os._exit: skip interpreter teardown, which may touch the broken capture again.
    code = textwrap.dedent(
        """
        import os
        import torch
        from graphsafe._errors import CaptureError
        from graphsafe._graphs.graph import Graph
        x = torch.ones(4, device="cuda")
        g = Graph(backend="cuda")
        status = 1
        try:
            with g.capture():
                (x * 2).sum().item()
        except CaptureError as e:
            print("CAPTURE_ERROR:", str(e).splitlines()[0])
            status = 0
        except BaseException as e:
            print("OTHER:", type(e).__name__, e)
            status = 2
        print(flush=True)
        os._exit(status)
        """
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CAPTURE_ERROR: the body did something a CUDA graph capture does not allow" in (
        done.stdout
    )
