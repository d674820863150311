"""``StabilityConfig``: every feature's section in one model, read from Python, a mapping or a file.

Each section is defined beside the module that owns what it configures (``ClipConfig`` in
``engine/clipping.py``, ``SpikeConfig`` in ``spikes.py``, ``RecoveryConfig`` in
``recovery/config.py``, ...) on the base in ``section.py``: unknown fields are rejected (a typo
in a YAML file fails loudly with the field's name) and a config is immutable. This module imports
the owners' sections; nothing it imports imports this module, not even to annotate (the engine's
and recovery's packages import their step and controller on first use), so there is no import cycle.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from stabilitykit.engine.clipping import ClipConfig
from stabilitykit.engine.fp16 import Fp16Config
from stabilitykit.grads import GradNormConfig
from stabilitykit.monitors.fp8 import Fp8MonitorConfig  # noqa: F401 (re-exported: sk.Fp8MonitorConfig)
from stabilitykit.monitors.monitor import MonitorConfig
from stabilitykit.nan import DataGuardConfig
from stabilitykit.nn.qk_clip import QKClipConfig
from stabilitykit.precision import PrecisionConfig
from stabilitykit.recovery.config import RecoveryConfig
from stabilitykit.replicas import ReplicaCheckConfig
from stabilitykit.rerun.config import RerunConfig
from stabilitykit.rules import SkipConfig
from stabilitykit.section import Section, UnknownFieldError
from stabilitykit.spikes import SpikeConfig
from stabilitykit.tracing import NaNTraceConfig


class StabilityConfig(Section):
    """Everything stabilitykit does in one place; each feature has its own section."""

    log_every_n_steps: int | None = Field(
        10,
        ge=1,
        description=(
            "Optimizer steps between logging steps (the only steps that copy metrics to the host). "
            "None in the Lightning callback means trainer.log_every_n_steps."
        ),
    )
    grad_norm: GradNormConfig = Field(default_factory=GradNormConfig)  # type: ignore[arg-type]
    clip: ClipConfig = Field(default_factory=ClipConfig)  # type: ignore[arg-type]
    skip: SkipConfig = Field(default_factory=SkipConfig)  # type: ignore[arg-type]
    spikes: SpikeConfig = Field(default_factory=SpikeConfig)  # type: ignore[arg-type]
    nan_trace: NaNTraceConfig = Field(default_factory=NaNTraceConfig)  # type: ignore[arg-type]
    data: DataGuardConfig = Field(default_factory=DataGuardConfig)  # type: ignore[arg-type]
    fp16: Fp16Config = Field(default_factory=Fp16Config)  # type: ignore[arg-type]
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)  # type: ignore[arg-type]
    qk_clip: QKClipConfig = Field(default_factory=QKClipConfig)  # type: ignore[arg-type]
    monitors: MonitorConfig | None = Field(
        None,
        description=(
            "Sampled activation / attention-logit / log Z monitors for models we did not write "
            "(MonitorConfig); None: off."
        ),
    )
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)  # type: ignore[arg-type]
    rerun: RerunConfig | None = Field(
        None,
        description=(
            "Re-run a flagged step to tell the data or the model (reproducible: skipped, recorded) from the "
            "machine (transient: the recomputed step is taken) (RerunConfig); None: off."
        ),
    )
    replicas: ReplicaCheckConfig | None = Field(
        None,
        description=(
            "Check every N steps that data-parallel replicas hold the same parameters and optimizer state "
            "(ReplicaCheckConfig); None: off."
        ),
    )
    module_metrics: bool = Field(
        True,
        description=(
            "Log metrics of modules that expose stability_metrics() (ZLoss: log Z; "
            "QKNormAttention: max attention logit) on logging steps."
        ),
    )
    metric_prefix: str = Field("stability", description="Prefix of every logged metric name.")

    @field_validator("recovery", mode="before")
    @classmethod
    def _recovery_switch(cls, value: Any) -> Any:
        """``None``/``False``: recovery off; ``True``: on with the defaults (as ``RecoveryConfig()`` given is)."""
        if value is None or value is False:
            return RecoveryConfig(enabled=False)
        if value is True:
            return {}
        return value

    @field_validator("monitors", mode="before")
    @classmethod
    def _monitors_switch(cls, value: Any) -> Any:
        """``False``: monitors off (as ``None``); ``True``: on with the defaults (as ``MonitorConfig()`` given is)."""
        if value is False:
            return None
        if value is True:
            return {}
        return value

    @model_validator(mode="after")
    def _recovery_given_is_on(self) -> StabilityConfig:
        """A ``RecoveryConfig`` given is on, as a ``MonitorConfig`` given is; an explicit ``enabled`` wins."""
        if "recovery" in self.model_fields_set and "enabled" not in self.recovery.model_fields_set:
            object.__setattr__(self, "recovery", self.recovery.model_copy(update={"enabled": True}))
        return self

    @property
    def can_skip(self) -> bool:
        """Whether anything in this configuration can ever skip a step (the same on every rank)."""
        return self.skip.nonfinite or self.data.mode == "skip" or self.skip.spike

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> StabilityConfig:
        """Build a config from a plain mapping (parsed YAML/JSON), strictly: a string where a number or
        a bool belongs (``"10"``, ``"yes"``, ``"1e0"``) is refused, not converted."""
        return cls.model_validate(dict(mapping), strict=True)

    @classmethod
    def from_file(cls, path: str | Path) -> StabilityConfig:
        """Load a config from a ``.yaml``/``.yml``, ``.json`` or ``.toml`` file (TOML: Python 3.11+ or tomli).

        A file that cannot be read or parsed is a ``ValueError`` naming the file (and the line, for a
        syntax error); a wrong value is a ``ConfigFileError`` (a ``ValueError``) naming the file, the
        field and the line; another extension is refused by name. Values are read strictly
        (``from_mapping``). In YAML, a section left empty (``recovery:``) is that section with its
        defaults, and so on (a section given is on); ``recovery: false`` turns it off.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"stabilitykit config file not found: {path}")
        reader = _CONFIG_READERS.get(path.suffix.lower())
        if reader is None:
            raise ValueError(
                f"{path}: cannot read a config from a {path.suffix or 'extensionless'!r} file; "
                "use .yaml, .yml, .json or .toml"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
        data, lines = reader(path, text)
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.from_mapping(data)
        except ValidationError as exc:
            raise ConfigFileError(path, exc, lines) from None


class ConfigFileError(ValueError):
    """A config file whose values are wrong: each problem with the file, the line and the field."""

    def __init__(self, path: Path, error: ValidationError, lines: Mapping[tuple[str, ...], int]) -> None:
        problems = []
        for item in error.errors(include_url=False):
            loc = tuple(str(part) for part in item["loc"])
            cause = item.get("ctx", {}).get("error")
            if isinstance(cause, UnknownFieldError):
                loc = (*loc, cause.field)  # point at the misspelled key's own line
            line = _line_of(loc, lines)
            where = f"line {line}: " if line is not None else ""
            field = ".".join(loc) or "(top level)"
            value = item.get("input")
            given = f" (got {value!r})" if not isinstance(value, Mapping) else ""
            problems.append(f"{path}: {where}{field}: {item['msg']}{given}")
        super().__init__("\n".join(problems))
        self.path = path
        self.errors = error.errors(include_url=False)


def _line_of(loc: tuple[str, ...], lines: Mapping[tuple[str, ...], int]) -> int | None:
    """The line of the deepest key of ``loc`` the file names (a field missing from it: its section's)."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def _yaml_lines(node: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Each mapping key's 1-based line in a composed YAML document, by its key path."""
    import yaml

    found: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*prefix, str(key.value))
            found[path] = key.start_mark.line + 1
            found.update(_yaml_lines(value, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found[(*prefix, str(i))] = item.start_mark.line + 1
            found.update(_yaml_lines(item, (*prefix, str(i))))
    return found


def _empty_sections(node: Any, data: Any) -> Any:
    """An empty top-level section in a YAML file (``recovery:`` with nothing under it) is that section
    with its defaults, as ``recovery: {}``; an explicit ``null`` or ``false`` stays as written."""
    import yaml

    if not isinstance(node, yaml.MappingNode) or not isinstance(data, dict):
        return data
    for key, value in node.value:
        name = str(key.value)
        empty = isinstance(value, yaml.ScalarNode) and value.tag.endswith(":null") and value.value == ""
        if empty and name in StabilityConfig.model_fields and data.get(name) is None:
            annotation = StabilityConfig.model_fields[name].annotation
            if annotation is not None and any(
                isinstance(t, type) and issubclass(t, Section)
                for t in (annotation, *getattr(annotation, "__args__", ()))
            ):
                data[name] = {}
    return data


def _read_yaml(path: Path, text: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a core dependency
        raise ImportError("reading YAML configs needs pyyaml: pip install pyyaml") from exc
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text) or {}
        return _empty_sections(node, data), _yaml_lines(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path}: invalid YAML{where}: {problem}") from None


def _json_lines(data: Any, text: str, prefix: tuple[str, ...] = (), start: int = 0) -> dict[tuple[str, ...], int]:
    """Each mapping key's 1-based line in a JSON text, by its key path: found in order, each key searched
    after its parent's (good for config files; a key written twice is found where it is first)."""
    import re

    found: dict[tuple[str, ...], int] = {}
    if not isinstance(data, dict):
        return found
    at = start
    for key, value in data.items():
        match = re.compile(r'"' + re.escape(json.dumps(key)[1:-1]) + r'"\s*:').search(text, at)
        if match is None:
            continue
        path = (*prefix, str(key))
        found[path] = text.count("\n", 0, match.start()) + 1
        found.update(_json_lines(value, text, path, match.end()))
        at = match.end()
    return found


def _read_json(path: Path, text: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    try:
        data = json.loads(text)
        return data, _json_lines(data, text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None


#: One TOML key: bare, "basic" or 'literal'; a dotted key is several joined by dots.
_TOML_KEY = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_TOML_DOTTED = rf"{_TOML_KEY}(?:\s*\.\s*{_TOML_KEY})*"


def _toml_key_parts(dotted: str) -> tuple[str, ...]:
    """``a."b.c".d`` -> ("a", "b.c", "d")."""
    import re

    return tuple(part.strip("\"'") for part in re.findall(_TOML_KEY, dotted))


def _toml_lines(text: str) -> dict[tuple[str, ...], int]:
    """Each key's 1-based line in a TOML text, by its key path (tomllib gives no positions).

    A line scan, enough for config files: ``[table]`` and ``[[array]]`` headers set the prefix, ``key =``
    and dotted ``a.b =`` lines name a key (and its parent tables), the keys of a one-line inline table
    ``{ k = v }`` take its line; the lines inside a multi-line string are passed over.
    """
    import re

    header = re.compile(rf"\[\s*({_TOML_DOTTED})\s*\]")
    array = re.compile(rf"\[\[\s*({_TOML_DOTTED})\s*\]\]")
    assignment = re.compile(rf"({_TOML_DOTTED})\s*=\s*(.*)")
    inline_key = re.compile(rf"[{{,]\s*({_TOML_DOTTED})\s*=")
    found: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    arrays: dict[tuple[str, ...], int] = {}
    open_string: str | None = None

    def name(path: tuple[str, ...], number: int) -> None:
        for end in range(1, len(path) + 1):
            found.setdefault(path[:end], number)

    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if open_string is not None:
            if line.count(open_string) % 2 == 1:
                open_string = None
            continue
        if not line or line.startswith("#"):
            continue
        if match := array.match(line):
            keys = _toml_key_parts(match[1])
            arrays[keys] = arrays.get(keys, -1) + 1
            table = (*keys, str(arrays[keys]))
            name(table, number)
        elif match := header.match(line):
            table = _toml_key_parts(match[1])
            name(table, number)
        elif match := assignment.match(line):
            path = (*table, *_toml_key_parts(match[1]))
            name(path, number)
            value = match[2]
            for quote in ('"""', "'''"):
                if value.startswith(quote) and value.count(quote) == 1:
                    open_string = quote
            if value.startswith("{"):
                for key in inline_key.finditer(value):
                    name((*path, *_toml_key_parts(key[1])), number)
    return found


def _read_toml(path: Path, text: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ImportError(
                f"{path}: reading TOML configs needs Python 3.11+ (tomllib) or the tomli package: pip install tomli"
            ) from None
    try:
        return tomllib.loads(text), _toml_lines(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        raise ValueError(f"{path}: invalid TOML: {exc}") from None


#: Config file readers by (lower-case) extension.
_CONFIG_READERS = {".yaml": _read_yaml, ".yml": _read_yaml, ".json": _read_json, ".toml": _read_toml}


# ---------------------------------------------------------------------- coercion and cross-section checks
def coerce_config(config: Any) -> StabilityConfig:
    """A ``StabilityConfig`` from a config, a mapping, a YAML/JSON/TOML path, or None (defaults).

    Anything else is a ``TypeError`` that names what was passed, so a wrong argument fails here
    and not deep inside the first step.
    """
    if config is None:
        return StabilityConfig()
    if isinstance(config, StabilityConfig):
        return config
    if isinstance(config, Mapping):
        return StabilityConfig.from_mapping(config)
    if isinstance(config, (str, Path)):
        return StabilityConfig.from_file(config)
    raise TypeError(
        f"config must be a stabilitykit.StabilityConfig, a mapping, or a path to a YAML/JSON/TOML file; got "
        f"{type(config).__name__}. Sections such as ClipConfig go inside one: "
        "StabilityConfig(clip=ClipConfig(...))"
    )


def with_cadence(config: StabilityConfig, every: int) -> StabilityConfig:
    """``config`` logging every ``every`` steps (the framework's cadence) unless the user set ``log_every_n_steps``."""
    if "log_every_n_steps" in config.model_fields_set:
        return config
    return config.model_copy(update={"log_every_n_steps": max(1, every)})


def refuse_two_clippers(config: StabilityConfig, setting: str, value: float | None, fix: str) -> None:
    """A framework's own clipping (``setting=value`` above 0) and stabilitykit's both on: refused, naming both."""
    if value and value > 0 and config.clip.mode != "off":
        raise ValueError(
            f"{setting}={value} and stabilitykit's ClipConfig(mode={config.clip.mode!r}) both clip gradients; "
            f"keep one: {fix} (stabilitykit then clips) or set ClipConfig(mode='off')"
        )


_WARNED: set[str] = set()


def warn_contradictions(config: StabilityConfig) -> None:
    """Settings that can never take effect: say so once per process.

    Only fields the user set count (``model_fields_set``): a default never warns.
    """
    for message in _contradictions(config):
        if message not in _WARNED:
            _WARNED.add(message)
            warnings.warn(message, UserWarning, stacklevel=4)


def _contradictions(config: StabilityConfig) -> list[str]:
    """One message per setting the rest of ``config`` makes ineffective."""
    found = []
    skip, clip, data = config.skip, config.clip, config.data
    if "max_consecutive" in skip.model_fields_set and skip.max_consecutive is not None and not config.can_skip:
        found.append(
            "stabilitykit: SkipConfig(max_consecutive=...) has no effect with SkipConfig(nonfinite=False) and no "
            "other skip source (DataGuardConfig(mode='skip')): nothing is ever skipped, so nothing can diverge"
        )
    if "max_norm" in clip.model_fields_set and clip.mode != "fixed":
        if clip.mode == "off":
            found.append(
                f"stabilitykit: ClipConfig(max_norm={clip.max_norm}) has no effect with ClipConfig(mode='off') (the "
                "default): nothing is clipped. Set ClipConfig(mode='fixed', max_norm=...) to clip"
            )
        else:
            found.append(
                f"stabilitykit: ClipConfig(max_norm={clip.max_norm}) has no effect with "
                f"ClipConfig(mode={clip.mode!r}): max_norm is the fixed mode's threshold; the adaptive modes cap "
                "their warmup with warmup_max_norm"
            )
    if "num_classes" in data.model_fields_set and data.num_classes is not None and data.mode == "off":
        found.append(
            f"stabilitykit: DataGuardConfig(num_classes={data.num_classes}) has no effect with "
            "DataGuardConfig(mode='off') (the default): batches are not checked. Set mode='skip' or mode='raise'"
        )
    spikes = config.spikes
    if spikes.enabled and spikes.per_layer and not config.grad_norm.per_layer:  # per_layer=True is never a default
        found.append(
            "stabilitykit: SpikeConfig(per_layer=True) has no effect with GradNormConfig(per_layer=False): no "
            "per-layer norms are measured for it to score. Set GradNormConfig(per_layer=True) (the default)"
        )
    found.extend(_recovery_contradictions(config))
    return found


def _recovery_contradictions(config: StabilityConfig) -> list[str]:
    """Recovery triggers that nothing in the rest of ``config`` can ever fire."""
    recovery = config.recovery
    if not recovery.enabled:
        return []
    found = []
    triggers = recovery.trigger
    if "diverged" in triggers and (config.skip.max_consecutive is None or not config.can_skip):
        found.append(
            "stabilitykit: RecoveryConfig(trigger=['diverged', ...]) never fires without skipped steps and "
            "SkipConfig(max_consecutive=...): nothing can diverge. Set SkipConfig(max_consecutive=10) (the default)"
        )
    chosen = "trigger" in recovery.model_fields_set  # the default's spike_alert just rests with spikes off
    if chosen and any(t in triggers for t in ("spike_alert", "loss_drift")) and not config.spikes.enabled:
        found.append(
            "stabilitykit: RecoveryConfig(trigger=['spike_alert' or 'loss_drift']) never fires with "
            "SpikeConfig(enabled=False): no spike_alert is raised"
        )
    if "loss_drift" in triggers and config.spikes.enabled and config.spikes.loss_drift_alert is None:
        found.append(
            "stabilitykit: RecoveryConfig(trigger=['loss_drift']) never fires with SpikeConfig(loss_drift_alert=None) "
            "(the loss-drift test turned off): set loss_drift_alert (4.0 is the default) to run it"
        )
    return found
