"""A new driver is hook mapping only: a hand-written trainer loop gets skips, scheduler holds, state,
``summary()`` and closing from ``stabilitykit.drivers.Driver`` with the driver below (under 60 lines)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.drivers import Driver
from tests.conftest import assert_bitwise_equal, batches, snapshot

NAN = float("nan")


class HandTrainer:
    """Someone's own trainer: it calls its callbacks' hooks and steps its optimizer and scheduler itself."""

    def __init__(self, model: torch.nn.Module, callbacks: list[Any]) -> None:
        self.model, self.callbacks = model, callbacks
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.global_step = 0

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def fit(self, data: list[tuple[torch.Tensor, torch.Tensor]], poison: dict[int, float]) -> None:
        self.call("on_fit_start")
        for x, y in data:
            loss = self.model.loss(x, y) * poison.get(self.global_step, 1.0)
            self.call("on_before_backward", loss)
            loss.backward()
            self.call("on_grads_final")
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.call("on_step_end")
            self.global_step += 1
        self.call("on_fit_end")


# ---------------------------------------------------------------- the whole driver: hooks mapped onto the base
class HandTrainerStability:
    def __init__(self, config: sk.StabilityConfig, sinks: tuple[Any, ...] = ()) -> None:
        self.driver = Driver(config, sinks=sinks)

    def on_fit_start(self, trainer: HandTrainer) -> None:
        self.driver.build_engines(trainer.model, [trainer.optimizer])
        self.driver.route_steps()  # the trainer's optimizer.step applies or skips
        self.driver.add_scheduler(trainer.scheduler, stepped_here=False)  # the trainer steps it: held on skips

    def on_before_backward(self, trainer: HandTrainer, loss: torch.Tensor) -> None:
        self.driver.record_loss(loss)

    def on_grads_final(self, trainer: HandTrainer) -> None:
        self.driver.decide(self.driver.engines[0], log_step=trainer.global_step)

    def on_step_end(self, trainer: HandTrainer) -> None:
        self.driver.end_step(self.driver.engines[0])

    def on_fit_end(self, trainer: HandTrainer) -> None:
        self.driver.end_run()


# ---------------------------------------------------------------- what it gets for free
class Recorder:
    """Another callback of the trainer: the state before and after each step."""

    def __init__(self) -> None:
        self.before: dict[int, Any] = {}
        self.after: dict[int, Any] = {}

    def on_grads_final(self, trainer: HandTrainer) -> None:
        self.before[trainer.global_step] = (snapshot(trainer.model, trainer.optimizer), trainer.scheduler.last_epoch)

    def on_step_end(self, trainer: HandTrainer) -> None:
        self.after[trainer.global_step] = (snapshot(trainer.model, trainer.optimizer), trainer.scheduler.last_epoch)

    def __getattr__(self, hook: str) -> Any:
        return lambda *args: None


class Sink:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False

    def log_metrics(self, metrics: Any, step: int) -> None:
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True


def test_a_minimal_driver_for_a_hand_written_loop_gets_the_lifecycle_from_the_base() -> None:
    assert len(inspect.getsource(HandTrainerStability).splitlines()) < 60
    sink, recorder = Sink(), Recorder()
    guarded = HandTrainerStability(sk.StabilityConfig(log_every_n_steps=2), sinks=(sink,))
    trainer = HandTrainer(sk.testing.tiny_gpt(seed=0), [recorder, guarded])
    step_before_run = trainer.optimizer.step
    trainer.fit(batches(6), poison={2: NAN})

    assert_bitwise_equal(recorder.before[2][0], recorder.after[2][0])  # the NaN step skipped: nothing moved
    assert recorder.after[2][1] == recorder.before[2][1]  # the LR scheduler held on the skip ...
    assert recorder.after[3][1] == recorder.before[3][1] + 1  # ... and stepping again after it
    summary = guarded.driver.summary()
    assert (summary["steps"], summary["skipped"]) == (6, 1)
    assert sink.steps == [0, 2, 4, 5] and sink.closed  # logging rows, the last steps' row, the sink closed
    assert trainer.optimizer.step == step_before_run  # the routed step undone
    assert type(trainer.scheduler) is torch.optim.lr_scheduler.LambdaLR  # the hold undone

    resumed = HandTrainerStability(sk.StabilityConfig(log_every_n_steps=2))
    resumed.driver.load_state_dict(guarded.driver.state_dict())  # before its cores exist: kept, loaded at start
    resumed.on_fit_start(HandTrainer(sk.testing.tiny_gpt(seed=0), [resumed]))
    assert resumed.driver.engines[0].step == 6 and resumed.driver.summary()["skipped"] == 1
    resumed.driver.end_run()
