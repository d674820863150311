"""Where metrics and events go: W&B, JSONL, the console, or any object with ``log_metrics`` (a Lightning logger too).

``WandbSink`` imports wandb only when it first logs, so ``import stabilitykit`` does not need it.
"""

from __future__ import annotations

from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.console import ConsoleSink
from stabilitykit.sinks.jsonl import JsonlError, JsonlSink, iter_jsonl, read_jsonl
from stabilitykit.sinks.wandb import WandbSink
from stabilitykit.sinks.wandb_file import WandbRunFile, read_wandb_records

__all__ = [
    "ConsoleSink",
    "JsonlError",
    "JsonlSink",
    "Sink",
    "WandbRunFile",
    "WandbSink",
    "iter_jsonl",
    "read_jsonl",
    "read_wandb_records",
]
