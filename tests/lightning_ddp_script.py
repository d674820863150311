"""Run by test_lightning.py: Lightning on 2 CPU processes with a NaN on rank 1 only.

``SK_RULE=1``: no NaN; a user's skip rule (``QualityGate``) and a recorded metric instead, rank 1 alone
recording a bad ``quality`` at step 5 from ``training_step`` (``sk.record``): both ranks must skip it;
and replica checks every 4 steps with one weight of rank 1 corrupted (a flipped mantissa bit) before
step 6's forward: reported at the check after step 7, naming rank 1 and the weight. DDP applies the
same averaged update on every rank, so every other tensor stays bitwise equal across the ranks. Rerun
is on too: a flipped bit in rank 1's local gradient at step 9, once, is judged transient naming rank 1
(its grads before the all-reduce, seen by a communication hook on the strategy's DDP wrapper).
With neither (DDP): rerun on; step 5's NaN comes again when computed again (reproducible: skipped on both
ranks) and a NaN in rank 1's logits at step 8, once, is judged transient naming rank 1 (the step taken);
then a second fit in the same processes, the same but without step 8's fault, whose final weights must
equal the first's bitwise (``weights`` and ``clean_weights``: hashes of their bytes).
``SK_STRATEGY``: "ddp" (default), or "fsdp2" (``ModelParallelStrategy`` with ``fully_shard`` in
``configure_model``; Lightning's ``FSDPStrategy`` requires CUDA). ``SK_RECOVERY=1``: recovery on
(a snapshot every 2 steps, a divergence after 3 skips) and a NaN on rank 1 only at steps 5-7, so
both ranks roll back together; each rank reports its rollback events.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback
from stabilitykit.testing import inject_fault
from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader
from tests.custom_rules import QualityGate

#: The weight rank 1 corrupts in the ``SK_RULE=1`` run (replica checks).
CORRUPTED = "model.blocks.0.mlp.fc.weight"


class RecordingGPT(GPTModule):
    """Records ``quality`` (bad on rank 1 at step 5) and ``rank_id`` from its training step."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        bad = self.global_rank == 1 and self.global_step == 5
        sk.record("quality", torch.tensor(0.0 if bad else 1.0))
        sk.record("rank_id", torch.tensor(float(self.global_rank + 1)), reduce="sum")
        return super().training_step(batch, batch_idx)


class FullyShardedGPT(GPTModule):
    """FSDP2 through Lightning's ModelParallelStrategy: each block and the model are fully_shard-ed."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _weights_hash(module: pl.LightningModule) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _trainer(kind: str, callback: StabilityCallback) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy() if kind == "fsdp2" else "ddp",
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=4,
        callbacks=[callback],
    )


def main() -> None:
    out = Path(os.environ["SK_OUT"])
    kind = os.environ.get("SK_STRATEGY", "ddp")
    recovery = os.environ.get("SK_RECOVERY") == "1"
    torch.set_num_threads(1)
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    poison = {5: float("nan")}
    if recovery:
        cfg = sk.StabilityConfig(
            clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
            skip=sk.SkipConfig(max_consecutive=3),
            recovery=sk.RecoveryConfig(
                enabled=True,
                snapshot_every=2,
                keep=2,
                trigger=["diverged"],
                skip_after=0,
                cooldown_steps=0,
                max_lookback_share=1.0,  # a few steps: any snapshot but the first's
            ),
        )
        poison = {5: float("nan"), 6: float("nan"), 7: float("nan")}
    rule = os.environ.get("SK_RULE") == "1"
    rows: dict[int, float] = {}
    skipped: list[list] = []

    class Rows:
        def log_metrics(self, metrics: dict, step: int) -> None:
            if "stability/metrics/rank_id" in metrics:
                rows[step] = float(metrics["stability/metrics/rank_id"])

        def log_event(self, event: sk.Event) -> None:
            if event.kind == "skipped":
                skipped.append([event.step, str(event.details.get("reason"))])
            if event.kind == "rerun":
                reruns.append([event.step, event.details["verdict"], event.details["rank"]])
            if event.kind == "replica_mismatch":
                mismatches.append(
                    {"step": event.step, "rank": event.details["rank"], "tensor": event.details["tensor"]}
                )

    if rule:
        poison = {}
        cfg = cfg.model_copy(update={"replicas": sk.ReplicaCheckConfig(every_n_steps=4), "rerun": sk.RerunConfig()})
    elif kind == "ddp" and not recovery:  # rerun: the NaN of step 5 comes again (reproducible), step 8's not
        cfg = cfg.model_copy(update={"rerun": sk.RerunConfig()})
    mismatches: list[dict] = []
    reruns: list[list] = []
    callback = StabilityCallback(cfg, sinks=[Rows()], rules=[QualityGate()] if rule else [])
    rollbacks: list[dict[str, int]] = []
    callback.hooks.on(
        "rollback", lambda e: rollbacks.append({k: int(e.details[k]) for k in ("at_step", "onset", "restored_step")})
    )
    trainer = _trainer(kind, callback)
    cls = FullyShardedGPT if kind == "fsdp2" else RecordingGPT if rule else GPTModule
    module = cls(fused=False, poison=poison, poison_rank=1)
    if rule:
        inject_fault(  # on the inner model, whose forward training_step calls
            module.model, "param", CORRUPTED.removeprefix("model."), step=6, rank=1, kind="bitflip", bit=12, index=3,
            step_of=lambda: trainer.global_step,
        )  # fmt: skip
        inject_fault(  # a flipped exponent bit in rank 1's local gradient at step 9, once: a transient fault
            module.model, "grad", "blocks.1.mlp.fc.weight", step=9, rank=1, step_of=lambda: trainer.global_step
        )
    elif kind == "ddp" and not recovery:  # a NaN in rank 1's logits at step 8, once: a transient fault
        inject_fault(
            module.model, "activation", "lm_head", step=8, rank=1, kind="nan", step_of=lambda: trainer.global_step
        )
    trainer.fit(module, gpt_dataloader(30))
    named = [(n, p) for n, p in module.named_parameters() if not (rule and n == CORRUPTED)]
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for _, p in named]
    checksum = sum(float(p.detach().double().sum()) for p in full)
    assert callback.engine is not None
    result = {
        "checksum": checksum,
        "skipped": int(callback.engine.counters.skipped_total),
        "steps": trainer.global_step,
        "rollbacks": rollbacks,
        "finite": all(bool(torch.isfinite(p).all()) for p in full),
        "skipped_events": skipped,
        "rank_id": sorted(set(rows.values())),
        "mismatches": mismatches,
        "reruns": reruns,
    }
    if kind == "ddp" and not rule and not recovery:  # the same fit in the same processes, without step 8's fault
        result["weights"] = _weights_hash(module)
        started = time.perf_counter()
        clean = cls(fused=False, poison=poison, poison_rank=1)
        _trainer(kind, StabilityCallback(cfg)).fit(clean, gpt_dataloader(30))
        result["clean_weights"] = _weights_hash(clean)
        result["clean_seconds"] = time.perf_counter() - started
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
