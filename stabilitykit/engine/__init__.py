"""The engine, split by job: layer naming, clipping strategies, the device journal, the ledger, the step.

Nothing here knows Lightning, Hugging Face or W&B; drivers reach it through ``stabilitykit.drivers.core``.
"""

from stabilitykit.engine.cadence import TrainerAlignedEngine as TrainerAlignedEngine
from stabilitykit.engine.journal import Journal as Journal
from stabilitykit.engine.journal import Row as Row
from stabilitykit.engine.journal import RowInfo as RowInfo
from stabilitykit.engine.layers import LayerMap as LayerMap
from stabilitykit.engine.layers import build_layer_map as build_layer_map
from stabilitykit.engine.layers import clean_name as clean_name
from stabilitykit.engine.layers import layer_names_for as layer_names_for
from stabilitykit.engine.layers import unwrap_model as unwrap_model
from stabilitykit.engine.ledger import Counters as Counters
from stabilitykit.engine.ledger import Divergence as Divergence
from stabilitykit.engine.ledger import Ledger as Ledger
from stabilitykit.engine.step import StabilityEngine as StabilityEngine
from stabilitykit.engine.step import StepDecision as StepDecision
from stabilitykit.engine.step import StepGate as StepGate
from stabilitykit.engine.step import is_fused as is_fused
