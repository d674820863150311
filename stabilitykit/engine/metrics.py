"""Metric naming: a logging step's numbers, from the rows the host just read, as sink-ready names.

Pure Python over host values: ``<prefix>/grad_norm/total``, ``<prefix>/grad_norm/<layer>``,
``skipped/*``, ``clip/*``, ``scaler/*``, the spike monitor's ``spikes/*``, module metrics and
update ratios. Which layers are logged follows ``GradNormConfig.include`` / ``exclude``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config module imports the sections' owners, this package among them
    from stabilitykit.config import StabilityConfig


class MetricNames:
    """Names and builds one optimizer's logging-step metrics."""

    def __init__(self, config: StabilityConfig, layer_names: Sequence[str]) -> None:
        self.prefix = config.metric_prefix
        gcfg = config.grad_norm
        self.per_layer = gcfg.per_layer
        self.recovery = config.recovery.enabled
        self.layer_names = list(layer_names)
        self.logged_layers = [i for i, name in enumerate(self.layer_names) if self._logged(config, name)]

    @staticmethod
    def _logged(config: StabilityConfig, name: str) -> bool:
        gcfg = config.grad_norm
        if gcfg.include and not any(re.search(p, name) for p in gcfg.include):
            return False
        return not (gcfg.exclude and any(re.search(p, name) for p in gcfg.exclude))

    def key(self, name: str) -> str:
        """The full metric name: ``<prefix>/<name>``."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def build(
        self,
        last: Any,
        counters: Any,
        clipping: bool,
        scaler: Mapping[str, float] | None,
        extra: Sequence[Mapping[str, float]],
    ) -> dict[str, float]:
        """The named metrics of a logging step whose newest row is ``last`` (a journal ``Row``)."""
        c = counters
        metrics: dict[str, float] = {
            "grad_norm/total": last.total,
            "grad_norm/max": c.max_norm_recent,
            "skipped/total": c.skipped_total,
            "skipped/recent": c.skipped_recent,
            "skipped/consecutive": c.consecutive,
            "nonfinite/total": c.nonfinite_total,
        }
        if self.recovery:
            metrics["skipped/ahead"] = c.skipped_ahead_total  # batches a rollback skipped after it
        if last.loss is not None:
            metrics["loss"] = last.loss
        if math.isfinite(c.max_loss_recent):
            metrics["loss/max"] = c.max_loss_recent  # the interval's largest finite loss, skipped steps too
        if clipping:
            metrics["clip/coef"] = last.coef
            metrics["clip/threshold"] = last.threshold
            metrics["clip/clipped_total"] = c.clipped_total
            metrics["clip/clipped_recent"] = c.clipped_recent
        if scaler:
            metrics.update(scaler)
        for group in extra:
            metrics.update(group)
        if self.per_layer and last.layers:
            for i in self.logged_layers:
                metrics[f"grad_norm/{self.layer_names[i]}"] = last.layers[i]
        head = f"{self.prefix}/" if self.prefix else ""
        return {head + k: float(v) for k, v in metrics.items()}
