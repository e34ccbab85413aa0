"""graphsafe: derived buffers that stay correct under captured CUDA graphs across reloads."""

from graphsafe._declare.decorators import derive
from graphsafe._errors import CaptureError
from graphsafe._errors import DerivationDriftError
from graphsafe._errors import FrozenWeightsError
from graphsafe._errors import GraphSafetyError
from graphsafe._errors import GraphSafetyWarning
from graphsafe._errors import ImpureDerivationError
from graphsafe._errors import NotMaterializedError
from graphsafe._errors import RegistrationError
from graphsafe._errors import StaleError
from graphsafe._errors import StorageMovedError
from graphsafe._errors import WeightLoadError
from graphsafe._fingerprint.digest import fingerprint
from graphsafe._graphs.graph import Graph
from graphsafe._lineage.discovery import Discovered
from graphsafe._lineage.probes import register_probe
from graphsafe._lineage.record.native import record_lineage
from graphsafe._memory.journal import mark_written
from graphsafe._memory.ledger import Ledger
from graphsafe._runtime.load_into import load_into
from graphsafe._runtime.writes.observer import observe_writes
from graphsafe._audit.audit import AuditReport
from graphsafe._audit.audit import audit
from graphsafe._declare.registry import Registry
from graphsafe._declare.registry import default_registry
from graphsafe._runtime.runtime import Runtime
from graphsafe._runtime.runtime import runtime
from graphsafe._runtime.runtime import weight_update
from graphsafe._runtime.decorator import graphsafe
from graphsafe._declare.spec import Derivation
from graphsafe._declare.spec import DerivationInfo
from graphsafe._declare.spec import DerivationReport
from graphsafe._declare.spec import Drift
from graphsafe._declare.spec import RefreshReport

__all__ = [
    "AuditReport",
    "CaptureError",
    "Derivation",
    "DerivationDriftError",
    "FrozenWeightsError",
    "DerivationInfo",
    "DerivationReport",
    "Discovered",
    "Drift",
    "Graph",
    "GraphSafetyError",
    "GraphSafetyWarning",
    "ImpureDerivationError",
    "Ledger",
    "NotMaterializedError",
    "RefreshReport",
    "RegistrationError",
    "Registry",
    "Runtime",
    "StaleError",
    "StorageMovedError",
    "WeightLoadError",
    "audit",
    "default_registry",
    "derive",
    "fingerprint",
    "graphsafe",
    "load_into",
    "mark_written",
    "observe_writes",
    "record_lineage",
    "register_probe",
    "runtime",
    "weight_update",
]

__version__ = "0.1.0"
