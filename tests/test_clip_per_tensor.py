"""Per-tensor adaptive clipping (AdaGC, ``ClipConfig(mode="per_tensor_adaptive")``): the algorithm by hand,
a one-tensor spike, NaN and skipped steps, checkpoints, Lightning, a transformers model, and real
gloo processes (DDP, FSDP2, FSDP1) against one process."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from pydantic import ValidationError
from torch import nn

import stabilitykit as sk
from stabilitykit.engine import StabilityEngine
from tests import distributed_per_tensor_script as dist_script
from tests.conftest import assert_bitwise_equal, batches, snapshot
from tests.distributed_script_runner import run_world
from tests.time_limits import limit, waits_for

RATIO, BETA = 1.05, 0.98


def _cfg(log_every_n_steps: int = 1000, **clip: Any) -> sk.StabilityConfig:
    clip_config = sk.ClipConfig(mode="per_tensor_adaptive", **clip)
    return sk.StabilityConfig(clip=clip_config, log_every_n_steps=log_every_n_steps)


def _mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6, bias=bias), nn.Tanh(), nn.Linear(6, 3, bias=bias))


_BASE = torch.Generator().manual_seed(0)
_X, _Y = torch.randn(5, 4, generator=_BASE), torch.randn(5, 3, generator=_BASE)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch with a little noise; steps 5 and 8 have twice the input (some tensors clip)."""
    g = torch.Generator().manual_seed(step)
    x = _X + 0.1 * torch.randn(5, 4, generator=g)
    return x * (2.0 if step in (5, 8) else 1.0), _Y


def _gamma(guard: sk.StabilityGuard) -> torch.Tensor:
    return guard.engine.clip.state_dict()["gamma"]  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------- algorithm


def test_matches_hand_computed_adagc_through_warmup_and_after() -> None:
    """AdaGC written out per tensor in float64 vs the engine's vector form, 12 steps, warmup 3."""
    warmup, max_norm, steps = 3, 0.8, 12
    model, ref = _mlp(), _mlp()
    cfg = _cfg(log_every_n_steps=1, warmup_steps=warmup, warmup_max_norm=max_norm)
    guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gamma: list[float | None] = [None] * len(list(ref.parameters()))
    clipped_alone = unclipped = 0
    for step in range(steps):
        x, y = _data(step)
        guard.backward(nn.functional.mse_loss(model(x), y))
        report = guard.step()
        guard.zero_grad()

        nn.functional.mse_loss(ref(x), y).backward()
        grads = [p.grad for p in ref.parameters()]
        norms = [float(g.double().norm()) for g in grads]  # type: ignore[union-attr]
        total = math.sqrt(sum(n * n for n in norms))
        if step < warmup:  # global clipping; gamma keeps the smallest clipped norm
            c = min(1.0, max_norm / (total + 1e-6))
            coefs = [c] * len(norms)
            gamma = [n * c if g is None else min(g, n * c) for g, n in zip(gamma, norms, strict=True)]
            expected_coef, expected_threshold = c, max_norm
        else:  # per tensor: clip to ratio * gamma, then the EMA of the clipped norm
            limits = [RATIO * g for g in gamma]  # type: ignore[operator]
            coefs = [lim / n if n > lim else 1.0 for n, lim in zip(norms, limits, strict=True)]
            clipped_alone += any(c < 1 for c in coefs) and any(c == 1 for c in coefs)
            unclipped += all(c == 1 for c in coefs)
            gamma = [BETA * g + (1 - BETA) * n * c for g, n, c in zip(gamma, norms, coefs, strict=True)]  # type: ignore[operator]
            post = math.sqrt(sum((n * c) ** 2 for n, c in zip(norms, coefs, strict=True)))
            expected_coef = post / total
            expected_threshold = math.sqrt(sum(lim * lim for lim in limits))
        for g, c in zip(grads, coefs, strict=True):
            g.mul_(c)  # type: ignore[union-attr]
        ref_opt.step()
        ref_opt.zero_grad()

        assert float(report.grad_norm) == pytest.approx(total, rel=1e-6), f"step {step}: the pre-clip total"
        assert float(report.clip_coef) == pytest.approx(min(expected_coef, 1.0), rel=1e-6), f"step {step}: coef"
        logged = guard.engine.readout.last_host_metrics  # every step is a logging step here
        assert logged["stability/clip/coef"] == pytest.approx(min(expected_coef, 1.0), rel=1e-6)
        assert logged["stability/clip/threshold"] == pytest.approx(expected_threshold, rel=1e-6), f"step {step}"
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
        torch.testing.assert_close(_gamma(guard).double(), torch.tensor(gamma, dtype=torch.float64), rtol=1e-6, atol=0)
    assert clipped_alone >= 2 and unclipped >= 1, "the data must exercise both cases"
    assert guard.engine.clip.state_dict()["count"].item() == steps  # type: ignore[union-attr]


