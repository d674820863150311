"""Monitors inside a model we did not write: a tiny random-init Hugging Face Llama on the CPU.

    python examples/monitors.py [--steps 160] [--out runs/monitors]

``StabilityConfig(monitors=sk.MonitorConfig())`` hooks the model's blocks, embeddings, final norm,
attention modules and LM head once; on every logging step (every 5 steps here) the hooks measure on
the device and the guard reads the values with the step's one device-to-host copy. From step 60 on,
the example multiplies the query projection of layer 1 by 1.04 after every step, as a runaway
attention logit would grow: the max attention logit of ``model.layers.1.self_attn`` climbs, and the
spike detector's trend rule raises a ``spike_warning`` naming that module, the signal and what to do
(add qk-norm or QK-clip, or lower the LR) once they stand 4x over their long-run level, while the
loss has not moved. Takes a few seconds; writes ``stability.jsonl`` (draw it with
``stabilitykit report``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import stabilitykit as sk

KEY = "stability/monitors/attn_logit_max/model.layers.{}.self_attn"


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--out", default="runs/monitors")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    config = sk.StabilityConfig(log_every_n_steps=5, monitors=sk.MonitorConfig())
    rows = Rows()
    guard = sk.StabilityGuard(
        model, optimizer, config=config, sinks=[sk.sinks.JsonlSink(out / "stability.jsonl"), rows]
    )
    warnings: list[sk.Event] = []
    guard.hooks.on("spike_warning", warnings.append)

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 96, (4, 16), generator=gen) for _ in range(4)]
    query = model.model.layers[1].self_attn.q_proj.weight
    print(f"{'step':>5} {'loss':>7} {'max logit L0':>13} {'max logit L1':>13} {'log Z':>7}")
    for step in range(args.steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
        if step >= 60:
            with torch.no_grad():
                query.mul_(1.04)  # the runaway: layer 1's queries grow 4% a step
        metrics = rows.rows.get(step)
        if metrics and step % 20 == 0:
            logits = [metrics[KEY.format(i)] for i in (0, 1)]
            log_z = metrics["stability/monitors/log_z/lm_head"]
            print(f"{step:>5} {metrics['stability/loss']:>7.3f} {logits[0]:>13.3f} {logits[1]:>13.3f} {log_z:>7.3f}")
    guard.close()
    for event in warnings:
        print(f"spike_warning at step {event.step}: {event.message}")
    last = rows.rows[max(step for step, row in rows.rows.items() if KEY.format(0) in row)]
    return {
        "warnings": [(e.step, e.details.get("signal")) for e in warnings],
        "max_logit": {i: last[KEY.format(i)] for i in (0, 1)},
        "jsonl": str(out / "stability.jsonl"),
    }


if __name__ == "__main__":
    main()
