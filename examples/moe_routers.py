"""Router monitors in a mixture of experts: a tiny random-init Hugging Face Mixtral on the CPU.

    python examples/moe_routers.py [--steps 40] [--bias-at 30]

``StabilityConfig(monitors=sk.MonitorConfig())`` finds the Mixtral's routers (``model.layers.0.mlp.gate``,
``model.layers.1.mlp.gate``) by itself and logs, on every logging step (every step here), the largest
expert's load over the mean, the fraction of dead experts, the router entropy and the router z-loss.
The model is trained as it should be, with the load-balancing loss in the loss
(``output_router_logits=True``). At step ``--bias-at`` one expert's gate row in layer 0 is pushed along
the mean direction of the hidden states the gate sees, as a bad update would leave it: that expert
takes the tokens on its side of that direction (about half of them: the load doubles), the
load-balancing loss pushes back while the training pulls further, and a ``router_collapse`` event names
the router and the expert a few sampled steps later (step 34 here). Takes a few seconds.
"""

from __future__ import annotations

import argparse
import io
from typing import Any

import torch
from transformers import MixtralConfig, MixtralForCausalLM

import stabilitykit as sk

EXPERT = 5


def _model() -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        output_router_logits=True,  # the load-balancing loss is only in the loss with this on
        router_aux_loss_coef=0.01,
    )
    return MixtralForCausalLM(config)


def _batch(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 96, (8, 32), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _bias_gate_row(model: MixtralForCausalLM, batch: dict[str, torch.Tensor]) -> None:
    gate = model.model.layers[0].mlp.gate
    seen: list[torch.Tensor] = []
    handle = gate.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    direction = seen[0].reshape(-1, seen[0].shape[-1]).mean(0)
    with torch.no_grad():
        gate.weight[EXPERT] += 40.0 * direction / direction.norm()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bias-at", type=int, default=30)
    args = parser.parse_args(argv)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = sk.StabilityConfig(log_every_n_steps=1, monitors=sk.MonitorConfig())
    guard = sk.StabilityGuard(model, optimizer, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])
    events: list[sk.Event] = []
    guard.hooks.on("router_collapse", events.append)
    loads: dict[int, float] = {}
    for step in range(args.steps):
        if step == args.bias_at:
            _bias_gate_row(model, _batch(step))
        guard.backward(model(**_batch(step)).loss)
        guard.step()
        guard.zero_grad()
        metrics = guard.engines[0].readout.last_host_metrics
        loads[step] = metrics["stability/monitors/expert_load_max/model.layers.0.mlp.gate"]
    guard.close()
    for event in events:
        print(event)
    print(f"layer 0 expert_load_max: {loads[args.bias_at - 1]:.2f} before the bias, {loads[args.bias_at]:.2f} after")
    return {"events": events, "loads": loads}


if __name__ == "__main__":
    main()
