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


# ------------------------------------------------------------------------ the first hour's rough edges
def _legend(ax) -> dict[str, object]:
    legend = ax.get_legend()
    return {text.get_text(): handle for text, handle in zip(legend.get_texts(), legend.legend_handles, strict=True)}


def test_report_shades_what_a_rollback_undid_and_skipped_ahead(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recovery = sk.RecoveryConfig(enabled=True, snapshot_every=4, keep=2, trigger=["diverged"], skip_after=3)
    cfg = sk.StabilityConfig(log_every_n_steps=5, skip=sk.SkipConfig(max_consecutive=3), recovery=recovery)
    log = tmp_path / "run.jsonl"
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(log)])
    gen = torch.Generator().manual_seed(0)
    for i in range(30):
        loss = model(torch.randn(16, 8, generator=gen)).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    (rollback,) = [e for e in sk.sinks.read_jsonl(log)[1] if e["event"] == "rollback"]
    fig = report_figure(log)
    top = fig.axes[0]
    handles = _legend(top)
    assert "undone by a rollback" in handles and "batches skipped after a rollback" in handles
    spans = {p.get_label(): p.get_x() for p in top.patches if p.get_label().startswith(("undone", "batches"))}
    assert spans["undone by a rollback"] == pytest.approx(rollback["skipped_from"] - 0.5)
    assert spans["batches skipped after a rollback"] == pytest.approx(rollback["skipped_to"] + 0.5)
    assert main(["report", str(log), "-o", str(tmp_path / "r.png")]) == 0


def test_report_spike_alerts_and_loss_spikes_have_their_own_markers(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    sink = sk.sinks.JsonlSink(log)
    for step in range(0, 40, 2):
        sink.log_metrics({"stability/loss": 2.0, "stability/grad_norm/total": 1.0 + step / 30}, step)
    sink.log_event(sk.Event("loss_spike", 20, "loss z-score 9", {"z": 9.0}))
    sink.log_event(sk.Event("spike_alert", 20, "alert", {"z": 9.0}))
    sink.close()
    fig = report_figure(log)
    handles = _legend(fig.axes[0])
    assert {"loss spike (1)", "spike alert (1)"} <= set(handles)
    loss_marker = handles["loss spike (1)"].get_paths()[0]
    alert_marker = handles["spike alert (1)"].get_paths()[0]
    assert len(loss_marker.vertices) != len(alert_marker.vertices)  # different shapes


def test_report_labels_a_narrow_log_axis_with_plain_numbers(tmp_path: Path) -> None:
    # a grad norm between 1 and 2.2 on a log axis: plain labels, more than the one decade "1"
    log = tmp_path / "run.jsonl"
    sink = sk.sinks.JsonlSink(log)
    for step in range(0, 40, 2):
        sink.log_metrics({"stability/loss": 2.0, "stability/grad_norm/total": 1.0 + step / 30}, step)
    sink.close()
    fig = report_figure(log)
    fig.canvas.draw()
    grad_axis = fig.axes[1]
    labels = [t.get_text() for t in grad_axis.get_yticklabels() if t.get_text()]
    low, high = grad_axis.get_ylim()
    visible = [lab for lab, t in zip(labels, grad_axis.get_yticks(), strict=False) if low <= t <= high]
    assert len(visible) >= 3 and all("10^" not in lab and "times" not in lab for lab in labels), labels


def _lightning_fit(root: Path, max_steps: int, ckpt: str | None) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        log_every_n_steps=2,
        logger=CSVLogger(root, name="csv"),
        callbacks=[StabilityCallback(sk.StabilityConfig())],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(poison={3: float("nan")}), gpt_dataloader(8, repeat=True), ckpt_path=ckpt)
    if ckpt is None:
        trainer.save_checkpoint(root / "mid.ckpt")


def test_report_of_a_resumed_lightning_folder_draws_every_version_without_a_phantom_skip(
    tmp_path: Path, capsys
) -> None:
    _lightning_fit(tmp_path, 8, None)
    _lightning_fit(tmp_path, 16, str(tmp_path / "mid.ckpt"))
    versions = sorted(p.parent.name for p in tmp_path.rglob("metrics.csv"))
    assert versions == ["version_0", "version_1"]
    run = load_run_log(tmp_path)
    assert [p.parent.name for p in run.sources] == ["version_0", "version_1"]
    assert run.first_step is not None and run.first_step < 8 and run.last_step is not None and run.last_step > 8
    assert [e["step"] for e in run.events if e["kind"] == "skipped"] == [3]  # none where version_1 starts
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "drawing version_0, version_1 as one run (resumed 1 time(s))" in out


