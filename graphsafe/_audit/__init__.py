"""The content audit: every derived tensor recomputed out of place and compared with what
the model holds (`audit`), without a copy of the buffers' size (`compare`).
"""
