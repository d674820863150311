"""When a step is re-run, with which random state, and what the verdict does.

Per step: the core arms the policy with the driver's way to compute the step's batch again (its
replay) and the random state is taken when the step's first forward starts (a forward pre-hook on
the model, once per step). The engine asks ``wanted`` only where the host reads the step's decision
code anyway (a logging step's read; every step of a non-fused optimizer with skipping on, which reads
to skip on the host), so rerun adds no host sync to a step: with a fused optimizer a step flagged
between logging steps is skipped on the device as without rerun, unless
``RerunConfig.read_every_step`` pays one read per step to re-run every flagged step. A step skipped
for a reason in ``RerunConfig.on``, and for none that blames the data or a rollback, is re-run: the
rules' and clipping's statistics and the random state put back, the grads dropped, running statistics
put back, the batch's forward and backward computed again (``recompute``), then measured again by
the engine (its row read: the rerun step's one more read), which passes both passes' values to
``judge``.

Verdicts: ``reproducible`` (the same values: the data or the model) keeps the skip and records the
batch; ``transient`` (other values: the machine) takes the recomputed step (its decision is the
recomputation's), names the rank, counts it, warns, and raises ``TransientFaultError`` after
``max_transient`` on one rank. Every rank takes the same branches: the code and the comparison are
agreed across ranks.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from stabilitykit.distributed import is_distributed
from stabilitykit.events import Event, TransientFaultError
from stabilitykit.hooks import HookManager
from stabilitykit.recovery.rng import capture_rng, restore_rng
from stabilitykit.rerun.compare import compare
from stabilitykit.rerun.config import NOT_RERUN, RerunConfig
from stabilitykit.rerun.judged_steps import RerunRecord
from stabilitykit.rerun.local import LocalGrads
from stabilitykit.rules import RuleSet
from stabilitykit.rules.registry import SKIP

#: The relative tolerance on GPUs when ``RerunConfig.rtol`` is None (the CPU's is 0: bitwise).
GPU_RTOL = 1e-4


class Rerun:
    """One optimizer's rerun policy (see the module docstring)."""

    def __init__(
        self,
        config: RerunConfig,
        model: nn.Module | None,
        device: torch.device,
        hooks: HookManager,
        reads: Callable[[], bool] | None = None,
    ) -> None:
        """``reads``: whether the host reads the decision of the step about to start (the engine's
        ``reads_coming_step``); only such a step can be re-run, so only its random state is taken (a capture
        copies every generator's state: tens of microseconds). None: every step's."""
        self.config = config
        self.hooks = hooks
        self.rtol = config.rtol if config.rtol is not None else (0.0 if device.type == "cpu" else GPU_RTOL)
        self.rank = dist.get_rank() if is_distributed() else 0
        self.judged_steps = RerunRecord(config.record_path, writer=self.rank == 0)
        #: Transient faults per rank (None: a fault no single rank could be blamed for).
        self.transient: dict[int | None, int] = {}
        #: The verdict events of this run, in order.
        self.events: list[Event] = []
        self._recompute: Callable[[], None] | None = None
        self._reasons: list[str] = []
        self._rng: dict[str, Any] = capture_rng(config.host_rng)
        self._captured = False
        self.reads = reads
        self._rng_taken = True  # the random state of this step was taken (a step the host does not read: not)
        self._hook = model.register_forward_pre_hook(self._on_forward) if model is not None else None
        #: This rank's own grads before DDP's all-reduce (``local.py``): names the rank of a local-gradient fault.
        self.local = LocalGrads(model)
        self._first_local: Tensor | None = None
        self._warned_accumulation = False

    # ------------------------------------------------------------------ the core's side
    def _on_forward(self, _module: nn.Module, _args: Any) -> None:
        """The step's first forward starts: the random state it starts with (a replay's forward is not first)."""
        if not self._captured:
            self._take_rng()

    def watch_local_grads(self, model: nn.Module | None) -> None:
        """A driver whose framework wraps the model for DDP itself (Lightning's strategy, the HF Trainer's
        Accelerator) hands the wrapper here, so that a local-gradient fault names its rank (``local.py``)."""
        if not self.local.hooked and model is not None:
            self.local = LocalGrads(model)

    def watch_forward(self, model: nn.Module) -> None:
        """A driver built without the model (``DeepSpeedGuard``) hands here what its loop calls forward on, so that
        each step's random state is taken as its first forward starts (without it: only when the run started)."""
        if self._hook is None:
            self._hook = model.register_forward_pre_hook(self._on_forward)

    def start_step(self) -> None:
        """A driver that knows where the step starts (Lightning's ``on_train_batch_start``): the random
        state is taken now, before anything of the step draws from it (not at the model's first forward,
        which a framework's training step may never call)."""
        self._take_rng()

    def _take_rng(self) -> None:
        """The step starts: its random state, where the step can be re-run (``reads``)."""
        self._captured = True
        self._rng_taken = self.reads is None or self.reads()
        if self._rng_taken:
            self._rng = capture_rng(self.config.host_rng)

    def arm(self, recompute: Callable[[], None] | None) -> None:
        """This step can be computed again by ``recompute`` (None: it cannot; it is never re-run)."""
        self._recompute = recompute

    @property
    def armed(self) -> bool:
        """This step can be re-run (the driver gave a way to compute it again)."""
        return self._recompute is not None

    def end_step(self) -> None:
        """The step is over: the next step's first forward takes the random state anew."""
        self._recompute = None
        self._captured = False
        self.local.take()

    def known_bad(self, step: int) -> bool:
        """Step ``step`` was judged reproducible-bad before (in this run or one whose record this run reads)."""
        return step in self.judged_steps.bad_steps

    def state_dict(self) -> dict[str, Any]:
        """Transient faults per rank (``[[rank, count], ...]``; rank None: no single rank to blame), so that
        ``max_transient`` counts across a resume."""
        return {"transient": [[rank, count] for rank, count in self.transient.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (an empty state: no faults so far)."""
        pairs = state.get("transient") or []
        self.transient = {(None if rank is None else int(rank)): int(count) for rank, count in pairs}

    def close(self) -> None:
        """Remove the forward pre-hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.local.close()

    # ------------------------------------------------------------------ the engine's side
    def wanted(self, code: int, rules: RuleSet, micro_batches: int = 1) -> bool:
        """This step's decision code (agreed across ranks, read by the host) calls for a rerun.

        ``micro_batches``: the losses backpropagated into this step's grads. With more than one (gradient
        accumulation) the driver's replay recomputes one batch, not the step: such a step is not re-run
        (one warning); the count comes from the configuration, so it is the same on every rank.
        """
        if self._recompute is None or not code & SKIP or not self._rng_taken:
            return False  # (a step whose random state was not taken is one the host was not to read)
        raised = rules.raised_anywhere(code)
        self._reasons = raised
        if not any(r in self.config.on for r in raised) or any(r in NOT_RERUN for r in raised):
            return False
        if micro_batches > 1:
            if not self._warned_accumulation:
                self._warned_accumulation = True
                warnings.warn(
                    f"stabilitykit: RerunConfig does not re-run a step with gradient accumulation ({micro_batches} "
                    "micro-batches backpropagated into this step's grads, and a replay recomputes one batch): "
                    "flagged steps with accumulation are skipped without a rerun",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return False
        return True

    def recompute(self) -> None:
        """Compute the step's batch again from the random state the step started with."""
        assert self._recompute is not None
        self._first_local = self.local.take()
        restore_rng(self._rng)
        self._recompute()

    def judge(self, step: int, first: tuple[Tensor | None, Tensor], again: tuple[Tensor | None, Tensor]) -> Event:
        """Compare the passes, emit the ``rerun`` event, record it; raise after too many transient faults."""
        found = compare((first[0], self._first_local, first[1]), (again[0], self.local.take(), again[1]), self.rtol)
        verdict = "transient" if found.transient else "reproducible"
        rank = found.rank if found.transient else None
        hosts = _hosts(found.world) if found.transient else []
        host = hosts[rank] if rank is not None and rank < len(hosts) else None
        reasons = ", ".join(self._reasons)
        if found.transient:
            who = f"rank {rank}" + (f" on {host}" if host else "") if rank is not None else f"ranks {found.ranks}"
            message = (
                f"step {step} ({reasons}) came out otherwise when computed again on {who}: a transient fault of "
                "the machine, not the data; the recomputed step is taken"
            )
        else:
            message = (
                f"step {step} ({reasons}) came out the same when computed again: the data or the model, not the "
                "machine; the step is skipped and its batch recorded"
            )
        details = {"verdict": verdict, "rank": rank, "ranks": found.ranks, "reasons": list(self._reasons)}
        if host is not None:
            details["host"] = host
        event = Event("rerun", step, message, details)
        self.events.append(event)
        self.hooks.emit(event)
        self.judged_steps.add(
            {
                "step": step,
                "batch": step,
                "verdict": verdict,
                "rank": rank,
                "host": host,
                "reasons": list(self._reasons),
            }
        )
        if found.transient:
            count = self.transient[rank] = self.transient.get(rank, 0) + 1
            warnings.warn(f"stabilitykit: {message}", RuntimeWarning, stacklevel=4)
            limit = self.config.max_transient
            if limit is not None and count >= limit:
                raise TransientFaultError(step, rank, count)
        return event


def _hosts(world: int) -> list[str]:
    """Every rank's host name (a collective every rank runs: the verdict is agreed)."""
    name = socket.gethostname()
    if not is_distributed():
        return [name]
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, name)
    return [str(h) for h in hosts]
