"""Mixture-of-experts router monitors on tiny random-init ``transformers`` MoE models of every family that
builds on the CPU (no mocks): each logged value against the model's own router logits of the same forward,
with and without padding; the collapse event, the aux-loss warning, skip rules reading the values,
torch.compile, a user's own router."""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import pytest
import torch
from moe_models import moe_families, padded_batch, tiny_mixtral, tiny_moe

import stabilitykit as sk

ONLY_ROUTERS = {"activations": False, "attention": False, "logits": False, "residual": False}

#: The families checked value by value: every MoE family of the installed transformers (5.24) with a
#: causal-LM head that builds and trains as a tiny model on the CPU within a second or two.
TESTED = [
    "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "doge", "dots1", "dots3_note", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
    "gemma4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "jamba", "jetmoe", "kimi_linear",
    "kolibri1", "laguna", "lara_mini", "lfm2_moe", "llama4", "longcat_flash", "mellum", "mimo_v2_flash", "minimax",
    "minimax_m2", "mixtral", "nemotron_h", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "qwen4_exp", "solar_open", "zaya",
]  # fmt: skip
#: The others, and why they are not in the value-by-value matrix (found automatically all the same).
NOT_TESTED: dict[str, str] = {}


#: The tested families that score experts with a sigmoid (normalised for the entropy), read in their code.
SIGMOID_FAMILIES = {
    "afmoe", "axk1", "axk2", "deepseek_v3", "deepseek_v32", "exaone_moe", "flint", "glm4_moe", "glm4_moe_lite",
    "hy_v3", "hy_v4", "kolibri1", "laguna", "minimax_m2", "solar_open", "glm_moe_dsa", "dots1", "lfm2_moe",
    "nemotron_h", "llama4_text", "bailing_hybrid", "kimi_linear", "beam", "dots3_note_text", "mimo_v2_flash",
}  # fmt: skip
#: Tested families whose config names a scoring of its own (``scoring_func``).
CONFIG_SCORED = {"deepseek_v4"}
#: Tested families whose routers return no top-k weights to compare the scoring with, and why.
OWN_WEIGHTS_NOT_COMPARED = {
    "llama4_text": "its router returns sigmoid scores over all experts (-inf but the top-k) and no chosen experts",
    "dbrx": "its router returns the logits only (the top-k of their softmax is taken in its FFN)",
    "jetmoe": "its gate returns the top-k weights flattened and sorted by expert (a softmax over the top-k logits)",
    "phimoe": "its weights come from sparsemixer (a masked softmax per chosen expert, with jitter), no scoring of all",
    "doge": "its router returns its two product-key halves only (the weights are a softmax over the top-k sums)",
    "gemma4_text": "its top-k weights are scaled per expert (per_expert_scale) after normalising",
}


def _guard(model: torch.nn.Module, rules: list[Any] | None = None, **monitors: Any) -> sk.StabilityGuard:
    cfg = sk.StabilityConfig(log_every_n_steps=1, monitors=sk.MonitorConfig(**{**ONLY_ROUTERS, **monitors}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return sk.StabilityGuard(
        model, opt, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())], rules=rules or []
    )


def routing_probs(rows: torch.Tensor, scoring: str) -> torch.Tensor:
    """The routing distribution as the family computes it: softmax, or sigmoid (sqrt-softplus) scores summing to 1."""
    if scoring in ("sigmoid", "sqrtsoftplus"):
        scores = rows.sigmoid() if scoring == "sigmoid" else torch.nn.functional.softplus(rows).sqrt()
        return scores / scores.sum(-1, keepdim=True)
    return rows.softmax(-1)


