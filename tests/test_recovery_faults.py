"""Recovery under storage faults and misuse: it never takes training down, never restores damage, says what
went wrong; optimizers with their own state_dict keys round-trip; the last healthy state outlives giving up."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stabilitykit as sk
from stabilitykit.recovery.files import owner_tag
from tests.recovery_setups import diverged_only_config, mlp, mlp_batches
from tests.time_limits import run

ROOT = Path(__file__).resolve().parents[1]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train(guard: sk.StabilityGuard, model: nn.Module, batches: list[torch.Tensor], nan: bool = False) -> None:
    for x in batches:
        loss = model(x).pow(2).mean()
        guard.backward(loss * float("nan") if nan else loss)
        guard.step()
        guard.zero_grad()


class _ByStep:
    """Parameters at the end of every step (keyed by the steps done), and the rollbacks seen."""

    def __init__(self, guard: sk.StabilityGuard, model: nn.Module) -> None:
        self.model = model
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.rollbacks: list[sk.Event] = []
        guard.hooks.on("rollback", self.rollbacks.append)

    def train(self, guard: sk.StabilityGuard, batches: list[torch.Tensor], nan: bool = False) -> None:
        for x in batches:
            loss = self.model(x).pow(2).mean()
            guard.backward(loss * float("nan") if nan else loss)
            guard.step()
            guard.zero_grad()
            self.params[guard.step_count] = _params(self.model)


# ---------------------------------------------------------------------------------------------- storage faults


def test_a_snapshot_folder_that_becomes_unusable_never_stops_training(tmp_path: Path) -> None:
    """The snapshot folder is replaced by a file mid-run (writes and removes of its files fail for any user,
    root included): each failure is a warning, guard.step() and guard.close() go on."""
    snaps = tmp_path / "snaps"
    model = mlp()
    guard = sk.StabilityGuard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), diverged_only_config(storage=str(snaps))
    )
    _train(guard, model, mlp_batches(9))
    guard.summary()  # the files of steps 4 and 8 are on disk
    assert len(list(snaps.glob("snapshot-*.pt"))) == 2
    shutil.rmtree(snaps)
    snaps.write_text("a file where the snapshot folder was")
    with pytest.warns(RuntimeWarning) as caught:
        _train(guard, model, mlp_batches(12, seed=1))  # writes of 12, 16, 20 fail; 4 and 8 cannot be removed
        guard.summary()
        guard.close()
    messages = " ".join(str(w.message) for w in caught)
    assert "could not write the recovery snapshot" in messages
    assert "could not remove the recovery snapshot" in messages
    assert guard.step_count == 21


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device whose writes fail: disk full)")
def test_a_full_disk_under_the_records_warns_after_a_whole_rollback(tmp_path: Path) -> None:
    """``skipped_batches.json`` cannot be written (ENOSPC): the rollback still happens whole, its event is
    emitted, the records stay in memory and a warning says so."""
    records = tmp_path / "records"
    records.mkdir()
    (records / "skipped_batches.json.tmp").symlink_to("/dev/full")
    model = mlp()
    guard = sk.StabilityGuard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), diverged_only_config(record_dir=str(records))
    )
    seen = _ByStep(guard, model)
    seen.train(guard, mlp_batches(10))
    with pytest.warns(RuntimeWarning, match="could not write the rollback records.*No space left"):
        seen.train(guard, mlp_batches(3, seed=1), nan=True)
    assert [e.details["restored_step"] for e in seen.rollbacks] == [8]
    assert _same(_params(model), seen.params[8])
    recovery = guard.engine.recovery
    assert recovery is not None and len(recovery.log.records) == 1
    assert guard.state_dict()["optimizers"][0]["recovery"]["rollbacks"][0]["restored_step"] == 8
    guard.close()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device whose writes fail: disk full)")
def test_a_full_disk_under_a_snapshot_file_warns_and_drops_it(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / f"snapshot-8.{owner_tag()}.pt.tmp").symlink_to("/dev/full")
    model = mlp()
    guard = sk.StabilityGuard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), diverged_only_config(storage=str(snaps))
    )
    seen = _ByStep(guard, model)
    with pytest.warns(RuntimeWarning, match="snapshot of step 8.*No space left"):
        seen.train(guard, mlp_batches(10))
        guard.summary()
    recovery = guard.engine.recovery
    assert recovery is not None and [s.step for s in recovery.store.confirmed] == [4]
    seen.train(guard, mlp_batches(3, seed=1), nan=True)
    assert [e.details["restored_step"] for e in seen.rollbacks] == [4]
    guard.close()


def _flip_tensor_byte(path: Path) -> None:
    """Flip one bit inside the largest tensor record of a ``torch.save`` zip (its data, not its header)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    header = info.header_offset
    name_len = int.from_bytes(raw[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(raw[header + 28 : header + 30], "little")
    start = header + 30 + name_len + extra_len
    raw[start + info.file_size // 2 + 3] ^= 0x40  # an exponent bit of one float32
    path.write_bytes(bytes(raw))


def _damage(path: Path, how: str) -> None:
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(path.stat().st_size))
    elif how == "bit_flip":
        _flip_tensor_byte(path)


DAMAGES = ["deleted", "truncated", "emptied", "garbage", "bit_flip"]


def _disk_run(tmp_path: Path) -> tuple[sk.StabilityGuard, nn.Module, _ByStep, dict[int, Path]]:
    model = mlp()
    guard = sk.StabilityGuard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), diverged_only_config(storage=str(tmp_path / "snaps"))
    )
    seen = _ByStep(guard, model)
    seen.train(guard, mlp_batches(10))
    guard.summary()  # the writes are done: the host copies are freed, a rollback reads the files
    recovery = guard.engine.recovery
    assert recovery is not None
    files = {s.step: s.path for s in recovery.store.confirmed}
    assert sorted(files) == [4, 8] and all(p is not None and p.exists() for p in files.values())
    return guard, model, seen, files  # type: ignore[return-value]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_snapshot_file_falls_back_to_the_next_older_one(tmp_path: Path, how: str) -> None:
    guard, model, seen, files = _disk_run(tmp_path)
    _damage(files[8], how)
    with pytest.warns(RuntimeWarning, match=f"recovery snapshot {files[8]}.*falls back to an older snapshot"):
        seen.train(guard, mlp_batches(3, seed=1), nan=True)
    assert [e.details["restored_step"] for e in seen.rollbacks] == [4]
    assert _same(_params(model), seen.params[4])  # bitwise the healthy state, never the damaged one
    guard.close()


