"""What the monitors (``MonitorConfig``) cost per training step. Prints milliseconds and ratios.

    python benchmarks/monitors_overhead.py [--rounds 20] [--batch 4] [--context 256] [--device cpu]
        [--models gpt2,llama,gemma2,bert,tiny_llama]

Models, all 4 layers x 256 wide with 4 heads and a vocabulary of 8192 at context 256: HF GPT-2 (SDPA),
HF Llama (SDPA, 2 key-value heads), HF Gemma 2 (eager: a sliding window of 128, attention and final
logit soft-caps), HF BERT (masked LM, SDPA); and a tiny HF Llama (2 layers, 32 wide, the test
suite's ``tiny_llama``) at context 16; and MoE families (``mixtral``, ``qwen2_moe``, ``qwen3_moe``,
``olmoe``: 4 layers x 128, 8 experts, top-2, vocabulary 8192, context 128, from ``tests/moe_models.py``)
timed with the router monitors alone (``MonitorConfig`` with the other signals off; any other family
of ``tests/moe_models.py`` by its model type, e.g. ``--models deepseek_v3,gpt_oss``). Arms, run interleaved in one
process (round-robin, same batch, each its own copy of the same weights), every one a whole step
(forward, backward, ``guard.step()`` with fused AdamW, ``zero_grad``) with no logging step inside
the timed region (the tiny Llama gets ten times the rounds: its steps take milliseconds):

* ``base``: the guard without monitors; ``base_again``: the same on another copy (the noise floor);
* ``sampled``: the guard with ``MonitorConfig()``, the step sampled (every hook measures);
* ``unsampled``: the same guard on a step that is not sampled (every hook returns at once).

For the MoE families two more rows attribute the cost without subtracting two noisy medians: ``router
code, sampled`` is the CPU time spent inside the router monitor's own code on a sampled step (its hook's
measurement and the step's finish, timed around those calls), and ``device ops added`` counts the ATen ops
a sampled and an unsampled step run beyond the base step's (exact, from one step under a dispatch mode).

``default cadence`` is the mean over a logging interval of 10 steps (``log_every_n_steps=10``, one
sampled step and nine others). This is a script, not a test: timings depend on the machine; the
ratios are what to compare (medians over rounds). On the CPU each step is timed in CPU time of this
process (``time.process_time``: what a step computes, less moved by other jobs on a shared machine
than the wall clock; ``--clock wall`` for the wall clock); on CUDA in wall time after a synchronize.
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import stabilitykit as sk
from stabilitykit.testing.ops import count_device_ops

CADENCE = 10


def _gpt2(context: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=8192, n_positions=context, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    return GPT2LMHeadModel(config)


def _llama_256(context: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=context,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _gemma2(context: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=context, sliding_window=128,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attn_implementation="eager",
    )  # fmt: skip
    return Gemma2ForCausalLM(config)


def _bert(context: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=context, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForMaskedLM(config)


def _llama(context: int) -> torch.nn.Module:
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


#: The MoE families timed with their router monitors alone (``--models mixtral,...``).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ROUTERS_ONLY = sk.MonitorConfig(activations=False, attention=False, logits=False, residual=False)


def _moe(family: str) -> Callable[[int], torch.nn.Module]:
    """A 4-layer x 128 MoE of ``family`` (8 experts, top-2, vocabulary 8192), random init."""

    def make(context: int) -> torch.nn.Module:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from moe_models import tiny_moe

        changes = {
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
            "num_hidden_layers": 4,
            "head_dim": 32,
            "vocab_size": 8192,
            "max_position_embeddings": max(context, 64),
        }
        model = tiny_moe(family, seed=0)
        fields = {k: v for k, v in model.config.to_dict().items() if k != "layer_types"}  # rebuilt for 4 layers
        fields.update({k: v for k, v in changes.items() if k in fields})
        if "qk_rope_head_dim" in fields:  # multi-head latent attention: its head sizes are its own
            fields["head_dim"] = model.config.head_dim
        config = type(model.config)(**fields)
        torch.manual_seed(0)
        return type(model)(config)

    return make


def _ops(step: Callable[[], None]) -> int:
    with count_device_ops() as counter:
        step()
    return counter.ops


def _time_router_code(monitor: Any, spent: list[float]) -> None:
    """Add the CPU time of the router monitor's own code (each measurement, each finish) to ``spent[0]``."""
    routers = monitor.routers

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.process_time() - start

        return wrapper

    routers._measure = timed(routers._measure)  # instance attributes: the hooks and the engine call these
    routers.finish = timed(routers.finish)


