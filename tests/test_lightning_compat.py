"""What Lightning's own test suite caught with the callback attached: the optimizer calls its closure,
LR schedulers built during the fit, parameters frozen at the start, a missing optimizer.

Each test drives a real Trainer with Lightning's ``BoringModel`` and, where named, Lightning's own callbacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback

NO_CLIP = sk.StabilityConfig(clip=sk.ClipConfig(mode="off"))


def _trainer(tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


class CallLog:
    """The order in which the training step and the optimizer's own step were entered."""

    def __init__(self) -> None:
        self.calls: list[str] = []


class LoggedSGD(torch.optim.SGD):
    """SGD that notes when its step is entered; ``twice`` evaluates the closure twice (SAM-style)."""

    def __init__(self, params: Any, log: CallLog, twice: bool = False, call_closure: bool = True) -> None:
        super().__init__(params, lr=0.1)
        self.log, self.twice, self.call_closure = log, twice, call_closure

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.log.calls.append("step")
        if closure is None or not self.call_closure:
            return super().step()
        if not self.twice:
            return super().step(closure)
        with torch.enable_grad():
            loss = closure()  # grads at w
        saved = [p.detach().clone() for group in self.param_groups for p in group["params"]]
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=0.05)  # climb to w + e, as SAM does
        with torch.enable_grad():
            closure()  # grads at w + e
        with torch.no_grad():
            params = [p for group in self.param_groups for p in group["params"]]
            for p, w in zip(params, saved, strict=True):
                p.copy_(w)
        super().step()
        return loss


class LoggedBoring(BoringModel):
    def __init__(self, twice: bool = False, call_closure: bool = True) -> None:
        super().__init__()
        self.log_calls = CallLog()
        self.twice, self.call_closure = twice, call_closure

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log_calls.calls.append("training_step")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return LoggedSGD(self.parameters(), self.log_calls, twice=self.twice, call_closure=self.call_closure)


def test_the_optimizer_calls_its_closure(tmp_path: Path) -> None:
    """Lightning's ``test_train_loop_system``: the optimizer's step is entered, then the closure runs."""
    module = LoggedBoring()
    _trainer(tmp_path, [StabilityCallback(NO_CLIP)], max_steps=3).fit(module)
    assert module.log_calls.calls == ["step", "training_step"] * 3


def test_an_optimizer_that_forgets_its_closure_is_still_caught_by_lightning(tmp_path: Path) -> None:
    """Lightning's ``test_optimizer_step_no_closure_raises``: the callback must not run the closure for it."""
    with pytest.raises(MisconfigurationException, match="closure"):
        _trainer(tmp_path, [StabilityCallback(NO_CLIP)], max_steps=2).fit(LoggedBoring(call_closure=False))


def test_a_two_pass_optimizer_trains_exactly_as_without_the_callback(tmp_path: Path) -> None:
    """A SAM-style step evaluates the closure twice: both evaluations are real, the first decides."""
    results = []
    for callbacks in ([], [StabilityCallback(NO_CLIP)]):
        torch.manual_seed(0)
        module = LoggedBoring(twice=True)
        _trainer(tmp_path, callbacks, max_steps=3).fit(module)
        results.append((module.log_calls.calls, [p.detach().clone() for p in module.parameters()]))
    (calls_plain, params_plain), (calls_guarded, params_guarded) = results
    assert calls_guarded == calls_plain == ["step", "training_step", "training_step"] * 3
    for a, b in zip(params_plain, params_guarded, strict=True):
        assert torch.equal(a, b)


class NaNOnSecondPass(LoggedBoring):
    """A NaN loss on the first closure evaluation of global step 1."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 1 and self.log_calls.calls.count("training_step") == 3:
            out["loss"] = out["loss"] * float("nan")
        return out


def test_a_two_pass_optimizer_skip_stops_before_any_update(tmp_path: Path) -> None:
    module = NaNOnSecondPass(twice=True)
    callback = StabilityCallback(NO_CLIP)
    seen: dict[str, Any] = {}

    class Snap(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 1:
                seen["before"] = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == 2 and "after" not in seen:
                seen["after"] = [p.detach().clone() for p in pl_module.parameters()]

    _trainer(tmp_path, [callback, Snap()], max_steps=3).fit(module)
    assert callback.engine is not None and callback.engine.skipped_total == 1
    # the skipped step ran its closure once (the first evaluation decided), and nothing moved
    assert module.log_calls.calls[3:5] == ["step", "training_step"]
    for a, b in zip(seen["before"], seen["after"], strict=True):
        assert torch.equal(a, b)


class NoSchedulerBoring(BoringModel):
    """No LR scheduler of its own, so the first one to wrap ``optimizer.step`` is built mid-fit."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_swa_builds_its_lr_scheduler_during_the_fit(tmp_path: Path) -> None:
    """Lightning's ``test_swa_multiple_lrs``: SWALR wraps ``optimizer.step`` after the callback did."""
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    trainer = _trainer(tmp_path, [StabilityCallback(NO_CLIP), swa], max_epochs=3, max_steps=-1, limit_train_batches=4)
    trainer.fit(NoSchedulerBoring())
    assert trainer.global_step == 12
    assert swa._swa_scheduler is not None and swa._swa_scheduler.last_epoch > 0


def test_a_scheduler_built_after_the_guard_in_a_plain_loop() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = sk.StabilityGuard(model, optimizer, NO_CLIP)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for i in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean() * (float("nan") if i == 1 else 1.0)
        guard.backward(loss)
        guard.step()
        scheduler.step()
        guard.zero_grad()
    assert guard.skipped_total == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    guard.close()
    optimizer.step()  # still a working optimizer after close


