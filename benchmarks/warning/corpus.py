"""The early-warning corpus: real training runs of models this project did not write, on the CPU.

    nice python benchmarks/warning/corpus.py [--families gpt2,bert,llama,mixtral,resnet] [--steps 500]
                                             [--out benchmarks/warning/corpus.npz] [--jobs 1]

Five families from ``transformers`` (random init, tiny): a GPT-2 decoder, a Llama decoder, a BERT
encoder trained as a masked LM, a Mixtral mixture of experts, and a ResNet (convolutions with
BatchNorm) classifying synthetic images. The language models read bytes of the Python standard
library's ``.py`` sources (on every machine, no download); the ResNet reads 16x16 images drawn
around ten smooth class prototypes (noise 1.5x, 10% of labels random, so the loss has a floor).
Every run goes through ``sk.StabilityGuard`` with clipping off
and spike detection off (the guard only measures, and skips a non-finite step so a run stays
readable), logging every step; what it logs is the trace: loss, total and per-layer grad norm,
the update-to-weight ratio (total and per layer; logged one step late, as the engine feeds it), the
LR of each param group, and
the model monitors (max attention logit per attention module as the model computes it, max |logit|
and log Z of the output, the residual norm after each block).

Per family, ten runs of ``--steps`` steps each (the arms below). Optimizers and schedules differ by
family so that a held-out family is also a held-out optimizer and schedule:

==========  =======================  ==========================
family      second optimizer         its schedule
==========  =======================  ==========================
gpt2        SGD + momentum 0.9       constant (warmup 20)
bert        Adafactor (transformers)  cosine with warm restarts
llama       torch.optim.Muon + AdamW  warmup-stable-decay
mixtral     Lion (the published rule) cosine with warm restarts
resnet      SGD + momentum 0.9       warmup-stable-decay
==========  =======================  ==========================

Arms (healthy by design: ``adamw``, ``second``, ``accum_bf16``, ``finetune``; unstable by a real
mechanism: the rest). Whether a step is an onset is decided afterwards from the loss alone
(``benchmarks/spike_suite.ground_truth``, fixed before any detector here was scored):

* ``adamw``: AdamW (betas 0.9/0.95, weight decay 0.1), warmup 50 then cosine; its final state is
  the checkpoint the two fine-tuning arms start from;
* ``second``: the family's second optimizer and schedule (table above);
* ``accum_bf16``: AdamW, two micro-batches of half size per step, bf16 autocast, warmup-stable-decay;
* ``finetune``: from ``adamw``'s checkpoint, on unseen data (the other part of the sources; other
  prototypes for the ResNet), AdamW at a third of the LR, constant;
* ``lr_edge``: the second optimizer with its LR growing exponentially to 300x over the run;
* ``qk_growth``: AdamW whose query and key projections' LR grows to 3000x (no qk-norm): attention
  logits grow (the ResNet, with no attention, grows its first convolution's LR instead);
* ``logit_drift``: AdamW whose output head's LR grows to 3000x with no weight decay and no z-loss:
  the output logits and log Z drift;
* ``adam_beta2``: AdamW with beta2 0.9999 and eps 1e-12 at 3x the LR; from mid-run the data shift
  (bytes moved into the upper half of the byte range; inverted images): the fast first moment
  follows the larger gradients while the slow second moment does not;
* ``burst``: AdamW at 2x the LR; three bursts of junk (uniform random bytes; pure-noise images with
  random labels): 10 steps from 35% of the run, 25 from 60%, 5 from 85%;
* ``finetune_hot``: from ``adamw``'s checkpoint, AdamW at 30x the LR, constant.

Stored: one float32 array per run (steps x columns), keyed ``family/arm``, and a JSON ``meta`` with
each run's family, arm, optimizer, schedule, mechanism and column names. About 2 MB compressed.
At 500 steps a run (25,000 steps in all) it is about 11 minutes of one core's work on a quiet machine
(27 ms a step for the language models, 11 ms for the ResNet); on a machine shared by a dozen busy
processes, one process per family (``--families gpt2 --out ...``, then ``--merge``) took about 40 minutes
for GPT-2 and BERT, and about 55 minutes for Llama and Mixtral (one process each, beside other work). The
committed ``corpus.npz`` holds all five families at 500 steps under these arms (each run's
``meta["steps"]`` says its length).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

OUT = Path(__file__).with_name("corpus.npz")
FAMILIES = ("gpt2", "bert", "llama", "mixtral", "resnet")
ARMS = (
    "adamw",
    "second",
    "accum_bf16",
    "finetune",
    "lr_edge",
    "qk_growth",
    "logit_drift",
    "adam_beta2",
    "burst",
    "finetune_hot",
)
HEALTHY_ARMS = ("adamw", "second", "accum_bf16", "finetune")
MECHANISM = {
    "adamw": "healthy",
    "second": "healthy",
    "accum_bf16": "healthy",
    "finetune": "healthy",
    "lr_edge": "LR past the edge",
    "qk_growth": "attention-logit growth (no qk-norm)",
    "logit_drift": "output-logit drift (no z-loss)",
    "adam_beta2": "Adam beta2 near 1, eps 1e-12, data shift",
    "burst": "data burst",
    "finetune_hot": "fine-tuning at 30x the LR",
}
SECOND = {
    "gpt2": ("sgd", "constant"),
    "bert": ("adafactor", "restarts"),
    "llama": ("muon", "wsd"),
    "mixtral": ("lion", "restarts"),
    "resnet": ("sgd", "wsd"),
}
CONTEXT, BATCH, VOCAB = 32, 16, 256
IMAGE_BATCH = 64  # a batch of 16 images gives a loss too noisy (x5 between steps) for a 1.3x spike to mean anything
ADAMW_LR = {"gpt2": 2e-3, "bert": 1e-3, "llama": 2e-3, "mixtral": 2e-3, "resnet": 2e-3}
SECOND_LR = {"sgd": 0.05, "adafactor": 1e-3, "muon": 0.02, "lion": 2e-4}
RAMP = 300.0  # the LR-edge arm's LR grows to this many times its start
#: The qk_growth and logit_drift arms' group LR grows to this many times its start (at 300x, over 300 steps,
#: neither moved the loss in any family: no onset to warn of).
GROUP_RAMP = 3000.0
SHIFT_AT = 0.5  # the data shift starts at this fraction of the run
#: The burst arm's bursts of junk: (start as a fraction of the run, length in steps); three onsets per run.
BURSTS = ((0.35, 10), (0.6, 25), (0.85, 5))


# ----------------------------------------------------------------------------- data
@functools.lru_cache(maxsize=1)
def source_bytes(max_bytes: int = 3_000_000) -> np.ndarray:
    """Bytes of the standard library's .py files, in sorted path order (the same on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class Data:
    """Batches for one run: ``batch(step, size)`` -> model keyword arguments (inputs and labels)."""

    def __init__(self, family: str, arm: str, seed: int, steps: int) -> None:
        self.family, self.arm, self.steps = family, arm, steps
        self.gen = torch.Generator().manual_seed(seed)
        self.shift_at = int(steps * SHIFT_AT) if arm == "adam_beta2" else steps + 1
        self.bursts = [(int(steps * at), length) for at, length in BURSTS] if arm == "burst" else []
        fine = arm in ("finetune", "finetune_hot")
        if family == "resnet":
            proto_gen = torch.Generator().manual_seed(1 if fine else 0)
            coarse = torch.randn(10, 3, 4, 4, generator=proto_gen)
            self.protos = nn.functional.interpolate(coarse, size=(16, 16), mode="bilinear", align_corners=False)
        else:
            data = source_bytes()
            cut = int(len(data) * 0.8)
            self.text = data[cut:] if fine else data[:cut]

    def junk(self, step: int) -> bool:
        return any(start <= step < start + length for start, length in self.bursts)

    def shifted(self, step: int) -> bool:
        return self.arm == "adam_beta2" and step >= self.shift_at

    def batch(self, step: int, size: int) -> dict[str, Tensor]:
        if self.family == "resnet":
            return self._images(step, size)
        if self.junk(step):
            seq = torch.randint(0, VOCAB, (size, CONTEXT), generator=self.gen)
        else:
            starts = torch.randint(0, len(self.text) - CONTEXT, (size,), generator=self.gen).numpy()
            rows = np.stack([self.text[s : s + CONTEXT] for s in starts]).astype(np.int64)
            seq = torch.from_numpy(rows)
            if self.shifted(step):
                seq = seq | 128  # the same text moved into byte values the run has never seen
        if self.family == "bert":
            mask = torch.rand(seq.shape, generator=self.gen) < 0.15
            mask[:, 0] |= ~mask.any(dim=1)
            labels = torch.where(mask, seq, torch.full_like(seq, -100))
            inputs = torch.where(mask, torch.full_like(seq, VOCAB), seq)  # token VOCAB is [MASK]
            return {"input_ids": inputs, "labels": labels}
        return {"input_ids": seq, "labels": seq}

    def _images(self, step: int, size: int) -> dict[str, Tensor]:
        labels = torch.randint(0, 10, (size,), generator=self.gen)
        noise = torch.randn(size, 3, 16, 16, generator=self.gen)
        if self.junk(step):
            return {"pixel_values": 2.0 * noise, "labels": labels}
        images = self.protos[labels] + 1.5 * noise
        relabel = torch.rand(size, generator=self.gen) < 0.1  # 10% label noise: the loss has a floor, as real data
        labels = torch.where(relabel, torch.randint(0, 10, (size,), generator=self.gen), labels)
        flip = torch.rand(size, generator=self.gen) < 0.5
        images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        if self.shifted(step):
            images = -2.0 * images
        return {"pixel_values": images, "labels": labels}


