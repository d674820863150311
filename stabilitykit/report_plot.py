"""``stabilitykit report``: one picture of a run from its JSONL log or a Lightning CSV log.

Panels: loss; total grad norm (log scale) with the clip threshold; the grad-norm z-score with
the warning line; the update-to-weight ratio, total and per layer, when the run logged it
(``GradNormConfig(update_ratio=True)``); the monitors' precursor signals (max attention logit per
layer, output logits' max and log Z) when the run logged them (``MonitorConfig``); a per-layer
grad-norm heatmap (layers x steps). Skipped steps, spike warnings,
loss spikes and alerts are marked on every line panel. Needs matplotlib (``plots`` extra).

The log is read one line at a time into a bounded number of step bins per series (min, max and
last value per bin), so a log of millions of lines is drawn in bounded memory; logs shorter than
the bin count are drawn exactly. A log resumed from a checkpoint repeats steps: the later row wins.
"""

from __future__ import annotations

import csv
import math
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabilitykit.spikes import SpikeConfig

_MARKERS = {
    "skipped": ("x", "tab:red", "skipped"),
    "spike_warning": ("^", "tab:orange", "spike warning"),
    "loss_spike": ("v", "tab:purple", "loss spike"),
    "spike_alert": ("*", "crimson", "spike alert"),
    "diverged": ("X", "black", "diverged"),
    "fp16_warning": ("s", "tab:brown", "fp16 warning"),
    "rollback": ("D", "tab:green", "rollback"),
}
#: Series the report draws, by name under the metric prefix.
_LINES = (
    "loss",
    "loss/max",
    "grad_norm/total",
    "grad_norm/max",
    "clip/threshold",
    "spikes/z_grad_norm",
    "spikes/max_z_grad_norm",
    "spikes/z_loss",
    "spikes/max_z_loss",
    "spikes/z_warning",
    "skipped/total",
    "update_ratio",
)
#: Monitor signals the report draws (``monitors/<signal>/<module>``): the precursors.
_MONITOR_SIGNALS = ("attn_logit_max", "logits_max", "log_z")
#: The rule-of-thumb update/weight ratio per step drawn as a reference line (Adam-style optimizers).
_RATIO_GUIDE = 1e-3
_ANCHOR = "grad_norm/total"  # every metric row of the guard holds it: it tells the prefix
_LINE_BINS = 4096  # per line series; per-layer series get a quarter of it
_MAX_MARKS = 2000
_LANE = 0.06  # the height, in axes fractions, between the event kinds' lanes of marks on the top panel
_FULL_LINES = 200  # up to this many marks of a kind get a full-height line on every panel
_CHUNK = 65536  # values buffered per series before they are folded into its bins
_UNSEEN = object()
#: A rollback event's step range: the steps it undid and the batches it skipped after it.
_ROLLBACK_SPAN = ("skipped_from", "skipped_to", "skip_ahead_to")


class ReportError(ValueError):
    """A log or an output path the report cannot use; the message names it and says why (one line)."""


