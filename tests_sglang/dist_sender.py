"""The trainer side of `update_weights_from_distributed`, run as its own process: joins the
engine's weight-update group (rank 0, gloo) and broadcasts a checkpoint's tensors.

Usage: python dist_sender.py PORT GROUP KIND SEED
"""

from __future__ import annotations

import sys

import sglang_stubs

sglang_stubs.install()

import sglang_models as sm  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    from sglang.srt.utils.common import init_custom_process_group

    port, group, kind, seed = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    pg = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
        group_name=group,
    )
    for _, w in sm.checkpoint(kind, seed):
        torch.distributed.broadcast(w.contiguous(), src=0, group=pg)
    torch.distributed.destroy_process_group(pg)


if __name__ == "__main__":
    main()