# ----------------------------------------------------------------------------- models
def build_model(family: str) -> nn.Module:
    """A tiny random-init model of ``family`` from transformers."""
    import transformers as tf

    common = {"vocab_size": VOCAB + 1, "max_position_embeddings": 64}
    if family == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=VOCAB + 1, n_positions=64, n_embd=64, n_layer=2, n_head=4, tie_word_embeddings=False
            )
        )
    if family == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            **common,
        )
        return tf.LlamaForCausalLM(cfg)
    if family == "mixtral":
        cfg = tf.MixtralConfig(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            **common,
        )
        return tf.MixtralForCausalLM(cfg)
    if family == "bert":
        cfg = tf.BertConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            tie_word_embeddings=False,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        return tf.BertForMaskedLM(cfg)
    if family == "resnet":
        cfg = tf.ResNetConfig(
            num_channels=3,
            embedding_size=16,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            layer_type="basic",
            num_labels=10,
            downsample_in_first_stage=False,
        )
        return tf.ResNetForImageClassification(cfg)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def qk_params(model: nn.Module, family: str) -> list[nn.Parameter]:
    """The parameters whose LR the ``qk_growth`` arm grows: query and key projections (ResNet: first conv)."""
    if family == "resnet":
        names = ("embedder.embedder.convolution",)
    else:
        names = ("q_proj", "k_proj", ".query.", ".key.", "c_attn")
    return [p for n, p in model.named_parameters() if any(k in n for k in names)]


