"""The frameworks' own logs as sinks: the Hugging Face Trainer's log entries and ``log_history``, and
Accelerate's trackers. Each only writes where its framework already logs; the drivers add them."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stabilitykit.events import Event
from stabilitykit.sinks.wandb import send_alert

#: Event kinds kept out of the Trainer's logs (the device's precision advice is not a training event).
NOT_LOGGED = ("precision",)
#: What the Trainer's console shows of our keys with ``console="short"`` (besides the events).
CONSOLE_KEYS = ("grad_norm/total", "skipped/total", "nonfinite/total")


def event_value(event: Event) -> float:
    """An event's value in the Trainer's logs: 1, or the grad norm's z-score when that z-score itself
    raised a spike warning (then at least ``z_warning``). A warning raised by a layer or a
    precursor logs 1: the total's z-score may then be low or negative, which reads as no spike."""
    if event.kind == "spike_warning" and event.details.get("signal") == "grad_norm":
        return float(event.details.get("z", 1.0))
    return 1.0


class TrainerLogs:
    """A sink that holds one logging step's metrics, and the events since, until the Trainer writes its log
    entry. ``alerts``: event kinds paged to the active W&B run as ``WandbSink`` pages them."""

    def __init__(self, prefix: str, alerts: Iterable[str] = ()) -> None:
        self.prefix = prefix
        self.alerts = set(alerts)
        self.metrics: dict[str, float] = {}
        self.events: list[Event] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.metrics = dict(metrics)

    def log_event(self, event: Event) -> None:
        self.events.append(event)

    def take_events(self, as_entry: bool = True) -> dict[str, float] | None:
        """The events since the last call, alerts paged; as log keys ``<prefix>/events/<kind>``
        (``event_value``) and ``..._step`` (the 0-based optimizer step), or None (none, or not ``as_entry``)."""
        events, self.events = [e for e in self.events if e.kind not in NOT_LOGGED], []
        for event in events:
            if event.kind in self.alerts:
                _page(event)
        if not (events and as_entry):
            return None
        entry: dict[str, float] = {}
        for event in events:
            key = f"{self.prefix}/events/{event.kind}".lstrip("/")
            entry[key] = event_value(event)
            entry[f"{key}_step"] = float(event.step)
        return entry

    def console_keys(self) -> Callable[[str], bool]:
        """Which keys of a log entry the console shows with ``console="short"``: the Trainer's own, and of
        ours the total grad norm, the skip and non-finite counts and the events."""
        prefix = f"{self.prefix}/".lstrip("/")
        shown = {f"{prefix}{name}" for name in CONSOLE_KEYS}

        def keep(key: str) -> bool:
            ours = key.startswith(prefix) if prefix else "/" in key
            return not ours or key in shown or key.startswith(f"{prefix}events/")

        return keep


def _page(event: Event) -> None:
    """A W&B alert on the active run, made as ``WandbSink`` makes them; never stops training."""
    try:
        send_alert(event)
    except Exception as exc:
        warnings.warn(f"stabilitykit: W&B alert failed: {exc!r}", RuntimeWarning, stacklevel=4)


class LogHistory:
    """A sink: metrics and event markers into ``trainer.state.log_history``, at their optimizer step."""

    def __init__(self, trainer: Any, prefix: str) -> None:
        self._trainer = weakref.ref(trainer)
        self.prefix = prefix

    def _append(self, entry: dict[str, Any]) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.state.log_history.append(entry)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._append({**metrics, "step": step})

    def log_event(self, event: Event) -> None:
        self._append({f"{self.prefix}/events/{event.kind}": 1.0, "step": event.step})


class AcceleratorTrackers:
    """A sink: metrics and event markers to every tracker of an ``Accelerator`` (``accelerator.log``)."""

    def __init__(self, accelerator: Any, prefix: str = "stability") -> None:
        self.accelerator = accelerator
        self.prefix = prefix

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.accelerator.trackers:
            self.accelerator.log(dict(metrics), step=step)

    def log_event(self, event: Event) -> None:
        if self.accelerator.trackers:
            self.accelerator.log({f"{self.prefix}/events/{event.kind}": 1.0}, step=event.step)
