"""The real-client matrix: tiny random-init Hugging Face models in a real Lightning Trainer with
checkpointing and step-interval schedulers, a real GradScaler, the PyTorch AMP recipe, the HF
Trainer's optimizer, torch.compile. Each test here failed before the driver core existed."""

from __future__ import annotations

import copy
import csv
import math
import socket
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from hf_models import VOCAB, tiny_gpt2, tiny_llama, token_batches
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning_checks import StateAt
from lightning_hf import SCHEDULERS, HFModule, hf_dataloader

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback

NAN = float("nan")


def _trainer(root: Path, callbacks: list, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


class NormProbe(pl.Callback):
    """After StabilityCallback in the list: the true global norm of the grads the optimizer will use."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            norm /= float(scaler.get_scale())  # fused optimizers keep their grads scaled until their step
        self.norms[trainer.global_step] = norm


class Reports(pl.Callback):
    """Every report of the first guarded optimizer, read to the host."""

    def __init__(self, callback: StabilityCallback) -> None:
        self.callback = callback
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        report = self.callback.last_report
        if report is not None and (not self.rows or self.rows[-1]["step"] != report.step):
            self.rows.append(report.to_dict())


# --------------------------------------------------------------------------- 1. checkpoints and scheduler hold


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_step_scheduler_checkpoints_save_and_load_weights_only(tmp_path: Path, scheduler: str) -> None:
    callback = StabilityCallback(sk.StabilityConfig(log_every_n_steps=2))
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_last=True, save_top_k=-1)
    module = HFModule(scheduler=scheduler, poison={4: NAN})
    trainer = _trainer(tmp_path, [callback, checkpoints], enable_checkpointing=True)
    trainer.fit(module, hf_dataloader())  # saving at steps 3 and 6 used to raise PicklingError

    sched = trainer.lr_scheduler_configs[0].scheduler
    optimizer = trainer.optimizers[0]
    assert sched.last_epoch == 7, "8 optimizer steps, 1 skipped: the scheduler advanced 7 times"
    assert "step" not in vars(sched) and type(sched).__name__ in {"LambdaLR", "OneCycleLR"}
    assert type(sched) in (torch.optim.lr_scheduler.LambdaLR, torch.optim.lr_scheduler.OneCycleLR)
    own_step = vars(optimizer).get("step")
    assert own_step is None or getattr(own_step, "_wrapped_by_lr_sched", False), "optimizer still routed"
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    saved = [*sorted((tmp_path / "ckpt").glob("*.ckpt")), tmp_path / "after_fit.ckpt"]
    assert len(saved) >= 3
    for path in saved:
        state = torch.load(path, weights_only=True)  # a bound method in the state used to fail here
        assert "step" not in state["lr_schedulers"][0]
    assert callback.engine is not None and callback.engine.skipped_total == 1
    lr = optimizer.param_groups[0]["lr"]
    sched.step()
    assert optimizer.param_groups[0]["lr"] != lr, "the learning rate must keep moving after fit"


def test_an_exception_leaves_optimizer_and_scheduler_unwrapped(tmp_path: Path) -> None:
    module = HFModule(scheduler="cosine", fail_at=3)
    trainer = _trainer(tmp_path, [StabilityCallback()])
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.fit(module, hf_dataloader())
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert type(sched) is torch.optim.lr_scheduler.LambdaLR
    own_step = vars(trainer.optimizers[0]).get("step")
    assert own_step is None or getattr(own_step, "_wrapped_by_lr_sched", False)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path: Path, fused: bool) -> None:
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="adaptive", warmup_steps=3), log_every_n_steps=3)
    poison = {2: NAN, 9: NAN}

    def fit(max_steps: int, ckpt: str | None, root: Path) -> tuple[StabilityCallback, pl.Trainer, HFModule]:
        callback = StabilityCallback(cfg)
        checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_epochs=1, save_top_k=-1)
        module = HFModule(scheduler="cosine", fused=fused, poison=poison, total_steps=16)
        trainer = _trainer(root, [callback, checkpoints], max_steps=max_steps, enable_checkpointing=True)
        trainer.fit(module, hf_dataloader(4, repeat=True), ckpt_path=ckpt)
        return callback, trainer, module

    straight, straight_trainer, straight_module = fit(12, None, tmp_path / "a")
    fit(8, None, tmp_path / "b")
    ckpt = next((tmp_path / "b" / "ckpt").glob("*step=8.ckpt"))
    resumed, resumed_trainer, resumed_module = fit(12, str(ckpt), tmp_path / "c")

    for (name, a), b in zip(straight_module.named_parameters(), resumed_module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"parameter {name}")
    lr_a = straight_trainer.optimizers[0].param_groups[0]["lr"]
    assert lr_a == resumed_trainer.optimizers[0].param_groups[0]["lr"]
    a, b = straight.state_dict(), resumed.state_dict()
    assert a["optimizers"][0]["engine"]["ledger"] == b["optimizers"][0]["engine"]["ledger"]
    assert a["optimizers"][0]["engine"]["ledger"]["counters"]["skipped_total"] == 2


# --------------------------------------------------------------------------- precision x optimizer x accumulation


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_precision_optimizer_accumulation_matrix(tmp_path: Path, precision: str, fused: bool, accumulate: int) -> None:
    callback = StabilityCallback(sk.StabilityConfig(log_every_n_steps=2))
    state_at, probe = StateAt(3), NormProbe()
    reports = Reports(callback)
    kwargs: dict[str, Any] = {"precision": precision}
    if precision == "16-mixed":  # the real GradScaler path (on the CPU Lightning would fall back to bf16)
        kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    module = HFModule(scheduler="lambda", fused=fused, poison={3: NAN})
    trainer = _trainer(
        tmp_path, [callback, probe, state_at, reports], max_steps=6, accumulate_grad_batches=accumulate, **kwargs
    )
    trainer.fit(module, hf_dataloader(12))
    state_at.assert_unchanged()
    rows = {row["step"]: row for row in reports.rows}
    assert rows[3]["skipped"] and rows[3]["reason"] in {"nonfinite_loss", "fp16_overflow"}
    for step in (0, 1, 2, 4, 5):
        assert not rows[step]["skipped"]
        assert rows[step]["grad_norm"] == pytest.approx(probe.norms[step], rel=1e-4), f"step {step}"
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch in (5, 6)  # fused: the hold may come a step late


# --------------------------------------------------------------------------- 2 and 3. GradScaler


def _llama_and_scaler(fused: bool, lr: float = 1e-2) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused, foreach=not fused)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_data_guard_skip_reaches_a_fused_optimizer_under_a_grad_scaler(fused: bool) -> None:
    model, opt, scaler = _llama_and_scaler(fused)
    cfg = sk.StabilityConfig(data=sk.DataGuardConfig(mode="skip", num_classes=VOCAB), log_every_n_steps=100)
    guard = sk.StabilityGuard(model, opt, cfg, scaler=scaler)
    for i, batch in enumerate(token_batches(4)):
        batch["weights"] = torch.ones(4)
        if i == 2:
            batch["weights"][1] = NAN  # a NaN in a field the model never reads: loss and grads stay finite
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt_before = copy.deepcopy(opt.state_dict()["state"])
        guard.check_batch(batch)
        guard.backward(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
        report = guard.step()
        guard.zero_grad()
        if i == 2:
            assert bool(report.skipped) and report.reason == "bad_batch"
            for name, p in model.named_parameters():
                assert torch.equal(p, before[name]), f"{name} changed on a skipped step"
            for key, state in opt_before.items():
                for field, value in state.items():
                    assert torch.equal(value, opt.state_dict()["state"][key][field])
    assert guard.summary()["skipped"] == 1


def test_lightning_16_mixed_fused_data_guard_skip_is_applied(tmp_path: Path) -> None:
    class WithBadField(HFModule):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)

    data = token_batches(6)
    for i, batch in enumerate(data):
        batch["weights"] = torch.ones(4)
        if i == 2:
            batch["weights"][0] = NAN
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    cfg = sk.StabilityConfig(data=sk.DataGuardConfig(mode="skip"), log_every_n_steps=2)
    callback, state_at = StabilityCallback(cfg), StateAt(2)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = _trainer(tmp_path, [callback, state_at], max_steps=5, plugins=[plugin])
    trainer.fit(WithBadField(scheduler=None, fused=True), loader)
    state_at.assert_unchanged()
    assert callback.engine is not None and callback.engine.counters.last_bad_reason == "bad_batch"


def test_amp_recipe_with_user_unscale_reports_the_true_norm_and_clips() -> None:
    batches = token_batches(3)
    model, opt, scaler = _llama_and_scaler(fused=True)
    reference, ref_opt, ref_scaler = _llama_and_scaler(fused=True)
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=0.5), log_every_n_steps=100)
    guard = sk.StabilityGuard(model, opt, cfg, scaler=scaler)
    for batch in batches:
        # the PyTorch AMP recipe, step by step, with the guard where clip_grad_norm_ would be
        scaler.scale(model(**batch).loss).backward()
        scaler.unscale_(opt)
        true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        report = guard.step()
        guard.zero_grad()
        assert float(report.grad_norm) == pytest.approx(true_norm, rel=1e-5)
        assert float(report.clip_coef) < 1.0
        ref_scaler.scale(reference(**batch).loss).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- 4. layer names


def test_lightning_module_holding_an_hf_model_names_layers_by_their_path(tmp_path: Path) -> None:
    callback = StabilityCallback(sk.StabilityConfig(log_every_n_steps=1))
    seen: list[sk.Event] = []
    callback.hooks.on("nonfinite", seen.append)
    trainer = _trainer(tmp_path, [callback], max_steps=3)
    trainer.fit(HFModule(scheduler=None, poison={1: NAN}), hf_dataloader())
    assert callback.engine is not None
    names = callback.engine.layer_names
    assert names == [
        "model.model.embed_tokens",
        "model.model.layers.0",
        "model.model.layers.1",
        "model.model.norm",
        "model.lm_head",
    ]
    assert seen and seen[0].details["layer"] == "model.lm_head"


def test_hf_trainer_param_groups_keep_backward_order(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, weight_decay=0.1)
    optimizer = Trainer(model=model, args=args).create_optimizer()  # decay / no-decay groups: norms come last
    assert len(optimizer.param_groups) == 2
    seen: list[sk.Event] = []
    guard = sk.StabilityGuard(model, optimizer, sk.StabilityConfig(log_every_n_steps=1))
    guard.hooks.on("nonfinite", seen.append)
    assert guard.engine.layer_names[-1] == "lm_head"
    guard.backward(model(**token_batches(1)[0]).loss * NAN)
    guard.step()
    assert seen[0].details["layer"] == "lm_head"


@pytest.fixture
def one_process_group() -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_same_layer_names_under_every_wrapper(one_process_group: Any) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def names(model: torch.nn.Module) -> list[str]:
        opt = torch.optim.AdamW(model.parameters())
        return sk.StabilityGuard(model, opt, sk.StabilityConfig(precision={"report_choice": False})).engine.layer_names

    bare = names(tiny_llama())
    assert bare == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert names(torch.nn.parallel.DistributedDataParallel(tiny_llama())) == bare
    policy = ModuleWrapPolicy({LlamaDecoderLayer})
    cpu = torch.device("cpu")
    for orig in (True, False):
        fsdp1 = FullyShardedDataParallel(tiny_llama(), auto_wrap_policy=policy, use_orig_params=orig, device_id=cpu)
        got = names(fsdp1)
        assert got == (bare if orig else ["root", "model.layers.0", "model.layers.1"]), got
    fsdp2 = tiny_llama()
    for layer in fsdp2.model.layers:
        fully_shard(layer)
    fully_shard(fsdp2)
    assert names(fsdp2) == bare
    assert names(torch.compile(tiny_llama())) == bare
    wrapped = tiny_llama()
    for i, layer in enumerate(wrapped.model.layers):
        wrapped.model.layers[i] = checkpoint_wrapper(layer)
    assert names(wrapped) == bare
    with pytest.warns(RuntimeWarning, match="no parameter has a gradient"):  # no backward ran: norms are 0
        ddp_norms = sk.grad_norms(torch.nn.parallel.DistributedDataParallel(tiny_gpt2()))
    assert list(ddp_norms) == [*names(tiny_gpt2()), "total"]


# --------------------------------------------------------------------------- 5. drivers agree


def test_guard_data_guard_bad_first_micro_batch_skips_the_step() -> None:
    model, opt, _ = _llama_and_scaler(fused=True)
    cfg = sk.StabilityConfig(data=sk.DataGuardConfig(mode="skip"), log_every_n_steps=100)
    guard = sk.StabilityGuard(model, opt, cfg)
    first, second = token_batches(2)
    first["weights"] = torch.tensor([NAN])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for micro in (first, second):
        guard.check_batch(micro)
        guard.backward(model(input_ids=micro["input_ids"], labels=micro["labels"]).loss / 2)
    report = guard.step()
    assert bool(report.skipped) and report.reason == "bad_batch"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("mode", ["always", "every_n"])
def test_lightning_nan_tracing_modes_trace(tmp_path: Path, mode: str) -> None:
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode=mode, every_n_steps=2), log_every_n_steps=1)
    callback = StabilityCallback(cfg)
    trainer = _trainer(tmp_path, [callback], max_steps=6)

    class Poisoned(HFModule):
        def training_step(self, batch, batch_idx):
            if self.global_step != 4:
                return super().training_step(batch, batch_idx)
            handle = self.model.model.norm.register_forward_pre_hook(lambda mod, args: (args[0] * NAN,))
            try:  # the final norm's output goes NaN in forward at step 4
                return super().training_step(batch, batch_idx)
            finally:
                handle.remove()

    trainer.fit(Poisoned(scheduler=None), hf_dataloader())
    record = callback.last_nonfinite
    assert record is not None and record.step == 4
    assert (record.module, record.phase) == ("model.model.norm", "forward")


def test_guard_and_callback_give_equal_reports_and_events(tmp_path: Path) -> None:
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="adaptive", warmup_steps=2), log_every_n_steps=2)
    data = token_batches(16)
    poison = {3: NAN}

    callback = StabilityCallback(cfg)
    lightning_events: list[tuple[str, int]] = []
    callback.hooks.on("*", lambda e: lightning_events.append((e.kind, e.step)))
    reports = Reports(callback)
    loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
    module = HFModule(scheduler="lambda", poison=poison)
    _trainer(tmp_path, [callback, reports], max_steps=8, accumulate_grad_batches=2).fit(module, loader)

    model = HFModule(scheduler="lambda").model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched)
    guard_events: list[tuple[str, int]] = []
    guard.hooks.on("*", lambda e: guard_events.append((e.kind, e.step)))
    guard_rows = []
    for step in range(8):
        for micro in data[2 * step : 2 * step + 2]:
            guard.backward(model(**micro).loss * poison.get(step, 1.0) / 2)
        guard_rows.append(guard.step().to_dict())
        guard.zero_grad()

    assert [r["skipped"] for r in guard_rows] == [r["skipped"] for r in reports.rows]
    for g, lit in zip(guard_rows, reports.rows, strict=True):
        assert g["step"] == lit["step"] and g["reason"] == lit["reason"]
        if not g["skipped"]:
            assert g["grad_norm"] == pytest.approx(lit["grad_norm"], rel=1e-5)
            assert g["clip_coef"] == pytest.approx(lit["clip_coef"], rel=1e-5)
            assert g["loss"] == pytest.approx(lit["loss"], rel=1e-5)
    # "clipped" events come at logging steps: the callback logs on Lightning's rows (1, 3, 5, 7), the guard at 0, 2, ...
    lightning_only = [e for e in lightning_events if e[0] not in ("precision", "clipped")]
    guard_only = [e for e in guard_events if e[0] not in ("precision", "clipped")]
    assert guard_only == lightning_only
    assert callback.engine is not None and callback.engine.counters.clipped_total == guard.engine.counters.clipped_total
    assert ("skipped", 3) in guard_events


# --------------------------------------------------------------------------- 6. torch.compile


def test_nan_tracing_under_torch_compile_names_modules_without_recompiling() -> None:
    from torch._dynamo.utils import counters

    model = sk.testing.tiny_gpt()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode="every_n", every_n_steps=2), log_every_n_steps=1)
    data = sk.testing.char_batches()
    graphs: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = sk.StabilityGuard(compiled, opt, cfg)
        for step in range(8):
            x, y = next(data)
            logits = compiled(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            guard.backward(loss * (NAN if step == 6 else 1.0))
            guard.step()
            guard.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
    messages = [str(w.message) for w in caught]
    assert sum("one graph break per hooked module" in m for m in messages) == 1, "said once"
    assert not any("recompile_limit" in m for m in messages)
    assert graphs[-1] == graphs[1], f"no new graphs after the first traced and untraced steps: {graphs}"
    assert guard.last_nonfinite is not None and guard.last_nonfinite.module == "lm_head"
    assert "_orig_mod" not in " ".join(guard.engine.layer_names)


def test_on_nonfinite_tracing_of_a_compiled_hf_model_replays_eagerly_without_breaks_or_recompiles() -> None:
    """A compiled HF Llama with ``nan_trace="on_nonfinite"``: after an inf in ``lm_head`` the guard
    does not hook the compiled model (that added graph breaks and recompiles); it replays the batch
    eagerly (``force_eager``) and names the module. No graph break, no new frame or graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    compiled = torch.compile(model, backend="eager")  # Dynamo's breaks and recompiles, without inductor's time
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode="on_nonfinite"), log_every_n_steps=5)
    guard = sk.StabilityGuard(compiled, opt, cfg)
    frames: list[int] = []
    for step, batch in enumerate(token_batches(12, batch_size=2, seed=1)):
        poison = step == 3
        if poison:
            saved = model.lm_head.weight[0, 0].item()
            with torch.no_grad():
                model.lm_head.weight[0, 0] = float("inf")  # a tensor value: no Dynamo guard sees it

        def loss_fn(batch=batch):
            return compiled(**batch).loss

        guard.backward(loss_fn())
        guard.step(replay=loss_fn)
        guard.zero_grad()
        if poison:
            with torch.no_grad():
                model.lm_head.weight[0, 0] = saved
        frames.append(counters["frames"]["total"])
    guard.close()
    assert guard.skipped_total == 1
    assert guard.last_nonfinite is not None and guard.last_nonfinite.module == "lm_head"
    assert guard.last_nonfinite.phase == "forward" and guard.last_nonfinite.step == 3
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert frames[-1] == frames[0], f"no frame compiled after the first step: {frames}"


