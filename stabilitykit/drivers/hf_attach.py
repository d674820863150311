"""The Hugging Face Trainer drivers' one attach and restore path: ``AttachedCallback`` is bound to one Trainer,
the Trainer's callback-state restore gets it back, and its saved state rides in ``trainer_state.json``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from stabilitykit.drivers import missing
from stabilitykit.state import from_json, to_json

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.hf", "transformers", "transformers accelerate") from exc

#: Every attached callback (weak), newest last, for the Trainer's callback-state restore to find.
_ATTACHED: list[weakref.ReferenceType[AttachedCallback]] = []


class AttachedCallback(TrainerCallback, ExportableState):  # type: ignore[misc]
    """A Trainer callback bound to one Trainer, that the Trainer's callback-state restore hands back."""

    _trainer: weakref.ReferenceType[Trainer] | None = None
    #: The attribute that holds the saved state: ``state()`` exports it, the callback-state restore sets it.
    saved_key = "saved_state"

    def __new__(cls, *args: Any, restore_into_attached: bool = False, **kwargs: Any) -> AttachedCallback:
        """The Trainer restoring callback states: hand back this class's live callback attached to that Trainer."""
        if restore_into_attached:
            _ATTACHED[:] = [ref for ref in _ATTACHED if ref() is not None]
            for ref in reversed(_ATTACHED):
                callback = ref()
                trainer = callback.bound_trainer() if callback is not None else None
                restores = trainer is not None and trainer.args.restore_callback_states_from_checkpoint
                if type(callback) is cls and restores:
                    return callback
        return super().__new__(cls)

    def restored(self, restore_into_attached: bool) -> bool:
        """True in ``__init__`` of the attached callback ``__new__`` handed back: keep everything it holds."""
        return restore_into_attached and self._trainer is not None

    def bind(self, trainer: Trainer) -> None:
        """Bind to ``trainer`` and add this callback to it (once)."""
        self._trainer = weakref.ref(trainer)
        _ATTACHED[:] = [ref for ref in _ATTACHED if ref() is not None]
        _ATTACHED.append(weakref.ref(self))
        if not any(cb is self for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(self)

    def bound(self) -> Trainer:
        """The Trainer this callback is attached to; refused by name when it was passed in ``callbacks=[...]``."""
        trainer = self.bound_trainer()
        if trainer is None:
            raise RuntimeError(
                f"{type(self).__name__} is not attached to a Trainer: use stabilitykit.integrations.stabilize(trainer, "
                "config) or callback.attach(trainer) instead of passing it in callbacks=[...]"
            )
        return trainer

    def bound_trainer(self) -> Trainer | None:
        """The Trainer this callback is attached to (None before ``attach`` or once it is gone)."""
        return self._trainer() if self._trainer is not None else None

    def saved_in(self, state: Any, key: str) -> Any:
        """The attribute ``key`` this callback saved in a resumed ``TrainerState`` (its ``stateful_callbacks``)."""
        stored: Any = state.stateful_callbacks or {}
        entry = stored.get(type(self).__name__) if isinstance(stored, Mapping) else None
        if isinstance(entry, list):
            entry = entry[0] if entry else None
        if not isinstance(entry, Mapping):
            return None
        return entry.get("attributes", {}).get(key)

    def resumed_state(self, state: Any, device: torch.device) -> Any:
        """A resumed run's saved state (from the restore, else from ``state``; tensors on ``device``), taken once."""
        saved = getattr(self, self.saved_key, None) or self.saved_in(state, self.saved_key)
        setattr(self, self.saved_key, None)
        return from_json(saved, device) if saved and state.global_step > 0 else None

    def exported(self, saved: Any) -> dict[str, Any]:
        """What the Trainer writes into ``trainer_state.json`` for ``saved`` (JSON values only)."""
        attributes = {self.saved_key: to_json(saved) if saved else None}
        return {"args": {"restore_into_attached": True}, "attributes": attributes}
