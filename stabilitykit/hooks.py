"""HookManager: the events both drivers produce, dispatched to user functions and to sinks."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stabilitykit.events import EVENT_KINDS, Event
from stabilitykit.run_log import EventLog
from stabilitykit.sinks.base import Sink

EventHook = Callable[[Event], Any]


class HookManager:
    """Events in, user hooks and sinks out.

    ``on(kind, fn)`` registers ``fn(event)`` for one event kind (or ``"*"`` for all). Sinks get
    ``log_metrics`` on logging steps and ``log_event`` for events; a sink that raises is disabled
    with one warning so a failing logger never stops training. User hooks are user code: their
    exceptions propagate (raise from a hook to stop training on purpose). Skips, divergence and
    alerts also go to Python's ``logging`` (``run_log.EventLog``; ``log_events=False``: not).
    """

    def __init__(self, sinks: Iterable[Sink] | None = None, log_events: bool = True) -> None:
        self._hooks: dict[str, list[EventHook]] = defaultdict(list)
        self.sinks: list[Any] = list(sinks or [])
        self.disabled: dict[int, str] = {}
        self._borrowed: set[int] = set()  # sinks a framework owns (a Lightning logger): never closed here
        self.event_log: EventLog | None = EventLog() if log_events else None

    def on(self, kind: str, fn: EventHook) -> EventHook:
        """Call ``fn(event)`` for every event of ``kind`` ("*": every event). Returns ``fn``."""
        if kind != "*" and kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {', '.join(EVENT_KINDS)} or '*'")
        self._hooks[kind].append(fn)
        return fn

    def off(self, kind: str, fn: EventHook) -> None:
        """Stop calling ``fn`` for ``kind``."""
        self._hooks[kind].remove(fn)

    def add_sink(self, sink: Sink, owned: bool = True) -> None:
        """Send metrics and events to one more sink. ``owned=False``: a framework's own logger (a
        Lightning logger), which the framework closes; ``close()`` leaves it alone."""
        self.sinks.append(sink)
        if not owned:
            self._borrowed.add(id(sink))

    def _call_sink(self, sink: Any, method: str, *args: Any) -> None:
        if id(sink) in self.disabled:
            return
        fn = getattr(sink, method, None)
        if fn is None:
            return
        try:
            fn(*args)
        except Exception as exc:
            self.disabled[id(sink)] = repr(exc)
            warnings.warn(
                f"stabilitykit: sink {type(sink).__name__} raised {exc!r} in {method}; "
                "it is disabled for the rest of the run, training goes on",
                RuntimeWarning,
                stacklevel=2,
            )

    def emit(self, event: Event) -> None:
        """Send one event to the hooks registered for its kind, to "*" hooks, then to the sinks."""
        if self.event_log is not None:
            self.event_log(event)
        for fn in [*self._hooks.get(event.kind, []), *self._hooks.get("*", [])]:
            fn(event)
        for sink in self.sinks:
            self._call_sink(sink, "log_event", event)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Send one logging step's host-side metrics to every live sink."""
        for sink in self.sinks:
            self._call_sink(sink, "log_metrics", metrics, step)

    def close(self) -> None:
        """Close every sink that has ``close()`` (a framework's own loggers excepted). Idempotent: a sink
        is closed once, and a closed manager closes nothing more."""
        for sink in self.sinks:
            if id(sink) not in self._borrowed:
                self._borrowed.add(id(sink))
                self._call_sink(sink, "close")
