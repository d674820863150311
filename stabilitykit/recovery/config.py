"""``RecoveryConfig``: what recovery does, as the user writes it (``StabilityConfig(recovery=...)``).

Its own small module so that ``stabilitykit.config`` composes it without importing the controller
(``controller.py``), which needs the engine: the config stays below both in the import order.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from stabilitykit.section import Section


class RecoveryConfig(Section):
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
    max_lookback: int = Field(
        500,
        ge=1,
        description=(
            "Restore no snapshot taken more than this many steps before the step that rolls back. With none "
            "inside the bound an alert lowers the learning rate where the run is, instead of going further back."
        ),
    )
    max_lookback_share: float = Field(
        0.5,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description=(
            "Nor more than this share of the steps done so far: a rollback never puts back the initial weights "
            "(at step 60 the snapshot of step 1 is 59 steps back, over half the run)."
        ),
    )
    lr_backoff: list[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [0.5, 0.25],
        description=(
            "When trouble comes back after a rollback on data the restored model reads fine, or only once an "
            "LR lowered where the run was has ended, the learning rate is to blame: each such rollback lowers it "
            "one level further (times 0.5, then 0.25), held for backoff_steps; so does a lowered LR that ends with "
            "the loss still 1.5x or more the best the run held, or than its first step's loss (the trouble did "
            "not pass). [] turns escalation off (every rollback is a first one)."
        ),
    )
    backoff_steps: int = Field(
        500, ge=1, description="Steps a backoff level of lr_backoff holds after its rollback (then the schedule's LR)."
    )
    max_rollbacks: int = Field(
        3,
        ge=1,
        description=(
            "Rollbacks within `window` steps before recovery stops rolling back. One more trigger then lowers "
            "the LR to the next lr_backoff level if any is left; once the lowest holds, a divergence raises "
            "RollbackLimitError (saying what was tried) and an alert leaves the run to skip and clip."
        ),
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


def refuse_several_optimizers(config: RecoveryConfig, count: int) -> None:
    """Recovery restores one optimizer with the model: refuse it, by name, with several optimizers."""
    if config.enabled and count > 1:
        raise ValueError(
            f"RecoveryConfig(enabled=True) supports one optimizer; this run has {count}. A rollback restores "
            "the model's parameters, which several optimizers would have to agree on; turn recovery off here"
        )
