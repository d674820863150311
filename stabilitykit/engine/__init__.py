"""The engine, split by job: layer naming, clipping strategies, the device journal, the ledger, the step.

Nothing here knows Lightning, Hugging Face or W&B; drivers reach it through ``stabilitykit.core``.
"""

from stabilitykit.engine.cadence import TrainerAlignedEngine
from stabilitykit.engine.journal import Journal, Row, RowInfo
from stabilitykit.engine.layers import LayerMap, build_layer_map, clean_name, layer_names_for, unwrap_model
from stabilitykit.engine.ledger import Counters, Divergence, Ledger
from stabilitykit.engine.step import StabilityEngine, StepDecision, StepGate, is_fused

__all__ = [
    "Counters",
    "Divergence",
    "Journal",
    "LayerMap",
    "Ledger",
    "Row",
    "RowInfo",
    "StabilityEngine",
    "StepDecision",
    "StepGate",
    "TrainerAlignedEngine",
    "build_layer_map",
    "clean_name",
    "is_fused",
    "layer_names_for",
    "unwrap_model",
]
