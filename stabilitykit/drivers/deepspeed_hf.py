"""The Hugging Face Trainer with ``deepspeed=``: a ``DeepSpeedGuard`` on the engine the Trainer makes in
``train()``; metrics to ``log_history``; every rank's state through checkpoints and ``trainer_state.json``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stabilitykit.config import StabilityConfig, refuse_two_clippers
from stabilitykit.drivers import missing
from stabilitykit.drivers.deepspeed import DeepSpeedLater
from stabilitykit.hooks import HookManager
from stabilitykit.rules import SkipRule
from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.trainers import LogHistory

try:
    from transformers import Trainer

    from stabilitykit.drivers.hf_attach import AttachedCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.deepspeed_hf", "transformers", "transformers") from exc


class DeepSpeedTrainerCallback(DeepSpeedLater, AttachedCallback):
    """Guards the DeepSpeed engine a Trainer trains with; made by ``stabilize(trainer, cfg)``."""

    saved_key = "saved_ranks"  # every rank's saved guard state (JSON values)

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        rules: Sequence[SkipRule] = (),
        *,
        restore_into_attached: bool = False,
    ) -> None:
        if self.restored(restore_into_attached):
            return  # the attached callback came back from __new__ (``AttachedCallback``): keep all it holds
        self.saved_ranks: list[Any] | None = None
        super().__init__(config, sinks, hooks, rules)

    def attach(self, trainer: Trainer) -> DeepSpeedTrainerCallback:
        """Bind to ``trainer`` (and add this callback to it); refuses two clippers by name."""
        # the Trainer's max_grad_norm is DeepSpeed's gradient_clipping
        refuse_two_clippers(self.config, "max_grad_norm", trainer.args.max_grad_norm, "set max_grad_norm=0")
        self.bind(trainer)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """DeepSpeed's engine exists now: guard it; a resumed run gives each rank its saved state back."""
        trainer = self.bound()
        self.start_guard(trainer.model_wrapped, sinks=[LogHistory(trainer, self.config.metric_prefix)])
        assert self.guard is not None
        saved = self.resumed_state(state, self.guard.engine.device)
        if saved:
            self.guard.load_rank_state(saved)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close_guard()

    def state(self) -> dict[str, Any]:
        """For ``trainer_state.json``: every rank's guard state as DeepSpeed's last ``save_checkpoint`` gathered it."""
        return self.exported(self.guard.checkpoint_states if self.guard is not None else None)
