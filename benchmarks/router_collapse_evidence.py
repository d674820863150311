"""Evidence for the ``"router_collapse"`` defaults (``RouterConfig.collapse_load``, ``collapse_dead``,
``collapse_steps``): how far healthy tiny MoE runs and runs with one biased gate row go. Prints a table.

    python benchmarks/router_collapse_evidence.py [--steps 100] [--families mixtral,qwen2_moe,...] [--seeds 2]

Each family (tiny random-init ``transformers`` model: 2 layers, 8 experts, top-2, 32 wide, from
``tests/moe_models.py``) is trained with AdamW (lr 1e-3) on random tokens (batch 8 x 32, one row half
padding), every step sampled:

* ``healthy``: the load-balancing loss on (``output_router_logits=True``), ``--steps`` steps;
* ``no_aux``: the same without it (the transformers default: the trap the aux-loss warning names);
* ``bias_update``: healthy, and every router with a score-correction bias (DeepSeek-V3's
  ``e_score_correction_bias``) has it updated after each step as DeepSeek-V3's aux-loss-free balancing
  does (``bias += gamma * sign(mean load - expert load)``, gamma 0.001 as in the DeepSeek-V3 report):
  the balancing the family is built for and ``transformers`` does not run in training;
* ``biased``: healthy, with one expert's gate row in layer 0 pushed along the mean hidden-state
  direction (strength 20), 3 steps.

Per run: the largest ``concentration`` (expert_load_max as a fraction of the way from balance, 1.0,
to the most concentrated load possible, experts / k) and the largest ``experts_dead`` over routers and
steps, and the longest streak of steps at or above each candidate ``collapse_load``. Mixtral and
Qwen2-MoE are the families the defaults were read from; the rest are held out.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_models import padded_batch, tiny_moe

import stabilitykit as sk
from stabilitykit.monitors.routers import chosen_experts

BIAS_GAMMA = 1e-3

ONLY_ROUTERS = {"activations": False, "attention": False, "logits": False, "residual": False}
CANDIDATES = (0.3, 0.4, 0.5, 0.6)


def _gate(model: torch.nn.Module, routers: list[str]) -> torch.nn.Module:
    return dict(model.named_modules())[routers[0]]


def _balance_by_bias(model: nn.Module) -> list[object]:
    """Hooks that keep, per router with an ``e_score_correction_bias``, the tokens each expert got in the
    step; ``_update_biases`` moves the bias against the load (aux-loss-free balancing)."""
    handles: list[object] = []
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if not isinstance(bias, torch.Tensor):
            continue

        def count(m: nn.Module, args: object, output: object, bias: torch.Tensor = bias) -> None:
            rows = bias.numel()
            logits = output[0] if isinstance(output, tuple) else output
            chosen = chosen_experts(output, logits.reshape(-1, rows).shape[0])
            if chosen is not None:
                load = torch.bincount(chosen.reshape(-1), minlength=rows).float()
                BIAS_LOADS.setdefault(id(bias), [bias, torch.zeros(rows)])[1].add_(load)

        handles.append(module.register_forward_hook(count))
    return handles


BIAS_LOADS: dict[int, list[torch.Tensor]] = {}


def _update_biases() -> None:
    with torch.no_grad():
        for bias, load in BIAS_LOADS.values():
            bias.add_(BIAS_GAMMA * torch.sign(load.mean() - load))
            load.zero_()


def run(family: str, arm: str, steps: int, seed: int, aux: float | None = None, lr: float = 1e-3) -> dict[str, float]:
    changes = {} if aux is None else {"router_aux_loss_coef": aux}
    model = tiny_moe(family, seed=seed, **changes)
    model.train()
    cfg = sk.StabilityConfig(log_every_n_steps=1, monitors=sk.MonitorConfig(**ONLY_ROUTERS))
    guard = sk.StabilityGuard(
        model,
        torch.optim.AdamW(model.parameters(), lr=lr),
        config=cfg,
        sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())],
    )
    monitor = guard.engines[0].monitor
    assert monitor is not None and monitor.routers is not None
    routers = monitor.routers.names
    if arm == "biased":
        gate = _gate(model, routers)
        seen: list[torch.Tensor] = []
        handle = gate.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
        with torch.no_grad():
            model(**padded_batch(8, 32, seed=1000 + seed), use_cache=False)
        handle.remove()
        direction = seen[0].mean(0)
        with torch.no_grad():
            gate.weight[1] += 20.0 * direction / direction.norm()
        steps = 3
    if arm == "bias_update":
        BIAS_LOADS.clear()
        balancing = _balance_by_bias(model)
        assert balancing, f"{family} has no e_score_correction_bias to update"
    worst, dead = 0.0, 0.0
    streaks = {c: 0 for c in CANDIDATES}
    longest = {c: 0 for c in CANDIDATES}
    for step in range(steps):
        batch = padded_batch(8, 32, seed=seed * 10_000 + step)
        out = model(**batch, output_router_logits=arm != "no_aux", use_cache=False)
        guard.backward(out.loss)
        guard.step()
        guard.zero_grad()
        if arm == "bias_update":
            _update_biases()
        metrics = guard.engines[0].readout.last_host_metrics
        step_worst = 0.0
        for name in routers if arm != "biased" else routers[:1]:
            router = next(r for r in monitor.routers.routers if r.name == name)
            ceiling = router.experts / max(router.k, 1)
            load = metrics[f"stability/monitors/expert_load_max/{name}"]
            step_worst = max(step_worst, (load - 1.0) / (ceiling - 1.0))
            dead = max(dead, metrics[f"stability/monitors/experts_dead/{name}"])
        worst = max(worst, step_worst)
        for c in CANDIDATES:
            streaks[c] = streaks[c] + 1 if step_worst >= c else 0
            longest[c] = max(longest[c], streaks[c])
    guard.close()
    return {"concentration": worst, "dead": dead, **{f"streak@{c}": longest[c] for c in CANDIDATES}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--families", default="mixtral,qwen2_moe,qwen3_moe,olmoe,deepseek_v3,gpt_oss")
    parser.add_argument("--arms", default="healthy,no_aux,biased")
    parser.add_argument("--aux", type=float, default=None, help="router_aux_loss_coef (default: the family's)")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    head = f"{'family':<14}{'arm':<9}{'seed':>5}{'concentration':>15}{'dead':>7}" + "".join(
        f"{'streak@' + str(c):>12}" for c in CANDIDATES
    )
    print(head)
    for family in args.families.split(","):
        for arm in args.arms.split(","):
            for seed in range(args.seeds):
                row = run(family, arm, args.steps, seed, args.aux, args.lr)
                print(
                    f"{family:<14}{arm:<9}{seed:>5}{row['concentration']:>15.3f}{row['dead']:>7.3f}"
                    + "".join(f"{row['streak@' + str(c)]:>12}" for c in CANDIDATES),
                    flush=True,
                )


if __name__ == "__main__":
    main()
