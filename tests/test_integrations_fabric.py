"""FabricGuard with a real Lightning Fabric: 2 gloo processes (DDP), Fabric's MixedPrecision plugin
with a real GradScaler, several optimizers each with its own engine."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision

import stabilitykit as sk
from stabilitykit.integrations import FabricGuard
from stabilitykit.testing import char_batches, tiny_gpt
from tests.conftest import assert_bitwise_equal, snapshot
from tests.time_limits import run


def test_two_gloo_processes_nan_on_one_rank_skips_everywhere_and_resumes(tmp_path: Path) -> None:
    script = Path(__file__).parent / "fabric_ddp_script.py"
    env = {**os.environ, "SK_OUT": str(tmp_path), "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = run(
        [sys.executable, str(script)], "fabric_ddp_script", env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["unchanged"], "parameters and optimizer state bitwise unchanged on the skipped step"
        assert r["skipped_step"] == 4 and r["skipped"] == 1, "rank 0 skips rank 1's NaN step too"
        assert r["lr_steps"] == 9, "10 steps, 1 skipped: the scheduler advanced 9 times"
        assert r["restored_step"] == 6 and r["resume_exact"] and r["skipped_after_resume"] == 1
        assert r["layer_names"][0] == "tok_emb", "names follow the user's module, not Fabric's wrappers"
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    # recovery: rank 1 alone alerted; both rolled back once, at the same step, and stayed identical
    first, second = ranks[0]["recovery"], ranks[1]["recovery"]
    assert first["alerts"] == [] and second["alerts"] == [8]
    assert len(first["rollbacks"]) == 1 and first["rollbacks"] == second["rollbacks"]
    assert first["rollbacks"][0]["restored_step"] == 8
    assert first["checksum"] == second["checksum"]
    # a user's skip rule raised on rank 1 only skips both ranks; a recorded metric is summed across ranks
    first, second = ranks[0]["rule"], ranks[1]["rule"]
    for rule in (first, second):
        assert rule["skipped"] == [[3, "quality_gate"]] and rule["unchanged"]
        assert rule["sums"] == [3.0]
    assert first["checksum"] == second["checksum"]


def test_fabric_mixed_precision_grad_scaler_true_norm_and_skip() -> None:
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    model = tiny_gpt(seed=0)
    reference = tiny_gpt(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    model.mark_forward_method("loss")
    config = sk.StabilityConfig(log_every_n_steps=1)
    guard = FabricGuard(fabric, model, optimizer, config)
    assert guard.engine.scaler.enabled, "Fabric's GradScaler is found on its precision plugin"
    data = char_batches(seed=0)
    x, y = next(data)
    with torch.autocast("cpu", dtype=torch.float16):
        reference.loss(x, y).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    guard.backward(model.loss(x, y))
    report = guard.step()
    guard.zero_grad()
    assert abs(float(report.grad_norm) - expected) <= 2e-3 * expected, "the unscaled norm, read once"
    assert float(scaler.get_scale()) == 2.0**10
    x, y = next(data)
    before = snapshot(model, optimizer)
    guard.backward(model.loss(x, y) * float("nan"))
    report = guard.step()
    guard.zero_grad()
    # a NaN loss is a bad batch, not an overflow, even under the GradScaler (which still backs off)
    assert bool(report.skipped) and report.reason == "nonfinite_loss"
    assert_bitwise_equal(before, snapshot(model, optimizer))
    assert float(scaler.get_scale()) == 2.0**9, "Fabric's scaler.update() backed off after the overflow"
    x, y = next(data)
    guard.backward(model.loss(x, y))
    assert not bool(guard.step().skipped)


def test_two_optimizers_each_guarded_with_own_prefix_cadence_and_skip() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = tiny_gpt(seed=0)
    body = [p for n, p in model.named_parameters() if not n.startswith("lm_head")]
    head = list(model.lm_head.parameters())
    opt_a = torch.optim.AdamW(body, lr=3e-3, fused=True)
    opt_b = torch.optim.SGD(head, lr=0.1)
    model, opt_a, opt_b = fabric.setup(model, opt_a, opt_b)
    model.mark_forward_method("loss")
    logged: dict[str, list[int]] = {}

    class Sink:
        def log_metrics(self, metrics, step):
            for key in metrics:
                if key.endswith("grad_norm/total"):
                    logged.setdefault(key, []).append(step)

    guard = FabricGuard(fabric, model, [opt_a, opt_b], sk.StabilityConfig(log_every_n_steps=2), sinks=[Sink()])
    assert [e.fused for e in guard.engines] == [True, False]
    data = char_batches(seed=0)
    skipped_b = []
    for i in range(6):
        x, y = next(data)
        guard.backward(model.loss(x, y), optimizer=opt_a)
        guard.step(optimizer=opt_a)
        guard.zero_grad()
        if i % 2 == 0:  # the second optimizer steps every other iteration, as a GAN's critic might
            x, y = next(data)
            loss = model.loss(x, y)
            if i == 2:
                loss = loss * float("nan")
            before = snapshot(model, opt_b)
            guard.backward(loss, optimizer=opt_b)
            report = guard.step(optimizer=opt_b)
            guard.zero_grad()
            skipped_b.append(bool(report.skipped))
            if i == 2:
                head_names = [n for n in before["params"] if n.startswith("lm_head")]
                after = snapshot(model, opt_b)
                assert all(torch.equal(before["params"][n], after["params"][n]) for n in head_names)
    summary = guard.summary()
    assert [row["steps"] for row in summary["optimizers"]] == [6, 3]
    assert skipped_b == [False, True, False]
    assert [row["skipped"] for row in summary["optimizers"]] == [0, 1], "each optimizer's own skip decision"
    assert logged == {"stability/opt0/grad_norm/total": [0, 2, 4], "stability/opt1/grad_norm/total": [0, 2]}
