"""``StabilityConfig``: every feature's section in one model, read from Python, a mapping or a file.

Each section is defined beside the module that owns what it configures (``ClipConfig`` in
``engine/clipping.py``, ``SpikeConfig`` in ``spikes.py``, ``RecoveryConfig`` in
``recovery/controller.py``, ...) on the base in ``section.py``: unknown fields are rejected (a typo
in a YAML file fails loudly with the field's name) and a config is immutable. This module imports
the owners; none of them imports this module at run time (only to annotate), so there is no
import cycle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from stabilitykit.engine.clipping import ClipConfig
from stabilitykit.engine.fp16 import Fp16Config
from stabilitykit.grads import GradNormConfig
from stabilitykit.monitors.monitor import MonitorConfig
from stabilitykit.nan import DataGuardConfig
from stabilitykit.nn.qk_clip import QKClipConfig
from stabilitykit.precision import PrecisionConfig
from stabilitykit.recovery.controller import RecoveryConfig
from stabilitykit.rules import SkipConfig
from stabilitykit.section import Section
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
    module_metrics: bool = Field(
        True,
        description=(
            "Log metrics of modules that expose stability_metrics() (ZLoss: log Z; "
            "QKNormAttention: max attention logit) on logging steps."
        ),
    )
    metric_prefix: str = Field("stability", description="Prefix of every logged metric name.")

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
        """Build a config from a plain mapping (parsed YAML/JSON)."""
        return cls.model_validate(dict(mapping))

    @classmethod
    def from_file(cls, path: str | Path) -> StabilityConfig:
        """Load a config from a ``.yaml``/``.yml``, ``.json`` or ``.toml`` file (TOML: Python 3.11+ or tomli).

        A file that cannot be read or parsed is a ``ValueError`` naming the file (and the line, for a
        syntax error); another extension is refused by name.
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
        data = reader(path, text)
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        return cls.from_mapping(data)


def _read_yaml(path: Path, text: str) -> Any:
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a core dependency
        raise ImportError("reading YAML configs needs pyyaml: pip install pyyaml") from exc
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path}: invalid YAML{where}: {problem}") from None


def _read_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None


def _read_toml(path: Path, text: str) -> Any:
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
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        raise ValueError(f"{path}: invalid TOML: {exc}") from None


#: Config file readers by (lower-case) extension.
_CONFIG_READERS = {".yaml": _read_yaml, ".yml": _read_yaml, ".json": _read_json, ".toml": _read_toml}
