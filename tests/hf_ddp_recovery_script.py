"""Run by test_recovery_distributed.py under ``torchrun --nproc_per_node 2``: the HF Trainer on 2 gloo
processes (DDP through Accelerate) with ``stabilize()`` and recovery on.

A tiny random-init ``LlamaForCausalLM`` trains 20 steps. On rank 1 only, the loss the Trainer
reports jumps 1000x at global step 12 (a constant times the detached loss is added, so the grads
are unchanged): only rank 1's detector raises a ``spike_alert``. Both ranks must roll back once,
at the same step, to the same snapshot, and keep identical replicas. Each rank writes
``rank<r>.json`` to ``SK_OUT``. The same run carries a user's skip rule and recorded metrics
(``sk.record`` in ``compute_loss``): rank 1 alone records a bad ``quality`` at step 5, so both ranks
skip step 5; ``rank_id`` is recorded with reduce "sum" and logged agreed (3) on both. Rerun is on: a NaN
in rank 1's logits at step ``NAN_STEP`` and a flipped exponent bit in rank 1's local gradient at step
``GRAD_STEP``, once each, are judged transient naming rank 1 (the gradient's through a communication hook
on the Accelerator's DDP wrapper), the steps taken; rank 1's loss NaN at step ``BAD_STEP`` every time it
is computed is judged reproducible and skipped on both ranks. Then the same training again in the same
processes without the two one-time faults: its final weights must equal the first's bitwise (``weights``
and ``clean_weights``: hashes of their bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.integrations import stabilize
from stabilitykit.testing import inject_fault
from tests.custom_rules import QualityGate
from tests.hf_models import tiny_llama, token_batches

JUMP_STEP = 12
RULE_STEP = 5
NAN_STEP, GRAD_STEP, BAD_STEP = 8, 10, 18


def _weights_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    from transformers import Trainer, TrainingArguments

    out = Path(os.environ["SK_OUT"])
    torch.set_num_threads(1)
    rows = [{k: v[0] for k, v in batch.items()} for batch in token_batches(200, batch_size=1, seed=3)]

    class JumpTrainer(Trainer):
        """Rank 1's reported loss jumps at one step; the gradient is the plain loss's."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            bad = self.args.process_index == 1 and self.state.global_step == RULE_STEP
            sk.record("quality", torch.tensor(0.0 if bad else 1.0))
            sk.record("rank_id", torch.tensor(float(self.args.process_index + 1)), reduce="sum")
            if self.args.process_index == 1 and self.state.global_step == JUMP_STEP:
                loss = loss + 1000.0 * loss.detach()
            if self.args.process_index == 1 and self.state.global_step == BAD_STEP:
                loss = loss * float("nan")
            return loss

    args = TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        per_device_train_batch_size=2,
        max_steps=20,  # the last fault at step 18
        learning_rate=3e-3,
        logging_steps=2,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = tiny_llama()
    trainer = JumpTrainer(model=model, args=args, train_dataset=rows)
    at = {"rank": 1, "step_of": lambda: trainer.state.global_step}
    inject_fault(model, "activation", "lm_head", step=NAN_STEP, kind="nan", **at)
    inject_fault(model, "grad", "model.layers.0.mlp.down_proj.weight", step=GRAD_STEP, **at)
    cfg = sk.StabilityConfig(
        spikes=sk.SpikeConfig(warmup_steps=5),
        recovery=sk.RecoveryConfig(
            enabled=True, snapshot_every=2, keep=3, trigger=["spike_alert"], skip_after=0, cooldown_steps=0
        ),
        rerun=sk.RerunConfig(read_every_step=True),
    )
    sums: set[float] = set()
    skipped: list[list] = []
    reruns: list[list] = []

    class Rows:
        def log_metrics(self, metrics: dict, step: int) -> None:
            sums.add(float(metrics["stability/metrics/rank_id"]))

        def log_event(self, event: sk.Event) -> None:
            if event.kind == "skipped":
                skipped.append([event.step, event.details["reason"]])
            if event.kind == "rerun":
                reruns.append([event.step, event.details["verdict"], event.details["rank"]])

    callback = stabilize(trainer, cfg, sinks=[Rows()], rules=[QualityGate()])
    rollbacks: list[dict[str, int]] = []
    alerts: list[int] = []
    callback.hooks.on(
        "rollback", lambda e: rollbacks.append({k: int(e.details[k]) for k in ("at_step", "onset", "restored_step")})
    )
    callback.hooks.on("spike_alert", lambda e: alerts.append(e.step))
    trainer.train()
    params = [p.detach() for p in trainer.model.parameters()]
    result = {
        "rank": args.process_index,
        "world": args.world_size,
        "rollbacks": rollbacks,
        "alerts": alerts,
        "steps": trainer.state.global_step,
        "checksum": sum(float(p.double().sum()) for p in params),
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "rule_skips": [s for s in skipped if s[1] == "quality_gate"],
        "skipped": [s[0] for s in skipped],
        "reruns": reruns,
        "sums": sorted(sums),
        "weights": _weights_hash(trainer.model),
    }
    started = time.perf_counter()  # the same training without the one-time faults: the weights a clean run's
    clean = tiny_llama()
    again = JumpTrainer(model=clean, args=args, train_dataset=rows)
    stabilize(again, cfg, rules=[QualityGate()])
    again.train()
    result["clean_weights"] = _weights_hash(again.model)
    result["clean_seconds"] = time.perf_counter() - started
    (out / f"rank{args.process_index}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown racing gloo's threads


if __name__ == "__main__":
    main()
