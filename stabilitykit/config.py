"""Pydantic models for every feature: one model per concern, unknown fields rejected.

Every model uses ``extra="forbid"`` so a typo in a YAML file fails loudly with the
field's name instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    """Base for all config models: unknown fields are an error, and a config is immutable.

    A driver reads its config when it is built; a field assigned afterwards would be validated and
    then silently ignored, so assignment raises instead. Derive a changed copy with
    ``config.model_copy(update={...})`` and build a new driver with it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        """A misspelled field names the closest real one (``max_nrom`` -> did you mean ``max_norm``?)."""
        if isinstance(data, Mapping):
            known = set(cls.model_fields)
            for key in data:
                if isinstance(key, str) and key not in known:
                    close = difflib.get_close_matches(key, sorted(known), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {', '.join(sorted(known))}"
                    raise ValueError(f"{cls.__name__} has no field {key!r}{hint}")
        return data


def _check_norm_type(value: float) -> float:
    if value == math.inf:
        return value
    if not math.isfinite(value) or value <= 0:
        raise ValueError("norm_type must be a positive number or inf (e.g. 1, 2, 'inf')")
    return float(value)


def _check_patterns(patterns: list[str] | None) -> list[str] | None:
    for pattern in patterns or []:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from exc
    return patterns


class GradNormConfig(_Strict):
    """How gradient norms are measured and grouped into layers."""

    norm_type: float = Field(2.0, description="p of the p-norm: 1, 2, any p > 0, or inf.")
    per_layer: bool = Field(True, description="Also compute and log one norm per layer.")
    grouping: Literal["auto", "top", "param"] | list[str] = Field(
        "auto",
        description=(
            "How parameters form layers. 'auto': each child of the largest ModuleList/Sequential "
            "of same-type modules is a layer ('blocks.3'), other parameters group by top-level "
            "module. 'top': by top-level module. 'param': one layer per parameter. A list of "
            "regular expressions: the first pattern that matches a parameter name gives the "
            "layer name (the matched text); unmatched parameters fall back to 'auto'."
        ),
    )
    include: list[str] | None = Field(
        None, description="Regexes: only layers whose name matches one are logged per layer."
    )
    exclude: list[str] | None = Field(
        None, description="Regexes: layers whose name matches one are not logged per layer."
    )
    update_ratio: bool = Field(
        False,
        description=(
            "Also log the update-to-weight ratio ||Δw|| / ||w|| and the weight norm, per layer and in total, "
            "on logging steps (the update of the optimizer step just before). Costs a copy of the "
            "parameters (one parameter-sized buffer, in the parameters' dtype and device) held during "
            "one optimizer step per logging interval, and no host sync."
        ),
    )

    @field_validator("norm_type", mode="before")
    @classmethod
    def _parse_inf(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in {"inf", "infinity", "+inf"}:
            return math.inf
        return value

    @field_validator("norm_type")
    @classmethod
    def _valid_norm_type(cls, value: float) -> float:
        return _check_norm_type(value)

    @field_validator("grouping")
    @classmethod
    def _valid_grouping(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("grouping as a list needs at least one regular expression")
            _check_patterns(value)
        return value

    @field_validator("include", "exclude")
    @classmethod
    def _valid_filters(cls, value: list[str] | None) -> list[str] | None:
        return _check_patterns(value)


class ClipConfig(_Strict):
    """Gradient clipping: off, a fixed max_norm, an adaptive global threshold, or per-tensor adaptive (AdaGC)."""

    @field_validator("max_norm", mode="before")
    @classmethod
    def _zero_means_off_elsewhere(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            raise ValueError(
                "max_norm=0 is how nanoGPT and the Hugging Face Trainer say 'no clipping'; here that is "
                "ClipConfig(mode='off')"
            )
        return value

    mode: Literal["off", "fixed", "adaptive", "per_tensor_adaptive"] = Field(
        "off",
        description=(
            "Clipping mode. 'fixed': clip the total norm to max_norm. 'adaptive': clip the total norm to "
            "mean + z_threshold * std of its EMAs. 'per_tensor_adaptive' (AdaGC): clip each parameter tensor to "
            "per_tensor_ratio times the EMA of its own past clipped norms."
        ),
    )
    max_norm: float = Field(1.0, gt=0, description="Fixed mode: the largest total grad norm after clipping.")
    z_threshold: float = Field(2.5, gt=0, description="Adaptive mode: clip norms above mean + z_threshold * std.")
    ema_decay: float = Field(0.97, gt=0, lt=1, description="Adaptive mode: EMA decay of the norm mean and variance.")
    warmup_steps: int = Field(
        25,
        ge=1,
        description=(
            "Adaptive modes: finite steps that only collect statistics before the adaptive threshold applies "
            "(per_tensor_adaptive: finite steps the engine did not skip; each tensor's threshold starts from its "
            "smallest clipped norm in them)."
        ),
    )
    warmup_max_norm: float | None = Field(
        None,
        gt=0,
        description=(
            "Adaptive modes: fixed max_norm of the total norm during warmup (None: no clipping during warmup). "
            "per_tensor_adaptive: AdaGC's lambda_abs (1.0 is the usual choice)."
        ),
    )
    per_tensor_ratio: float = Field(
        1.05,
        ge=1,
        allow_inf_nan=False,
        description=(
            "per_tensor_adaptive (AdaGC's lambda_rel): a tensor whose norm exceeds this times its EMA is scaled "
            "down to exactly that; at least 1 (below 1 every step is clipped and the thresholds shrink to 0)."
        ),
    )
    per_tensor_beta: float = Field(
        0.98,
        gt=0,
        lt=1,
        description="per_tensor_adaptive (AdaGC's beta): EMA decay of each tensor's clipped norm.",
    )


class SkipConfig(_Strict):
    """Skip-the-batch: which steps are skipped and when training is declared diverged."""

    nonfinite: bool = Field(True, description="Skip the step when the grad norm or loss is NaN/Inf.")
    max_consecutive: int | None = Field(
        10,
        ge=1,
        description="Raise TrainingDivergedError after this many skipped steps in a row (None: never).",
    )
    sync_ranks: bool = Field(
        True,
        description="Under torch.distributed, all-reduce the skip flag so every rank decides alike.",
    )
    restore_buffers: Literal["auto", "all", "none"] = Field(
        "auto",
        description=(
            "Buffers a skipped step puts back as they were before its forward passes: 'auto' the running "
            "statistics of modules with track_running_stats (BatchNorm, InstanceNorm), 'all' every buffer, "
            "'none' nothing."
        ),
    )
    spike: bool = Field(
        False,
        description=(
            "Skip-on-spike: also skip a finite step whose grad norm (or loss) is an outlier, decided on "
            "the device with no host sync (stabilitykit.spike_skip.SpikeSkipRule)."
        ),
    )
    spike_z: float = Field(6.0, gt=0, description="Skip-on-spike: log-space z-score above which a step is skipped.")
    spike_rate: float = Field(0.05, gt=0, lt=1, description="Skip-on-spike: EMA rate of the log-space statistics.")
    spike_warmup_steps: int = Field(50, ge=1, description="Skip-on-spike: finite steps before any step is skipped.")
    spike_on_loss: bool = Field(True, description="Skip-on-spike: test the loss as well as the grad norm.")


class SpikeConfig(_Strict):
    """Early warning on the loss and the total grad norm (robust one-step-ahead baseline)."""

    enabled: bool = Field(True, description="Run the spike detectors.")
    warmup_steps: int = Field(20, ge=1, description="Steps that only collect statistics.")
    baseline_rate: float = Field(0.1, gt=0, lt=1, description="EMA rate of the log-space baseline.")
    scale_rate: float = Field(
        0.1,
        gt=0,
        lt=1,
        description=(
            "EMA rate of the residual scale (debiased). Slower (0.03) gives less noisy z-scores on "
            "stationary noise; 0.1 follows noise that changes during training (better on real runs)."
        ),
    )
    z_warning: float = Field(
        4.0, gt=0, description="Grad-norm (or layer) z-score that raises a spike_warning (dashboard only)."
    )
    z_spike: float = Field(6.0, gt=0, description="Robust z-score of the loss that is a loss spike.")
    z_alert: float = Field(
        5.0,
        gt=0,
        description="With no loss given: the grad-norm z-score that raises a spike_alert (the rare event that pages).",
    )
    z_joint: float = Field(
        3.0, gt=0, description="With a loss: grad norm and loss both at this z-score raise a spike_alert."
    )
    z_loss_alert: float = Field(6.0, gt=0, description="Loss z-score that raises a spike_alert.")
    alert_cooldown: int = Field(
        20,
        ge=1,
        description=(
            "Steps after a spike_alert during which no other is raised (after a loss-drift alert, a jump of "
            "the loss or grad norm still alerts)."
        ),
    )
    loss_drift_alert: float | None = Field(
        4.0,
        gt=0,
        description=(
            "Sequential test (CUSUM) on the loss: a spike_alert when the running sum of (loss z-score - 1), "
            "each term clamped to 4, reaches this; catches a loss that climbs over several steps. None: off. "
            "4 was chosen on the tuning runs of the monitors benchmark; lower is more recall for more "
            "alerts: see the spike guide's operating points."
        ),
    )
    loss_level_alert: float | None = Field(
        2.0,
        gt=1,
        description=(
            "A spike_alert when the loss's recent level (an EMA over about ten steps) reaches this many times "
            "the best level the run has held; it scores from the fifth step on (inside warmup_steps too) and its "
            "reference never follows a climb, so a blow-up that starts early or lasts is alerted once per "
            "excursion (re-armed when the level falls back under the square root of this). None: off."
        ),
    )
    trend_warning: float = Field(
        0.7,
        gt=0,
        description=(
            "Precursor signals (max attention logit, log Z, update size): warn when the recent level "
            "exceeds the long-run level by this much in log units (0.7: about 2x)."
        ),
    )
    per_layer: bool = Field(
        False, description="Also score each layer's grad norm (names the layer that leads a spike)."
    )
    score_window: int = Field(128, ge=2, description="Window of the OLMo-style spike score (steps).")
    score_sigma: float = Field(6.0, gt=0, description="Std multiple beyond which the spike score counts a step.")

    @model_validator(mode="after")
    def _ordered(self) -> SpikeConfig:
        if self.z_spike < self.z_warning:
            raise ValueError("z_spike must be >= z_warning")
        return self


class NaNTraceConfig(_Strict):
    """Locating the first module whose forward output or input gradient went non-finite."""

    mode: Literal["off", "always", "every_n", "on_nonfinite"] = Field(
        "off",
        description=(
            "'always': hooks on every step (a Python call per module per step; on a compiled model "
            "one graph break per module); 'every_n': on every n-th step; 'on_nonfinite': no hooks "
            "until a step goes non-finite (the guard records the next steps; a compiled model is "
            "never hooked: the bad batch is replayed eagerly)."
        ),
    )
    every_n_steps: int = Field(100, ge=1, description="Cadence of mode 'every_n'.")
    replay: bool = Field(
        True,
        description=(
            "Mode 'on_nonfinite': replay a non-finite batch once with hooks and "
            "torch.autograd.detect_anomaly to name the module and the forward source line "
            "(the guard needs step(replay=...); costs one sync per step to learn of the skip)."
        ),
    )


class DataGuardConfig(_Strict):
    """Checking batches before they are trained on: non-finite floats, out-of-range labels, empty tensors."""

    mode: Literal["off", "skip", "raise"] = Field(
        "off",
        description=(
            "'raise': BadBatchError naming the path and index (one sync per checked batch); "
            "'skip': the step is skipped on the device, no sync (the event says the batch was bad)."
        ),
    )
    num_classes: int | None = Field(None, ge=1, description="Labels must lie in [0, num_classes) (-100 is ignored).")
    label_keys: list[str | int] = Field(
        default_factory=lambda: ["labels", "label", "targets", "target", "y"],  # type: ignore[arg-type]
        description="Mapping keys (or tuple positions, e.g. 1 for (x, y) batches) whose integer tensors are labels.",
    )


class Fp16Config(_Strict):
    """fp16 overflow diagnosis: warn when GradScaler skips too often or the loss scale collapses."""

    window: int = Field(200, ge=10, description="Steps over which the overflow rate is measured.")
    max_overflow_rate: float = Field(
        0.05, gt=0, le=1, description="Share of overflow-skipped steps in the window that triggers the warning."
    )
    scale_floor: float = Field(1.0, gt=0, description="A loss scale below this triggers the warning.")


class PrecisionConfig(_Strict):
    """Precision knobs the drivers apply when they start (they do not own autocast: see sk.select_precision)."""

    report_choice: bool = Field(
        False,
        description=(
            "Add sk.select_precision()'s advice for the model's device to the start-of-run 'precision' event "
            "(which always says what the run uses: parameter dtypes, whether a GradScaler scales the loss)."
        ),
    )
    tf32: bool = Field(False, description="Call sk.configure_tf32() (matmul precision 'high' unless already chosen).")
    deterministic_seed: int | None = Field(None, description="Call sk.set_determinism(seed) before training.")


class QKClipConfig(_Strict):
    """QK-clip (MuonClip): after each optimizer step, rescale the q/k rows of heads whose max logit exceeded tau."""

    enabled: bool = Field(
        False,
        description=(
            "Run stabilitykit.nn.QKClip after every optimizer step that is not skipped; the model needs "
            "attention modules implementing stabilitykit.nn.QKClipTarget."
        ),
    )
    threshold: float = Field(
        100.0,
        gt=0,
        allow_inf_nan=False,
        description="tau: the largest max pre-softmax logit a head keeps (Megatron: 100).",
    )
    query_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Share of the rescale on the queries (the paper's alpha: eta ** query_share); keys get "
            "eta ** (1 - query_share)."
        ),
    )


class MonitorConfig(_Strict):
    """Sampled activation, attention-logit and output-logit monitors for any model.

    Off unless ``StabilityConfig(monitors=MonitorConfig(...))`` is given; hooks are installed once,
    when the driver starts.

    On a sampled step, forward hooks measure on the device: the output RMS and max |x| of the
    selected modules, the residual-stream norm after each block of every stack, the largest
    attention logit of each attention module, taken at the call that computes the attention
    (``F.scaled_dot_product_attention`` with the model's mask, window and scale, or the input of the
    eager path's softmax, after mask, window and soft-cap), and the max and log Z of the model's own
    output logits over real (unpadded) positions. The values are read with the logging step's one
    device-to-host copy; on other steps every hook returns at once. A measurement that fails
    disables itself with one warning; modules that cannot be measured are named once and in the
    run summary.
    """

    every: int | None = Field(
        None,
        ge=1,
        description=(
            "Measure on every n-th optimizer step (None: on logging steps). Values measured between "
            "logging steps stay on the device until the next logging read (maxima are kept as running maxima)."
        ),
    )
    modules: list[str] | None = Field(
        None,
        description=(
            "Modules whose output RMS and max |x| are measured, as clean names or globs "
            "('model.layers.*', 'lm_head'). None: each transformer block, the embeddings and the final norm."
        ),
    )
    activations: bool = Field(True, description="Output RMS and max |x| of the selected modules.")
    attention: bool = Field(
        True, description="Largest attention logit of each attention module, at its attention call."
    )
    logits: bool = Field(
        True, description="Max |logit| and mean log Z of the model's output logits (after any final soft-cap)."
    )
    residual: bool = Field(True, description="Residual-stream norm (mean L2 norm per token) after each block.")
    causal: bool | None = Field(
        None,
        description=(
            "Deprecated, no effect: the attention logits are measured with the mask the model itself "
            "hands its attention call (causal or not, padding, sliding window)."
        ),
    )
    log_z_positions: int | None = Field(
        256,
        ge=1,
        description=(
            "Token positions (spread evenly over the whole batch, padding left out) whose log Z is averaged: "
            "a log-sum-exp over the whole vocabulary at every position costs about as much as the LM head's "
            "own matmul. None: all positions."
        ),
    )
    precursors: list[Literal["attn_logit_max", "logits_max", "log_z", "act_max", "act_rms", "resid_norm"]] = Field(
        default_factory=lambda: ["attn_logit_max", "logits_max", "log_z"],  # type: ignore[arg-type]
        description=(
            "Signals fed to the spike detector's trend warnings (SpikeConfig.trend_warning); the others are "
            "logged only."
        ),
    )

    @field_validator("causal")
    @classmethod
    def _causal_is_read_from_the_model(cls, value: bool | None) -> bool | None:
        if value is not None:
            import warnings

            warnings.warn(
                "MonitorConfig.causal has no effect: attention logits are measured with the mask the model "
                "hands its attention call",
                DeprecationWarning,
                stacklevel=2,
            )
        return value


class RecoveryConfig(_Strict):
    """Rollback past a divergence: a ring of healthy snapshots, restored when a trigger fires, then training goes on.

    On by being given: ``StabilityConfig(recovery=RecoveryConfig(...))`` turns it on without ``enabled=True``
    (as a ``MonitorConfig`` given is on); ``enabled=False`` turns a given one off, and a
    ``StabilityConfig`` given none has it off. See the recovery guide for what is restored, what is
    skipped and what it costs.
    """

    enabled: bool = Field(
        False,
        description=(
            "Take snapshots and roll back on a trigger. Set to True when this config is given to "
            "StabilityConfig(recovery=...) without enabled; enabled=False keeps a given config off."
        ),
    )
    snapshot_every: int = Field(
        100, ge=1, description="Optimizer steps between snapshots (a snapshot is kept only if its step was taken)."
    )
    keep: int = Field(2, ge=1, description="Healthy snapshots kept (the ring's depth).")
    trigger: list[Literal["diverged", "spike_alert", "loss_drift"]] = Field(
        default_factory=lambda: ["diverged", "spike_alert"],  # type: ignore[arg-type]
        min_length=1,
        description=(
            "What rolls back. 'diverged': a run of SkipConfig.max_consecutive skipped steps (instead of raising "
            "TrainingDivergedError); 'spike_alert': a spike_alert for a jump of the loss or grad norm, or for a "
            "loss far above its best level (SpikeConfig.loss_level_alert); "
            "'loss_drift': a spike_alert of the loss-drift rule (SpikeConfig.loss_drift_alert). The default "
            "(both of the first two) rolls back a finite blow-up and a burst of bad data as well as a divergence "
            "(the recovery benchmarks)."
        ),
    )
    min_lookback: int = Field(
        0,
        ge=0,
        description=(
            "Restore the newest snapshot taken at least this many steps before the onset (the first skipped "
            "step of a divergence, the step of an alert)."
        ),
    )
    lr_scale: float = Field(
        0.5,
        gt=0,
        allow_inf_nan=False,
        description=(
            "After a rollback, the optimizer steps with its learning rates times this for cooldown_steps "
            "(1.0: unchanged)."
        ),
    )
    cooldown_steps: int = Field(
        50, ge=0, description="Steps after a rollback (and after its skip_after) that use lr_scale (0: none)."
    )
    skip_after: int = Field(
        50,
        ge=0,
        description=(
            "After a rollback, also skip this many of the following batches (measured and logged, never "
            "trained on; the LR schedule waits): the large-run recipe of restarting before a spike and "
            "skipping the next batches, for bad data that goes on past the trigger. 0: none."
        ),
    )
    max_rollbacks: int = Field(
        3, ge=1, description="Rollbacks allowed within `window` steps; one more trigger raises TrainingDivergedError."
    )
    window: int = Field(1000, ge=1, description="Steps over which max_rollbacks is counted.")
    storage: str = Field(
        "memory",
        min_length=1,
        description="'memory': snapshots in host memory; any other value: a directory that holds them as files.",
    )
    record_dir: str | None = Field(
        None,
        description=(
            "Directory of skipped_batches.json (the step ranges each rollback skipped). None: the storage "
            "directory with disk storage, no file with memory storage."
        ),
    )
    restore_rng: bool = Field(
        False,
        description=(
            "Also put back the random generators (torch, CUDA, random, numpy) saved with the snapshot. Off by "
            "default: a loop that draws its batches from them would then replay the batches it skipped."
        ),
    )

    @classmethod
    def preset(cls, name: Literal["bad_data", "blow_up"], **overrides: Any) -> RecoveryConfig:
        """A named recipe from the recovery guide (its benchmark rows say what each did), on, with ``overrides``.

        Each is the defaults with one change. ``"bad_data"``: skip the next 100 batches after a rollback
        (the default skips 50): a long burst of bad data that goes on past the trigger.
        ``"blow_up"``: skip none and train on every batch after the rollback: a finite blow-up with good
        data (a learning-rate or optimizer accident). Both roll back on a divergence or a ``spike_alert``.
        """
        recipes: dict[str, dict[str, Any]] = {
            "bad_data": {"trigger": ["diverged", "spike_alert"], "skip_after": 100},
            "blow_up": {"trigger": ["diverged", "spike_alert"], "skip_after": 0},
        }
        if name not in recipes:
            raise ValueError(f"unknown recovery preset {name!r}; the presets are {sorted(recipes)}")
        return cls(**{"enabled": True, **recipes[name], **overrides})


class StabilityConfig(_Strict):
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
