"""Lightning's loggers as sinks: each logger itself, except that a ``WandbLogger``'s run gets a ``WandbSink``.

A Lightning logger has ``log_metrics`` only, so through it W&B would get the counters and nothing
else: no ``stability/events/*`` markers and no alerts. When a ``WandbLogger`` is among
``trainer.loggers`` (and the user gave no ``WandbSink`` of their own), its run is fed by a
``WandbSink`` instead, which logs the same metrics against the same ``trainer/global_step`` and
adds the markers and alerts. Only rank zero has the run; other ranks keep the logger (which logs
nothing there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def _is_wandb_logger(logger: Any) -> bool:
    return type(logger).__name__ == "WandbLogger"


def sinks_for_loggers(loggers: Iterable[Any], sinks: Sequence[Any], is_global_zero: bool) -> list[tuple[Any, bool]]:
    """The sinks to add for ``loggers`` beside the ``sinks`` already there, each with whether the driver
    owns it (closes it at the end; a logger is Lightning's to finalize)."""
    from stabilitykit.sinks.wandb import WandbSink

    has_wandb_sink = any(isinstance(sink, WandbSink) for sink in sinks)
    added: list[tuple[Any, bool]] = []
    for logger in loggers:
        if any(sink is logger for sink in sinks):
            continue
        if _is_wandb_logger(logger):
            if has_wandb_sink:
                continue  # the user's WandbSink logs to W&B already: the logger is not fed twice
            if is_global_zero:
                # the sink closes without finishing the run (the logger's to finish); it owns only its buffer
                added.append((WandbSink(logger.experiment), True))
                has_wandb_sink = True
                continue
        added.append((logger, False))
    return added