def _arm(
    model: torch.nn.Module,
    monitors: bool,
    sampled: bool,
    batch: dict[str, torch.Tensor],
    config: sk.MonitorConfig | None = None,
    router_time: list[float] | None = None,
) -> Callable[[], None]:
    """One whole training step of ``model`` under a guard; the monitor's sampling is set by hand.
    ``router_time``: a one-element list the router monitor's own CPU time is added to."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    cfg = sk.StabilityConfig(
        log_every_n_steps=10**9,  # step 0 logs (untimed warm-up); no timed step does
        monitors=(config or sk.MonitorConfig()) if monitors else None,
        precision=sk.PrecisionConfig(report_choice=False),
    )
    guard = sk.StabilityGuard(model, opt, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])
    monitor = guard.engines[0].monitor
    if router_time is not None and monitor is not None and monitor.routers is not None:
        _time_router_code(monitor, router_time)

    def step() -> None:
        if monitor is not None:
            monitor.sampling = sampled  # what begin_step decides at a sampled / unsampled step
        guard.backward(model(**batch).loss)
        guard.step()
        guard.zero_grad()
        if monitor is not None:
            monitor.stability_metrics()  # what the logging read takes (drops the device values)

    return step


def _time(fn: Callable[[], None], device: torch.device, clock: Callable[[], float]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - start


def measure(
    name: str, make: Callable[[int], torch.nn.Module], context: int, args: argparse.Namespace, rounds: int
) -> None:
    device = torch.device(args.device)
    base_model = make(context).to(device)
    config = ROUTERS_ONLY if name.startswith("HF MoE") else None
    router_time = [0.0] if config is not None else None
    vocab = base_model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, context), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    arms = {
        "base": _arm(copy.deepcopy(base_model), False, False, batch),
        "base_again": _arm(copy.deepcopy(base_model), False, False, batch),
        "sampled": _arm(copy.deepcopy(base_model), True, True, batch, config, router_time),
        "unsampled": _arm(copy.deepcopy(base_model), True, False, batch, config),
    }
    for fn in arms.values():  # warm-up: the logging step 0, allocator, kernels
        for _ in range(2):
            fn()
    ops = {k: _ops(arms[k]) for k in ("base", "sampled", "unsampled")} if router_time is not None else {}
    times: dict[str, list[float]] = {k: [] for k in arms}
    if router_time is not None:
        router_time[0] = 0.0
    cpu_clock = device.type == "cpu" and args.clock == "cpu"
    clock = time.process_time if cpu_clock else time.perf_counter
    for _ in range(rounds):
        for key, fn in arms.items():
            times[key].append(_time(fn, device, clock))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["base"]
    cadence = (med["sampled"] + (CADENCE - 1) * med["unsampled"]) / CADENCE
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    what = "CPU time" if cpu_clock else "wall time"
    print(f"\n{name}: batch {args.batch}, context {context}, {rounds} rounds, {device}{threads}, {what}")
    print(f"{'arm':<22}{'ms/step':>10}{'vs base':>10}")
    for label, value in [
        ("base", base),
        ("base again (noise)", med["base_again"]),
        ("sampled step", med["sampled"]),
        ("unsampled step", med["unsampled"]),
        (f"default cadence ({CADENCE})", cadence),
    ]:
        print(f"{label:<22}{value * 1e3:>10.2f}{(value / base - 1) * 100:>+9.1f}%")
    if router_time is not None:
        own = router_time[0] / rounds
        print(f"{'router code, sampled':<22}{own * 1e3:>10.2f}{own / base * 100:>+9.1f}%")
        added = {k: ops[k] - ops["base"] for k in ("sampled", "unsampled")}
        print(f"device ops added: sampled {added['sampled']} (base {ops['base']}), unsampled {added['unsampled']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU; 1 on a busy machine)")
    parser.add_argument("--models", default="gpt2,llama,gemma2,bert,tiny_llama", help="comma-separated")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="on the CPU: process CPU time or wall")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    models = {
        "gpt2": ("HF GPT-2, 4 layers x 256", _gpt2, args.context, args.rounds),
        "llama": ("HF Llama, 4 layers x 256", _llama_256, args.context, args.rounds),
        "gemma2": ("HF Gemma 2 (eager, window, soft-caps), 4 layers x 256", _gemma2, args.context, args.rounds),
        "bert": ("HF BERT masked LM, 4 layers x 256", _bert, args.context, args.rounds),
        "tiny_llama": ("tiny HF Llama, 2 layers x 32", _llama, 16, args.rounds * 10),  # ms steps: more rounds
    }
    for family in [*MOE_FAMILIES, *(k for k in args.models.split(",") if k not in models)]:
        models[family] = (
            f"HF MoE {family}, 4 layers x 128, 8 experts top-2, router monitors only",
            _moe(family),
            128,
            args.rounds,
        )
    for key in args.models.split(","):
        name, make, context, rounds = models[key]
        measure(name, make, context, args, rounds)


if __name__ == "__main__":
    main()
