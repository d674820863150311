"""The sync rule through every driver on a real GPU: the Lightning callback, the HF Trainer callback
and FSDP2 on one GPU pay no host sync of ours off logging steps and one read on a logging step.

Frameworks sync for their own reasons (Lightning's loop, the Trainer's loss tracking), so a sync
counts as ours when the Python frame that made it is in stabilitykit's files: CUDA's sync debug
mode ("warn") reports each one as a warning whose filename is that frame. Skipped where CUDA is
absent (tests/cuda/conftest.py).
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import stabilitykit as sk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/hf_models.py

LOG_EVERY = 5


@contextmanager
def _our_syncs(record: list[int]) -> Iterator[None]:
    """Append the number of syncs made from stabilitykit's files inside the block to ``record``."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ours = [w for w in caught if "synchroniz" in str(w.message) and f"{os.sep}stabilitykit{os.sep}" in w.filename]
    record.append(len(ours))


def _check(per_step: list[int], logging_steps: set[int]) -> None:
    """No sync of ours off logging steps; at most one on each logging step."""
    assert per_step, "no step was measured"
    assert all(per_step[i] == 0 for i in range(len(per_step)) if i not in logging_steps), per_step
    assert all(per_step[i] <= 1 for i in logging_steps if i < len(per_step)), per_step


def test_lightning_callback_pays_no_sync_off_logging_steps() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from stabilitykit.lightning import StabilityCallback

    per_step: list[int] = []

    class Counted(pl.Callback):
        def __init__(self) -> None:
            self._block: Any = None

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step >= 2:  # after the first steps (optimizer state is created)
                self._block = _our_syncs(per_step)
                self._block.__enter__()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if self._block is not None:
                self._block.__exit__(None, None, None)
                self._block = None

    class Model(BoringModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=22,
        log_every_n_steps=LOG_EVERY,
        callbacks=[StabilityCallback(sk.StabilityConfig()), Counted()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())
    # measured from global step 2; Lightning's logging rows are global steps 4, 9, 14, 19
    logging = {s - 2 for s in range(LOG_EVERY - 1, 22, LOG_EVERY)}
    _check(per_step, logging)


def test_hf_trainer_callback_pays_no_sync_off_logging_steps(tmp_path: Path) -> None:
    from hf_models import tiny_llama, token_batches
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabilitykit.integrations import stabilize

    per_step: list[int] = []
    rows = [{k: v[0] for k, v in b.items()} for b in token_batches(64, batch_size=1, seed=3)]

    class Counted(TrainerCallback):
        def __init__(self) -> None:
            self._block: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step >= 2:
                self._block = _our_syncs(per_step)
                self._block.__enter__()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._block is not None:
                self._block.__exit__(None, None, None)
                self._block = None

    args = TrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        per_device_train_batch_size=4,
        max_steps=22,
        learning_rate=1e-3,
        logging_steps=LOG_EVERY,
        max_grad_norm=0.0,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        optim="adamw_torch_fused",
    )
    trainer = Trainer(model=tiny_llama().cuda(), args=args, train_dataset=rows, callbacks=[Counted()])
    stabilize(trainer, sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0)))
    trainer.train()
    # measured from global step 2 (the step that starts there); the Trainer logs after steps 5, 10, ...
    logging = {s - 3 for s in range(LOG_EVERY, 23, LOG_EVERY)}
    _check(per_step, logging)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fsdp2_on_one_gpu_pays_no_sync_off_logging_steps() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=LOG_EVERY))
        x = torch.randn(32, 64, device="cuda")
        per_step: list[int] = []
        for step in range(17):
            if step < 2:
                guard.backward(model(x).pow(2).mean())
                guard.step()
                guard.zero_grad()
                continue
            with _our_syncs(per_step):
                guard.backward(model(x).pow(2).mean() * (float("nan") if step == 7 else 1.0))
                guard.step()
                guard.zero_grad()
        guard.close()
        assert guard.skipped_total == 1
        _check(per_step, {s - 2 for s in range(0, 17, LOG_EVERY) if s >= 2})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("every", [1, LOG_EVERY])
def test_summary_and_close_read_once(every: int) -> None:
    """``guard.close()`` (the final row and the summary line) reads the journal once."""
    model = torch.nn.Linear(64, 64).cuda()
    guard = sk.StabilityGuard(model, torch.optim.AdamW(model.parameters(), fused=True), sk.StabilityConfig())
    x = torch.randn(8, 64, device="cuda")
    for _ in range(every + 2):
        guard.backward(model(x).pow(2).mean())
        guard.step()
        guard.zero_grad()
    record: list[int] = []
    with _our_syncs(record):
        guard.close()
    assert record[0] <= 1, record