def head_params(model: nn.Module, family: str) -> list[nn.Parameter]:
    """The output head's parameters (the ``logit_drift`` arm)."""
    names = {"resnet": ("classifier",), "bert": ("cls.predictions.decoder",)}.get(family, ("lm_head",))
    return [p for n, p in model.named_parameters() if any(k in n for k in names)]


# ----------------------------------------------------------------------------- optimizers
class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): update = sign(beta1 m + (1 - beta1) g); m <- beta2 m + (1 - beta2) g."""

    def __init__(
        self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.1
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the hidden matrices, AdamW on the rest (embeddings, head, norms), as Muon is used.

    One optimizer object, so one guard program steps both; each group's ``lr`` (set by the scheduler)
    is copied into the inner optimizer before it steps."""

    def __init__(self, model: nn.Module, lr: float, adam_lr: float) -> None:
        hidden = [
            p
            for n, p in model.named_parameters()
            if p.ndim == 2 and "embed" not in n and "lm_head" not in n and "wte" not in n and "wpe" not in n
        ]
        ids = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if id(p) not in ids]
        self.muon = torch.optim.Muon(hidden, lr=lr, weight_decay=0.1)
        self.adamw = torch.optim.AdamW(rest, lr=adam_lr, betas=(0.9, 0.95), weight_decay=0.1)
        super().__init__([{"params": hidden, "lr": lr}, {"params": rest, "lr": adam_lr}], {})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        self.muon.param_groups[0]["lr"] = self.param_groups[0]["lr"]
        self.adamw.param_groups[0]["lr"] = self.param_groups[1]["lr"]
        self.muon.step()
        self.adamw.step()


def adamw(groups: list[dict[str, Any]], lr: float, **kw: Any) -> torch.optim.Optimizer:
    kw.setdefault("betas", (0.9, 0.95))
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1, **kw)


def second_optimizer(model: nn.Module, family: str) -> torch.optim.Optimizer:
    kind = SECOND[family][0]
    lr = SECOND_LR[kind]
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    if kind == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(model.parameters(), lr=lr, relative_step=False, scale_parameter=False, warmup_init=False)
    if kind == "muon":
        return MuonAdamW(model, lr, ADAMW_LR[family])
    return Lion(model.parameters(), lr=lr)


def grouped(model: nn.Module, special: list[nn.Parameter], decay_special: float = 0.1) -> list[dict[str, Any]]:
    ids = {id(p) for p in special}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": rest}, {"params": special, "weight_decay": decay_special}]


