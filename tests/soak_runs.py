"""Soak runs: many steps of a tiny model through each driver, with memory measured after warm-up.

Used by tests/test_long_runs.py (a few thousand steps, in CI) and benchmarks/soak.py (100,000 steps).
Each run logs every 10 steps and meets periodic events (a NaN loss every ``NAN_EVERY`` steps, so
skipped, nonfinite and clipped events keep coming). Memory is read with tracemalloc twice after a
warm-up: the growth of every allocation made in stabilitykit's own files, the growth of all Python
allocations, and the process RSS.
"""

from __future__ import annotations

import gc
import resource
import tempfile
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import stabilitykit as sk

NAN_EVERY = 97
LOG_EVERY = 10


@dataclass
class Soak:
    """Memory growth between the warm-up mark and the end of a soak, per step."""

    driver: str
    steps: int
    ours_bytes_per_step: float  # allocations made in stabilitykit's files
    python_bytes_per_step: float  # every Python allocation (the framework's own included)
    rss_growth_mb: float

    def line(self) -> str:
        return (
            f"{self.driver:<10} {self.steps:>7} steps  stabilitykit {self.ours_bytes_per_step:8.2f} B/step  "
            f"all Python {self.python_bytes_per_step:8.2f} B/step  RSS +{self.rss_growth_mb:.1f} MB"
        )


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Meter:
    """tracemalloc snapshots at the warm-up mark and at the end."""

    def __init__(self) -> None:
        self.start: Any = None
        self.rss = 0.0

    def mark(self) -> None:
        gc.collect()
        self.start = tracemalloc.take_snapshot()
        self.rss = _rss_mb()

    def result(self, driver: str, steps: int) -> Soak:
        gc.collect()
        end = tracemalloc.take_snapshot()
        ours = [tracemalloc.Filter(True, "*stabilitykit/*")]
        diff_ours = sum(
            s.size_diff for s in end.filter_traces(ours).compare_to(self.start.filter_traces(ours), "lineno")
        )
        diff_all = sum(s.size_diff for s in end.compare_to(self.start, "lineno"))
        return Soak(driver, steps, diff_ours / steps, diff_all / steps, _rss_mb() - self.rss)


def _config() -> sk.StabilityConfig:
    return sk.StabilityConfig(log_every_n_steps=LOG_EVERY, clip=sk.ClipConfig(mode="fixed", max_norm=0.5))


def soak_guard(steps: int, warmup: int = 300) -> Soak:
    """The plain guard with a JSONL sink."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = _Meter()
    with tempfile.TemporaryDirectory() as tmp:
        guard = sk.StabilityGuard(model, optimizer, _config(), sinks=[sk.sinks.JsonlSink(Path(tmp) / "run.jsonl")])
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        tracemalloc.start()
        try:
            for i in range(warmup + steps):
                if i == warmup:
                    meter.mark()
                loss = torch.nn.functional.mse_loss(model(x), y)
                guard.backward(loss * float("nan") if i % NAN_EVERY == NAN_EVERY - 1 else loss)
                guard.step()
                guard.zero_grad()
            result = meter.result("guard", steps)
        finally:
            tracemalloc.stop()
            guard.close()
    return result


def soak_lightning(steps: int, warmup: int = 300) -> Soak:
    """A real Lightning Trainer (BoringModel) with the callback and a CSV logger."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from lightning.pytorch.loggers import CSVLogger

    from stabilitykit.lightning import StabilityCallback

    meter = _Meter()

    class Marked(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == warmup:
                meter.mark()
            out = super().training_step(batch, batch_idx)
            if self.trainer.global_step % NAN_EVERY == NAN_EVERY - 1:
                out["loss"] = out["loss"] * float("nan")
            return out

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(RandomDataset(32, warmup + steps), batch_size=1)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=warmup + steps,
            callbacks=[StabilityCallback(_config())],
            logger=CSVLogger(tmp),
            log_every_n_steps=LOG_EVERY,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
        )
        tracemalloc.start()
        try:
            trainer.fit(Marked())
            return meter.result("lightning", steps)
        finally:
            tracemalloc.stop()


def soak_hf(steps: int, warmup: int = 200) -> Soak:
    """The real Hugging Face Trainer over a tiny random-init Llama, with ``stabilize``.

    ``trainer.state.log_history`` keeps every log entry by design (ours included, about 2 KB per
    logging step with per-layer norms); the soak empties it at each log so only our growth counts.
    """
    from hf_models import tiny_llama, token_batches
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabilitykit.integrations import stabilize

    meter = _Meter()
    model = tiny_llama()
    rows = [{k: v[0] for k, v in b.items()} for b in token_batches(64, batch_size=1, seed=3)]

    poison = {"on": False}
    model.lm_head.register_forward_hook(lambda _m, _i, out: out * float("nan") if poison["on"] else None)

    class Mark(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == warmup:
                meter.mark()
            poison["on"] = state.global_step % NAN_EVERY == NAN_EVERY - 1

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            state.log_history.clear()  # the Trainer keeps every log entry by design: not ours to count

    class Cycle(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return (warmup + steps) * 2

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return rows[i % len(rows)]

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=2,
            max_steps=warmup + steps,
            learning_rate=1e-3,
            logging_steps=LOG_EVERY,
            max_grad_norm=0.0,  # stabilitykit clips
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Cycle(), callbacks=[Mark()])
        stabilize(trainer, _config())
        tracemalloc.start()
        try:
            trainer.train()
            return meter.result("hf", steps)
        finally:
            tracemalloc.stop()


DRIVERS: dict[str, Callable[..., Soak]] = {"guard": soak_guard, "lightning": soak_lightning, "hf": soak_hf}