def reference(
    logits: torch.Tensor,
    mask: torch.Tensor | None,
    k: int,
    scoring: str = "softmax",
    chosen: torch.Tensor | None = None,
    experts: int | None = None,
) -> dict[str, float]:
    """The four router values computed from one router's logits the model returned (``output.router_logits``):
    the top ``k`` of the logits counted, or ``chosen`` where the family's own rule says otherwise, over the
    first ``experts`` classes (all of them unless given)."""
    rows = logits.detach().float().reshape(-1, logits.shape[-1])
    classes = rows.shape[-1]
    experts = classes if experts is None else experts
    w = torch.ones(rows.shape[0])
    if mask is not None and mask.numel() == rows.shape[0]:
        w = mask.reshape(-1).float()
    chosen = rows.topk(k, dim=-1).indices if chosen is None else chosen
    counts = torch.zeros(experts)
    for row in range(rows.shape[0]):
        for e in chosen[row].tolist():
            if e < experts:
                counts[e] += w[row]
    p = routing_probs(rows, scoring)
    entropy = -(p * p.log()).sum(-1) / math.log(classes)
    z = rows.logsumexp(-1) ** 2
    return {
        "expert_load_max": float(counts.max() * experts / counts.sum()),
        "experts_dead": float((counts == 0).float().mean()),
        "router_entropy": float((entropy * w).sum() / w.sum()),
        "router_z": float((z * w).sum() / w.sum()),
    }


