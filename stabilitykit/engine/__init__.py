"""The engine, split by job: layer naming, clipping strategies, the device journal, the ledger, the step.

Nothing here knows Lightning, Hugging Face or W&B; drivers reach it through ``stabilitykit.drivers.base``.

The step (``StabilityEngine``, ``TrainerAlignedEngine``, ``is_fused``) and the ledger (``Ledger``,
``Counters``, ``Divergence``) are imported on first use: they take a ``StabilityConfig``, and
``stabilitykit.config`` imports sections defined in this package (``ClipConfig``, ``Fp16Config``), so
importing them here would close an import circle. Code in the package imports them from their modules.
"""

import importlib
from typing import Any

from stabilitykit.engine.decision import StepDecision as StepDecision
from stabilitykit.engine.gate import StepGate as StepGate
from stabilitykit.engine.journal import Journal as Journal
from stabilitykit.engine.journal import Row as Row
from stabilitykit.engine.journal import RowInfo as RowInfo
from stabilitykit.engine.layers import LayerMap as LayerMap
from stabilitykit.engine.layers import build_layer_map as build_layer_map
from stabilitykit.engine.layers import clean_name as clean_name
from stabilitykit.engine.layers import layer_names_for as layer_names_for
from stabilitykit.engine.layers import unwrap_model as unwrap_model

#: Names imported on first use, by the module that defines them.
_LAZY = {
    "StabilityEngine": "stabilitykit.engine.step",
    "is_fused": "stabilitykit.engine.step",
    "TrainerAlignedEngine": "stabilitykit.engine.cadence",
    "Ledger": "stabilitykit.engine.ledger",
    "Counters": "stabilitykit.engine.ledger",
    "Divergence": "stabilitykit.engine.ledger",
}


def __getattr__(name: str) -> Any:
    """The step's and the ledger's names, imported when first asked for (old paths such as
    ``stabilitykit.engine.StabilityEngine`` keep working)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stabilitykit.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
