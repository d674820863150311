"""Where metrics and events go: JSONL, the console, or any object with ``log_metrics`` (a Lightning logger too)."""

from __future__ import annotations

from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.console import ConsoleSink
from stabilitykit.sinks.jsonl import JsonlSink, read_jsonl

__all__ = ["ConsoleSink", "JsonlSink", "Sink", "read_jsonl"]
