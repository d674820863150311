"""Do recovery's defaults and presets act on a wrecked run, and stay quiet on a healthy one?

    python benchmarks/recovery_defaults.py [--models byte_gpt,hf_gpt2,hf_llama] [--seeds 0,1,2]
        [--arms none,defaults,...] [--out runs.jsonl] [--table]

Four model families on the instability benchmark's byte corpus, 200 steps (AdamW, warm-up then
cosine decay to a peak LR of 0.1), the same data order per seed, driven two ways:

* this project's plain loop (``sk.StabilityGuard``, the schedule a ``LambdaLR`` given to the guard):
  ``byte_gpt``, the instability benchmark's 4-block byte-level GPT (``instability/train.py``), and
  ``gpt2``, Hugging Face ``GPT2LMHeadModel``, random init, 2 blocks of width 64 over the 256 byte values;
* the Hugging Face ``Trainer`` (an adopted third-party trainer, with its own defaults: fused AdamW,
  ``max_grad_norm=1.0``, its ``cosine_with_min_lr`` schedule) guarded by
  ``stabilize(trainer, cfg)``: ``hf_gpt2`` (the same GPT-2) and ``hf_llama``
  (``LlamaForCausalLM``, random init, 2 blocks of width 64). The faults come from a
  ``TrainerCallback`` (the LR) and from an iterable dataset in a fixed order (the data).

Scenarios:

* ``clean``: nothing goes wrong (a rollback here acts on a run that needed nothing);
* ``lr_x1000``: the learning rate is 1000 times the schedule's for two steps at half the run (a
  finite blow-up: no non-finite step, so no streak of skips);
* ``garbled``: 30 steps of random bytes from half the run (bad data); ``garbled_long``: 60 steps;
* persistent trouble, ``hot<k>_w<n>``: the schedule's peak LR k times ``PEAK_LR`` for the whole run,
  reached after a warm-up of n steps (``PERSISTENT``: levels 3, 10 and 30, warm-ups 20 and 100; any k, n);
  ``hot30_w0`` and ``hot100_w0``, no warm-up at all: a run that really blows up with the guard alone
  (its ``spike_alert`` events are counted: ``alerts``).

A third way to drive a model: ``nanogpt``, a trainer written the way nanoGPT's ``model.py`` and
``train.py`` are (``nanogpt_style.py``: its GPT, its optimizer groups, betas 0.9/0.95, its hand-set
warm-up and cosine LR, ``grad_clip=1.0``), adopted as the plain-loop guide says (its clipping as
``ClipConfig``, ``get_lr(guard.schedule_step)``): a family and a trainer the defaults were not tuned on.

Arms: ``none`` (the library's defaults without recovery: non-finite steps skipped; on the Trainer
its ``max_grad_norm=1.0`` clips, so there ``none`` is the clipping arm), ``clip`` (plain loop:
``ClipConfig(mode="fixed", max_norm=1.0)``), ``defaults`` (``RecoveryConfig()`` given),
``old_defaults`` (the defaults before this benchmark: trigger ``["diverged"]``, ``skip_after=0``, the
learning rate unchanged after a rollback), the presets ``blow_up`` and ``bad_data``, and candidates
``alert_s<N>[_lr<x>_c<n>]`` (see ``recovery_for``). Per model, scenario and arm over the seeds: the
final held-out loss, its gap to the clean run without recovery, rollbacks per run (held-out seeds
starred), runs that gave up, and runs that end healthy (within 0.15 nats of the clean run of the same
seed). "Within noise" against the guard alone (``--versus``): within twice the RMS of the guard alone's
null perturbations on the same model and scenario (``<scenario>~d<t>``: its data redrawn from position t
on; ``null_noise``), else within its seed spread (``noise_of``). Null perturbations are run as scenarios
of arm ``none``, e.g. ``--arms none --scenarios hot10_w20~d20,hot10_w20~d100``. ``--out`` appends each
run (with its train-loss trace, every 10 steps) to a JSONL file and skips the runs already there; a run
that equals one already made to the bit (``same_run``) is not trained again. Prints a markdown table;
``--versus defaults`` also prints every run of an arm against the guard alone (``none``) of the same
model, scenario and seed, with what recovery did.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "instability")]

from train import BATCH, CONTEXT, ByteGPT, batch, corpus, lr_at  # noqa: E402

import stabilitykit as sk  # noqa: E402

SCENARIOS = ("clean", "lr_x1000", "garbled", "garbled_long")
#: Persistent trouble: ``hot<k>_w<n>``, the schedule's peak LR k times ``PEAK_LR`` for the whole run, reached
#: after a warm-up of n steps (short and long).
PERSISTENT = ("hot3_w20", "hot3_w100", "hot10_w20", "hot10_w100", "hot30_w20", "hot30_w100", "hot30_w0", "hot100_w0")
ARMS = ("none", "clip", "old_defaults", "defaults", "blow_up", "bad_data")
MODELS = ("byte_gpt", "gpt2", "hf_gpt2", "hf_llama", "nanogpt")
PEAK_LR = 0.1
HEALTHY_GAP = 0.15  # nats above the clean run of the same seed that still count as ending healthy
BURSTS = {"garbled": 30, "garbled_long": 60}  # steps of random bytes


def split_null(scenario: str) -> tuple[str, int | None]:
    """``<scenario>~d<t>`` is ``scenario`` with a null perturbation: from data position t on, the batches are
    another draw from the same corpus (the data generator reseeded). Nothing about the run is better or worse
    for it; how far its final loss moves from the unperturbed run's measures what "within noise" means
    (``null_noise``). Returns (scenario, t or None)."""
    base, _, at = scenario.partition("~d")
    return base, (int(at) if at else None)


def schedule_of(scenario: str) -> tuple[float, int]:
    """(peak LR, warm-up steps) of ``scenario``: ``hot<k>_w<n>`` is k times ``PEAK_LR`` after n steps; every
    other scenario ``PEAK_LR`` after 100."""
    scenario = split_null(scenario)[0]
    if scenario.startswith("hot"):
        level, warmup = scenario.removeprefix("hot").split("_w")
        return PEAK_LR * float(level), int(warmup)
    return PEAK_LR, 100


def recovery_for(arm: str) -> sk.RecoveryConfig | None:
    """The arm's ``RecoveryConfig``, as a user writes it (None: recovery off).

    ``defaults``: ``RecoveryConfig()``; ``old_defaults``: the defaults before this benchmark (trigger
    ``["diverged"]``, nothing skipped after a rollback, the learning rate unchanged); ``bad_data``,
    ``blow_up``: the presets. ``alert_s<N>[_lr<x>_c<n>]``: triggers ``["diverged", "spike_alert"]``,
    ``skip_after=N``, and ``lr_scale=x`` for ``cooldown_steps=n`` (1.0 and 0 when not named): the
    candidates for the defaults.
    """
    if arm in ("none", "clip"):
        return None
    if arm == "defaults":
        return sk.RecoveryConfig()
    if arm == "old_defaults":
        return sk.RecoveryConfig(trigger=["diverged"], skip_after=0, lr_scale=1.0, cooldown_steps=0)
    if arm.startswith("alert_s"):
        skip, *rest = arm.removeprefix("alert_s").split("_")
        extra: dict[str, Any] = {"lr_scale": 1.0, "cooldown_steps": 0}
        for part in rest:
            if part.startswith("lr"):
                extra["lr_scale"] = float(part[2:])
            elif part.startswith("c"):
                extra["cooldown_steps"] = int(part[1:])
        return sk.RecoveryConfig(trigger=["diverged", "spike_alert"], skip_after=int(skip), **extra)
    return sk.RecoveryConfig.preset(arm)  # type: ignore[arg-type]


def config_for(arm: str) -> sk.StabilityConfig:
    """The arm's configuration, as a user writes it."""
    recovery = recovery_for(arm)
    clip = sk.ClipConfig(mode="fixed", max_norm=1.0) if arm == "clip" else sk.ClipConfig()
    if recovery is None:
        return sk.StabilityConfig(clip=clip)
    return sk.StabilityConfig(clip=clip, recovery=recovery)


