"""graphsafe: derived buffers that stay correct under captured CUDA graphs across reloads."""

from graphsafe.declare import derive
from graphsafe.declare import graphsafe
from graphsafe.errors import CaptureError
from graphsafe.errors import DerivationDriftError
from graphsafe.errors import GraphSafetyError
from graphsafe.errors import ImpureDerivationError
from graphsafe.errors import RegistrationError
from graphsafe.errors import StaleError
from graphsafe.errors import StorageMovedError
from graphsafe.errors import WeightLoadError
from graphsafe.graph import Graph
from graphsafe.ledger import Drift
from graphsafe.ledger import Ledger
from graphsafe.registry import Registry
from graphsafe.registry import default_registry
from graphsafe.runtime import Runtime
from graphsafe.runtime import runtime
from graphsafe.runtime import weight_update
from graphsafe.spec import Derivation
from graphsafe.spec import DerivationInfo
from graphsafe.spec import DerivationReport
from graphsafe.spec import RefreshReport

__all__ = [
    "CaptureError",
    "Derivation",
    "DerivationDriftError",
    "DerivationInfo",
    "DerivationReport",
    "Drift",
    "Graph",
    "GraphSafetyError",
    "ImpureDerivationError",
    "Ledger",
    "RefreshReport",
    "RegistrationError",
    "Registry",
    "Runtime",
    "StaleError",
    "StorageMovedError",
    "WeightLoadError",
    "default_registry",
    "derive",
    "graphsafe",
    "runtime",
    "weight_update",
]

__version__ = "0.1.0"