# ----------------------------------------------------------------------------- schedules
def schedule(kind: str, steps: int, ramp: float = RAMP) -> Callable[[int], float]:
    """LR multiplier per step: cosine (warmup 50), constant (warmup 20), wsd (warmup 50, last 20% linear
    to 0), restarts (cosine with period steps // 3, warmup 20), ramp (x RAMP, exponential)."""

    def f(t: int) -> float:
        if kind == "ramp":
            return ramp ** (t / steps)
        if kind == "constant":
            return min(1.0, (t + 1) / 20)
        if kind == "cosine":
            if t < 50:
                return (t + 1) / 50
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 50) / max(1, steps - 50)))
        if kind == "wsd":
            if t < 50:
                return (t + 1) / 50
            decay_from = int(steps * 0.8)
            return 1.0 if t < decay_from else max(0.0, 1 - (t - decay_from) / (steps - decay_from))
        if kind == "restarts":
            period = max(1, steps // 3)
            warm = min(1.0, (t + 1) / 20)
            return warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (t % period) / period)))
        raise ValueError(kind)

    return f


# ----------------------------------------------------------------------------- one run
class Rows:
    """A sink keeping each step's metrics (the guard logs every step here)."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows[step] = dict(metrics)


KEEP = (
    "grad_norm/",
    "loss",
    "update_ratio",
    "lr/",
    "monitors/attn_logit_max/",
    "monitors/logits_max/",
    "monitors/log_z/",
    "monitors/resid_norm/",
)
PREFIX = "stability/"


def column_of(key: str) -> str | None:
    """The corpus column of a logged metric, or None to drop it."""
    if not key.startswith(PREFIX):
        return None
    name = key[len(PREFIX) :]
    if name == "grad_norm/max":
        return None
    if name == "grad_norm/total":
        return "grad_norm"
    if name.startswith("grad_norm/"):
        return "layer/" + name[len("grad_norm/") :]
    if name == "loss" or name == "update_ratio" or name.startswith("lr/"):
        return name
    if name.startswith("update_ratio/"):
        return "update/" + name[len("update_ratio/") :]
    for signal in ("attn_logit_max", "logits_max", "log_z", "resid_norm"):
        if name.startswith(f"monitors/{signal}/"):
            return f"{signal}/" + name[len(f"monitors/{signal}/") :]
    return None


@dataclass
class Spec:
    family: str
    arm: str
    steps: int
    seed: int


def run(spec: Spec, checkpoint: dict[str, Any] | None) -> tuple[np.ndarray, list[str], dict[str, Any], Any]:
    """Train one run; its trace, column names, meta and (for ``adamw``) its final model state."""
    import stabilitykit as sk

    family, arm, steps = spec.family, spec.arm, spec.steps
    torch.manual_seed(spec.seed)
    model = build_model(family)
    if checkpoint is not None and arm.startswith("finetune"):
        model.load_state_dict(checkpoint)
    base = ADAMW_LR[family]
    kind, sched = "adamw", "cosine"
    lr_lambda: Any
    if arm == "adamw":
        opt = adamw(model.parameters(), base)
    elif arm == "second":
        kind, sched = SECOND[family]
        opt = second_optimizer(model, family)
    elif arm == "accum_bf16":
        opt, sched = adamw(model.parameters(), base), "wsd"
    elif arm == "finetune":
        opt, sched = adamw(model.parameters(), base / 3), "constant"
    elif arm == "lr_edge":
        kind, sched = SECOND[family][0], "ramp"
        opt = second_optimizer(model, family)
    elif arm in ("qk_growth", "logit_drift"):
        special = qk_params(model, family) if arm == "qk_growth" else head_params(model, family)
        opt = adamw(grouped(model, special, 0.1 if arm == "qk_growth" else 0.0), base)
        sched = "constant"
    elif arm == "adam_beta2":
        opt, sched = adamw(model.parameters(), 3 * base, betas=(0.9, 0.9999), eps=1e-12), "constant"
    elif arm == "burst":
        opt, sched = adamw(model.parameters(), 2 * base), "constant"
    elif arm == "finetune_hot":
        opt, sched = adamw(model.parameters(), 30 * base), "constant"
    else:
        raise ValueError(arm)
    if arm in ("qk_growth", "logit_drift"):
        warm, ramp = schedule("constant", steps), schedule("ramp", steps, GROUP_RAMP)
        lr_lambda = [warm, lambda t: warm(t) * ramp(t)]
    else:
        lr_lambda = schedule(sched, steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    micro = 2 if arm == "accum_bf16" else 1
    cfg = sk.StabilityConfig(
        log_every_n_steps=1,
        grad_norm=sk.GradNormConfig(per_layer=True, update_ratio=True),
        clip=sk.ClipConfig(mode="off"),
        skip=sk.SkipConfig(nonfinite=True, max_consecutive=None),
        spikes=sk.SpikeConfig(enabled=False),
        monitors=sk.MonitorConfig(),
    )
    rows = Rows()
    data = Data(family, arm, spec.seed + 1, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = sk.StabilityGuard(model, opt, config=cfg, scheduler=scheduler, sinks=[rows])
        model.train()
        for step in range(steps):
            for _ in range(micro):
                kwargs = data.batch(step, (IMAGE_BATCH if family == "resnet" else BATCH) // micro)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=arm == "accum_bf16"):
                    loss = model(**kwargs).loss
                guard.backward(loss / micro)
            guard.step()
            guard.zero_grad()
        guard.close()
    columns: list[str] = []
    for metrics in rows.rows.values():
        for key in metrics:
            col = column_of(key)
            if col is not None and col not in columns:
                columns.append(col)
    columns.sort(key=lambda c: (c not in ("loss", "grad_norm"), c != "grad_norm", c))
    trace = np.full((steps, len(columns)), np.nan, dtype=np.float32)
    index = {c: i for i, c in enumerate(columns)}
    ordered = sorted(rows.rows)
    for t, step in enumerate(ordered[:steps]):
        for key, value in rows.rows[step].items():
            col = column_of(key)
            if col is not None:
                trace[t, index[col]] = value
    meta = {
        "family": family,
        "arm": arm,
        "optimizer": kind,
        "schedule": "ramp (head / qk groups)" if arm in ("qk_growth", "logit_drift") else sched,
        "mechanism": MECHANISM[arm],
        "healthy_by_design": arm in HEALTHY_ARMS,
        "columns": columns,
    }
    state = copy.deepcopy(model.state_dict()) if arm == "adamw" else None
    return trace, columns, meta, state


def run_family(family: str, steps: int, arms: tuple[str, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    checkpoint = None
    for i, arm in enumerate(arms):
        start = time.perf_counter()
        trace, _, meta, state = run(Spec(family, arm, steps, seed=100 * FAMILIES.index(family) + i), checkpoint)
        if state is not None:
            checkpoint = state
        loss = trace[:, meta["columns"].index("loss")]
        meta["seconds"] = round(time.perf_counter() - start, 1)
        out[f"{family}/{arm}"] = (trace, meta)
        print(
            f"{family}/{arm}: {meta['seconds']}s, loss {np.nanmedian(loss[:20]):.3f} -> "
            f"{np.nanmedian(loss[-20:]):.3f} (max {np.nanmax(loss):.3g}, non-finite {int((~np.isfinite(loss)).sum())})",
            flush=True,
        )
    return out


def merge(parts: list[Path], out: Path) -> int:
    """One corpus from several (e.g. one file per family, trained in parallel)."""
    runs: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for part in parts:
        with np.load(part) as npz:
            meta = json.loads(str(npz["meta"]))
            runs.update(meta["runs"])
            arrays.update({key: npz[key] for key in meta["runs"]})
    for key, m in runs.items():
        m["steps"] = len(arrays[key])  # parts may differ in length (a family regenerated alone)
    steps = max(m["steps"] for m in runs.values())
    np.savez_compressed(out, meta=json.dumps({"steps": steps, "runs": runs}), **arrays)
    print(f"wrote {out}: {len(runs)} runs, {out.stat().st_size / 1e6:.2f} MB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--merge", nargs="*", help="merge these corpus files into --out instead of training")
    args = parser.parse_args(argv)
    if args.merge:
        return merge([Path(p) for p in args.merge], Path(args.out))
    families = [f for f in args.families.split(",") if f]
    arms = tuple(a for a in args.arms.split(",") if a)
    if any(a.startswith("finetune") for a in arms) and "adamw" not in arms:
        arms = ("adamw", *arms)
    start = time.perf_counter()
    results: dict[str, Any] = {}
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for part in pool.map(run_family, families, [args.steps] * len(families), [arms] * len(families)):
                results.update(part)
    else:
        for family in families:
            results.update(run_family(family, args.steps, arms))
    meta = {"steps": args.steps, "runs": {key: m for key, (_, m) in results.items()}}
    np.savez_compressed(args.out, meta=json.dumps(meta), **{key: t for key, (t, _) in results.items()})
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {len(results)} runs, {size / 1e6:.2f} MB, {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