@pytest.mark.parametrize("how", ["deleted", "bit_flip"])
def test_no_readable_snapshot_raises_naming_the_files_and_restores_nothing(tmp_path: Path, how: str) -> None:
    guard, model, seen, files = _disk_run(tmp_path)
    for path in files.values():
        _damage(path, how)
    with pytest.warns(RuntimeWarning), pytest.raises(sk.SnapshotUnavailableError) as info:
        seen.train(guard, mlp_batches(3, seed=1), nan=True)
    assert isinstance(info.value, sk.TrainingDivergedError)
    assert str(files[8]) in str(info.value) and str(files[4]) in str(info.value)
    assert seen.rollbacks == []
    assert _same(_params(model), seen.params[10])  # the skipped steps changed nothing; nothing was restored
    guard.close()


# ---------------------------------------------------------------------------------------------- misuse


def test_a_step_after_close_is_refused_and_applies_nothing() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config())
    _train(guard, model, mlp_batches(3))
    guard.close()
    before = _params(model)
    with pytest.raises(RuntimeError, match=r"guard.backward\(\) after guard.close\(\)"):
        guard.backward(model(mlp_batches(1)[0]).pow(2).mean() * float("nan"))
    (model(mlp_batches(1)[0]).pow(2).mean() * float("nan")).backward()
    with pytest.raises(RuntimeError, match=r"guard.step\(\) after guard.close\(\)"):
        guard.step()
    assert _same(_params(model), before)


