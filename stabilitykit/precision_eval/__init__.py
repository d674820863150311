"""Layer-wise precision report: how far bf16 / fp16 / TF32 (or your own variant) drift from fp32, per module."""

from __future__ import annotations

from stabilitykit.precision_eval.evaluate import PrecisionReport, Variant, compare, evaluate

__all__ = ["PrecisionReport", "Variant", "compare", "evaluate"]