def _step(guard: sk.StabilityGuard, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    out = model(**batch, output_router_logits=True, use_cache=False)
    guard.backward(out.loss)
    guard.step()
    guard.zero_grad()
    return out


def _weights_follow_the_scoring(outputs: list[Any], scoring: str) -> int:
    """Each router output that holds the family's own top-k weights (a float (rows, k) tensor beside the
    chosen experts): those weights, normalised, are the routing probabilities of the chosen experts,
    normalised (``scoring`` is the family's own computation). Returns how many outputs were checked."""
    checked = 0
    for output in outputs:
        if not isinstance(output, tuple):
            continue
        logits = next(t for t in output if isinstance(t, torch.Tensor) and t.is_floating_point())
        rows = logits.detach().float().reshape(-1, logits.shape[-1])
        ints = [t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2]
        weights = [t for t in output if isinstance(t, torch.Tensor) and t is not logits and t.is_floating_point()]
        weights = [t for t in weights if ints and tuple(t.shape) == tuple(ints[0].shape)]
        if not ints or not weights or ints[0].shape[-1] < 2:
            continue
        chosen = ints[0].long()
        own = weights[0].detach().float()
        own = own / own.sum(-1, keepdim=True)
        ours = routing_probs(rows, scoring).gather(1, chosen)
        torch.testing.assert_close(ours / ours.sum(-1, keepdim=True), own, atol=1e-4, rtol=1e-3)
        checked += 1
    return checked


def _own_rules(
    family: str, router_logits: list[torch.Tensor], proj: list[torch.Tensor], k: int
) -> list[tuple[torch.Tensor, torch.Tensor | None, int | None]]:
    """(logits over the experts, the chosen experts or None for the top-k, the real experts or None) for each
    router logits tensor the model returned, by the family's own routing rule, read in its code:

    * Doge (product keys): its router logits are the two halves (2, tokens, keys); expert i * keys + j scores
      x[i] + y[j], and its top-k is over those sums.
    * ZAYA: the last of its experts + 1 classes is a skip expert with no compute; it chooses the top-k of
      softmax(logits) + its balancing biases (the test sets them to 0, so the skip class is chosen too).
    * Gemma 4: its router returns the softmax of its ``proj``, so the logits are ``proj``'s output (checked
      against the probabilities it returned).
    """
    if family == "doge":
        return [((t[0][:, :, None] + t[1][:, None, :]).reshape(t.shape[1], -1), None, None) for t in router_logits]
    if family == "zaya":
        return [(t, (t.float().softmax(-1)).topk(k, dim=-1).indices, t.shape[-1] - 1) for t in router_logits]
    if family == "gemma4_text":
        assert len(proj) == len(router_logits)
        for logits, probs in zip(proj, router_logits, strict=True):
            torch.testing.assert_close(logits.float().softmax(-1).reshape(probs.shape), probs.float())
        return [(t, None, None) for t in proj]
    return [(t, None, None) for t in router_logits]


def _check_against_reference(model: torch.nn.Module, guard: sk.StabilityGuard, batch: dict[str, torch.Tensor]) -> int:
    monitor = guard.engines[0].monitor
    assert monitor is not None and monitor.routers is not None
    outputs: list[Any] = []
    proj: list[torch.Tensor] = []
    handles = [
        r.module.register_forward_hook(lambda m, a, output: outputs.append(output)) for r in monitor.routers.routers
    ] + [
        r.module.proj.register_forward_hook(lambda m, a, output: proj.append(output.detach()))
        for r in monitor.routers.routers
        if type(r.module).__name__ == "Gemma4TextRouter"
    ]
    out = _step(guard, model, batch)
    for handle in handles:
        handle.remove()
    scoring = monitor.routers.scoring
    family = model.config.model_type
    if family in CONFIG_SCORED:
        assert scoring == model.config.scoring_func
    else:
        assert scoring == ("sigmoid" if family in SIGMOID_FAMILIES else "softmax")
    if family not in OWN_WEIGHTS_NOT_COMPARED and monitor.routers.routers[0].k >= 2:  # top-1: all 1
        assert _weights_follow_the_scoring(outputs, scoring), "no router output with top-k weights to compare"
    names = monitor.routers.names
    logits = [t for t in (out.router_logits or ()) if t is not None]
    assert names and len(logits) == len(names), (names, [tuple(t.shape) for t in logits])
    metrics = guard.engines[0].readout.last_host_metrics
    k = monitor.routers.routers[0].k  # TOP_K, or a top-1 family's own
    mask = batch.get("attention_mask")
    expected = [reference(t, mask, k, scoring, c, e) for t, c, e in _own_rules(family, logits, proj, k)]
    for name in names:  # the model's order of calls may differ from its modules' (JetMoE: attention experts)
        got = {signal: metrics[f"stability/monitors/{signal}/{name}"] for signal in expected[0]}
        match = [e for e in expected if all(got[k] == pytest.approx(v, abs=1e-4, rel=1e-4) for k, v in e.items())]
        assert match, (name, got, expected)
        expected.remove(match[0])
    return len(names)


@pytest.mark.parametrize("family", TESTED)
def test_router_values_equal_the_models_own_router_logits_with_and_without_padding(family: str) -> None:
    model = tiny_moe(family)
    if family == "zaya":  # its skip expert (last class) chosen like the others: its bias -1 -> 0
        for module in model.modules():
            if hasattr(module, "balancing_biases"):
                module.balancing_biases.zero_()
    guard = _guard(model)
    padded = padded_batch(seed=1)
    routers = _check_against_reference(model, guard, padded)
    unpadded = {k: v for k, v in padded_batch(seed=2).items() if k != "attention_mask"}
    unpadded["labels"] = unpadded["input_ids"].clone()
    assert _check_against_reference(model, guard, unpadded) == routers
    guard.close()


def test_every_moe_family_of_transformers_is_tested_or_named() -> None:
    families = set(moe_families())
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"} <= set(TESTED)
    assert families == set(TESTED) | set(NOT_TESTED), families ^ (set(TESTED) | set(NOT_TESTED))


def _bias_gate_row(model: torch.nn.Module, expert: int, strength: float = 20.0) -> None:
    """Push every token of layer 0 to ``expert``: its gate row gets a large component along the mean
    direction of the hidden states the gate sees (a biased gate row, as a bad update would leave it)."""
    gate = model.model.layers[0].mlp.gate
    seen: list[torch.Tensor] = []
    handle = gate.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1]))
    )
    with torch.no_grad():
        model(**padded_batch(seed=99))
    handle.remove()
    direction = seen[0].mean(0)
    with torch.no_grad():
        gate.weight[expert] += strength * direction / direction.norm()


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_biased_gate_row_raises_router_collapse_naming_that_router_within_three_sampled_steps(family: str) -> None:
    model = tiny_mixtral() if family == "mixtral" else tiny_moe(family)
    model.train()
    if family == "mixtral":
        _bias_gate_row(model, expert=5)
    else:  # a stuck score-correction bias: +1 on a sigmoid score in (0, 1) wins every token's top-k
        with torch.no_grad():
            model.model.layers[0].mlp.gate.e_score_correction_bias[5] += 1.0
    guard = _guard(model)
    events: list[sk.Event] = []
    guard.hooks.on("router_collapse", events.append)
    for seed in range(3):
        _step(guard, model, padded_batch(seed=seed))
    assert events, "no router_collapse within 3 sampled steps"
    assert {e.details["router"] for e in events} == {"model.layers.0.mlp.gate"}
    assert 5 in events[0].details["experts"]
    # DeepSeek-V3 balances with a score-correction bias transformers never updates: the advice names it
    bias = events[0].details["balancing_bias"]
    assert bias == (None if family == "mixtral" else "model.layers.0.mlp.gate.e_score_correction_bias")
    assert ("score-correction bias" in events[0].message) == (family != "mixtral")
    guard.close()