# --------------------------------------------------------------------------- 7. several optimizers


class TwoOptimizers(pl.LightningModule):
    """GAN-style manual optimization: two nets, two optimizers, a NaN in the second's loss at one step."""

    def __init__(self, poison_step: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        self.critic = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.poison_step = poison_step
        self.batches = 0

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        x = batch[0]
        critic_loss = (self.critic(x) - self.critic(self.generator(x).detach())).pow(2).mean()
        opt_c.zero_grad()
        self.manual_backward(critic_loss)
        opt_c.step()
        gen_loss = self.critic(self.generator(x)).pow(2).mean()
        if batch_idx == self.poison_step:
            gen_loss = gen_loss * NAN
        opt_g.zero_grad()
        self.manual_backward(gen_loss)
        opt_g.step()

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), 1e-3), torch.optim.Adam(self.critic.parameters(), 1e-3)]


def test_two_optimizers_each_guarded_with_own_prefix_and_cadence(tmp_path: Path) -> None:
    callback = StabilityCallback(sk.StabilityConfig(log_every_n_steps=2))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8))
    module = TwoOptimizers(poison_step=3)
    trainer = _trainer(
        tmp_path, [callback], max_steps=-1, max_epochs=1, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1
    )
    gen_before: dict[str, torch.Tensor] = {}

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 3:
                gen_before.update({n: p.detach().clone() for n, p in pl_module.generator.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 3:
                for n, p in pl_module.generator.named_parameters():
                    assert torch.equal(p, gen_before[n]), f"generator.{n} changed on its skipped step"

    trainer.callbacks.append(Watch())
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    generator, critic = callback.engines
    assert generator.step == critic.step == 8
    assert generator.skipped_total == 1 and critic.skipped_total == 0
    with open(next((tmp_path / "csv").rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    logged_g = [r for r in rows if r.get("stability/opt0/grad_norm/total")]
    logged_c = [r for r in rows if r.get("stability/opt1/grad_norm/total")]
    assert len(logged_g) == len(logged_c) == 4, "every 2nd of each optimizer's own 8 steps"


# --------------------------------------------------------------------------- 8. a caught divergence is not raised again


def test_caught_divergence_is_not_raised_again_on_a_healthy_run() -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # non-fused: skips are known at once
    cfg = sk.StabilityConfig(skip=sk.SkipConfig(max_consecutive=3), log_every_n_steps=5)
    guard = sk.StabilityGuard(model, opt, cfg)
    diverged = []
    for step, batch in enumerate(token_batches(12)):
        guard.backward(model(**batch).loss * (NAN if step < 3 else 1.0))
        try:
            guard.step()
        except sk.TrainingDivergedError as err:
            diverged.append(err.step)
        guard.zero_grad()
    assert diverged == [2], "raised once, at the third skip; healthy logging steps 5 and 10 stay quiet"
    assert guard.summary()["skipped"] == 3
    assert not math.isnan(float(guard.engine.counters.max_norm))