def build_model(name: str) -> torch.nn.Module:
    """A fresh model of family ``name`` (seeded by the caller): the byte GPT, or a Hugging Face model."""
    if name == "byte_gpt":
        return ByteGPT(False)
    if name.endswith("llama"):
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT,
        )
        return LlamaForCausalLM(llama)
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4))


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, ByteGPT):
        return model(x)  # type: ignore[no-any-return]
    if type(model).__name__ == "GPT":  # the nanoGPT-style model: (logits, loss)
        return model(x)[0]  # type: ignore[no-any-return]
    return model(input_ids=x).logits  # type: ignore[no-any-return]


def held_out_loss(model: torch.nn.Module, heldout: np.ndarray) -> float:
    """Mean next-byte loss over 16 fixed held-out batches."""
    model.eval()
    eval_gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        held = [
            F.cross_entropy(logits_of(model, xe).flatten(0, 1), ye.flatten())
            for xe, ye in (batch(heldout, eval_gen) for _ in range(16))
        ]
    return float(torch.stack(held).mean())


def data_at(step: int, scenario: str, data: np.ndarray, gen: torch.Generator, noise: torch.Generator, middle: int):  # type: ignore[no-untyped-def]
    """The batch at data position ``step`` (random bytes inside the garbled burst; another draw of the corpus
    from the null perturbation's position on)."""
    scenario, redraw_at = split_null(scenario)
    if step == redraw_at:
        gen.manual_seed(gen.initial_seed() + 7919)
    x, y = batch(data, gen)
    if middle <= step < middle + BURSTS.get(scenario, 0):
        tokens = torch.randint(0, 256, (x.shape[0], x.shape[1] + 1), generator=noise)
        x, y = tokens[:, :-1], tokens[:, 1:]
    return x, y