def _spike_run(
    mode: str, spiked: str, factor: float = 100.0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """Same batch every step (lr 0: identical grads); at step 6 one tensor's grad is multiplied by ``factor``.

    Returns the clipped grads at the spike, the grads of a plain step, and the spike's report.
    """
    model = _mlp()
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode=mode, warmup_steps=3), log_every_n_steps=1000)  # type: ignore[arg-type]
    guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    x, y = _data(0)
    plain: dict[str, torch.Tensor] = {}
    for step in range(7):
        guard.backward(nn.functional.mse_loss(model(x), y))
        if step == 6:
            dict(model.named_parameters())[spiked].grad.mul_(factor)  # type: ignore[union-attr]
        report = guard.step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        if step == 5:
            plain = grads
        guard.zero_grad()
    return grads, plain, report


def test_a_single_tensor_spiking_100x_is_clipped_and_the_others_are_untouched() -> None:
    spiked = "0.weight"
    grads, plain, report = _spike_run("per_tensor_adaptive", spiked)
    for name, grad in grads.items():
        if name == spiked:  # scaled back to exactly ratio x its EMA (here its steady norm), direction kept
            assert grad.norm().item() == pytest.approx(RATIO * plain[name].norm().item(), rel=1e-5)
            torch.testing.assert_close(grad / grad.norm(), plain[name] / plain[name].norm())
        else:
            assert torch.equal(grad, plain[name]), f"{name} was changed by another tensor's spike"
    assert 0 < float(report.clip_coef) < 1 and bool(report.clipped)

    # what global clipping does with the same spike: every tensor pays for one
    global_grads, global_plain, _ = _spike_run("adaptive", spiked)
    others = [n for n in global_grads if n != spiked]
    assert all(global_grads[n].norm() < 0.5 * global_plain[n].norm() for n in others)


def test_nan_step_leaves_emas_params_and_optimizer_state_unchanged() -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = sk.StabilityGuard(model, opt, _cfg(warmup_steps=2, warmup_max_norm=1.0))
    for i, (x, y) in enumerate(batches(8)):
        loss = model.loss(x, y) * (float("nan") if i in (1, 5) else 1.0)  # in warmup and after
        state, clip = snapshot(model, opt), guard.engine.clip.state_dict()  # type: ignore[union-attr]
        guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        if i in (1, 5):
            assert bool(report.skipped)
            assert_bitwise_equal(state, snapshot(model, opt))
            after = guard.engine.clip.state_dict()  # type: ignore[union-attr]
            for key, value in clip.items():
                assert torch.equal(value, after[key]), f"clip.{key} changed on the NaN step {i}"
    gamma = _gamma(guard)
    assert torch.isfinite(gamma).all() and (gamma > 0).all()
    assert guard.engine.clip.state_dict()["count"].item() == 6  # type: ignore[union-attr]


def test_a_step_the_engine_skips_or_does_not_skip_leaves_the_statistics_alone() -> None:
    """A finite step skipped by the data guard's flag, and a NaN step with skipping off (grads untouched)."""
    model = _mlp()
    params = list(model.parameters())
    cfg = sk.StabilityConfig(
        clip=sk.ClipConfig(mode="per_tensor_adaptive", warmup_steps=1), skip=sk.SkipConfig(nonfinite=False)
    )
    engine = StabilityEngine(params, cfg, model=model)
    x, y = _data(0)
    for step in range(4):
        model.zero_grad()
        nn.functional.mse_loss(model(x * (3.0 if step == 3 else 1.0)), y).backward()
        force = torch.tensor(step == 3)
        engine.book_step(engine.evaluate(force_skip=force))
        if step == 2:
            before = engine.clip.state_dict()  # type: ignore[union-attr]
    after = engine.clip.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed the EMAs"

    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    params[0].grad[0, 0] = float("nan")  # type: ignore[index]
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    decision = engine.evaluate()
    engine.book_step(decision)
    assert not bool(decision.skip), "skipping is off"
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)  # coefficient exactly 1
    final = engine.clip.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(after[k], final[k]) for k in after), "a NaN norm entered the EMAs"


# ------------------------------------------------------------------------------------------- state