def test_an_optimizer_stepped_behind_the_guards_back_is_named() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config())
    _train(guard, model, mlp_batches(2))
    with pytest.warns(RuntimeWarning, match=r"AdamW.step\(\) was called directly, behind the guard's back") as caught:
        for x in mlp_batches(15, seed=1):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert len([w for w in caught if "called directly" in str(w.message)]) == 1  # named once, counted always
    assert guard.engine.unguarded_steps == 15 and guard.step_count == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(guard, model, mlp_batches(2))  # the guarded steps say nothing
    guard.close()


def test_a_scheduler_not_given_to_recovery_is_named() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    guard = sk.StabilityGuard(model, opt, diverged_only_config())
    with pytest.warns(UserWarning, match=r"an LR scheduler drives AdamW.*scheduler=scheduler"):
        for x in mlp_batches(5):
            guard.backward(model(x).pow(2).mean())
            guard.step()
            guard.zero_grad()
            sched.step()
    guard.close()
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(), scheduler=sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(guard, model, mlp_batches(5))  # given: nothing to say
    guard.close()


# ---------------------------------------------------------------------------------------------- optimizer state


class WarmupMomentum(torch.optim.Optimizer):
    """SGD with momentum and a learning-rate warm-up counted outside the per-parameter state, the way SPAM and
    StableSPAM keep ``warmup`` / ``total_step`` as attributes saved as extra top-level ``state_dict()`` keys;
    a step count in ``state`` not keyed by a parameter (as MADGRAD's ``k``) and a Python int per parameter."""

    def __init__(self, params: Any, lr: float = 0.05, warmup: int = 50) -> None:
        super().__init__(params, {"lr": lr})
        self.warmup = warmup
        self.total_step = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.total_step += 1
        if "k" not in self.state:
            self.state["k"] = torch.zeros((), dtype=torch.long)
        self.state["k"] += 1
        scale = min(1.0, self.total_step / self.warmup) * (1.0 + 0.01 * float(self.state["k"]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    state["updates"] = 0
                state["momentum"].mul_(0.9).add_(p.grad)
                state["updates"] += 1
                p.add_(state["momentum"], alpha=-group["lr"] * scale)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["warmup"] = self.warmup
        state["total_step"] = self.total_step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.warmup = state_dict.pop("warmup")
        self.total_step = state_dict.pop("total_step")
        super().load_state_dict(state_dict)


def _equal_trees(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_trees(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_an_optimizers_own_state_dict_keys_and_python_state_round_trip_in_place() -> None:
    model = mlp()
    opt = WarmupMomentum(model.parameters())
    guard = sk.StabilityGuard(model, opt, diverged_only_config())
    saved: dict[int, dict[str, Any]] = {}
    checked: list[int] = []
    momentum = {}

    def on_rollback(event: sk.Event) -> None:
        restored = event.details["restored_step"]
        assert _equal_trees(opt.state_dict(), saved[restored]), "the optimizer's state_dict differs from the snapshot's"
        assert all(opt.state[p]["momentum"] is momentum[p] for p in momentum), "a state tensor was replaced"
        checked.append(restored)

    guard.hooks.on("rollback", on_rollback)
    for i, x in enumerate(mlp_batches(20)):
        loss = model(x).pow(2).mean()
        guard.backward(loss * float("nan") if 10 <= i < 13 else loss)
        guard.step()
        guard.zero_grad()
        saved[guard.step_count] = copy.deepcopy(opt.state_dict())
        if not momentum:
            momentum = {p: opt.state[p]["momentum"] for p in model.parameters()}
    assert checked == [8]
    assert opt.total_step == 8 + 7 and int(opt.state["k"]) == 15  # went on from the snapshot's counts
    guard.close()


# ---------------------------------------------------------------------------------------------- giving up


def _give_up(guard: sk.StabilityGuard, model: nn.Module) -> sk.RollbackLimitError:
    with pytest.raises(sk.RollbackLimitError) as info:
        for i, x in enumerate(mlp_batches(60)):
            loss = model(x).pow(2).mean()
            guard.backward(loss * float("nan") if i >= 10 else loss)  # the run never recovers
            guard.step()
            guard.zero_grad()
    return info.value


@pytest.mark.parametrize("storage", ["disk", "memory"])
def test_the_last_good_state_outlives_the_rollback_limit(tmp_path: Path, storage: str) -> None:
    model = mlp()
    place = {"storage": str(tmp_path / "snaps")} if storage == "disk" else {"record_dir": str(tmp_path / "records")}
    cfg = diverged_only_config(max_rollbacks=2, window=100, **place)
    cfg = cfg.model_copy(update={"clip": sk.ClipConfig(mode="fixed", max_norm=1.0)})
    guard = sk.StabilityGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    states: dict[int, dict[str, torch.Tensor]] = {}
    guard.hooks.on("rollback", lambda e: states.setdefault(e.details["restored_step"], _params(model)))
    error = _give_up(guard, model)
    assert error.last_good_step == 8 and "enable clipping" not in str(error)  # clipping is on
    assert error.last_good_path is not None and error.last_good_path in str(error)
    guard.close()
    kept = Path(error.last_good_path)
    assert kept.exists() and kept.name == "last-good-8.pt"  # close() left it on disk
    assert Path(str(kept) + ".sha256").exists()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # whatever happened to the model since
    assert guard.restore_last_good() == 8  # from the file, after close()
    assert _same(_params(model), states[8])
    assert not list((tmp_path / "snaps").glob("snapshot-*.pt"))


def test_the_rollback_limit_says_enable_clipping_only_when_it_is_off() -> None:
    model = mlp()
    guard = sk.StabilityGuard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), diverged_only_config(max_rollbacks=1)
    )
    error = _give_up(guard, model)
    assert "enable clipping" in str(error) and error.last_good_path is None  # memory storage, no record_dir
    assert guard.restore_last_good() == 8  # still in memory before close()
    guard.close()


# ---------------------------------------------------------------------------------------------- orphans


def test_snapshot_files_of_a_killed_process_are_removed_at_start(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from torch import nn
        import stabilitykit as sk
        model = nn.Linear(4, 1)
        cfg = sk.StabilityConfig(recovery=sk.RecoveryConfig(enabled=True, snapshot_every=2, storage={str(snaps)!r}))
        guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
        for _ in range(5):
            guard.backward(model(torch.randn(2, 4)).sum())
            guard.step()
            guard.zero_grad()
        guard.summary()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = run([sys.executable, "-c", script], "killed_after_snapshots", env=env, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    left = sorted(p.name for p in snaps.glob("snapshot-*.pt"))
    assert len(left) == 2, left  # keep=2: the killed process never removed them
    alive = snaps / f"snapshot-4.{owner_tag().rsplit('-', 1)[0]}-{os.getppid()}.pt"  # a process still running
    alive.write_bytes(b"another run's snapshot")
    other_host = snaps / "snapshot-4.elsewhere-1.pt"
    other_host.write_bytes(b"a run on another machine")
    model = mlp()
    guard = sk.StabilityGuard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), diverged_only_config(storage=str(snaps))
    )
    assert sorted(p.name for p in snaps.glob("snapshot-*.pt")) == sorted([alive.name, other_host.name])
    guard.close()


# ---------------------------------------------------------------------------------------------- config


def test_a_recovery_config_given_is_on_and_enabled_false_keeps_it_off() -> None:
    given = sk.StabilityConfig(skip=sk.SkipConfig(max_consecutive=3), recovery=sk.RecoveryConfig(snapshot_every=4))
    assert given.recovery.enabled
    assert not sk.StabilityConfig(recovery=sk.RecoveryConfig(snapshot_every=4, enabled=False)).recovery.enabled
    assert not sk.StabilityConfig().recovery.enabled
    assert sk.StabilityConfig.from_mapping({"recovery": {"snapshot_every": 4}}).recovery.enabled
    assert not sk.StabilityConfig.from_mapping(sk.StabilityConfig().model_dump()).recovery.enabled  # round trip
    model = mlp()
    guard = sk.StabilityGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), given)
    seen = _ByStep(guard, model)
    seen.train(guard, mlp_batches(10))
    seen.train(guard, mlp_batches(3, seed=1), nan=True)  # a wrecked run: rolled back, not raised
    assert [e.details["restored_step"] for e in seen.rollbacks] == [8]
    guard.close()