def test_a_healthy_tiny_moe_raises_nothing_in_100_sampled_steps() -> None:
    # healthy: the load-balancing loss in the loss (coefficient 0.01, as Switch and OLMoE use), lr 3e-4
    model = tiny_mixtral(output_router_logits=True, router_aux_loss_coef=0.01)
    guard = sk.StabilityGuard(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-4),
        config=sk.StabilityConfig(log_every_n_steps=1, monitors=sk.MonitorConfig(**ONLY_ROUTERS)),
        sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())],
    )
    events: list[sk.Event] = []
    guard.hooks.on("*", events.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(100):
            out = model(**padded_batch(8, 32, seed=step))
            guard.backward(out.loss)
            guard.step()
            guard.zero_grad()
    guard.close()
    assert [e for e in events if e.kind == "router_collapse"] == []
    assert not [w for w in caught if "load-balancing" in str(w.message)]


def test_the_aux_loss_warning_appears_once_when_router_logits_are_not_output() -> None:
    model = tiny_mixtral()  # output_router_logits=False: the config's default
    guard = _guard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(4):
            out = model(**padded_batch(seed=seed))
            guard.backward(out.loss)
            guard.step()
            guard.zero_grad()
    guard.close()
    aux = [w for w in caught if "load-balancing loss is not in your loss" in str(w.message)]
    assert len(aux) == 1, [str(w.message) for w in caught]
    assert aux[0].filename == __file__, aux[0].filename  # the user's guard.step() line, not the monitor's


@pytest.mark.parametrize("how", ["config", "keyword"])
def test_no_aux_loss_warning_when_router_logits_are_output(how: str) -> None:
    model = tiny_mixtral(output_router_logits=how == "config")
    guard = _guard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            batch = padded_batch(seed=seed)
            out = model(**batch, output_router_logits=True) if how == "keyword" else model(**batch)
            guard.backward(out.loss)
            guard.step()
            guard.zero_grad()
    guard.close()
    assert not [w for w in caught if "load-balancing" in str(w.message)]


class LoadRule(sk.SkipRule):
    """Skip a step whose layer-0 router sends more than twice the mean load to one expert."""

    name = "router_load"

    def flag(self, values: sk.StepValues) -> torch.Tensor:
        return values["monitors/expert_load_max/model.layers.0.mlp.gate"] > 2.0


def test_skip_rules_read_router_values_on_sampled_steps_and_nan_elsewhere() -> None:
    model = tiny_mixtral()
    _bias_gate_row(model, expert=2, strength=40.0)
    cfg = sk.StabilityConfig(log_every_n_steps=2, monitors=sk.MonitorConfig(**ONLY_ROUTERS))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = sk.StabilityGuard(
        model, opt, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())], rules=[LoadRule()]
    )
    reasons = []
    for seed in range(4):
        out = model(**padded_batch(seed=seed))
        guard.backward(out.loss)
        report = guard.step()
        guard.zero_grad()
        reasons.append(report.reason)
    guard.close()
    assert reasons == ["router_load", None, "router_load", None]  # sampled on logging steps 0 and 2 only


def test_the_spike_detector_can_watch_router_values_as_precursors() -> None:
    model = tiny_mixtral()
    guard = _guard(model, precursors=["router_z", "expert_load_max"])
    monitor = guard.engines[0].monitor
    assert monitor is not None
    assert monitor.is_precursor("monitors/router_z/model.layers.0.mlp.gate")
    assert not monitor.is_precursor("monitors/router_entropy/model.layers.0.mlp.gate")
    guard.close()


