"""A guarded Hugging Face Trainer: one line, a NaN batch skipped, metrics in log_history, a resume.

    python examples/hf_trainer.py [--steps 12] [--out runs/hf_trainer]

A tiny random-init Llama trains on random tokens (CPU, a few seconds). At optimizer step 5 the
model's output is poisoned with NaN: the step is skipped with parameters, optimizer state and the
LR schedule untouched, and the skip appears in ``trainer.state.log_history`` next to the
Trainer's own ``loss`` and ``grad_norm`` (the true pre-clip norm). The run checkpoints every 4
steps; a second Trainer resumes from the last checkpoint with the guard's state restored.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import stabilitykit as sk
from stabilitykit.drivers.hf import stabilize

VOCAB, SEQ = 96, 16
POISON_STEP = 5


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class PoisonStep(TrainerCallback):
    """NaN in the model's output during one optimizer step (a stand-in for a numerical blow-up)."""

    def __init__(self, model: torch.nn.Module, step: int) -> None:
        self.step, self.active = step, False
        model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan") if self.active else None)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False


def make_trainer(out: Path, steps: int) -> tuple[Trainer, Any]:
    model = tiny_llama()
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],  # "wandb", "tensorboard", ...: every integration gets the stability metrics
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        logging_steps=2,
        save_steps=4,
        max_grad_norm=1.0,  # the Trainer clips; stabilitykit measures before it and skips
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset(256), callbacks=[PoisonStep(model, POISON_STEP)])
    callback = stabilize(trainer, sk.StabilityConfig())  # the one line
    return trainer, callback


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="runs/hf_trainer")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)

    trainer, callback = make_trainer(out, args.steps)
    trainer.train()
    for row in trainer.state.log_history:
        keys = ("loss", "grad_norm", "stability/grad_norm/total", "stability/skipped/total")
        shown = {k: round(v, 4) for k, v in row.items() if k in keys or "events/" in k}
        if shown:
            print(f"step {row['step']:>3}: {shown}")

    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    resumed, resumed_callback = make_trainer(out, args.steps + 4)
    resumed.train(resume_from_checkpoint=str(last))
    resumed_summary = resumed_callback.summary()  # the run's totals, as every driver gives them
    assert resumed_summary is not None
    print(f"resumed from {last.name}: {resumed_summary.skipped} skipped step(s) carried over")
    summary = callback.summary()
    assert summary is not None
    return {
        "log_history": trainer.state.log_history,
        "skipped": summary.skipped,
        "resumed_skipped": resumed_summary.skipped,
        "resumed_steps": resumed.state.global_step,
    }


if __name__ == "__main__":
    main()
