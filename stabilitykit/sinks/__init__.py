"""Where metrics and events go: JSONL, the console, W&B, Lightning loggers, or any object with ``log_metrics``."""

from __future__ import annotations

from typing import Any

from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.console import ConsoleSink
from stabilitykit.sinks.jsonl import JsonlSink, read_jsonl

__all__ = ["ConsoleSink", "JsonlSink", "LightningLoggerSink", "Sink", "WandbSink", "read_jsonl"]


def __getattr__(name: str) -> Any:
    # W&B and Lightning are optional extras: import them only when asked for.
    if name == "WandbSink":
        from stabilitykit.sinks.wandb import WandbSink

        return WandbSink
    if name == "LightningLoggerSink":
        from stabilitykit.sinks.lightning_logger import LightningLoggerSink

        return LightningLoggerSink
    raise AttributeError(f"module 'stabilitykit.sinks' has no attribute {name!r}")
