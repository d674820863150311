"""The Hugging Face Trainer drivers' one attach and restore path (with and without ``deepspeed=``).

* ``AttachedCallback``: a ``TrainerCallback`` bound to one Trainer by ``attach``; the Trainer's
  callback-state restore (``restore_callback_states_from_checkpoint=True`` rebuilds each callback
  as ``type(cb)(**saved_args)``) gets the attached callback back, so its binding, config and sinks
  survive and the saved state is restored into it; ``saved_in`` finds a resumed run's saved state.
* ``to_json`` / ``from_json``: the driver state as strict JSON values, for ``trainer_state.json``.

``drivers/hf.py`` and ``drivers/deepspeed_hf.py`` both build on it; neither imports the other at
import time (``stabilize`` picks the DeepSpeed one on first use).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from stabilitykit.drivers._extras import missing

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

    def __new__(cls, *args: Any, restore_into_attached: bool = False, **kwargs: Any) -> AttachedCallback:
        """``restore_into_attached``: the Trainer is restoring callback states from a checkpoint: hand back
        the newest live callback of this class attached to a Trainer that restores callback states."""
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


def _json_float(x: float) -> float | str:
    """A float strict JSON can hold: non-finite values as "nan", "inf", "-inf" (``json`` would write NaN)."""
    return x if math.isfinite(x) else str(x)


def to_json(value: Any) -> Any:
    """A driver's state as strict JSON values (tensors become tagged lists; every float32 survives
    exactly; NaN and infinities become the strings "nan", "inf", "-inf", never JSON's invalid NaN)."""
    if isinstance(value, Tensor):
        t = value.detach().cpu()
        data = t.float().reshape(-1).tolist() if t.is_floating_point() else t.reshape(-1).tolist()
        return {
            "__tensor__": [_json_float(x) for x in data] if t.is_floating_point() else data,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": str(value)}
    return value


def from_json(value: Any, device: torch.device | None = None) -> Any:
    """Undo ``to_json``."""
    if isinstance(value, Mapping):
        if "__tensor__" in value:
            dtype = getattr(torch, value["dtype"])
            data = [float(x) if isinstance(x, str) else x for x in value["__tensor__"]]
            return torch.tensor(data, dtype=dtype, device=device).reshape(value["shape"])
        if "__float__" in value:
            return float(value["__float__"])
        return {k: from_json(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v, device) for v in value]
    return value
