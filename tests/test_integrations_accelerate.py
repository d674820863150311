"""AccelerateGuard in real Accelerate loops: accumulation + bf16, fused AdamW behind
AcceleratedOptimizer, Accelerate's GradScaler path, save_state / load_state."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from hf_models import tiny_llama, token_batches

import stabilitykit as sk
from stabilitykit.integrations import AccelerateGuard
from tests.conftest import assert_bitwise_equal, snapshot

NAN = float("nan")
ACCUM = 2


def _setup(fused: bool, mixed_precision: str = "bf16") -> tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=ACCUM)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def _micro_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    return token_batches(steps * ACCUM, batch_size=4, seed=1)


def test_reference_norm_is_the_fully_accumulated_unclipped_norm(fresh_accelerate: None) -> None:
    batches = _micro_batches(1)
    reference_model = tiny_llama()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in batches:
            (reference_model(**batch).loss / ACCUM).backward()
    grads = [p.grad for p in reference_model.parameters()]
    expected = float(torch.nn.utils.clip_grad_norm_(reference_model.parameters(), float("inf")))
    assert all(g is not None for g in grads)

    accelerator, model, optimizer, scheduler = _setup(fused=True)
    config = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=0.5), log_every_n_steps=1)
    guard = AccelerateGuard(accelerator, model, optimizer, config, scheduler=scheduler)
    assert guard.engine.fused, "the fused AdamW behind AcceleratedOptimizer is recognised"
    reports = []
    for batch in batches:
        with accelerator.accumulate(model):
            guard.backward(model(**batch).loss)
            reports.append(guard.step())
            guard.zero_grad()
    assert reports[0] is None, "the first micro-batch is not an optimizer step"
    report = reports[1]
    assert report is not None and report.step == 0 and guard.step_count == 1
    assert float(report.grad_norm) == pytest.approx(expected, rel=1e-4)
    assert float(report.clip_coef) == pytest.approx(0.5 / expected, rel=1e-3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = sum(float(reference_model(**b).loss) for b in batches) / ACCUM
    assert float(report.loss) == pytest.approx(ref_loss, rel=1e-2)  # the batch mean, not the sum


@pytest.mark.parametrize("fused", [True, False])
def test_nan_at_a_known_step_is_skipped_bitwise_and_training_continues(fresh_accelerate: None, fused: bool) -> None:
    accelerator, model, optimizer, scheduler = _setup(fused=fused)
    guard = AccelerateGuard(accelerator, model, optimizer, sk.StabilityConfig(log_every_n_steps=3), scheduler=scheduler)
    events: list[sk.Event] = []
    guard.hooks.on("skipped", events.append)
    poison_step = 3
    before = after = None
    reports = []
    for i, batch in enumerate(_micro_batches(6)):
        step = i // ACCUM
        if step == poison_step and i % ACCUM == 0:
            before = snapshot(model, optimizer)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            if step == poison_step and i % ACCUM == 1:
                loss = loss * NAN  # the second micro-batch of optimizer step 3
            guard.backward(loss)
            report = guard.step()
            guard.zero_grad()
        if report is not None:
            reports.append(report)
        if step == poison_step and i % ACCUM == 1:
            after = snapshot(model, optimizer)
    assert before is not None and after is not None
    assert_bitwise_equal(before, after)
    assert len(reports) == 6 and guard.step_count == 6, "12 micro-batches, 6 optimizer steps"
    assert [bool(r.skipped) for r in reports] == [False, False, False, True, False, False]
    guard.close()
    assert [e.step for e in events] == [poison_step]
    assert guard.summary()["skipped"] == 1
    assert scheduler.scheduler.last_epoch == 5, "6 optimizer steps, 1 skipped: the scheduler advanced 5 times"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(reports[-1].grad_norm) > 0 and not bool(reports[-1].skipped)


def test_accelerated_optimizer_with_a_grad_scaler_routes_its_step_through_the_guard(
    fresh_accelerate: None,
) -> None:
    """Accelerate's AcceleratedOptimizer calls the step it captured at construction inside
    ``scaler.step``: a skip GradScaler cannot see (a bad batch, finite grads) must still skip."""
    accelerator = Accelerator(cpu=True)
    model = tiny_llama()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    optimizer = AcceleratedOptimizer(inner, scaler=scaler)  # what prepare() builds under fp16 on a GPU
    config = sk.StabilityConfig(data=sk.DataGuardConfig(mode="skip", num_classes=96), log_every_n_steps=1)
    guard = AccelerateGuard(accelerator, model, optimizer, config, scaler=scaler)
    batches = token_batches(4, seed=2)
    bad = copy.deepcopy(batches[2])
    bad["labels"][0, 0] = 10_000  # a label id beyond the vocabulary: the data guard skips the step
    batches[2] = bad
    for i, batch in enumerate(batches):
        guard.check_batch(batch)
        before = snapshot(model, inner)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"].clamp(max=95)).loss
        guard.record_loss(loss)
        scaler.scale(loss).backward()
        report = guard.step()
        guard.zero_grad()
        assert report is not None
        assert bool(report.skipped) == (i == 2)
        if i == 2:
            assert report.reason == "bad_batch"
            assert_bitwise_equal(before, snapshot(model, inner))
    assert guard.step_count == 4 and guard.skipped_total == 1
    assert float(scaler.get_scale()) == 2.0**8, "no overflow: GradScaler's scale never backed off"
    # after the guard: the AcceleratedOptimizer steps the real optimizer again, unwrapped
    guard.close()
    loss = model(**batches[0]).loss
    scaler.scale(loss).backward()
    before = snapshot(model, inner)
    optimizer.step()
    assert not optimizer.step_was_skipped
    changed = snapshot(model, inner)
    assert any(not torch.equal(changed["params"][n], before["params"][n]) for n in before["params"])


def test_save_state_and_load_state_resume_exactly(fresh_accelerate: None, tmp_path: Path) -> None:
    accelerator, model, optimizer, scheduler = _setup(fused=True)
    guard = AccelerateGuard(accelerator, model, optimizer, sk.StabilityConfig(log_every_n_steps=4), scheduler=scheduler)
    accelerator.register_for_checkpointing(guard)
    batches = _micro_batches(8)

    def train(start: int, stop: int) -> None:
        for i in range(start * ACCUM, stop * ACCUM):
            with accelerator.accumulate(model):
                loss = model(**batches[i]).loss
                if i == 5 * ACCUM:
                    loss = loss * NAN
                guard.backward(loss)
                guard.step()
                guard.zero_grad()

    train(0, 3)
    accelerator.save_state(str(tmp_path / "ckpt"))
    train(3, 8)
    guard.engine.flush()
    first = (snapshot(model, optimizer), guard.step_count, guard.skipped_total, scheduler.scheduler.last_epoch)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert guard.step_count == 3 and guard.skipped_total == 0
    train(3, 8)
    guard.engine.flush()
    assert_bitwise_equal(first[0], snapshot(model, optimizer))
    assert (guard.step_count, guard.skipped_total, scheduler.scheduler.last_epoch) == first[1:]
    assert first[1:3] == (8, 1)


def test_fused_adamw_behind_accelerated_optimizer_costs_no_sync_off_logging_steps(fresh_accelerate: None) -> None:
    from stabilitykit.testing.syncs import count_host_syncs

    accelerator, model, optimizer, scheduler = _setup(fused=True, mixed_precision="no")
    config = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=4)
    guard = AccelerateGuard(accelerator, model, optimizer, config, scheduler=scheduler)
    batches = _micro_batches(4)
    counts = []
    for step in range(4):
        losses = [model(**b).loss for b in batches[step * ACCUM : (step + 1) * ACCUM]]
        with count_host_syncs() as counter:
            for loss in losses:
                with accelerator.accumulate(model):
                    guard.backward(loss)
                    guard.step()
                    guard.zero_grad()
        counts.append(counter.count)
    assert counts[1:] == [0, 0, 0], counter.sites


def test_the_plain_guard_refuses_an_accumulating_accelerate_optimizer() -> None:
    """Inside ``accelerator.accumulate`` the plain guard would count micro-batches as steps: refused by name."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="AccelerateGuard"):
        sk.StabilityGuard(model, optimizer)
    guard = AccelerateGuard(accelerator, model, optimizer)  # follows sync_gradients
    guard.close()


