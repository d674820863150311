"""The Hugging Face Trainer with ``deepspeed=`` (ZeRO-2) under ``stabilize(trainer, cfg)``: a NaN loss on
one rank skipped on every rank.

    python examples/deepspeed_hf_trainer.py [--steps 6] [--out runs/deepspeed_hf_trainer]
    torchrun --nproc_per_node 2 examples/deepspeed_hf_trainer.py    # the same, launched by hand

Run with ``python``, it starts itself under ``torchrun`` on 2 CPU processes (DeepSpeed's CPU
accelerator; collectives over gloo on 127.0.0.1). Each rank builds a tiny random-init Llama and the
real ``Trainer`` with a ZeRO-2 ``deepspeed=`` config dict (each rank holds half of every gradient),
and ``stabilize(trainer, cfg)`` is the one line that guards it. At optimizer step 2 rank 1 alone gets
a NaN loss (a ``compute_loss`` override standing in for a bad batch). DeepSpeed's ZeRO-2 would skip
that step silently (an ``inf`` norm, nothing else); here both ranks skip it on the guard's decision,
agreed across ranks, with a ``skipped`` event naming the first non-finite layer, and the engine does
not count it. Rank 0 prints what each rank saw, whether the parameters are finite and identical on
both ranks, and the guard's summary. Needs ``pip install 'stabilitykit[deepspeed]'``. About 15 s.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: no GPU needed

import torch

# the model and data of the HF Trainer example beside this file (its folder is on sys.path when run)
from hf_trainer import dataset, tiny_llama

import stabilitykit as sk
from stabilitykit.drivers.hf import stabilize

BAD_STEP = 2  # the Trainer's global_step (optimizer steps done) when rank 1's loss is NaN
BAD_RANK = 1
WORLD = 2


def train(steps: int, out: Path) -> None:
    """One rank (under torchrun): the Trainer with ``deepspeed=``, guarded in one line."""
    import torch.distributed as dist
    from deepspeed.utils import logger
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    logger.setLevel("ERROR")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)

    class NaNOnOneRank(Trainer):
        """Rank 1's loss is NaN at one step: one rank's bad batch."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if self.args.process_index == BAD_RANK and self.state.global_step == BAD_STEP:
                loss = loss * float("nan")
            return loss

    ds_config = {  # "auto": the Trainer fills these from its own arguments
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",  # max_grad_norm=0 below: stabilitykit clips (one clipper)
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=3e-3,
        max_grad_norm=0.0,
        logging_steps=2,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=ds_config,
    )
    trainer = NaNOnOneRank(model=tiny_llama(), args=args, train_dataset=dataset(64))
    cfg = sk.StabilityConfig(log_every_n_steps=2, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    callback = stabilize(trainer, cfg)  # the one line
    skipped: list[int] = []
    callback.hooks.on("skipped", lambda e: skipped.append(e.step))
    trainer.train()

    engine = trainer.model_wrapped
    params = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    assert callback.guard is not None
    mine = {
        "skipped": skipped,
        "engine_steps": engine.global_steps,
        "finite": bool(torch.isfinite(params).all()),
        "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "summary": callback.guard.summary().line(),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        for r, seen in enumerate(ranks):
            print(f"rank {r}: skipped steps {seen['skipped']}, engine steps {seen['engine_steps']}")
        together = all(seen["skipped"] == [BAD_STEP] for seen in ranks)
        print(f"every rank skipped step {BAD_STEP} (NaN on rank {BAD_RANK} only): {together}")
        identical = all(seen["finite"] and seen["digest"] == ranks[0]["digest"] for seen in ranks)
        print(f"parameters finite and identical on every rank: {identical}")
        print(f"guard: {ranks[0]['summary']}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()  # a live group at interpreter exit can abort the process (SIGABRT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("runs/deepspeed_hf_trainer"))
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # a rank under torchrun
        train(args.steps, args.out)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port), __file__]
    cmd += ["--steps", str(args.steps), "--out", str(args.out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