class _Bins:
    """min, max and last finite value of a series in at most ``capacity`` step bins (bin width doubles as needed).

    Values are appended to a small buffer and folded into the bins with numpy every ``_CHUNK``
    values, so adding one costs two appends. Within a one-step bin the later row wins (a resumed
    run repeats steps); wider bins keep the min and max of all their rows, and the last step's value.
    """

    def __init__(self, capacity: int) -> None:
        import numpy as np

        self.capacity = capacity + capacity % 2
        self.origin: int | None = None
        self.width = 1
        self.lo = np.full(self.capacity, np.nan)
        self.hi = np.full(self.capacity, np.nan)
        self.last = np.full(self.capacity, np.nan)
        self.last_step = np.full(self.capacity, -1, dtype=np.int64)
        self.total = np.zeros(self.capacity)
        self.count = np.zeros(self.capacity)
        self.used = 0  # bins up to the highest one written
        self.step_buffer = array("q")  # appended to by the loader, folded every _CHUNK values
        self.value_buffer = array("d")

    def add(self, step: int, value: float) -> None:
        self.step_buffer.append(step)
        self.value_buffer.append(value)
        if len(self.step_buffer) >= _CHUNK:
            self.fold()

    def fold(self) -> None:
        """Fold the buffered values into the bins."""
        import numpy as np

        if not self.step_buffer:
            return
        steps = np.array(self.step_buffer, dtype=np.int64)
        values = np.array(self.value_buffer, dtype=np.float64)
        del self.step_buffer[:], self.value_buffer[:]
        keep = np.isfinite(values)  # a skipped step's NaN/Inf is marked by its event, not drawn as a value
        steps, values = steps[keep], values[keep]
        if not len(steps):
            return
        if self.origin is None:
            self.origin = int(steps[0])
        offset = np.maximum(steps - self.origin, 0)
        while int(offset.max()) // self.width >= self.capacity:
            self._halve()
        cols = offset // self.width
        self.used = max(self.used, int(cols.max()) + 1)
        order = np.lexsort((np.arange(len(steps)), steps))  # by step, then by when the row was written
        cols_sorted, steps_sorted, values_sorted = cols[order], steps[order], values[order]
        tail = np.r_[cols_sorted[1:] != cols_sorted[:-1], True]  # the last entry of each bin: its latest row
        at, step_at, value_at = cols_sorted[tail], steps_sorted[tail], values_sorted[tail]
        if self.width == 1:
            self.lo[at] = self.hi[at] = self.last[at] = self.total[at] = value_at
            self.last_step[at] = step_at
            self.count[at] = 1
            return
        np.fmin.at(self.lo, cols, values)
        np.fmax.at(self.hi, cols, values)
        np.add.at(self.total, cols, values)
        np.add.at(self.count, cols, 1)
        newer = step_at >= self.last_step[at]
        self.last[at[newer]] = value_at[newer]
        self.last_step[at[newer]] = step_at[newer]

    def _halve(self) -> None:
        """Merge neighbouring bins pairwise: half the bins, twice the width."""
        import numpy as np

        half = self.capacity // 2

        def pad(values: Any, fill: Any) -> Any:
            return np.concatenate([values, np.full(half, fill, dtype=values.dtype)])

        self.lo = pad(np.fmin(self.lo[0::2], self.lo[1::2]), np.nan)
        self.hi = pad(np.fmax(self.hi[0::2], self.hi[1::2]), np.nan)
        right = self.last_step[1::2] >= self.last_step[0::2]
        self.last = pad(np.where(right, self.last[1::2], self.last[0::2]), np.nan)
        self.last_step = pad(np.where(right, self.last_step[1::2], self.last_step[0::2]), -1)
        self.total = pad(self.total[0::2] + self.total[1::2], 0.0)
        self.count = pad(self.count[0::2] + self.count[1::2], 0.0)
        self.width *= 2
        self.used = (self.used + 1) // 2

    def steps(self) -> list[int]:
        """The first step of each bin that holds a value."""
        self.fold()
        origin = self.origin or 0
        return [origin + i * self.width for i in range(self.used) if self.last_step[i] >= 0]

    def column(self, which: str) -> list[float]:
        """``lo``, ``hi``, ``last`` or ``mean`` of each bin that holds a value."""
        self.fold()
        if which == "mean":
            values = self.total[: self.used] / self.count[: self.used].clip(min=1)
        else:
            values = getattr(self, which)[: self.used]
        return [float(v) for v in values[self.last_step[: self.used] >= 0]]


@dataclass
class RunLog:
    """A run's metric series (binned by step) and its events, whatever file they came from."""

    prefix: str = "stability"
    lines: dict[str, _Bins] = field(default_factory=dict)
    layers: dict[str, _Bins] = field(default_factory=dict)
    #: per-layer update/weight ratios (``update_ratio/<layer>``), when the run logged them
    update_layers: dict[str, _Bins] = field(default_factory=dict)
    #: monitor signals (``monitors/<signal>/<module>`` without the prefix), when the run logged them
    monitors: dict[str, _Bins] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    n_rows: int = 0
    first_step: int | None = None
    last_step: int | None = None
    #: the files the picture was drawn from, in order (several: a resumed Lightning run's versions)
    sources: list[Path] = field(default_factory=list)
    #: what a reader should know about how the files were chosen (printed by ``stabilitykit report``)
    notes: list[str] = field(default_factory=list)

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """Steps and values (the last value of each bin) of ``<prefix>/<name>`` where present."""
        bins = self.lines.get(name)
        return ([], []) if bins is None else (bins.steps(), bins.column("last"))

    def layer_names(self) -> list[str]:
        """Per-layer grad-norm names, in first-seen order."""
        return list(self.layers)

    @property
    def has_update_ratio(self) -> bool:
        """The run logged the update/weight ratio (total or per layer)."""
        return "update_ratio" in self.lines or bool(self.update_layers)

    @property
    def has_monitors(self) -> bool:
        """The run logged monitor precursors (max attention logit, output logits' max, log Z)."""
        return bool(self.monitors)

    def all_bins(self) -> list[_Bins]:
        """Every series' bins."""
        return [*self.lines.values(), *self.layers.values(), *self.update_layers.values(), *self.monitors.values()]

    @property
    def binned(self) -> bool:
        """True when some series has more steps than bins (then each point stands for several steps)."""
        return any(b.width > 1 for b in self.all_bins())