def test_accumulating_guard_is_bitwise_the_accelerate_recipe(fresh_accelerate: None) -> None:
    """Under ``accelerator.accumulate`` with bf16 autocast, the guard's clip is Accelerate's own: the same
    norms and, after 6 AdamW steps, the same parameters, bit for bit (the recipe: clip_grad_norm_ + step)."""
    from accelerate.state import AcceleratorState, GradientState

    batches = _micro_batches(6)
    max_norm = 0.5

    def run(guarded: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator, model, optimizer, _ = _setup(fused=False)
        guard = None
        if guarded:
            config = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=max_norm), log_every_n_steps=4)
            guard = AccelerateGuard(accelerator, model, optimizer, config)
        norms = []
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if guard is not None:
                    guard.backward(loss)
                    report = guard.step()
                    if report is not None:
                        norms.append(report.grad_norm.clone())
                else:
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm).clone())
                    optimizer.step()
                optimizer.zero_grad()
        return norms, [p.detach().clone() for p in model.parameters()]

    recipe_norms, recipe_params = run(guarded=False)
    norms, params = run(guarded=True)
    assert len(norms) == len(recipe_norms) == 6
    assert all(torch.equal(a, b) for a, b in zip(norms, recipe_norms, strict=True)), (norms, recipe_norms)
    assert all(torch.equal(a, b) for a, b in zip(params, recipe_params, strict=True))
