"""``stabilitykit report``: the one-page picture from a guard JSONL log and from a Lightning CSV log,
for the runs people need it for (many skips, killed mid-write, resumed, long), and a clear line for bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import stabilitykit as sk
from stabilitykit.cli import main
from stabilitykit.report_plot import ReportError, draw_report, load_run_log, report_figure
from tests.conftest import batches


def _jsonl_run(path: Path) -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=2, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(path)])
    for i, (x, y) in enumerate(batches(40)):
        loss = model.loss(x, y) * (float("nan") if i == 11 else 1000.0 if i == 30 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()


def test_report_from_jsonl_marks_skips_and_spikes(tmp_path: Path, capsys) -> None:
    log = tmp_path / "run.jsonl"
    _jsonl_run(log)
    run = load_run_log(log)
    assert run.layer_names()[:2] == ["tok_emb", "pos_emb"] and "blocks.0" in run.layer_names()
    kinds = {e["kind"]: e["step"] for e in run.events}
    assert kinds["skipped"] == 11 and kinds["spike_warning"] == 30
    assert main(["report", str(log), "-o", str(tmp_path / "report.png")]) == 0
    assert (tmp_path / "report.png").stat().st_size > 30_000
    assert "wrote" in capsys.readouterr().out


def test_report_from_lightning_csv(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=20,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[StabilityCallback(sk.StabilityConfig())],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(poison={5: float("nan")}), gpt_dataloader(20))
    run = load_run_log(tmp_path / "csv")
    assert run.series("grad_norm/total")[0][:3] == [1, 3, 7] and "model.blocks.0" in run.layer_names()  # 5: NaN
    assert "model.lm_head" in run.layer_names()
    assert [e["step"] for e in run.events if e["kind"] == "skipped"] == [5]  # step 5 is a logging row itself
    assert main(["report", str(tmp_path / "csv"), "-o", str(tmp_path / "csv.png")]) == 0
    assert (tmp_path / "csv.png").stat().st_size > 30_000


def _bad_run(path: Path, steps: int = 680, skips: int = 97, **config: object) -> None:
    """A real guard run of a small MLP whose loss stays in [1, 3], with ``skips`` non-finite steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = sk.StabilityConfig(log_every_n_steps=1, **config)  # type: ignore[arg-type]
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(path)])
    bad = set(random.Random(0).sample(range(5, steps), skips))
    x, y = torch.randn(32, 8), torch.randint(0, 8, (32,))
    for i in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)  # about ln 8 = 2.08, falling slowly
        guard.backward(loss * (float("inf") if i in bad else 1.0))
        guard.step()
        guard.zero_grad()
    guard.close()


def test_report_of_a_run_with_97_skips_keeps_the_loss_axis_on_the_loss(tmp_path: Path) -> None:
    log = tmp_path / "bad.jsonl"
    _bad_run(log)
    assert len(log.read_text().splitlines()) == 875  # the size of the log in the bug report
    run = load_run_log(log)
    assert len([e for e in run.events if e["kind"] == "skipped"]) == 97
    fig = report_figure(run)
    _steps, loss = run.series("loss")
    low, high = fig.axes[0].get_ylim()
    assert min(loss) >= 1.0 and max(loss) <= 3.0
    assert (max(loss) - min(loss)) / (high - low) > 0.85  # was 13% when each skip mark pushed the axis up
    assert draw_report(log, tmp_path / "bad.png").stat().st_size > 30_000


def test_report_finds_the_metric_prefix(tmp_path: Path) -> None:
    for prefix in ("train/stab", ""):
        log = tmp_path / f"prefix{len(prefix)}.jsonl"
        _bad_run(log, steps=30, skips=3, metric_prefix=prefix)
        run = load_run_log(log)
        assert run.prefix == prefix and len(run.series("loss")[0]) == 27 and "2" in run.layer_names()
        assert main(["report", str(log), "-o", str(tmp_path / f"{len(prefix)}.png")]) == 0
    with pytest.raises(ReportError, match=r"none holds a stabilitykit metric"):
        load_run_log(log, prefix="stability")