def test_report_reads_a_hf_trainers_trainer_state_and_output_folder(tmp_path: Path, capsys) -> None:
    from hf_models import tiny_llama, token_batches
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabilitykit.integrations import stabilize

    model = tiny_llama()

    class Poison(TrainerCallback):
        def __init__(self) -> None:
            self.active = False
            model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan") if self.active else None)

        def on_step_begin(self, args, state, control, **kwargs):
            self.active = state.global_step == 3

    data = [{k: v[0] for k, v in b.items()} for b in token_batches(32, batch_size=1, seed=3)]
    out = tmp_path / "out"
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, report_to=[], per_device_train_batch_size=4, max_steps=8,
        logging_steps=2, save_strategy="steps", save_steps=4, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Poison()])
    stabilize(trainer, sk.StabilityConfig())
    trainer.train()
    state = out / "checkpoint-8" / "trainer_state.json"
    run = load_run_log(state)
    assert run.n_rows >= 4 and "grad_norm/total" in run.lines
    assert [e["step"] for e in run.events if e["kind"] == "skipped"] == [4]  # 0-based step 3: global step 4
    assert main(["report", str(state), "-o", str(tmp_path / "a.png")]) == 0
    assert main(["report", str(out), "-o", str(tmp_path / "b.png")]) == 0
    assert "checkpoint-8" in capsys.readouterr().out


def test_report_of_a_folder_with_a_jsonl_and_metrics_csv_draws_the_jsonl_and_says_so(tmp_path: Path) -> None:
    """Lightning's metrics.csv beside the guard's JSONL: the JSONL (every event, each skip's step) is drawn,
    and the note says so; the z panel draws the loss z too (an alert may come from it)."""
    _jsonl_run(tmp_path / "run.jsonl")
    csv = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    csv.parent.mkdir(parents=True)
    csv.write_text("step,stability/grad_norm/total,stability/skipped/total\n1,0.5,0\n3,0.6,0\n")
    log = load_run_log(tmp_path)
    assert log.sources == [tmp_path / "run.jsonl"]
    assert any("drawing" in n and "run.jsonl" in n and "metrics.csv" in n for n in log.notes), log.notes
    assert {e["kind"]: e["step"] for e in log.events}["skipped"] == 11
    fig = report_figure(tmp_path)
    labels = [line.get_label() for line in fig.axes[2].get_lines()]
    assert "loss z (logging step)" in labels and "grad-norm z (logging step)" in labels


def test_a_blow_up_between_logging_steps_is_logged_and_drawn(tmp_path: Path) -> None:
    """A loss x40 and an inf grad norm at step 12, between logging steps (every 5): the next row logs the
    interval's largest finite loss (loss/max, skipped steps included), and the loss panel draws it."""
    log = tmp_path / "run.jsonl"
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = sk.StabilityGuard(model, opt, {"log_every_n_steps": 5}, sinks=[sk.sinks.JsonlSink(log)])
    for i, (x, y) in enumerate(batches(20)):
        loss = model.loss(x, y)
        if i == 12:
            loss = loss * 40.0
            loss.register_hook(lambda g: g * float("inf"))  # finite loss, inf grads: skipped
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    rows, _ = sk.sinks.read_jsonl(log)
    row = next(r for r in rows if r["step"] == 15)  # the logging step after it (steps 0, 5, 10, 15)
    assert row["stability/loss/max"] > 10 * row["stability/loss"]
    assert all(r["stability/loss/max"] >= r["stability/loss"] for r in rows)
    fig = report_figure(log)
    drawn = next(line for line in fig.axes[0].get_lines() if line.get_label() == "max since last log")
    assert max(drawn.get_ydata()) == row["stability/loss/max"]


def test_report_marks_at_one_step_do_not_hide_each_other(tmp_path: Path) -> None:
    """A skip, a spike alert, a loss spike and a rollback at one step: four marks at four heights."""
    log = tmp_path / "run.jsonl"
    sink = sk.sinks.JsonlSink(log)
    for step in range(0, 40, 2):
        sink.log_metrics({"stability/loss": 2.0, "stability/grad_norm/total": 1.0}, step)
    for kind in ("skipped", "loss_spike", "spike_alert", "rollback"):
        sink.log_event(sk.Event(kind, 20, kind, {}))
    sink.close()
    fig = report_figure(log)
    marks = [c for c in fig.axes[0].collections if c.get_label().endswith("(1)")]
    assert len(marks) == 4
    heights = {c.get_label(): float(c.get_offsets()[0][1]) for c in marks}
    assert len(set(heights.values())) == 4, heights
    assert {float(c.get_offsets()[0][0]) for c in marks} == {20.0}