class TinyMoE(torch.nn.Module):
    """A user's own MoE layer: a linear router returning logits only, top-1 experts."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        choice = logits.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (choice == e).unsqueeze(-1) * expert(x)
        return out


def test_a_users_own_router_is_named_in_the_config() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(TinyMoE(), TinyMoE())
    guard = _guard(model, routers=sk.RouterConfig(modules=["*.router"], top_k=1))
    x = torch.randn(64, 16)
    seen: list[torch.Tensor] = []
    handle = model[1].router.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    guard.backward(model(x).square().mean())
    guard.step()
    handle.remove()
    metrics = guard.engines[0].readout.last_host_metrics
    expected = reference(seen[0], None, 1)
    for signal, value in expected.items():
        assert metrics[f"stability/monitors/{signal}/1.router"] == pytest.approx(value, abs=1e-4)
    assert "stability/monitors/expert_load_max/0.router" in metrics
    guard.close()
    with pytest.raises(ValueError, match="names no module"):
        sk.StabilityGuard(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            config=sk.StabilityConfig(monitors=sk.MonitorConfig(routers=sk.RouterConfig(modules=["*.gate"]))),
        )


def test_compiled_mixtral_logs_the_same_values_with_no_graph_breaks_from_the_monitors() -> None:
    """Graph breaks are Dynamo's, whatever the backend: the monitored model compiled with ``eager`` and with
    ``aot_eager`` (its values through AOTAutograd too) breaks no more than the bare model compiled with
    ``eager``; the values equal the uncompiled model's under both backends.
    One layer: one router is enough to trace the hooks."""
    from torch._dynamo.utils import counters

    def run(backend: str | None, monitors: bool) -> tuple[dict[str, float], int]:
        torch._dynamo.reset()
        counters.clear()
        model = tiny_mixtral(num_hidden_layers=1)
        compiled = torch.compile(model, backend=backend) if backend is not None else model
        cfg = sk.StabilityConfig(log_every_n_steps=2, monitors=sk.MonitorConfig(**ONLY_ROUTERS) if monitors else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = sk.StabilityGuard(compiled, opt, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])
        for seed in range(3):  # steps 0 and 2 sampled, step 1 not: both variants of the graph
            guard.backward(compiled(**padded_batch(seed=seed)).loss)
            guard.step()
            guard.zero_grad()
        metrics = dict(guard.engines[0].readout.last_host_metrics)
        guard.close()
        breaks = sum(counters["graph_break"].values())
        torch._dynamo.reset()
        return metrics, breaks

    _, bare_breaks = run("eager", False)
    eager, _ = run(None, True)
    keys = [k for k in eager if "/monitors/" in k]
    assert len(keys) == 5
    for backend in ("eager", "aot_eager"):
        with_monitors, breaks = run(backend, True)
        assert breaks == bare_breaks, (backend, breaks, bare_breaks)
        for key in keys:
            assert with_monitors[key] == pytest.approx(eager[key], abs=1e-4), (backend, key)


def test_router_monitors_add_no_host_sync_on_unsampled_steps_and_ride_the_logging_read() -> None:
    from stabilitykit.testing.syncs import count_host_syncs

    model = tiny_mixtral()
    cfg = sk.StabilityConfig(log_every_n_steps=4, monitors=sk.MonitorConfig(every=2, **ONLY_ROUTERS))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = sk.StabilityGuard(model, opt, config=cfg, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])
    counts = []
    for seed in range(9):
        with count_host_syncs() as counter:
            guard.backward(model(**padded_batch(seed=seed)).loss)
            guard.step()
            guard.zero_grad()
        counts.append(len(counter.library_sites()))  # Mixtral's own expert loop syncs: not ours
    guard.close()
    assert counts == [1 if i % 4 == 0 else 0 for i in range(9)], counts
    assert "stability/monitors/expert_load_max/model.layers.1.mlp.gate" in guard.engines[0].readout.last_host_metrics


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_logs_the_same_router_values_as_one_forward(reentrant: bool) -> None:
    """Activation checkpointing runs each layer's forward again inside the backward; the routers are
    measured once per forward the model computes, not again for the recomputation."""

    def run(checkpointing: bool) -> dict[str, float]:
        model = tiny_mixtral(num_hidden_layers=2)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        guard = _guard(model)
        _step(guard, model, padded_batch(seed=0))
        metrics = dict(guard.engines[0].readout.last_host_metrics)
        guard.close()
        return {k: v for k, v in metrics.items() if "/monitors/" in k}

    plain, checkpointed = run(False), run(True)
    assert plain and plain.keys() == checkpointed.keys()
    for key, value in plain.items():
        assert checkpointed[key] == pytest.approx(value, abs=1e-5), key