def test_the_step_wrapper_is_installed_once() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = sk.StabilityGuard(model, optimizer, NO_CLIP)
    wrapped = vars(optimizer)["step"]  # installed at construction, for the guard's life
    for _ in range(5):
        guard.backward(model(torch.randn(8, 4)).sum())
        guard.step()
        guard.zero_grad()
        assert vars(optimizer)["step"] is wrapped
    assert hasattr(optimizer.step, "__func__")  # a bound method, as torch's LR schedulers need
    guard.close()
    assert "step" not in vars(optimizer)


def test_double_precision_trains_and_measures_in_float64(tmp_path: Path) -> None:
    """Lightning's ``test_double_precision``: ``precision="64-true"`` crashed on the first step."""
    seen: list[torch.Tensor] = []

    class Reference(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    callback = StabilityCallback(sk.StabilityConfig(clip=sk.ClipConfig(mode="off"), log_every_n_steps=1))
    trainer = _trainer(tmp_path, [Reference(), callback], max_steps=3, precision="64-true")
    trainer.fit(NoSchedulerBoring())
    report = callback.engines[0].last_report
    assert report is not None and report.grad_norm.dtype == torch.float64
    assert torch.equal(report.grad_norm, seen[-1].to(report.grad_norm))


class Backbone(BoringModel):
    """BoringModel split into a backbone and a head; a NaN in the backbone's grad at ``nan_step``."""

    def __init__(self, nan_step: int | None = None, fused: bool = False) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(32, 32)
        self.nan_step, self.fused = nan_step, fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.relu(self.backbone(x)))

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.nan_step and self.backbone.weight.grad is not None:
            self.backbone.weight.grad[0, 0] = float("nan")

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=0.05, fused=self.fused)


class UnfreezeAt(BaseFinetuning):
    """Lightning's documented flow: freeze the backbone at setup, unfreeze it into a new param group."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: Any, current_epoch: int, optimizer: Any) -> None:
        if current_epoch == self.epoch:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, train_bn=True)


@pytest.mark.parametrize("fused", [False, True])
def test_a_backbone_unfrozen_mid_fit_is_guarded(tmp_path: Path, fused: bool) -> None:
    """Lightning's ``BaseFinetuning``: a NaN grad in a parameter unfrozen after the fit started is skipped."""
    module = Backbone(nan_step=6, fused=fused)
    callback = StabilityCallback(NO_CLIP)
    trainer = _trainer(tmp_path, [UnfreezeAt(epoch=1), callback], max_epochs=2, max_steps=-1, limit_train_batches=4)
    trainer.fit(module)
    assert trainer.global_step == 8
    assert len(trainer.optimizers[0].param_groups) == 2
    assert torch.isfinite(module.backbone.weight).all()
    callback.engines[0].flush()
    assert callback.engine is not None and callback.engine.skipped_total == 1
    assert "backbone" in callback.engine.layer_names


class BackboneOnly(Backbone):
    """The optimizer holds only the backbone, which is frozen when the fit starts."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.backbone.parameters(), lr=0.1)


def test_everything_frozen_at_the_start_is_not_an_error(tmp_path: Path) -> None:
    """Lightning's ``test_finetuning_callback_warning`` flow: every guarded parameter frozen at fit start."""

    class FreezeThenTrain(BaseFinetuning):
        def freeze_before_training(self, pl_module: Any) -> None:
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module: Any, current_epoch: int, optimizer: Any) -> None:
            if current_epoch == 1:
                self.make_trainable(pl_module.backbone)

    module = BackboneOnly(nan_step=4)
    callback = StabilityCallback(NO_CLIP)
    trainer = _trainer(tmp_path, [FreezeThenTrain(), callback], max_epochs=2, max_steps=-1, limit_train_batches=3)
    with (
        pytest.warns(RuntimeWarning, match="no parameter has a gradient"),
        pytest.warns(UserWarning, match="the model is frozen"),
    ):
        trainer.fit(module)
    callback.engines[0].flush()
    engine = callback.engine
    assert engine is not None and engine.step == 6 and engine.skipped_total == 1  # the NaN after unfreezing
    assert torch.isfinite(module.backbone.weight).all() and engine.counters.max_norm > 0


def test_no_optimizer_steps_aside_with_a_warning(tmp_path: Path) -> None:
    class NoOptimizer(BoringModel):
        def configure_optimizers(self) -> None:
            return None

    with pytest.warns(UserWarning, match="configure_optimizers returned None"):
        _trainer(tmp_path, [StabilityCallback(NO_CLIP)], max_steps=2).fit(NoOptimizer())


def test_a_param_group_added_in_a_plain_loop_is_guarded() -> None:
    torch.manual_seed(0)
    head, extra = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(head.parameters(), lr=0.1)
    guard = sk.StabilityGuard(None, optimizer, sk.StabilityConfig(log_every_n_steps=1))  # type: ignore[arg-type]
    for i in range(4):
        if i == 2:
            optimizer.add_param_group({"params": list(extra.parameters())})
        loss = extra(head(torch.randn(8, 4))).pow(2).mean()
        guard.backward(loss)
        if i == 3:
            extra.weight.grad[0, 0] = float("inf")
        before = extra.weight.detach().clone()
        report = guard.step()
        guard.zero_grad()
    assert bool(report.skipped) and torch.equal(extra.weight, before)
    assert guard.engine.plan.present.count(True) == 4
