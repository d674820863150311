"""Monitors for models we did not write: sampled activation, attention-logit and output-logit signals.

``ModelMonitor`` (``monitor.py``) hooks a model once and measures on sampled steps only; which
modules it hooks is ``select.py``, how the attention logits are measured at the call that
computes them is ``attention.py``, and the device-side statistics are ``stats.py``. The engine
builds one from ``StabilityConfig.monitors`` and reads it like any other metric source.
"""

from __future__ import annotations

from stabilitykit.monitors.monitor import ModelMonitor

__all__ = ["ModelMonitor"]