def test_checkpoint_round_trip_resumes_bitwise_equal_to_an_uninterrupted_run() -> None:
    data = batches(16)
    cfg = sk.StabilityConfig(
        clip=sk.ClipConfig(mode="per_tensor_adaptive", warmup_steps=4, warmup_max_norm=1.0), log_every_n_steps=3
    )

    def run(resume_at: int | None) -> tuple[sk.StabilityGuard, nn.Module]:
        model = sk.testing.tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        guard = sk.StabilityGuard(model, opt, cfg)
        for i, (x, y) in enumerate(data):
            if i == resume_at:
                buffer = io.BytesIO()
                torch.save({"guard": guard.state_dict(), "opt": opt.state_dict(), "model": model.state_dict()}, buffer)
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=True)
                model = sk.testing.tiny_gpt(seed=1)
                model.load_state_dict(saved["model"])
                opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
                opt.load_state_dict(saved["opt"])
                guard = sk.StabilityGuard(model, opt, cfg)
                guard.load_state_dict(saved["guard"])
            guard.backward(model.loss(x, y) * (float("nan") if i in (2, 11) else 1.0))
            guard.step()
            guard.zero_grad()
        return guard, model

    straight, straight_model = run(None)
    for resume_at in (3, 9):  # inside the warmup, and after it
        resumed, resumed_model = run(resume_at)
        a, b = straight.engine.clip.state_dict(), resumed.engine.clip.state_dict()  # type: ignore[union-attr]
        for key in a:
            assert torch.equal(a[key], b[key]), f"clip.{key} differs after resuming at step {resume_at}"
        for (name, p), q in zip(straight_model.named_parameters(), resumed_model.parameters(), strict=True):
            assert torch.equal(p, q), f"{name} differs after resuming at step {resume_at}"
        assert (
            straight.state_dict()["optimizers"][0]["engine"]["ledger"]
            == resumed.state_dict()["optimizers"][0]["engine"]["ledger"]
        )


def test_state_from_another_parameter_count_or_mode_is_refused_clearly() -> None:
    model = _mlp()
    guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg())
    x, y = _data(0)
    guard.backward(nn.functional.mse_loss(model(x), y))
    guard.step()
    state = guard.state_dict()

    smaller = _mlp(bias=False)  # the same layers, half the tensors
    other = sk.StabilityGuard(smaller, torch.optim.SGD(smaller.parameters(), lr=0.1), _cfg())
    with pytest.raises(
        ValueError,
        match=r"state at 'optimizers\.0\.engine\.clip\.gamma': a tensor of shape \(2,\) expected, got \(4,\)",
    ):
        other.load_state_dict(state)
    assert other.engine.step == 0  # nothing was loaded

    adaptive = sk.StabilityGuard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sk.StabilityConfig(clip=sk.ClipConfig(mode="adaptive"))
    )
    adaptive.backward(nn.functional.mse_loss(model(x), y))
    adaptive.step()
    with pytest.raises(
        ValueError, match=r"state at 'optimizers\.0\.engine\.clip': missing \['gamma', 'seen'\].*another mode"
    ):
        guard.load_state_dict(adaptive.state_dict())


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="per_tensor_ratio"):
        sk.ClipConfig(mode="per_tensor_adaptive", per_tensor_ratio=0.9)
    with pytest.raises(ValidationError, match="per_tensor_ratio"):
        sk.ClipConfig(mode="per_tensor_adaptive", per_tensor_ratio=math.inf)
    with pytest.raises(ValidationError, match="per_tensor_decay"):
        sk.ClipConfig(mode="per_tensor_adaptive", per_tensor_decay=1.0)
    with pytest.raises(ValidationError, match=r"clip\.per_tensor_decay"):
        sk.StabilityConfig.from_mapping({"clip": {"mode": "per_tensor_adaptive", "per_tensor_decay": 0}})


# ------------------------------------------------------------------------------------------- real clients


