"""FP8 training with torchao, emulated on the CPU: the precision report's FP8 rows, then the FP8 monitors.

    python examples/fp8.py [--steps 40] [--out runs/fp8]      # needs the fp8 extra: pip install "stabilitykit[fp8]"

A tiny random-init Hugging Face Llama. First ``sk.precision_eval.evaluate(..., variants=("bf16",
"fp8"))`` compares bf16 autocast and torchao's float8 linear layers against fp32, layer by layer
(the "fp8" variant converts a copy; on a device without FP8 matmuls it is emulated, with the very
casts of the real layer). Then the model itself is converted with ``convert_to_float8_training``
(``Float8LinearConfig(emulate=True)`` on the CPU) and trained under the guard with
``MonitorConfig()``: every logging step measures each ``Float8Linear``'s input, weight and
output-gradient casts. From step 20 on, one value a million times larger than the rest enters
``model.layers.0.mlp.down_proj``'s input (a massive activation): per-tensor scaling turns every
other value of that input into zero, its ``fp8_underflow`` jumps to about 1, and an ``fp8_warning``
names that layer and role; with ``--fallback`` the layer then runs in high precision. Writes
``stability.jsonl`` and ``precision.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import stabilitykit as sk

LAYER = "model.layers.0.mlp.down_proj"
UNDERFLOW = f"stability/monitors/fp8_underflow/{LAYER}/input"


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,  # every linear dimension a multiple of 16, as FP8 GEMMs need
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


class Rows:
    """A sink (any object with ``log_metrics``) that keeps each logging step's metrics."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows[step] = dict(metrics)


class MassiveActivation:
    """A forward pre-hook that, once ``on``, puts one value 10^6 times the largest of the rest into the input."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if not self.on:
            return None
        x = args[0].clone()
        x.view(-1)[0] = 1e6 * x.detach().abs().max()
        return (x,)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/fp8")
    parser.add_argument("--fallback", action="store_true", help="run a warned layer in high precision")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 96, (8, 16), generator=gen) for _ in range(4)]

    # 1. the report: what FP8 casting costs each layer, next to bf16
    report = sk.precision_eval.evaluate(
        _model(), batches[0], lambda m, ids: m(input_ids=ids, labels=ids).loss, variants=("bf16", "fp8"), progress=False
    )
    report.print()
    report.save_json(out / "precision.json")
    fp8 = {r["module"]: r["rms_rel"] for r in report.variants["fp8"]["forward"]}
    bf16 = {r["module"]: r["rms_rel"] for r in report.variants["bf16"]["forward"]}
    converted = report.notes["fp8"]["converted"]
    print(f"{LAYER}: forward rms_rel fp8 {fp8[LAYER]:.2e}, bf16 {bf16[LAYER]:.2e}")

    # 2. training in FP8 (emulated on the CPU) with the monitors
    model = _model()
    emulate = not sk.select_precision(log_choice=False).fp8_capable
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate))
    outlier = MassiveActivation()
    dict(model.named_modules())[LAYER].register_forward_pre_hook(outlier, prepend=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitors = sk.MonitorConfig(fp8=sk.Fp8MonitorConfig(fallback=args.fallback))
    config = sk.StabilityConfig(log_every_n_steps=5, monitors=monitors)
    rows = Rows()
    guard = sk.StabilityGuard(
        model, optimizer, config=config, sinks=[sk.sinks.JsonlSink(out / "stability.jsonl"), rows]
    )
    warnings: list[sk.Event] = []
    guard.hooks.on("fp8_warning", warnings.append)
    print(f"{'step':>5} {'loss':>7} {'underflow':>10}  ({LAYER} input)")
    for step in range(args.steps):
        outlier.on = step >= 20
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
        metrics = rows.rows.get(step)
        if metrics and UNDERFLOW in metrics:
            print(f"{step:>5} {metrics['stability/loss']:>7.3f} {metrics[UNDERFLOW]:>10.4f}")
    guard.close()
    for event in warnings:
        print(f"fp8_warning at step {event.step}: {event.message}")
    return {
        "converted": converted,
        "fp8_rms_rel": fp8[LAYER],
        "bf16_rms_rel": bf16[LAYER],
        "warnings": [(e.step, e.details["layer"], e.details["role"], e.details["fallback"]) for e in warnings],
        "jsonl": str(out / "stability.jsonl"),
    }


if __name__ == "__main__":
    main()