Run = dict[str, Any]
Runs = dict[tuple[str, str, str, int], Run]  # (model, scenario, arm, seed) -> its run


def train(
    model_name: str, arm: str, scenario: str, seed: int, steps: int, data: np.ndarray, heldout: np.ndarray
) -> Run:
    """One run: final held-out loss (NaN when it gave up), rollbacks, gave up, the train-loss trace."""
    if model_name.startswith("hf_"):
        return train_hf_trainer(model_name, arm, scenario, seed, steps, data, heldout)
    if model_name == "nanogpt":
        return train_nanogpt(arm, scenario, seed, steps, data, heldout)
    torch.manual_seed(seed)
    model = build_model(model_name)
    peak, warmup = schedule_of(scenario)
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, peak, warmup) / peak)
    guard = sk.StabilityGuard(model, opt, config_for(arm), scheduler=scheduler)
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    guard.hooks.on("recovery", rollbacks.append)
    alerts: list[sk.Event] = []
    guard.hooks.on("spike_alert", alerts.append)
    gen = torch.Generator().manual_seed(1000 + seed)
    noise = torch.Generator().manual_seed(5000 + seed)
    middle = steps // 2
    gave_up = False
    trace: list[float] = []
    for step in range(steps):  # the data position: batches of undone steps are not replayed
        model.train()
        x, y = data_at(step, scenario, data, gen, noise, middle)
        blow_up = scenario == "lr_x1000" and middle <= step < middle + 2
        if blow_up:
            for group in opt.param_groups:
                group["lr"] *= 1000.0
        loss = F.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten())
        guard.backward(loss)
        try:
            guard.step()
        except sk.TrainingDivergedError:
            gave_up = True
            break
        if blow_up:  # the schedule's value again (a held scheduler did not set it)
            for group, lr in zip(opt.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        guard.zero_grad()
        if step % 10 == 9:
            trace.append(float(loss.detach()))
    skipped = guard.summary().skipped
    guard.close()
    final = held_out_loss(model, heldout)
    return _result(final, rollbacks, gave_up, trace, skipped, len(alerts))


def _result(
    final: float, events: list[sk.Event], gave_up: bool, trace: list[float], skipped: int, alerts: int | None = None
) -> Run:
    """A run's row: ``events`` are its ``rollback`` and ``recovery`` events (an LR lowered without a rollback,
    recovery standing down), in order; ``alerts``: its ``spike_alert`` events (None: not counted)."""
    rollbacks = [e for e in events if e.kind == "rollback"]
    return {
        "alerts": alerts,
        "skipped": skipped,
        "final": final if not gave_up else math.nan,
        "rollbacks": len(rollbacks),
        "gave_up": gave_up,
        "at": [(e.details["trigger"], e.details["trigger_step"], e.details["restored_step"]) for e in rollbacks],
        "restored_first_step": any(e.details["restored_step"] <= 1 for e in rollbacks),
        "actions": [
            (e.details.get("cause", "-")[0] if e.kind == "rollback" else e.details["action"][0].upper())
            + (f"{e.details['lr_factor']:g}" if e.details.get("lr_factor", 1.0) != 1.0 else "")
            for e in events
        ],
        "trace": trace,
        # what recovery did and said, to read a run again without training it again
        "events": [{"kind": e.kind, "step": e.step, "message": e.message} for e in events],
    }


def train_nanogpt(arm: str, scenario: str, seed: int, steps: int, data: np.ndarray, heldout: np.ndarray) -> Run:
    """One run of the nanoGPT-style trainer (``nanogpt_style.py``: its model, optimizer groups, betas 0.9/0.95,
    hand-set warm-up and cosine LR, ``grad_clip=1.0`` as ``ClipConfig``), adopted as the plain-loop guide says."""
    from nanogpt_style import train as nanogpt_train

    peak, warmup = schedule_of(scenario)
    gen = torch.Generator().manual_seed(1000 + seed)
    noise = torch.Generator().manual_seed(5000 + seed)
    middle = steps // 2

    def get_batch(iter_num: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = data_at(iter_num, scenario, data, gen, noise, middle)
        return x.contiguous(), y.contiguous()  # nanoGPT's get_batch stacks rows: contiguous

    def boost(iter_num: int) -> float:
        return 1000.0 if scenario == "lr_x1000" and middle <= iter_num < middle + 2 else 1.0

    events: list[sk.Event] = []
    model, guard, trace, gave_up = nanogpt_train(
        get_batch, steps, peak, warmup, recovery_for(arm), seed, lr_boost=boost, events=events
    )
    skipped = guard.summary().skipped
    guard.close()
    return _result(held_out_loss(model, heldout), events, gave_up, trace, skipped)


def train_hf_trainer(
    model_name: str, arm: str, scenario: str, seed: int, steps: int, data: np.ndarray, heldout: np.ndarray
) -> Run:
    """One run through the Hugging Face ``Trainer`` (its defaults: fused AdamW, ``max_grad_norm=1.0``),
    guarded by ``stabilize(trainer, cfg)``. The LR blow-up comes from a ``TrainerCallback`` at global
    steps ``middle`` and ``middle + 1`` (the global step goes on after a rollback, so it does not
    repeat); the data from an iterable dataset in a fixed order (the loader's position goes on too)."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from stabilitykit.integrations import stabilize

    middle = steps // 2

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            gen = torch.Generator().manual_seed(1000 + seed)
            noise = torch.Generator().manual_seed(5000 + seed)
            for position in range(steps):
                x, y = data_at(position, scenario, data, gen, noise, middle)
                # the model shifts the labels itself: the window's bytes are input and label
                tokens = torch.cat([x, y[:, -1:]], dim=1)
                for row in tokens:
                    yield {"input_ids": row[:-1], "labels": row[:-1]}

    class BlowUp(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            if scenario == "lr_x1000" and middle <= state.global_step < middle + 2:
                for group in optimizer.param_groups:
                    group["lr"] *= 1000.0

        def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):  # type: ignore[no-untyped-def]
            for group, lr in zip(optimizer.param_groups, lr_scheduler.get_last_lr(), strict=True):
                group["lr"] = lr  # the schedule's value (a held scheduler did not set it)

    torch.manual_seed(seed)
    model = build_model(model_name)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=BATCH,
            max_steps=steps,
            learning_rate=schedule_of(scenario)[0],
            warmup_steps=min(schedule_of(scenario)[1], steps // 2),
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1},
            weight_decay=0.1,
            adam_beta2=0.99,
            logging_steps=10,
            save_strategy="no",
            seed=seed,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Stream(), callbacks=[BlowUp()])
        recovery = recovery_for(arm)
        cfg = sk.StabilityConfig() if recovery is None else sk.StabilityConfig(recovery=recovery)
        trainer.remove_callback(PrinterCallback)  # the benchmark prints its own lines
        callback = stabilize(trainer, cfg)
        rollbacks: list[sk.Event] = []
        callback.hooks.on("rollback", rollbacks.append)
        callback.hooks.on("recovery", rollbacks.append)
        alerts: list[sk.Event] = []
        callback.hooks.on("spike_alert", alerts.append)
        gave_up = False
        try:
            trainer.train()
        except sk.TrainingDivergedError:
            gave_up = True
        summary = callback.summary()
    trace = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    skipped = summary.skipped if summary else 0
    return _result(held_out_loss(model, heldout), rollbacks, gave_up, trace, skipped, len(alerts))


def _mean(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "-"
    spread = f" ± {statistics.stdev(finite):.3f}" if len(finite) > 1 else ""
    return f"{statistics.mean(finite):.3f}{spread}"


def _triggers(arm: str) -> tuple[str, ...] | None:
    recovery = recovery_for(arm)
    if recovery is None:
        return None
    dump = recovery.model_dump(exclude={"skip_after", "lr_scale", "cooldown_steps", "enabled"})
    return tuple(f"{k}={v}" for k, v in sorted(dump.items()))


def same_run(runs: dict[tuple[str, str, str, int], Run], model: str, scenario: str, arm: str, seed: int) -> Run | None:
    """A run already made that this arm's run equals to the bit, or None.

    Recovery that never rolls back leaves the run bitwise the run without it (``tests/test_recovery.py``),
    and until its first rollback an arm's ``skip_after``, ``lr_scale`` and ``cooldown_steps`` change
    nothing. So an arm equals a run of the same model, scenario and seed whose triggers and snapshot
    settings are its own and that never rolled back; and an arm whose only trigger is ``"diverged"`` equals
    ``none`` when ``none`` skipped fewer steps in all than a streak needs (``SkipConfig.max_consecutive``).
    Likewise any recovery arm with the default snapshot settings equals ``none`` when ``none`` raised no
    ``spike_alert`` (counted: ``alerts``) and skipped fewer steps than a streak needs: no trigger ever fires.
    """
    mine = _triggers(arm)
    if mine is None or arm == "clip":
        return None
    streak = sk.SkipConfig().max_consecutive or 0
    for (m, sc, other, sd), run in runs.items():
        if (m, sc, sd) != (model, scenario, seed):
            continue
        if other != "clip" and recovery_for(other) == recovery_for(arm):  # the same configuration
            return {**run, "same_as": other}
        if run["rollbacks"] or run["gave_up"] or run.get("actions"):  # recovery acted (an LR lowered in place too)
            continue
        same_triggers = other != "clip" and _triggers(other) == mine
        plain = other == "none" and recovery_for(arm).trigger == ["diverged"] and run["skipped"] < streak  # type: ignore[union-attr]
        quiet = other == "none" and run.get("alerts") == 0 and run["skipped"] < streak and not run["gave_up"]
        if same_triggers or plain or quiet:
            return {**run, "same_as": other}
    return None


def _scenario_order(scenario: str) -> tuple[int, str]:
    known = (*SCENARIOS, *PERSISTENT)
    return (known.index(scenario) if scenario in known else len(known), scenario)


#: Arms whose null perturbations move the final loss by less than this RMS (nats) end on a plateau either way;
#: above it the guard alone blows up for good (100x the LR) and one run says little.
PLATEAU_RMS = 1.0
NOISE = 0.05  # nats: the least difference to the guard alone's final loss that is not "within noise"


def noise_of(runs: dict[tuple[str, str, str, int], Run], model: str, scenario: str, base: str = "none") -> float:
    """What "within noise" means on one arm: the seed spread of ``base`` (the guard alone) on the same model and
    scenario, the range of its final losses over the seeds run (a persistent-LR run ends wherever its
    blow-ups left it: two seeds of the same arm differ by up to 0.14 nats), and never under ``NOISE``."""
    finals = [r["final"] for k, r in runs.items() if k[:3] == (model, scenario, base) and math.isfinite(r["final"])]
    return max(NOISE, max(finals) - min(finals)) if len(finals) > 1 else NOISE


def null_differences(runs: Runs, model: str, scenario: str, base: str = "none") -> list[float]:
    """Every null perturbation of ``base`` on this model and scenario (``<scenario>~d<t>``, any t and seed) minus
    the unperturbed run of the same seed: how far the final loss moves when nothing but chance changes."""
    diffs = []
    for (m, perturbed, arm, seed), run in runs.items():
        of, redraw_at = split_null(perturbed)
        twin = runs.get((model, scenario, base, seed))
        if (m, of, arm) == (model, scenario, base) and redraw_at is not None and twin and math.isfinite(run["final"]):
            diffs.append(run["final"] - twin["final"])
    return diffs


def null_noise(runs: Runs, model: str, scenario: str, base: str = "none") -> float | None:
    """What "within noise" means where null perturbations were run: ``band_of`` its ``null_differences``."""
    return band_of(null_differences(runs, model, scenario, base))


def band_of(diffs: list[float]) -> float | None:
    """Twice the root mean square of null differences (about a 95% band if they are normal), never under
    ``NOISE``; None with fewer than two."""
    if len(diffs) < 2:
        return None
    return max(NOISE, 2.0 * math.sqrt(statistics.fmean(d * d for d in diffs)))


def versus(runs: dict[tuple[str, str, str, int], Run], arm: str, base: str = "none") -> str:
    """Every run of ``arm`` against the same model, scenario and seed under ``base`` (the guard alone): the
    final held-out losses, the difference, what recovery did (``actions``: u/d/l a rollback whose cause was
    undetermined, the data, the learning rate; L the LR lowered without a rollback; S recovery standing down;
    each with the LR factor it set) and whether it restored the first step's state or gave up."""
    lines = [
        f"| model | scenario | seed | {base} | {arm} | difference | noise | actions | restored step 1 | gave up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    tally = {"better": 0, "within noise": 0, "worse": 0, "gave up": 0}
    acted: list[float] = []  # the differences where the arm acted, on plateau arms (``PLATEAU_RMS``)
    nulls: dict[tuple[str, str], list[float]] = {}  # every arm's null differences (empty: none run)
    for key in sorted(runs, key=lambda k: (k[0], _scenario_order(k[1]), k[3])):
        if split_null(key[1])[1] is not None:
            continue
        model, scenario, other, seed = key
        if other != arm or (model, scenario, base, seed) not in runs:
            continue
        mine, theirs = runs[key], runs[model, scenario, base, seed]
        diff = mine["final"] - theirs["final"]
        if (model, scenario) not in nulls:
            nulls[model, scenario] = null_differences(runs, model, scenario, base)
        null = band_of(nulls[model, scenario])
        noise = null if null is not None else noise_of(runs, model, scenario, base)
        if null is not None and mine.get("actions") and math.isfinite(diff) and null < 2 * PLATEAU_RMS:
            acted.append(diff)
        if mine["gave_up"] and not theirs["gave_up"]:
            tally["gave up"] += 1
        elif math.isfinite(diff):
            tally["better" if diff < -noise else "worse" if diff > noise else "within noise"] += 1
        lines.append(
            f"| {model} | {scenario} | {seed} | {theirs['final']:.3f} | {mine['final']:.3f} | {diff:+.3f} | "
            f"{noise:.3f} | "
            f"{' '.join(mine.get('actions', [])) or '-'} | {'yes' if mine.get('restored_first_step') else 'no'} | "
            f"{'yes' if mine['gave_up'] else 'no'} |"
        )
    counts = ", ".join(f"{n} {what}" for what, n in tally.items())
    text = "\n".join(lines) + (
        f"\n\n{arm} against {base} (noise: twice the RMS of {base}'s null perturbations on the same model and "
        f"scenario where they were run, else the seed spread of {base}; at least {NOISE} nats): {counts}"
    )
    bands = {arm_: band_of(diffs) or NOISE for arm_, diffs in nulls.items() if diffs}
    above = sum(1 for arm_, band in bands.items() for d in nulls[arm_] if d > band)
    if bands:
        text += (
            f"\n\nCalibration: {above} of {sum(map(len, nulls.values()))} null perturbations end above their own "
            f"arm's band (by chance alone, a 95% band leaves about 2.5% above)"
        )
    plateau = [d for arm_, band in bands.items() if band < 2 * PLATEAU_RMS for d in nulls[arm_]]
    if len(acted) > 1 and len(plateau) > 1:
        text += (
            f"\n\nOn the arms where the guard alone ends on a plateau (null RMS under {PLATEAU_RMS:g} nat), the "
            f"{len(acted)} runs where {arm} acted: {arm} - {base} {_mean_se(acted)}; the {len(plateau)} null "
            f"perturbations there: {_mean_se(plateau)}"
        )
    return text


def _mean_se(values: list[float]) -> str:
    """Mean ± its standard error, and the root mean square."""
    se = statistics.stdev(values) / math.sqrt(len(values))
    rms = math.sqrt(statistics.fmean(v * v for v in values))
    return f"{statistics.fmean(values):+.3f} ± {se:.3f} (RMS {rms:.3f})"


def table(runs: dict[tuple[str, str, str, int], Run], held: set[int]) -> str:
    """The markdown table: per model, scenario and arm over the seeds run (held-out seeds marked)."""
    lines = [
        f"| model | scenario | arm | final held-out loss | gap to clean | ends healthy (<= +{HEALTHY_GAP}) "
        "| rollbacks per seed | gave up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    models = list(dict.fromkeys(k[0] for k in runs))
    scenarios = [
        sc
        for sc in dict.fromkeys(k[1] for k in sorted(runs, key=lambda k: _scenario_order(k[1])))
        if split_null(sc)[1] is None  # the null perturbations measure noise: versus()
    ]
    arms = list(dict.fromkeys(k[2] for k in runs))
    for model in models:
        clean = {k[3]: r["final"] for k, r in runs.items() if k[:3] == (model, "clean", "none")}
        for scenario in scenarios:
            for arm in arms:
                rows = {k[3]: r for k, r in sorted(runs.items()) if k[:3] == (model, scenario, arm)}
                if not rows:
                    continue
                gaps = {s: r["final"] - clean[s] for s, r in rows.items() if math.isfinite(r["final"]) and s in clean}
                gap = f"{statistics.mean(gaps.values()):+.3f}" if gaps else "-"
                healthy = sum(1 for g in gaps.values() if g <= HEALTHY_GAP)
                per_seed = ", ".join(f"{r['rollbacks']}{'*' if s in held else ''}" for s, r in rows.items())
                lines.append(
                    f"| {model} | {scenario} | {arm} | {_mean([r['final'] for r in rows.values()])} | {gap} | "
                    f"{healthy}/{len(rows)} | {per_seed} | {sum(r['gave_up'] for r in rows.values())} |"
                )
    return "\n".join(lines)


def summary(runs: dict[tuple[str, str, str, int], Run], seeds: set[int]) -> str:
    """Per arm over every model and the given seeds: wrecked runs (every transient scenario but ``clean``;
    the persistent ones are judged against the guard alone by ``versus``) that end healthy, clean runs
    rolled back, runs that gave up, and the mean and worst gap to the clean run."""
    lines = [
        "| arm | wrecked runs ending healthy | clean runs rolled back | gave up | most rollbacks in a run "
        "| mean gap (wrecked) | worst gap (wrecked) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    clean = {(k[0], k[3]): r["final"] for k, r in runs.items() if k[1] == "clean" and k[2] == "none"}
    for arm in dict.fromkeys(k[2] for k in runs):
        mine = {k: r for k, r in runs.items() if k[2] == arm and k[3] in seeds and (k[0], k[3]) in clean}
        wrecked = {k: r for k, r in mine.items() if k[1] in SCENARIOS and k[1] != "clean"}  # transient: versus()
        calm = [r for k, r in mine.items() if k[1] == "clean"]
        gaps = [r["final"] - clean[k[0], k[3]] if not r["gave_up"] else math.inf for k, r in wrecked.items()]
        finite = [g for g in gaps if math.isfinite(g)]
        healthy = sum(1 for g in gaps if g <= HEALTHY_GAP)
        lines.append(
            f"| {arm} | {healthy}/{len(gaps)} | {sum(1 for r in calm if r['rollbacks'])}/{len(calm)} | "
            f"{sum(r['gave_up'] for r in mine.values())} | {max((r['rollbacks'] for r in mine.values()), default=0)} | "
            + (f"{statistics.mean(finite):+.3f} | {max(gaps):+.3f} |" if finite else "- | - |")
        )
    return "\n".join(lines)


def load_runs(path: Path) -> Runs:
    """The runs of a JSONL file written by ``--out`` (a later line of the same run replaces an earlier one)."""
    runs: Runs = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        runs[row["model"], row["scenario"], row["arm"], row["seed"]] = row
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--held-out", default="2", help="seeds not looked at when the defaults were chosen")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", help="append each run to this JSONL file (and read the runs already there)")
    parser.add_argument("--table", action="store_true", help="only print the table of the runs in --out")
    parser.add_argument("--versus", help="also print every run of this arm against the guard alone (arm none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    held = {int(s) for s in args.held_out.split(",") if s}
    runs = load_runs(Path(args.out)) if args.out and Path(args.out).exists() else {}
    if not args.table:
        data = corpus()
        cut = int(len(data) * 0.95)
        train_data, heldout = data[:cut], data[cut:]
        for model in args.models.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                for scenario in args.scenarios.split(","):
                    for arm in args.arms.split(","):
                        if (model, scenario, arm, seed) in runs:
                            continue
                        run = same_run(runs, model, scenario, arm, seed) or train(
                            model, arm, scenario, seed, args.steps, train_data, heldout
                        )
                        run.update(model=model, scenario=scenario, arm=arm, seed=seed)
                        runs[model, scenario, arm, seed] = run
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(run) + "\n")
                        tag = " (held out)" if seed in held else ""
                        print(
                            f"run {model} {scenario} {arm} seed {seed}{tag}: final {run['final']:.3f}, "
                            f"rollbacks {run['rollbacks']} {run['at']}, gave up {run['gave_up']}",
                            flush=True,
                        )
    print("\n" + table(runs, held) + "\n\n(* held-out seed)")
    if args.versus:
        print("\n" + versus(runs, args.versus))
    tuning = {k[3] for k in runs} - held
    for name, seeds in (("tuning", tuning), ("held-out", held)):
        if any(k[3] in seeds for k in runs):
            print(f"\nEvery model, {name} seeds {sorted(seeds)}:\n\n" + summary(runs, seeds))


if __name__ == "__main__":
    main()