def test_lightning_trainer_clips_per_tensor_like_the_plain_loop(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    cfg = sk.StabilityConfig(
        clip=sk.ClipConfig(mode="per_tensor_adaptive", warmup_steps=3, warmup_max_norm=1.0), log_every_n_steps=4
    )
    callback = StabilityCallback(cfg)
    module = GPTModule(poison={6: float("nan")})
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=12, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=4,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[callback],
    )  # fmt: skip
    trainer.fit(module, gpt_dataloader(12))
    engine = callback.engine
    assert engine is not None and int(engine.counters.skipped_total) == 1
    assert int(engine.counters.clipped_total) >= 1

    # the same 12 steps in a plain loop: the same per-tensor statistics and parameters
    plain = GPTModule()
    opt = torch.optim.AdamW(plain.parameters(), lr=plain.lr, weight_decay=0.1, fused=True)
    guard = sk.StabilityGuard(plain, opt, cfg)
    for i, (x, y) in enumerate(gpt_dataloader(12)):
        guard.backward(plain.model.loss(x, y) * (float("nan") if i == 6 else 1.0))
        guard.step()
        guard.zero_grad()
    ours, theirs = engine.clip.state_dict(), guard.engine.clip.state_dict()  # type: ignore[union-attr]
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=0, msg=f"clip.{key}")
    for (name, p), q in zip(module.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    metrics = (Path(trainer.logger.log_dir) / "metrics.csv").read_text()  # type: ignore[union-attr]
    assert "stability/clip/coef" in metrics and "stability/clip/threshold" in metrics


def test_transformers_llama_one_spiking_tensor_is_clipped_alone() -> None:
    """A 100x spike in one tensor of a tiny Llama: that tensor goes to its own threshold; every other tensor
    gets the coefficient its own norm and EMA give (as without the spike), not a share of the spike."""
    from tests.hf_models import tiny_llama, token_batches

    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = sk.StabilityGuard(model, opt, _cfg(warmup_steps=3, warmup_max_norm=1.0))
    spiked = "model.layers.1.mlp.down_proj.weight"
    params = dict(model.named_parameters())
    for i, batch in enumerate(token_batches(8)):
        guard.backward(model(**batch).loss)
        if i == 7:
            limits = dict(zip(params, (RATIO * _gamma(guard)).tolist(), strict=True))
            params[spiked].grad.mul_(100.0)  # type: ignore[union-attr]
            before = {n: p.grad.clone() for n, p in params.items()}  # type: ignore[union-attr]
        report = guard.step()
        if i == 7:
            for name, p in params.items():
                norm = before[name].norm().item()
                coef = limits[name] / norm if norm > limits[name] else 1.0
                torch.testing.assert_close(p.grad, before[name] * coef, rtol=1e-5, atol=1e-9, msg=name)
                if name != spiked:
                    assert coef > 0.2, f"{name} paid for another tensor's spike"
            assert params[spiked].grad.norm().item() == pytest.approx(limits[spiked], rel=1e-5)  # type: ignore[union-attr]
            assert 0 < float(report.clip_coef) < 0.5
        guard.zero_grad()
    assert _gamma(guard).shape == (len(params),) and torch.isfinite(_gamma(guard)).all()


# ------------------------------------------------------------------------------------------- distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    script = Path(dist_script.__file__)
    return run_world(script, 2, tmp_path_factory.mktemp("per_tensor"), timeout=limit("distributed_per_tensor_script"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("key", ["ddp|2.0", "fsdp2|2.0", "fsdp2|inf", "fsdp1|2.0"])
@waits_for("distributed_per_tensor_script")
def test_two_processes_clip_like_one(ranks: list[dict], key: str) -> None:
    """DDP, FSDP2 and FSDP1 on 2 gloo processes vs one process on the whole batch: same per-tensor clipping."""
    ref = dist_script.train_reference(float(key.split("|")[1]))
    assert ref["skipped"] == 1 and min(ref["coefs"]) < 0.5  # the spike step clipped hard
    for r, rank in enumerate(ranks):
        got = rank[key]
        assert got["skipped"] == 1, f"rank {r}: the NaN on rank 1 must skip everywhere"
        finite = [i for i, b in enumerate(ref["norms"]) if math.isfinite(b)]
        assert max(_rel(got["norms"][i], ref["norms"][i]) for i in finite) < 1e-6, f"rank {r} {key}: pre-clip totals"
        assert max(_rel(a, b) for a, b in zip(got["gamma"], ref["gamma"], strict=True)) < 1e-6, f"rank {r}: EMAs"
        for name, values in ref["params"].items():
            err = max(abs(a - b) for a, b in zip(got["params"][name], values, strict=True))
            assert err < 1e-6, f"rank {r} {key}: {name} differs from one process by {err}"
        if got["grads"][dist_script.SPIKED]:  # the clipped grads (FSDP1 keeps them sharded: params only)
            for name, norms in ref["grads"].items():
                for i in finite:
                    if i != dist_script.NAN_AT:
                        assert _rel(got["grads"][name][i], norms[i]) < 1e-6, f"rank {r} {key}: {name} at step {i}"
    assert ranks[0][key]["gamma"] == ranks[1][key]["gamma"], "every rank holds the same EMAs"


@waits_for("distributed_per_tensor_script")
def test_per_tensor_norms_ride_in_the_existing_collectives(ranks: list[dict]) -> None:
    counts = [rank["collectives"] for rank in ranks]
    assert counts[0] == counts[1]
    assert counts[0]["per_tensor_adaptive"] == counts[0]["fixed"] > 0, counts[0]
