"""Run by test_deepspeed.py under ``torchrun --nproc_per_node 2``: the HF Trainer with ``deepspeed=``
(ZeRO-2, DeepSpeed's CPU accelerator over gloo) and ``stabilize(trainer, cfg)``.

A tiny random-init ``LlamaForCausalLM`` trains 8 steps; at global step 3 rank 1 alone has a NaN loss.
Both ranks must skip that step (the engine not advancing for it), end with finite and identical
parameters, and find the guard's rows in ``trainer.state.log_history``. The run saves a checkpoint at
step 4; a second Trainer resumes from it (``resume_from_checkpoint``) and must end bitwise where the
first ended, each rank's guard state back (its own, from ``trainer_state.json``) and equal at the end.
Rank 0 also checks that ``stabilize`` refuses two clippers (``max_grad_norm`` > 0 with ``ClipConfig``).
Each rank writes ``rank<r>.json`` to ``SK_OUT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

import stabilitykit as sk
from stabilitykit.integrations import stabilize
from stabilitykit.integrations.transformers import to_json
from tests.hf_models import tiny_llama, token_batches

BAD_STEP = 3
STEPS = 8
SAVE_STEPS = 4


def _args(out: Path, max_grad_norm: float, restore_callbacks: bool = False) -> Any:
    from transformers import TrainingArguments

    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    return TrainingArguments(
        output_dir=str(out / "run"),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        logging_steps=2,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_only_model=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=ds,
        max_grad_norm=max_grad_norm,
        restore_callback_states_from_checkpoint=restore_callbacks,
    )


def main() -> None:
    from transformers import Trainer

    out = Path(os.environ["SK_OUT"])
    torch.set_num_threads(1)
    rows = [{k: v[0] for k, v in batch.items()} for batch in token_batches(64, batch_size=1, seed=3)]

    class NaNTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if self.args.process_index == 1 and self.state.global_step == BAD_STEP:
                loss = loss * float("nan")
            return loss

    refused = ""
    try:
        clipping = NaNTrainer(model=tiny_llama(), args=_args(out, 1.0), train_dataset=rows)
        stabilize(clipping, sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0)))
    except ValueError as exc:
        refused = str(exc)

    trainer = NaNTrainer(model=tiny_llama(), args=_args(out, 0.0), train_dataset=rows)
    skipped: list[int] = []
    callback = stabilize(trainer, sk.StabilityConfig(log_every_n_steps=2))
    callback.hooks.on("skipped", lambda e: skipped.append(e.step))
    trainer.train()
    engine = trainer.model_wrapped
    params = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    ours = [h for h in trainer.state.log_history if "stability/grad_norm/total" in h]
    assert callback.guard is not None
    end_state = to_json(callback.guard.state_dict())

    # resume from the step-4 checkpoint: the same end, bitwise, and the same guard state
    resumed = NaNTrainer(model=tiny_llama(), args=_args(out, 0.0), train_dataset=rows)
    again = stabilize(resumed, sk.StabilityConfig(log_every_n_steps=2))
    loaded: list[int] = []
    again.hooks.on("skipped", lambda e: loaded.append(e.step))
    resumed.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{SAVE_STEPS}"))
    assert again.guard is not None
    params_again = torch.cat([p.detach().float().flatten() for p in resumed.model_wrapped.module.parameters()])

    # resume from the last checkpoint with restore_callback_states_from_checkpoint=True: the Trainer rebuilds
    # the callback from its saved args, which hands back the attached one; its state is what step 8 saved
    from transformers import TrainerCallback

    restoring = NaNTrainer(model=tiny_llama(), args=_args(out, 0.0, restore_callbacks=True), train_dataset=rows)
    third = stabilize(restoring, sk.StabilityConfig(log_every_n_steps=2))
    seen: dict[str, Any] = {}

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if "loaded" not in seen and third.guard is not None:
                seen["loaded"] = to_json(third.guard.state_dict())

    restoring.add_callback(Probe())
    restoring.args.max_steps = STEPS + 1
    restoring.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{STEPS}"))
    assert callback.guard.checkpoint_states is not None
    saved_at_end = to_json(callback.guard.checkpoint_states[trainer.args.process_index])
    result = {
        "callback": type(callback).__name__,
        "skipped": skipped,
        "global_steps": engine.global_steps,
        "finite": bool(torch.isfinite(params).all()),
        "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "rows": len(ours),
        "refused": refused,
        "resume_exact": bool(torch.equal(params, params_again)),
        "resume_guard_state": to_json(again.guard.state_dict()) == end_state,
        "resume_skipped": again.guard.summary().skipped,
        "resume_global_steps": resumed.model_wrapped.global_steps,
        "restored_into_attached": any(cb is third for cb in restoring.callback_handler.callbacks),
        "restored_state": seen.get("loaded") == saved_at_end,
    }
    (out / f"rank{trainer.args.process_index}.json").write_text(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