def test_report_of_a_log_killed_mid_write_and_resumed(tmp_path: Path, capsys) -> None:
    log = tmp_path / "run.jsonl"
    rows = [{"step": s, "stability/grad_norm/total": 1.0, "stability/loss": 2.0} for s in range(0, 20, 2)]
    rows += [{"step": s, "stability/grad_norm/total": 1.0, "stability/loss": 1.0} for s in range(10, 30, 2)]
    log.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"event": "skipped", "step": 31, "mess')
    with pytest.warns(RuntimeWarning, match=r"run.jsonl:21: skipped a truncated last line"):
        run = load_run_log(log)
    steps, loss = run.series("loss")
    assert steps == list(range(0, 30, 2))  # the resumed run's rows replace the repeated steps
    assert loss == [2.0] * 5 + [1.0] * 10
    assert main(["report", str(log), "-o", str(tmp_path / "r.png")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: " in err and "truncated last line" in err


def test_long_logs_are_binned_with_spikes_kept(tmp_path: Path) -> None:
    log = tmp_path / "long.jsonl"
    with log.open("w") as out:
        for step in range(20_000):
            norm = 100.0 if step == 12_345 else 1.0 + (step % 7) / 10
            row = {"step": step, "stability/grad_norm/total": norm, "stability/grad_norm/fc": norm / 2}
            out.write(json.dumps(row) + "\n")
    run = load_run_log(log, bins=256)
    steps, _ = run.series("grad_norm/total")
    assert run.binned and len(steps) <= 256 and run.n_rows == 20_000
    bins = run.lines["grad_norm/total"]
    assert max(bins.column("hi")) == 100.0 and min(bins.column("lo")) == 1.0  # the spike survives binning
    assert max(run.layers["fc"].column("hi")) == 50.0
    assert draw_report(run, tmp_path / "long.png").exists()


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (b"", [], r"empty log, no metric rows"),
        (b"not json at all\n", [], r"bad.jsonl:1: not a JSON line"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", [], r"bad.jsonl:1: not UTF-8 text"),
        (b'{"event": "precision", "step": 0, "message": "x"}\n', [], r"no metric rows to draw, only 1 event"),
        (b'{"step": 0, "loss": 1.0}\n', [], r"none holds a stabilitykit metric"),
        (b'{"step": "zero", "stability/grad_norm/total": 1.0}\n', [], r"bad.jsonl:1: \"step\" is 'zero'"),
        (b'{"loss": 1.0}\n', [], r"bad.jsonl:1: a record without \"step\""),
        (None, [], r"missing.jsonl: no such file"),
        (b'{"step": 0, "stability/grad_norm/total": 1.0}\n', ["-o", "{tmp}/out"], r"no file extension"),
        (b'{"step": 0, "stability/grad_norm/total": 1.0}\n', ["-o", "{tmp}/out.xyz"], r"\.xyz is not an image"),
        (b'{"step": 0, "stability/grad_norm/total": 1.0}\n', ["-o", "{tmp}/bad.jsonl/x.png"], r"part of that path"),
        (b'{"step": 0, "stability/grad_norm/total": 1.0}\n', ["-o", "/proc/x.png"], r"/proc/x.png: cannot write"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path: Path, capsys, content, args, message) -> None:
    log = tmp_path / ("bad.jsonl" if content is not None else "missing.jsonl")
    if content is not None:
        log.write_bytes(content)
    out = ["-o", str(tmp_path / "r.png")] if not args else [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["report", str(log), *out]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("stabilitykit report: error: ")
    assert __import__("re").search(message, captured.err), captured.err


def test_report_draws_rows_until_the_next_plain_log_ticks_and_the_runs_own_warning_line(tmp_path: Path) -> None:
    """log_every_n_steps=5: the heatmap has no white gaps between logged rows; log axes read plain
    numbers; the z-score panel's warning line is the run's configured z_warning (3, not 4)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    log = tmp_path / "every5.jsonl"
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = sk.StabilityConfig(log_every_n_steps=5, spikes=sk.SpikeConfig(z_warning=3.0))
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(log)])
    for i, (x, y) in enumerate(batches(41)):
        guard.backward(model.loss(x, y) * (100.0 if i == 30 else 1.0))
        guard.step()
        guard.zero_grad()
    guard.close()
    fig = report_figure(log)
    FigureCanvasAgg(fig).draw()
    image = next(im for ax in fig.axes for im in ax.get_images()).get_array()
    assert image.shape[1] == 41 and not image.mask.any(), "every step from the first row on is drawn"
    labels = [t.get_text() for ax in fig.axes[:3] for t in ax.get_yticklabels()]
    assert labels and not any("times" in t or "^" in t for t in labels), labels
    z_lines = [line for line in fig.axes[2].get_lines() if line.get_label().startswith("warning")]
    assert [line.get_label() for line in z_lines] == ["warning (z = 3)"]