class _Builder:
    """Feeds metric rows and events into a ``RunLog``; finds the metric prefix when not given."""

    def __init__(self, source: Path, prefix: str | None, bins: int = _LINE_BINS) -> None:
        self.source = source
        self.bins = bins
        self.log = RunLog(prefix=prefix or "")
        self.prefix = prefix
        self.seen_events: set[tuple[str, int]] = set()
        self.targets: dict[str, Any] = {}
        self.rows_without_metrics = 0

    def _find_prefix(self, row: dict[str, Any]) -> str | None:
        for key in row:
            if key == _ANCHOR or key.endswith("/" + _ANCHOR):
                return key[: -len(_ANCHOR)].rstrip("/")
        return None

    def _target(self, key: str) -> _Bins | None:
        """The bins a key's values go to (created on first sight), or None for keys the report does not draw."""
        head = f"{self.prefix}/" if self.prefix else ""
        if not key.startswith(head):
            return None
        name = key[len(head) :]
        if name in _LINES:
            return self.log.lines.setdefault(name, _Bins(self.bins))
        if name.startswith("grad_norm/"):
            return self.log.layers.setdefault(name[len("grad_norm/") :], _Bins(max(2, self.bins // 4)))
        if name.startswith("update_ratio/"):
            return self.log.update_layers.setdefault(name[len("update_ratio/") :], _Bins(max(2, self.bins // 4)))
        if name.startswith("monitors/") and name.split("/")[1] in _MONITOR_SIGNALS:
            return self.log.monitors.setdefault(name, _Bins(max(2, self.bins // 4)))
        return None

    def add_row(self, row: dict[str, Any], step: int) -> None:
        if self.prefix is None:
            self.prefix = self._find_prefix(row)
            if self.prefix is None:
                self.rows_without_metrics += 1
                return
            self.log.prefix = self.prefix
        targets = self.targets
        found = False
        for key, value in row.items():
            target = targets.get(key, _UNSEEN)
            if target is _UNSEEN:
                bins = self._target(key)
                target = targets[key] = (bins.step_buffer.append, bins.value_buffer.append) if bins else None
            kind = type(value)
            if target is not None and (kind is float or kind is int):  # not bool, not "nan" strings
                target[0](step)
                target[1](value)
                found = True
        if not found:
            self.rows_without_metrics += 1
            return
        log = self.log
        if log.n_rows % _CHUNK == _CHUNK - 1:
            for bins in log.all_bins():
                bins.fold()
        log.n_rows += 1
        if log.first_step is None or step < log.first_step:
            log.first_step = step
        if log.last_step is None or step > log.last_step:
            log.last_step = step

    def add_event(self, kind: str, step: int, extra: dict[str, Any] | None = None) -> None:
        if (kind, step) in self.seen_events:  # a resumed run repeats its events
            return
        self.seen_events.add((kind, step))
        self.log.events.append({"kind": kind, "step": step, **(extra or {})})

    def finish(self, what: str) -> RunLog:
        log = self.log
        for bins in log.all_bins():
            bins.fold()
        if log.n_rows:
            return log
        if self.rows_without_metrics:
            raise ReportError(
                f"{self.source}: {self.rows_without_metrics} {what} but none holds a stabilitykit metric "
                f"(<prefix>/{_ANCHOR}); is this a stabilitykit log?"
            )
        if log.events:
            raise ReportError(
                f"{self.source}: no metric rows to draw, only {len(log.events)} event(s) "
                "(the run stopped before its first logging step?)"
            )
        raise ReportError(f"{self.source}: empty log, no metric rows to draw")


def _step_of(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReportError(f'{where}: "step" is {value!r}, expected an integer')
    return int(value)


def _load_jsonl(path: Path, prefix: str | None, bins: int) -> RunLog:
    from stabilitykit.sinks.jsonl import iter_jsonl_numbered

    build = _Builder(path, prefix, bins)
    for number, record in iter_jsonl_numbered(path, specials=False):
        where = f"{path}:{number}"
        if "step" not in record:
            raise ReportError(f'{where}: a record without "step"; is this a stabilitykit log?')
        step = _step_of(record["step"], where)
        if "event" in record:
            kind = str(record["event"])
            extra = {k: record[k] for k in _ROLLBACK_SPAN if k in record} if kind == "rollback" else None
            build.add_event(kind, step, extra)
        else:
            build.add_row(record, step)
    return build.finish("rows")


def _csv_rows(path: Path) -> Any:
    """``(line number, step, numeric values)`` of each row of a Lightning ``metrics.csv`` that has a step."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            for number, record in enumerate(csv.DictReader(handle), start=2):
                raw_step = record.get("step")
                if raw_step in (None, ""):
                    continue
                try:
                    step = _step_of(float(raw_step), f"{path}:{number}")
                except ValueError as exc:
                    raise ReportError(f'{path}:{number}: "step" is {raw_step!r}, expected an integer') from exc
                row: dict[str, Any] = {}
                for key, text in record.items():
                    if key is None or text in (None, "") or key == "step":
                        continue
                    try:
                        row[key] = float(text)
                    except (TypeError, ValueError):
                        continue
                yield number, step, row
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ReportError(f"{path}: not a readable CSV log ({exc})") from None


def _load_csv(paths: list[Path], prefix: str | None, bins: int) -> RunLog:
    """Lightning ``CSVLogger`` files (one, or a resumed run's versions in order): rows merged by step;
    skips read off the ``skipped/total`` counter.

    A resumed run's counter carries over: its first rows are compared with the counter the earlier
    files had reached before the resume's first step, so the carried-over count is no new skip.
    """
    build = _Builder(paths[-1], prefix, bins)
    history: list[tuple[int, float]] = []  # (step, skipped/total) of the files read so far
    for path in paths:
        skipped_before: float | None = None
        for _number, step, row in _csv_rows(path):
            build.add_row(row, step)
            total = row.get(f"{build.prefix}/skipped/total" if build.prefix else "skipped/total")
            if total is None or not math.isfinite(total):
                continue
            if skipped_before is None:  # this file's baseline: the earlier files' count before its first step
                skipped_before = max((t for s, t in history if s < step), default=0.0)
            if total > skipped_before:
                build.add_event("skipped", step, {"count": int(total - skipped_before)})
            skipped_before = total
            history.append((step, total))
    build.log.sources = list(paths)
    return build.finish("CSV rows")


def _first_csv_step(path: Path) -> int | None:
    for _number, step, _row in _csv_rows(path):
        return step
    return None


def _version_key(path: Path) -> tuple[str, int, str]:
    """``.../<name>/version_<n>/metrics.csv`` sorts by logger folder, then version number."""
    folder = path.parent.name
    number = int(folder.rsplit("_", 1)[1]) if folder.startswith("version_") and folder[8:].isdigit() else -1
    return (str(path.parent.parent), number, folder)


def _csv_run(found: list[Path]) -> tuple[list[Path], list[str]]:
    """The newest run among Lightning ``metrics.csv`` files, with the versions it was resumed from.

    A version whose first step is past the previous version's first step continues it (Lightning
    starts a new ``version_<n>`` on every fit, a resume included); one that starts over is another run.
    """
    ordered = sorted(found, key=_version_key)
    newest = ordered[-1]
    group = [p for p in ordered if p.parent.parent == newest.parent.parent]
    run = [group[-1]]
    for older in reversed(group[:-1]):
        first_newer, first_older = _first_csv_step(run[0]), _first_csv_step(older)
        if first_newer is None or first_older is None or first_newer <= first_older:
            break
        run.insert(0, older)
    names = [p.parent.name for p in run]
    notes = []
    if len(run) > 1:
        notes.append(f"drawing {', '.join(names)} as one run (resumed {len(run) - 1} time(s))")
    others = [p for p in ordered if p not in run]
    if others:
        notes.append(
            f"the folder holds {len(others)} other run(s) ({', '.join(p.parent.name for p in others[:5])}"
            f"{', ...' if len(others) > 5 else ''}); drawing the newest, {names[-1]} "
            "(give a metrics.csv to draw another)"
        )
    return run, notes


def _load_trainer_state(path: Path, prefix: str | None, bins: int) -> RunLog:
    """A Hugging Face Trainer's ``trainer_state.json``: its ``log_history`` entries, at the Trainer's
    global step. Events (``<prefix>/events/<kind>`` with ``..._step``, the 0-based optimizer step)
    are marked at the global step that ran them (that step + 1)."""
    import json

    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not a readable trainer_state.json ({exc})") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ReportError(f"{path}: a JSON file with no log_history; is this a Trainer's trainer_state.json?")
    build = _Builder(path, prefix, bins)
    for number, entry in enumerate(history):
        if not isinstance(entry, dict) or "step" not in entry:
            continue
        step = _step_of(entry["step"], f"{path}: log_history[{number}]")
        row = {}
        for key, value in entry.items():
            head, _, kind = key.rpartition("events/")
            if head.endswith("/") or (head == "" and key.startswith("events/")):
                if not kind.endswith("_step"):
                    when = entry.get(f"{key}_step")
                    event_step = int(when) + 1 if isinstance(when, (int, float)) and math.isfinite(when) else step
                    build.add_event(kind, event_step)
                continue
            row[key] = value
        build.add_row(row, step)
    build.log.sources = [path]
    return build.finish("log_history entries")


def _trainer_states(folder: Path) -> list[Path]:
    """``trainer_state.json`` files in a Trainer's output folder: its own, or its checkpoints' (newest last)."""
    own = folder / "trainer_state.json"
    if own.is_file():
        return [own]

    def number(path: Path) -> int:
        tail = path.parent.name.rsplit("-", 1)[-1]
        return int(tail) if tail.isdigit() else -1

    return sorted(folder.rglob("trainer_state.json"), key=lambda p: (number(p), str(p)))


def _is_trainer_state(path: Path) -> bool:
    if path.name == "trainer_state.json":
        return True
    if path.suffix != ".json":
        return False
    with path.open("rb") as handle:
        head = handle.read(4096)
    return head.lstrip().startswith(b"{") and b'"log_history"' in head


def load_run_log(path: str | os.PathLike[str], prefix: str | None = None, bins: int = _LINE_BINS) -> RunLog:
    """Read the guard's JSONL log, a Lightning ``CSVLogger`` ``metrics.csv`` (rows merged by step),
    or a Hugging Face Trainer's ``trainer_state.json`` (its ``log_history``).

    A folder: its ``*.jsonl`` log (the richest source: every event, each skip's step, rollback ranges),
    else its Lightning ``metrics.csv`` files (the newest run, with the versions it was resumed from,
    drawn as one), else the Trainer's ``trainer_state.json`` (the output folder's own, else the newest
    ``checkpoint-<n>``'s). What was chosen is in ``notes``, and why when the folder held both a JSONL
    log and ``metrics.csv``.
    ``prefix`` is the ``metric_prefix`` the run logged with; by default it is found in the log.
    ``bins``: step bins per series (memory stays bounded by it whatever the log's length).
    Raises ``ReportError`` (or ``JsonlError``), one line naming the file, for anything it cannot draw.
    """
    path = Path(path)
    notes: list[str] = []
    if path.is_dir():
        csvs = sorted(path.rglob("metrics.csv"))
        jsonls = sorted(path.rglob("*.jsonl"))
        if csvs and jsonls:
            notes.append(
                f"drawing {jsonls[-1]}: the JSONL log holds every event and skip, which Lightning's metrics.csv "
                f"({len(csvs)} in the folder) does not; give a metrics.csv to draw it instead"
            )
        if csvs and not jsonls:
            run, notes = _csv_run(csvs)
            log = _load_csv(run, prefix, bins)
            log.notes = notes
            return log
        found = jsonls or _trainer_states(path)
        if not found:
            raise ReportError(f"{path}: a folder with no metrics.csv, *.jsonl or trainer_state.json log in it")
        if len(found) > 1:
            notes.append(f"drawing {found[-1]} ({len(found)} logs in the folder; give a file to draw another)")
        path = found[-1]
    if not path.exists():
        raise ReportError(f"{path}: no such file")
    if path.suffix == ".csv":
        log = _load_csv([path], prefix, bins)
    elif _is_trainer_state(path):
        log = _load_trainer_state(path, prefix, bins)
    else:
        log = _load_jsonl(path, prefix, bins)
        log.sources = [path]
    log.notes = notes + log.notes
    return log


def check_output(output: Path) -> None:
    """Fail before reading the log when the picture could not be saved there."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    kind = output.suffix.lower().lstrip(".")
    if not kind:
        raise ReportError(f"{output}: no file extension; name the picture .png, .svg or .pdf")
    if kind not in formats:
        raise ReportError(f"{output}: .{kind} is not an image format matplotlib writes ({', '.join(sorted(formats))})")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ReportError(f"{output}: cannot create its folder (part of that path is a file)") from None
    except OSError as exc:
        raise ReportError(f"{output}: cannot create its folder ({exc.strerror or exc})") from None
    if output.is_dir():
        raise ReportError(f"{output}: is a folder; give a file name such as {output / 'report.png'}")
    if not os.access(output.parent, os.W_OK):
        raise ReportError(f"{output}: its folder is not writable")


def _marks(steps: list[int]) -> list[int]:
    """At most ``_MAX_MARKS`` marker positions: beyond that, one per step bucket (a panel is ~1000 px wide)."""
    if len(steps) <= _MAX_MARKS:
        return steps
    lo, hi = min(steps), max(steps)
    size = max(1, math.ceil((hi - lo + 1) / _MAX_MARKS))
    return sorted({lo + (s - lo) // size * size for s in steps})


def _plot_series(ax: Any, bins: _Bins | None, positive: bool = False, **style: Any) -> None:
    """The value per step as a line; when bins hold several steps, their mean, in the band of their min..max."""
    if bins is None:
        return
    steps, lo, hi = bins.steps(), bins.column("lo"), bins.column("hi")
    last = bins.column("last" if bins.width == 1 else "mean")
    if positive:
        keep = [i for i, v in enumerate(lo) if v > 0]
        steps = [steps[i] for i in keep]
        last, lo, hi = ([seq[i] for i in keep] for seq in (last, lo, hi))
    ax.plot(steps, last, **style)
    if bins.width > 1 and steps:
        ax.fill_between(steps, lo, hi, color=style.get("color"), alpha=0.2, lw=0, step="post")


def _plot_update_ratio(ax: Any, run: RunLog) -> None:
    """The update/weight ratio per step: the total in black, each layer a thin line (first layer purple,
    last yellow), the 1e-3 rule of thumb dashed. A skipped step's 0 is not drawn (log scale); its mark is."""
    from matplotlib import colormaps

    names = list(run.update_layers)
    cmap = colormaps["viridis"]
    for i, name in enumerate(names):
        color = cmap(i / max(1, len(names) - 1))
        label = name if len(names) <= 8 else None
        _plot_series(ax, run.update_layers[name], True, color=color, lw=0.7, alpha=0.8, label=label)
    _plot_series(ax, run.lines.get("update_ratio"), True, color="black", lw=1.4, label="total")
    ax.axhline(_RATIO_GUIDE, color="gray", lw=0.8, ls="--", label="1e-3 (rule of thumb)")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_ylabel("||Δw|| / ||w||")
    colours = f"; {len(names)} layers, purple (first) to yellow (last)" if len(names) > 8 else ""
    ax.set_title(f"update / weight ratio of the step before each logging step{colours}", fontsize=8)
    ax.legend(loc="upper right", fontsize=7, ncol=2)


def draw_report(
    log: str | os.PathLike[str] | RunLog,
    output: str | os.PathLike[str] = "report.png",
    title: str | None = None,
    prefix: str | None = None,
) -> Path:
    """Draw the one-page report of a run and save it; returns the path.

    ``prefix``: the run's ``metric_prefix`` (found in the log when None). Raises ``ReportError``
    (a ``ValueError``), one line naming the file, for a log it cannot draw or an output it
    cannot write (checked before the log is read).
    """
    output = Path(output)
    check_output(output)
    fig = report_figure(log, title=title, prefix=prefix)
    try:
        fig.savefig(output, dpi=100)
    except OSError as exc:
        raise ReportError(f"{output}: cannot write the picture ({exc.strerror or exc})") from None
    return output


def report_figure(log: str | os.PathLike[str] | RunLog, title: str | None = None, prefix: str | None = None) -> Any:
    """The report as a matplotlib ``Figure`` (not registered with pyplot, so no backend is touched).

    Panels, top to bottom, each drawn by its own function: loss, grad norm, z-score, the update
    ratio (when logged), the monitor precursors (when logged), the per-layer heatmap (when
    per-layer norms were logged); event marks on every line panel.
    """

    run = log if isinstance(log, RunLog) else load_run_log(log, prefix)
    return _figure(run, title, log)


def _figure(run: RunLog, title: str | None, log: Any) -> Any:
    from matplotlib.figure import Figure

    layers = run.layer_names()
    updates = run.has_update_ratio
    monitors = run.has_monitors
    fig = Figure(figsize=(12, 9 + (4 if layers else 0) + (3.5 if updates else 0) + (3.5 if monitors else 0)))
    axes = fig.subplots(3 + updates + monitors + bool(layers), 1, sharex=False)
    line_axes = [axes[0], axes[1], axes[2]]
    _panel_loss(axes[0], run)
    _panel_grad_norm(axes[1], run)
    _panel_z_score(axes[2], run)
    if updates:
        line_axes.append(axes[len(line_axes)])
        _plot_update_ratio(line_axes[-1], run)
    if monitors:
        line_axes.append(axes[len(line_axes)])
        _panel_monitors(line_axes[-1], run)
    _panel_events(line_axes, run)
    for ax in line_axes:
        _step_axis(ax, run)
    if layers:
        _panel_heatmap(fig, axes[-1], run, layers)
    if run.sources:
        name = " + ".join(p.parent.name for p in run.sources) if len(run.sources) > 1 else run.sources[0].name
    else:
        name = Path(os.fspath(log)).name if not isinstance(log, RunLog) else "run"
    fig.suptitle(title or f"stabilitykit report: {name}")
    # A fixed layout (tight_layout measured every label: 3/4 of the drawing time); the left margin
    # fits the longest layer name of the heatmap (7 pt text is about 0.0045 of the 12-inch width per character).
    longest = max((len(name) for name in layers), default=0)
    fig.subplots_adjust(left=max(0.085, 0.02 + 0.0045 * longest), right=0.97, top=0.94, bottom=0.05, hspace=0.4)
    return fig


def _plain_log_ticks(ax: Any) -> None:
    """A log axis labelled with plain numbers (0.9, 20, 1e-05), not "9 x 10^-1".

    On a narrow range the decades alone would leave one label or none (a grad norm between 1 and
    2.2 read only "1"): within a decade the ticks are evenly spaced plain values (1, 1.2, 1.4, ...),
    within two decades at 1, 2 and 5 times each power of ten.
    """
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    low, high = ax.get_ylim()
    if 0 < low < high and high / low < 10:  # within a decade: evenly spaced plain values (1, 1.5, 2)
        ticks = [t for t in MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high) if t > 0]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
    elif 0 < low < high and high / low < 100:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _panel_loss(ax: Any, run: RunLog) -> None:
    """The loss; a log scale when a spike would flatten everything else."""
    loss = run.lines.get("loss")
    _plot_series(ax, loss, color="tab:blue", lw=1.2, label="loss (logging step)")
    loss_max = run.lines.get("loss/max")
    _plot_series(ax, loss_max, color="tab:blue", lw=0.8, ls=":", label="max since last log")
    if loss_max is not None:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_ylabel("loss")
    width = max((b.width for b in run.lines.values()), default=1)
    if width > 1:
        ax.set_title(f"{run.n_rows} logging steps: lines are means per {width} steps, bands their min..max", fontsize=8)
    if loss is not None:
        extra = loss_max.column("hi") if loss_max is not None else []
        positive = [v for v in loss.column("lo") + loss.column("hi") + extra if v > 0]
        if positive and max(positive) / min(positive) > 50:
            ax.set_yscale("log")
            _plain_log_ticks(ax)


def _panel_grad_norm(ax: Any, run: RunLog) -> None:
    """The total grad norm, the max since the last log, and the clip threshold (log scale)."""
    _plot_series(ax, run.lines.get("grad_norm/total"), True, color="tab:green", lw=1.2, label="total grad norm")
    _plot_series(ax, run.lines.get("grad_norm/max"), True, color="tab:green", lw=0.8, ls=":",
                 label="max since last log")  # fmt: skip
    _plot_series(ax, run.lines.get("clip/threshold"), True, color="gray", ls="--", lw=1, label="clip threshold")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_ylabel("grad norm")
    ax.legend(loc="upper right", fontsize=8)


def z_warning_of(run: RunLog) -> float:
    """The run's configured ``SpikeConfig.z_warning`` (logged as ``spikes/z_warning``); the default
    for a log written before it was logged."""
    _steps, values = run.series("spikes/z_warning")
    finite = [v for v in values if math.isfinite(v)]
    return finite[-1] if finite else float(SpikeConfig.model_fields["z_warning"].default)


def _panel_z_score(ax: Any, run: RunLog) -> None:
    """The grad-norm and loss z-scores and their max since the last log, with the run's warning
    threshold: an alert may come from either series."""
    _plot_series(ax, run.lines.get("spikes/z_grad_norm"), color="tab:orange", lw=1.2,
                 label="grad-norm z (logging step)")  # fmt: skip
    _plot_series(ax, run.lines.get("spikes/max_z_grad_norm"), color="tab:red", lw=0.8, ls=":",
                 label="grad-norm max z since last log")  # fmt: skip
    _plot_series(ax, run.lines.get("spikes/z_loss"), color="tab:blue", lw=1.2, label="loss z (logging step)")
    _plot_series(ax, run.lines.get("spikes/max_z_loss"), color="tab:purple", lw=0.8, ls=":",
                 label="loss max z since last log")  # fmt: skip
    z_warning = z_warning_of(run)
    ax.axhline(z_warning, color="tab:red", lw=0.8, ls="--", label=f"warning (z = {z_warning:g})")
    ax.set_ylabel("z-score")
    ax.legend(loc="upper right", fontsize=8)


def _panel_monitors(ax: Any, run: RunLog) -> None:
    """The monitors' precursors (log scale): the max attention logit of each attention module (first
    purple, last yellow), the output logits' max |logit| (black) and mean log Z (gray, dashed)."""
    from matplotlib import colormaps

    attention = sorted(name for name in run.monitors if name.startswith("monitors/attn_logit_max/"))
    cmap = colormaps["viridis"]
    for i, name in enumerate(attention):
        module = name.split("/", 2)[2]
        label = f"max attention logit: {module}" if len(attention) <= 8 else None
        color = cmap(i / max(1, len(attention) - 1))
        _plot_series(ax, run.monitors[name], True, color=color, lw=0.9, label=label)
    for name, bins in run.monitors.items():
        signal, module = name.split("/", 2)[1:]
        if signal == "logits_max":
            _plot_series(ax, bins, True, color="black", lw=1.2, label=f"max |logit|: {module}")
        elif signal == "log_z":
            _plot_series(ax, bins, True, color="gray", lw=1.2, ls="--", label=f"log Z (mean): {module}")
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_ylabel("monitors")
    many = f"; {len(attention)} attention modules, purple (first) to yellow (last)" if len(attention) > 8 else ""
    ax.set_title(f"precursors on sampled steps: attention logits, output logits, log Z{many}", fontsize=8)
    ax.legend(loc="upper left", fontsize=7, ncol=2)


def _panel_events(line_axes: list[Any], run: RunLog) -> None:
    """Event marks in axes coordinates (y from 0 to 1, so they never move the data limits): a line on
    every panel, a marker on the top one. A rollback also shades, on every panel, the steps it undid
    (grey) and the batches it skipped after it (hatched): their loss is of batches never trained on."""
    by_kind: dict[str, list[int]] = {}
    for event in run.events:
        if event["kind"] in _MARKERS:
            by_kind.setdefault(event["kind"], []).append(int(event["step"]))
    top = line_axes[0]
    _shade_rollbacks(line_axes, run)
    # each kind in a lane of its own at the top, so marks at one step (a skip, an alert and the
    # rollback they caused) never hide each other
    lanes = {kind: i for i, kind in enumerate(k for k in _MARKERS if k in by_kind)}
    for kind, steps in by_kind.items():
        marker, color, label = _MARKERS[kind]
        height = 1.0 - _LANE * lanes[kind]
        steps = _marks(steps)
        bottom = 0.0 if len(steps) <= _FULL_LINES else 0.96  # many marks: ticks at the top, not a red wall
        for ax in line_axes:
            ax.vlines(steps, bottom, 1, transform=ax.get_xaxis_transform(), color=color, lw=0.6, alpha=0.5)
        top.scatter(
            steps,
            [height] * len(steps),
            transform=top.get_xaxis_transform(),
            marker=marker,
            color=color,
            s=80 if marker == "*" else None,
            zorder=5,
            label=f"{label} ({len(by_kind[kind])})",
            clip_on=False,
        )
    if by_kind:
        top.legend(loc="upper right", fontsize=8)


def _shade_rollbacks(line_axes: list[Any], run: RunLog) -> None:
    """Grey: steps a rollback undid (``skipped_from..skipped_to``); hatched: the batches it skipped
    after it (``skipped_to + 1..skip_ahead_to``)."""
    spans = [e for e in run.events if e["kind"] == "rollback" and "skipped_from" in e and "skipped_to" in e]
    for i, event in enumerate(spans):
        undone = (int(event["skipped_from"]) - 0.5, int(event["skipped_to"]) + 0.5)
        ahead = event.get("skip_ahead_to")
        for ax in line_axes:
            label = "undone by a rollback" if i == 0 and ax is line_axes[0] else None
            ax.axvspan(*undone, color="gray", alpha=0.18, lw=0, label=label)
            if isinstance(ahead, (int, float)) and ahead > event["skipped_to"]:
                label = "batches skipped after a rollback" if i == 0 and ax is line_axes[0] else None
                ax.axvspan(undone[1], int(ahead) + 0.5, facecolor="none", edgecolor="gray", hatch="//",
                           alpha=0.5, lw=0, label=label)  # fmt: skip


def _step_axis(ax: Any, run: RunLog) -> None:
    """A grid, the step label, and the run's step range (with a 2% margin)."""
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    if run.first_step is not None and run.last_step is not None and run.last_step > run.first_step:
        pad = (run.last_step - run.first_step) * 0.02
        ax.set_xlim(run.first_step - pad, run.last_step + pad)


def _panel_heatmap(fig: Any, ax: Any, run: RunLog, layers: list[str]) -> None:
    """log10 of each layer's grad norm per step (or per bin of steps). Each logged value is drawn until
    the layer's next one, so a log written every n steps is a continuous picture, not stripes."""
    import numpy as np

    width = max(b.width for b in run.layers.values())
    origin = min(b.origin for b in run.layers.values() if b.origin is not None)
    end = max((b.origin or 0) + b.used * b.width for b in run.layers.values())
    ncols = max(1, math.ceil((end - origin) / width))
    grid = np.full((len(layers), ncols), np.nan)
    for i, name in enumerate(layers):
        bins = run.layers[name]
        for step, value in zip(bins.steps(), bins.column("hi"), strict=True):
            if value > 0:
                j = min(ncols - 1, (step - origin) // width)
                grid[i, j] = np.fmax(grid[i, j], math.log10(value))
    grid = _fill_forward(grid)
    image = ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(origin - 0.5, origin + ncols * width - 0.5, len(layers) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_xlabel("step")
    binned = f", max per {width} steps" if width > 1 else ""
    ax.set_title(f"per-layer grad norm (log10{binned})")
    fig.colorbar(image, ax=ax, fraction=0.025)


def _fill_forward(grid: Any) -> Any:
    """Each row's empty cells take the row's last value to their left (cells before its first stay empty)."""
    import numpy as np

    filled = grid.copy()
    for row in filled:
        seen = ~np.isnan(row)
        if not seen.any():
            continue
        index = np.where(seen, np.arange(row.size), 0)
        np.maximum.accumulate(index, out=index)
        first = int(np.argmax(seen))
        row[first:] = row[index[first:]]
    return filled
