"""The Hugging Face Trainer with ``deepspeed=``: ``stabilize(trainer, cfg)`` puts a ``DeepSpeedGuard`` on its engine.

    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed=ds_config, max_grad_norm=0.0), ...)
    stabilize(trainer, cfg)   # -> DeepSpeedTrainerCallback
    trainer.train()

Under DeepSpeed the Trainer does not step a torch optimizer: Accelerate's ``backward`` calls
``engine.backward(loss)`` and then ``engine.step()``, and DeepSpeed steps its own optimizer and LR
scheduler. The callback builds a ``DeepSpeedGuard`` on that engine when training begins (the
Trainer creates the engine inside ``train()``); the guard routes the engine's ``backward`` and
``step``, so every optimizer step is measured, clipped and applied or skipped as in any DeepSpeed
loop (see the DeepSpeed guide). A skipped step is one the Trainer sees as skipped too (Accelerate
reads DeepSpeed's ``overflow``). Metrics and events go to ``trainer.state.log_history`` (each at
the optimizer step it belongs to) and to the sinks given.

Checkpoints: the Trainer saves through the engine's ``save_checkpoint``, which the guard routes, so
every rank's guard state is gathered there (and kept in DeepSpeed's client state); the Trainer then
writes it into ``trainer_state.json`` through its stateful-callback mechanism. A run resumed with
``resume_from_checkpoint`` gives each rank its own state back when training begins (also with
``restore_callback_states_from_checkpoint=True``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stabilitykit.config import StabilityConfig, coerce_config
from stabilitykit.drivers._extras import missing
from stabilitykit.drivers.deepspeed import DeepSpeedGuard
from stabilitykit.events import Event
from stabilitykit.hooks import HookManager
from stabilitykit.rules import SkipRule
from stabilitykit.sinks.base import Sink

try:
    from transformers import Trainer

    from stabilitykit.drivers.hf_attach import AttachedCallback, from_json, to_json
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.deepspeed_hf", "transformers", "transformers") from exc


class _LogHistory:
    """A sink: metrics and event markers into ``trainer.state.log_history``, at their optimizer step."""

    def __init__(self, trainer: Trainer, prefix: str) -> None:
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


class DeepSpeedTrainerCallback(AttachedCallback):
    """Guards the DeepSpeed engine a Trainer trains with; made by ``stabilize(trainer, cfg)``."""

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
        #: Every rank's saved guard state (JSON values), set by the Trainer's callback-state restore.
        self.saved_ranks: list[Any] | None = None
        self.config = coerce_config(config)
        self.sinks = list(sinks or [])
        self.hooks = hooks or HookManager()
        self.rules = list(rules)
        self.guard: DeepSpeedGuard | None = None

    def attach(self, trainer: Trainer) -> DeepSpeedTrainerCallback:
        """Bind to ``trainer`` (and add this callback to it); refuses two clippers by name."""
        max_norm = trainer.args.max_grad_norm
        if self.config.clip.mode != "off" and max_norm and max_norm > 0:
            raise ValueError(
                f"TrainingArguments(max_grad_norm={max_norm}) (DeepSpeed's gradient_clipping under the Trainer) "
                f"and stabilitykit's ClipConfig(mode={self.config.clip.mode!r}) both clip gradients; keep one: "
                "set max_grad_norm=0 (stabilitykit clips) or ClipConfig(mode='off')"
            )
        self.bind(trainer)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The engine exists now: guard it; a resumed run gives each rank its saved state back."""
        trainer = self.bound_trainer()
        if trainer is None:
            raise RuntimeError(
                "DeepSpeedTrainerCallback is not attached: use stabilitykit.integrations.stabilize(trainer)"
            )
        if self.guard is not None:
            self.guard.close()
        sinks = [*self.sinks, _LogHistory(trainer, self.config.metric_prefix)]
        self.guard = DeepSpeedGuard(trainer.model_wrapped, self.config, sinks=sinks, hooks=self.hooks, rules=self.rules)
        saved = self.saved_ranks or self.saved_in(state, "saved_ranks")
        self.saved_ranks = None
        if saved and state.global_step > 0:
            self.guard.load_rank_state(from_json(saved, self.guard.engine.device))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Training is over: the guard's last row and summary, its routes undone, the sinks closed."""
        if self.guard is not None:
            self.guard.close()

    def state(self) -> dict[str, Any]:
        """What the Trainer writes into ``trainer_state.json`` at a checkpoint (rank 0 only): every rank's guard
        state as the engine's ``save_checkpoint`` gathered it just before (JSON values)."""
        ranks = self.guard.checkpoint_states if self.guard is not None else None
        return {
            "args": {"restore_into_attached": True},
            "attributes": {"saved_ranks": to_json(ranks) if ranks else None},
        }
