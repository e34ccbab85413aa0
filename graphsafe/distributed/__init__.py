"""Weight sync over `torch.distributed`: one rank sends, the others load, graph-safe.

The trainer calls `send_weights` with checkpoint-named tensors; every other rank of the
group calls `receive_weights` with its own model, collectively. The sender never needs
the receivers' models: each receiver's own loader (`model.load_weights(pairs)`) decides
what it holds, so a pipeline rank skips the layers another rank owns.

The wire protocol, in order:

1. **Metadata**, posted to the default group's store (rank 0 serves it), not through a
   collective: a sync id, the protocol version, whether the sync is partial or verified,
   and per entry its name, shape, dtype, bucket and byte offset; the byte size of every
   bucket and of its segments. Receivers wait for it with a timeout of their own
   (`wait_timeout`, none by default), so a train step of any length fits between syncs;
   the group's timeout bounds only the transfer. A sender that fails before this point
   posts an abort record instead.
2. **Verdict**, one `all_gather` of one byte per entry and rank: each receiver says
   which entries it expects and whether the sync lacks any entry it expects (unless
   the sync is partial). A sync that lacks an expected entry, or carries one no receiver
   expects, is refused on every rank, naming the entries, before any data moves.
3. **Buckets**, each a flat byte buffer: the entries of the bucket, each at an offset
   aligned to 64 bytes, then a 32-byte trailer (a magic number, the sync id, the bucket
   index, a status). Each bucket is one `broadcast`, but the last bucket of entries,
   which travels in segments that halve toward its end down to 1 MiB (the plan says
   the size), one `broadcast` each, in order: a receiver fingerprints each bucket while
   the next one arrives, and each segment as it arrives, so that only the last
   segment's read follows the last byte. A bucket holds at most `bucket_bytes` of data;
   a tensor larger than that travels alone in a bucket of its own size (never split
   for the loader, which always gets whole tensors). The sender checks each bucket's
   length against the plan before posting it (a bucket longer than the receivers'
   buffer would abort their processes inside gloo). A sender that fails while packing
   a bucket broadcasts that bucket with the status *abort* in its trailer; its error
   text goes to the store.
4. **Handshake**, one `all_gather`, still inside the receivers' update blocks: every
   rank says whether its transfer went through (one int64) and, in a verified sync
   (`verify=True`, the default), every entry's fingerprint (two int64 per entry): the
   sender's `gs.fingerprint` of the tensor it was given, taken before packing it; each
   receiver's of the bytes it received for the entry, segment by segment as they
   arrived, before its loader ran (the fingerprint's sums are keyed by position and
   commute, so the segments' sums add up to the entry's). Every rank reads the same
   table: a receiver whose transfer failed, or that got an entry other than the sender
   was given it, did not apply the sync, and then every receiver fails closed; the
   entries that arrived changed are named on every rank.

Every wait on a collective polls the store for an abort record: a rank whose collective
failed (a peer died, a timeout) or that failed outside the protocol posts one, so every
other rank raises within a fraction of a second. Each error's `.recovery` says what the
next sync needs, and `recover` does it: nothing, a new group, or a new world.

A receiver runs the whole sync inside one `gs.weight_update(model)`: collectives write
into its staging buffer (never into parameters), the loader copies from views of that
buffer with its tracked `copy_`, the staging buffer's writes are declared to the journal
with `gs.mark_written` (graphsafe cannot see c10d writes), and the derived buffers are
refreshed once, when the block exits. Any failure inside the block leaves the model
failed closed: its guarded graphs refuse to replay until a later sync completes.

The copies overlap the transfer (`overlap=True`, the default): the staging buffer holds
two bucket slots, the sender packs bucket k+1 into one while bucket k's broadcast runs
from the other, and the receiver has bucket k+1's broadcast posted into one slot while
the loader copies bucket k out of the other. A slot is reused only after its broadcast
completed (sender) or its loader call returned (receiver). Overlap is each side's own
choice: the bytes on the wire are the same either way.

The staging buffer is allocated once per (model, group) and reused by every later sync
whose buckets fit in it (`staging_buffer`, `release_staging`); the sender keeps one per
group likewise. When the sync overlaps and has more than one bucket it holds two slots
(the largest even bucket and the largest odd one, trailers included: at most two
buckets), else one bucket; `overlap=False` keeps it at one.
With gloo the staging buffers live in CPU memory; with NCCL on the current CUDA device.
"""

from __future__ import annotations

from graphsafe.distributed._reports import RejectedEntry
from graphsafe.distributed._reports import SendReport
from graphsafe.distributed._reports import ReceiveReport
from graphsafe.distributed._reports import WeightSyncError
from graphsafe.distributed._staging import staging_buffer
from graphsafe.distributed._staging import release_staging
from graphsafe.distributed._sender import send_weights
from graphsafe.distributed._receive.receiver import receive_weights, sync_pending
from graphsafe.distributed._control.recover import recover

__all__ = [
    "ReceiveReport",
    "RejectedEntry",
    "SendReport",
    "WeightSyncError",
    "receive_weights",
    "recover",
    "release_staging",
    "send_weights",
    "staging_buffer",
    "sync_pending",
]
