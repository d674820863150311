"""Sinks under real faults: rotated/deleted logs, crashed writers, failing disks, W&B started late or finished early."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import wandb

import stabilitykit as sk
from stabilitykit.sinks import JsonlError, JsonlSink, WandbRunFile, WandbSink, iter_jsonl, read_jsonl
from tests.conftest import batches


def _train(guard: sk.StabilityGuard, model: torch.nn.Module, steps: range, nan_at: int = -1) -> None:
    data = batches(max(steps) + 1)
    for i in steps:
        x, y = data[i]
        guard.backward(model.loss(x, y) * (float("nan") if i == nan_at else 1.0))
        guard.step()
        guard.zero_grad()


def _guard(sinks: list[object], every: int = 2) -> tuple[sk.StabilityGuard, torch.nn.Module]:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=every), sinks=sinks), model


# ---------------------------------------------------------------------------------------------- JSONL
def test_jsonl_survives_logrotate_and_deletion(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "run.jsonl"
    guard, model = _guard([JsonlSink(log)])
    _train(guard, model, range(0, 6))
    log.rename(tmp_path / "logs" / "run.jsonl.1")  # logrotate: move, the writer keeps its handle
    _train(guard, model, range(6, 12))
    shutil.rmtree(tmp_path / "logs")  # deleted, folder and all
    _train(guard, model, range(12, 18))
    guard.close()
    assert not (tmp_path / "logs" / "run.jsonl.1").exists()
    rows, _ = read_jsonl(log)
    assert [r["step"] for r in rows] == [12, 14, 16, 17]  # nothing after the deletion was lost (17: close)


def test_jsonl_rotation_keeps_every_row(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    guard, model = _guard([JsonlSink(log)])
    _train(guard, model, range(0, 6))
    log.rename(tmp_path / "run.jsonl.1")
    _train(guard, model, range(6, 12))
    guard.close()
    old, _ = read_jsonl(tmp_path / "run.jsonl.1")
    new, _ = read_jsonl(log)
    assert [r["step"] for r in old] == [0, 2, 4] and [r["step"] for r in new] == [6, 8, 10, 11]


def test_jsonl_sink_cuts_a_partial_line_left_by_a_crash(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 0, "stability/loss": 3.1}\n{"step": 2, "stability/lo')
    with pytest.warns(RuntimeWarning, match=r"partial line \(25 bytes"):
        sink = JsonlSink(log)
        sink.log_metrics({"stability/loss": 2.5}, 4)
    sink.close()
    rows, _ = read_jsonl(log)
    assert [r["step"] for r in rows] == [0, 4]


def test_jsonl_reader_skips_only_a_truncated_last_line(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 0, "stability/loss": "nan"}\n\n{"step": 2, "stabil')
    with pytest.warns(RuntimeWarning, match=r"run.jsonl:3: skipped a truncated last line"):
        rows, events = read_jsonl(log)
    assert len(rows) == 1 and rows[0]["stability/loss"] != rows[0]["stability/loss"] and events == []
    log.write_text('{"step": 0}\n{"step": 2, "stabil\n{"step": 4}\n')
    with pytest.raises(JsonlError, match=r"run.jsonl:2: not a JSON line"):
        read_jsonl(log)
    log.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(JsonlError, match=r"run.jsonl:2: expected a JSON object, got list"):
        read_jsonl(log)
    log.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\n")
    with pytest.raises(JsonlError, match=r"run.jsonl:1: not UTF-8 text"):
        list(iter_jsonl(log))


def test_jsonl_write_failure_warns_once_counts_and_recovers(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    sink = JsonlSink(folder / "run.jsonl")
    sink.log_metrics({"a": 1.0}, 0)
    shutil.rmtree(folder)
    folder.parent.joinpath("logs").write_text("a file where the folder was")  # every reopen now fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 6):
            sink.log_metrics({"a": float(step)}, step)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "cannot write" in messages[0] and "training goes on" in messages[0]
    assert sink.dropped == 5
    folder.unlink()
    with pytest.warns(RuntimeWarning, match=r"writing .* again; dropped 5 record\(s\) so far \(steps 1\.\.5\)"):
        sink.log_metrics({"a": 6.0}, 6)
    sink.close()
    assert [r["step"] for r in read_jsonl(folder / "run.jsonl")[0]] == [6]


def test_jsonl_sink_writes_tensors_and_numpy_values_in_event_details(tmp_path: Path) -> None:
    import numpy as np

    sink = JsonlSink(tmp_path / "run.jsonl")
    sink.log_event(sk.Event("skipped", 3, "x", {"norm": torch.tensor(float("inf")), "n": np.int64(2), "p": tmp_path}))
    sink.close()
    _, events = read_jsonl(tmp_path / "run.jsonl")
    assert events[0]["norm"] == float("inf") and events[0]["n"] == 2 and events[0]["p"] == str(tmp_path)


# ---------------------------------------------------------------------------------------------- W&B
def test_wandb_sink_built_before_init_logs_everything_once_the_run_starts(tmp_path: Path) -> None:
    assert wandb.run is None
    sink = WandbSink()  # the usual order: sink and guard first, wandb.init() later
    with pytest.warns(RuntimeWarning, match="no active W&B run .* holding up to 1000 records") as caught:
        guard, model = _guard([sink], every=2)  # its precision event is the first record held
        _train(guard, model, range(0, 4), nan_at=1)
    assert len([w for w in caught if "WandbSink" in str(w.message)]) == 1
    run = wandb.init(project="stabilitykit-tests", dir=str(tmp_path), mode="offline")  # sets wandb.run
    _train(guard, model, range(4, 10))
    guard.close()
    run_dir = Path(run.dir).parent
    run.finish()
    logged = WandbRunFile.read(run_dir)
    steps = [r["trainer/global_step"] for r in logged.history if "stability/grad_norm/total" in r]
    assert steps == [0, 2, 4, 6, 8, 9]  # the rows from before wandb.init() were held and sent (9: close)
    assert [r["trainer/global_step"] for r in logged.history if "stability/events/nonfinite" in r] == [1]
    assert [a["title"] for a in logged.alerts] == ["stabilitykit: nonfinite at step 1"]
    assert logged.metrics["stability/*"]["step_metric"] == "trainer/global_step"


def test_wandb_sink_without_a_run_says_what_it_dropped(tmp_path: Path) -> None:
    assert wandb.run is None
    sink = WandbSink(buffer_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard, model = _guard([sink], every=1)
        _train(guard, model, range(0, 5))
        guard.close()
    messages = [str(w.message) for w in caught if "WandbSink" in str(w.message)]
    assert len(messages) == 3, messages  # no run; buffer full; the count at close
    assert "no active W&B run" in messages[0] and "dropping the oldest" in messages[1]
    assert sink.dropped >= 5 and f"{sink.dropped} record(s) dropped (steps 0..4)" in messages[2]
    assert guard.step_count == 5


def test_wandb_sink_on_a_finished_run_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    run = wandb.init(project="stabilitykit-tests", dir=str(tmp_path), mode="offline", reinit="create_new")
    guard, model = _guard([WandbSink(run)], every=2)
    _train(guard, model, range(0, 4))
    run_dir = Path(run.dir).parent
    run.finish()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(guard, model, range(4, 10))
        guard.close()
    messages = [str(w.message) for w in caught if "WandbSink" in str(w.message)]
    assert len(messages) == 2 and "UsageError" in messages[0] and "is finished" in messages[0]
    assert "4 record(s) dropped (steps 4..9)" in messages[1]  # 9: the final row from close()
    assert guard.step_count == 10
    steps = [r["trainer/global_step"] for r in WandbRunFile.read(run_dir).history if "stability/loss" in r]
    assert steps == [0, 2]


# ---------------------------------------------------------------------------------------------- W&B run file
def _finished_run_file(tmp_path: Path) -> Path:
    run = wandb.init(project="stabilitykit-tests", dir=str(tmp_path), mode="offline", reinit="create_new")
    for i in range(30):
        run.log({"a": float(i), "pad": "x" * 2000})  # > one 32 KiB block, so records span blocks
    run_dir = Path(run.dir).parent
    run.finish()
    WandbRunFile.read(run_dir)
    return next(run_dir.glob("run-*.wandb"))


def test_run_file_reader_waits_for_the_exit_record(tmp_path: Path) -> None:
    path = _finished_run_file(tmp_path)
    full = WandbRunFile.read(path)
    assert full.complete and [r["a"] for r in full.history] == [float(i) for i in range(30)]
    cut = tmp_path / "cut" / path.name
    cut.parent.mkdir()
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3 + 5])  # a writer caught mid-chunk
    partial = WandbRunFile.read(cut, timeout=0)
    assert not partial.complete and 0 < len(partial.history) < 30
    with pytest.raises(TimeoutError, match=rf"{cut.name}: no exit record after 0.3s"):
        WandbRunFile.read(cut, timeout=0.3)
    cut.write_bytes(data[:7])  # the header alone: what run.finish() often leaves at first
    assert WandbRunFile.read(cut, timeout=0).history == []
    with pytest.raises(FileNotFoundError, match=r"no run-\*\.wandb file under"):
        WandbRunFile.read(tmp_path / "nowhere", timeout=0.1)


def test_close_writes_a_final_row_for_the_steps_after_the_last_logging_step(tmp_path) -> None:
    """25 steps logging every 10: rows at 0, 10, 20 and, from ``close()``, 24 with the run's totals."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path / "run.jsonl"
    guard = sk.StabilityGuard(
        model, optimizer, sk.StabilityConfig(log_every_n_steps=10), sinks=[sk.sinks.JsonlSink(path)]
    )
    for step in range(25):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        guard.backward(loss * float("nan") if step == 22 else loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    rows, events = sk.sinks.read_jsonl(path)
    assert [r["step"] for r in rows] == [0, 10, 20, 24]
    assert rows[-1]["stability/skipped/total"] == 1 and rows[-1]["stability/skipped/recent"] == 1
    assert any(e["event"] == "skipped" and e["step"] == 22 for e in events)
    guard.close()  # a second close writes nothing more
    assert len(sk.sinks.read_jsonl(path)[0]) == 4


# ------------------------------------------------------------------------------- JSONL: one run per file
def _run_twice(log: Path, **sink_kwargs: object) -> list[warnings.WarningMessage]:
    guard, model = _guard([JsonlSink(log)])
    _train(guard, model, range(0, 5))
    guard.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard, model = _guard([JsonlSink(log, **sink_kwargs)])  # type: ignore[arg-type]
        _train(guard, model, range(0, 5))
        guard.close()
    return [w for w in caught if "JsonlSink" in str(w.message)]


def test_jsonl_a_second_run_on_the_same_path_gets_its_own_file(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    caught = _run_twice(log)
    assert len(caught) == 1 and "run.1.jsonl" in str(caught[0].message) and "mode='append'" in str(caught[0].message)
    assert [r["step"] for r in read_jsonl(log)[0]] == [0, 2, 4]  # this run only, not 0, 2, 4, 0, 2, 4
    assert [r["step"] for r in read_jsonl(tmp_path / "run.1.jsonl")[0]] == [0, 2, 4]  # the earlier run, kept
    assert [e["event"] for e in read_jsonl(log)[1]] == ["precision"]  # its start event went with it


def test_jsonl_append_and_overwrite_are_explicit_choices(tmp_path: Path) -> None:
    appended = tmp_path / "a" / "run.jsonl"
    assert _run_twice(appended, mode="append") == []
    assert [r["step"] for r in read_jsonl(appended)[0]] == [0, 2, 4, 0, 2, 4]
    replaced = tmp_path / "o" / "run.jsonl"
    assert _run_twice(replaced, mode="overwrite") == []
    assert [r["step"] for r in read_jsonl(replaced)[0]] == [0, 2, 4]
    assert sorted(p.name for p in replaced.parent.iterdir()) == ["run.jsonl"]
    with pytest.raises(ValueError, match=r"mode='rotate'.*'new', 'append', 'overwrite'"):
        JsonlSink(tmp_path / "x.jsonl", mode="rotate")  # type: ignore[arg-type]


def test_jsonl_a_resumed_run_continues_its_file(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    guard, model = _guard([JsonlSink(log)])
    _train(guard, model, range(0, 6))
    state = guard.state_dict()
    guard.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard, model = _guard([JsonlSink(log)])
        guard.load_state_dict(state)
        _train(guard, model, range(6, 10))
        guard.close()
    assert not [w for w in caught if "JsonlSink" in str(w.message)]
    assert [r["step"] for r in read_jsonl(log)[0]] == [0, 2, 4, 5, 6, 8, 9]
    assert not (tmp_path / "run.1.jsonl").exists()
