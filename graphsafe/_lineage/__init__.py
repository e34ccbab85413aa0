"""Provenance: what an engine derives from its weights without declaring it.

A recorder (compiled where the compiled checks are built, else a dispatch mode) records
the ops of an observed load (`record_lineage`); once it ends, the model
is walked and each tensor it keeps that was computed from its weights is discovered
(`resolve`), then witnessed and checked like a derivation (`discovery`).
"""

from graphsafe._lineage.discovery import AuditItem, Discovered, Discovery
from graphsafe._lineage.record.native import record_lineage
from graphsafe._lineage.record.recorder import Lineage, Recorder

__all__ = ["AuditItem", "Discovered", "Discovery", "Lineage", "Recorder", "record_lineage"]
