"""Router monitors for mixture-of-experts models: load, dead experts, entropy and z, measured where the model routes.

Each router is measured on sampled steps from its own output, as the model computes it: the router
logits (``tokens x experts``) and, where the router returns them, the experts it chose for each
token (an integer ``tokens x k`` tensor in its output: every ``transformers`` top-k router); else the
top ``k`` of the logits. Families that route by a rule of their own are read by it (``compat/moe.py``:
Doge's product keys, ZAYA's skip expert, Gemma 4's router returning probabilities, its logits read from its
``proj``). Positions the model's ``attention_mask`` marks as padding are left out. Per router, under the
metric prefix:

* ``monitors/expert_load_max/<router>``: the largest expert's share of the routed tokens divided by
  the mean share (1.0 is perfect balance; ``experts / k`` is every token on the same experts);
* ``monitors/experts_dead/<router>``: the fraction of experts that received no token;
* ``monitors/router_entropy/<router>``: the mean over tokens of the entropy of the router's routing
  distribution, divided by ``log(experts)`` (1.0 is uniform): the softmax of the router logits, or for
  a sigmoid-scored router (DeepSeek-V3, GLM-4-MoE, ...) its sigmoid scores normalised to sum to 1, as
  the family itself scores the experts (``compat/moe.py``);
* ``monitors/router_z/<router>``: the mean over tokens of ``logsumexp(router logits)²`` (the router
  z-loss value);
* ``monitors/router_collapsed/<router>``: how many sampled steps in a row the router has been
  collapsed (0 while healthy), the count behind the ``"router_collapse"`` event.

The counts add up over every forward pass of a sampled step (micro-batches of an accumulated step
count as one step); the values are computed when the step is decided, so skip rules read them as
``values["monitors/expert_load_max/<router>"]`` (NaN on unsampled steps), and they are logged with
the logging step's one device-to-host copy.

Routers are found in every ``transformers`` MoE from the model's own record of where its router
logits come from (``compat/moe.py``); in a user's own MoE they are named with
``RouterConfig(modules=[...])``.

Under data parallelism the values are global: on a sampled step, when the step is decided, every rank
adds its sums (tokens per expert, tokens, entropy and z sums of every router, packed in one vector) into
one SUM all-reduce, so every rank logs and judges the load of all ranks' tokens (an expert idle on one
rank but fed on another is not dead). Whether it runs depends only on the sampling cadence, the same on
every rank; unsampled steps run no collective. ``RouterConfig(across_ranks=False)`` keeps each rank's own
values, with no collective.

The load-balancing-loss trap (a positive ``router_aux_loss_coef``
while ``output_router_logits`` is off, so the loss is not in the loss) is warned once.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from stabilitykit.caller import user_stacklevel
from stabilitykit.compat.moe import (
    RouterSpec,
    expert_logits,
    family_choice,
    hf_router_specs,
    logits_submodule,
    router_scoring,
)
from stabilitykit.distributed import all_reduce, is_distributed
from stabilitykit.events import Event
from stabilitykit.section import Section

#: The per-router signals, in the order they are declared.
ROUTER_SIGNALS = ("expert_load_max", "experts_dead", "router_entropy", "router_z", "router_collapsed")

#: How routers turn their logits into routing probabilities (each normalised to sum to 1 over the experts).
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")

#: An expert must expect at least this many routed tokens in a sampled step for "no token at all" to
#: say it is dead rather than that the batch was small (chance of an empty expert: about exp(-8)).
MIN_EXPECTED_TOKENS = 8.0


class RouterConfig(Section):
    """Mixture-of-experts router monitors (``MonitorConfig(routers=...)``; None turns them off).

    Every ``transformers`` MoE family's routers are found by themselves; name the routers of your own
    MoE with ``modules``. The ``"router_collapse"`` event fires when a router's load concentrates
    (``collapse_load``) or its experts die (``collapse_dead``) for ``collapse_steps`` sampled steps
    in a row.
    """

    modules: list[str] | None = Field(
        None,
        description=(
            "Router modules of your own MoE, as clean names or globs ('blocks.*.moe.router'), added to those "
            "found in transformers models. A router's output is its logits (tokens x experts), or a tuple whose "
            "first floating tensor is; an integer (tokens x k) tensor in the tuple is taken as the chosen experts."
        ),
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description=(
            "Experts per token, for routers that do not return their choice (None: the router's `top_k` "
            "attribute, else the model config's `num_experts_per_tok`)."
        ),
    )
    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"] | None = Field(
        None,
        description=(
            "How the routers score experts, for router_entropy: 'softmax' of the logits, or 'sigmoid' / "
            "'sqrtsoftplus' scores normalised to sum to 1. None: as the transformers family does (sigmoid for "
            "DeepSeek-V3, GLM-4-MoE and their kin, softmax for Mixtral, Qwen-MoE, OLMoE, ...); softmax for your own."
        ),
    )
    collapse_load: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description=(
            "A router is collapsed when its expert_load_max has gone this fraction of the way from perfect "
            "balance (1.0) to the most concentrated load possible (experts / k). Healthy tiny Mixtral, Qwen2-MoE, "
            "Qwen3-MoE and OLMoE runs: at most 0.41; one biased gate row: 0.61-0.68 on its first steps "
            "(docs/guides/moe-routers.md)."
        ),
    )
    collapse_dead: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description=(
            "... or when at least this fraction of its experts got no token, in a sampled step where each "
            "expert expected 8 tokens or more."
        ),
    )
    across_ranks: bool = Field(
        True,
        description=(
            "Sum the routers' counts across ranks on sampled steps (one SUM all-reduce of a few floats per router "
            "and expert, sampled steps only), so the values are those of every rank's tokens; False: each rank's "
            "own values, no collective (a rank's experts_dead overstates the global share)."
        ),
    )
    collapse_steps: int = Field(
        2,
        ge=1,
        description=(
            "Sampled steps in a row a router must be collapsed before 'router_collapse' is raised (a biased gate row "
            "stayed above collapse_load for 2 of its first 3 steps in each of 6 families tried)."
        ),
    )


@dataclass
class Router:
    """One router: its clean name, module, where its logits are in its output, and its counts so far."""

    name: str
    module: nn.Module
    index: int | None  # the logits' position in the output tuple; None: the first floating tensor
    top_k: int | None
    scoring: str = "softmax"  # how the router scores experts (``SCORINGS``)
    balancing_bias: str | None = None  # the clean name of its score-correction bias, where it has one
    experts: int = 0  # known after the first measured forward
    k: int = 0
    counts: Tensor | None = None  # tokens routed to each expert in this sampled step
    tokens: Tensor | None = None
    entropy: Tensor | None = None  # sum over tokens
    z: Tensor | None = None  # sum over tokens
    streak: Tensor | None = None  # sampled steps in a row collapsed
    streak_before: Tensor | None = None  # the streak when the step in flight began
    last_counts: Tensor | None = None  # the counts of the newest finished sampled step
    pending: bool = False  # forward passes measured since the step was last finished
    captured: Tensor | None = None  # logits taken from its logits sub-module, where its output holds probabilities
    warned: bool = False  # a "router_collapse" event was raised for the current streak
    handles: list[Any] = field(default_factory=list)


def _router_modules(
    named: list[tuple[str, nn.Module]], model: nn.Module, config: RouterConfig
) -> list[tuple[str, nn.Module, int | None]]:
    """(clean name, module, logits index) of every router: those the transformers model records, then
    the user's ``modules`` patterns."""
    specs: list[RouterSpec] = hf_router_specs(model)
    found: list[tuple[str, nn.Module, int | None]] = []
    seen: set[int] = set()
    for name, module in named:
        spec = next((s for s in specs if s.matches(name, module)), None)
        if spec is not None and id(module) not in seen:
            found.append((name, module, spec.index))
            seen.add(id(module))
    for pattern in config.modules or []:
        hits = [(n, m) for n, m in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"RouterConfig.modules: {pattern!r} names no module of the model "
                f"(modules look like {', '.join(n for n, _ in named[:4])}, ...)"
            )
        for name, module in hits:
            if id(module) not in seen:
                found.append((name, module, None))
                seen.add(id(module))
    return found


def _top_k(module: nn.Module, model: nn.Module, config: RouterConfig) -> int | None:
    """Experts per token for a router that does not return its choice."""
    if config.top_k is not None:
        return config.top_k
    config_ = getattr(model, "config", None)
    for source in (
        module,
        config_,
        getattr(config_, "text_config", None),
        getattr(config_, "ffn_config", None),  # DBRX
    ):
        for attr in ("top_k", "num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k"):
            value = getattr(source, attr, None)
            if isinstance(value, int) and value >= 1:
                return value
    return None


#: Buffers through which a router balances its load without an aux loss (DeepSeek-V3's score-correction
#: bias, added to the scores before the top-k): the training loop must update them after each step.
BALANCING_BIASES = ("e_score_correction_bias", "expert_bias")


def _balancing_bias(name: str, named: Mapping[str, nn.Module]) -> str | None:
    """The clean name of the score-correction bias of router ``name`` (on the router or the block that
    holds it), or None."""
    parent = name.rpartition(".")[0]
    for owner in (name, parent) if parent else (name,):
        module = named.get(owner)
        for attr in BALANCING_BIASES:
            if isinstance(getattr(module, attr, None), Tensor):
                return f"{owner}.{attr}"
    return None


def _experts(module: nn.Module) -> int:
    """The router's expert count when it says so (``num_experts``, or a 2-D weight's rows), else 0 (learnt
    at its first measured forward pass)."""
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    weight = getattr(logits_submodule(module) or module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else 0


def router_logits_of(output: Any, index: int | None) -> Tensor | None:
    """The router logits in a router's ``output``: the element at ``index``, else the first floating tensor."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        if index is not None and index < len(output) and isinstance(output[index], Tensor):
            return output[index]  # type: ignore[no-any-return]
        return next((v for v in output if isinstance(v, Tensor) and v.is_floating_point()), None)
    return None


def chosen_experts(output: Any, rows: int) -> Tensor | None:
    """The experts the router chose for each token, when its output holds them: an integer (rows, k) tensor."""
    if not isinstance(output, (tuple, list)):
        return None
    for value in output:
        if (
            isinstance(value, Tensor)
            and not value.is_floating_point()
            and value.dtype != torch.bool
            and value.dim() == 2
            and value.shape[0] == rows
        ):
            return value
    return None


def routing_log_probs(logits: Tensor, scoring: str = "softmax") -> Tensor:
    """Log of the routing distribution over the experts from float32 ``logits`` (rows, experts): the
    softmax, or the ``sigmoid`` / ``sqrtsoftplus`` scores normalised to sum to 1 over each row."""
    if scoring == "sigmoid":
        log_scores = torch.nn.functional.logsigmoid(logits)
    elif scoring == "sqrtsoftplus":
        log_scores = 0.5 * torch.log(torch.nn.functional.softplus(logits).clamp_min(1e-30))
    else:
        log_scores = logits
    return log_scores - torch.logsumexp(log_scores, dim=-1, keepdim=True)


def router_step_sums(
    logits: Tensor, chosen: Tensor, weights: Tensor | None, scoring: str = "softmax", experts: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One forward pass of one router: (tokens per expert, token count, entropy sum, z sum), float32.

    ``logits``: (rows, classes); ``chosen``: (rows, k) expert indices (an index outside the experts,
    a dropped token, counts for none); ``weights``: (rows,) 1 for a real token, 0 for padding, or None;
    ``experts``: the real experts, the first ``experts`` classes (None: every class; ZAYA's extra skip
    class is no expert). The entropy is of the routing distribution over the classes (``routing_log_probs``
    with ``scoring``), divided by log(classes); z is logsumexp(logits)².
    """
    classes = logits.shape[-1]
    experts = classes if experts is None else experts
    rows = logits.detach().float()
    index = chosen.detach().long()
    index = torch.where((index >= 0) & (index < experts), index, experts)
    if weights is None:
        weights = torch.ones(rows.shape[0], device=rows.device)
    spread = weights[:, None].expand(-1, index.shape[1]).reshape(-1)
    tokens = weights.sum()
    counts = torch.zeros(experts + 1, device=rows.device).scatter_add_(0, index.reshape(-1), spread)[:experts]
    lse = torch.logsumexp(rows, dim=-1)
    logp = routing_log_probs(rows, scoring)
    entropy = -(logp.exp() * logp).sum(-1) / math.log(max(classes, 2))
    return counts, tokens, (entropy * weights).sum(), (lse.square() * weights).sum()


def router_stats(counts: Tensor, tokens: Tensor, entropy: Tensor, z: Tensor) -> dict[str, Tensor]:
    """expert_load_max, experts_dead, router_entropy and router_z from a step's sums (NaN without tokens)."""
    total = counts.sum()
    experts = counts.numel()
    some = total > 0
    nan = torch.full((), math.nan, device=counts.device)
    load = torch.where(some, counts.amax() * experts / total.clamp_min(1e-12), nan)
    dead = torch.where(some, (counts == 0).float().mean(), nan)
    has_tokens = tokens > 0
    return {
        "expert_load_max": load,
        "experts_dead": dead,
        "router_entropy": torch.where(has_tokens, entropy / tokens.clamp_min(1e-12), nan),
        "router_z": torch.where(has_tokens, z / tokens.clamp_min(1e-12), nan),
    }


def collapsed(load: Tensor, dead: Tensor, total: Tensor, experts: int, k: int, config: RouterConfig) -> Tensor:
    """Whether one sampled step's load says the router has collapsed (a 0-d device bool; NaN is healthy)."""
    ceiling = experts / max(k, 1)
    concentrated = load >= 1.0 + config.collapse_load * (ceiling - 1.0) if ceiling > 1.0 else load != load
    judged = total >= MIN_EXPECTED_TOKENS * experts
    return concentrated | ((dead >= config.collapse_dead) & judged)


class RouterMonitor:
    """Hooks every router of a model and measures it on sampled steps (see the module docstring).

    ``sampling()`` says whether the coming forward passes belong to a sampled step; ``declare(signal,
    name)`` and ``keep(signal, name, value)`` keep values in the model monitor's store; ``failed(name,
    reason)`` disables a router that could not be measured, with one warning.
    """

    def __init__(
        self,
        model: nn.Module,
        named: list[tuple[str, nn.Module]],
        config: RouterConfig,
        sampling: Callable[[], bool],
        declare: Callable[[str, str], None],
        keep: Callable[[str, str, Tensor], None],
        failed: Callable[[str, str], None],
        device: torch.device,
    ) -> None:
        self.config = config
        self.model = model
        self._sampling = sampling
        self._keep = keep
        self._failed = failed
        self.device = device
        self.disabled: set[str] = set()
        scoring = config.scoring or router_scoring(model) or "softmax"
        self.scoring = scoring if scoring in SCORINGS else "softmax"  # a name we do not know: the softmax
        by_name = dict(named)
        self.routers = [
            Router(
                name,
                module,
                index,
                _top_k(module, model, config),
                self.scoring,
                _balancing_bias(name, by_name),
                experts=_experts(module),
            )
            for name, module, index in _router_modules(named, model, config)
        ]
        self._mask: Tensor | None = None
        self._asked_router_logits: bool | None = None  # the output_router_logits keyword of a sampled forward
        self._aux_checked = False
        self._seen_sample = False  # a sampled step was measured
        self._handles: list[Any] = []
        self._nan = torch.full((), math.nan, device=device)
        self._unsampled = {f"monitors/{s}/{r.name}": self._nan for r in self.routers for s in ROUTER_SIGNALS}
        if not self.routers:
            return
        for router in self.routers:
            for signal in ROUTER_SIGNALS:
                declare(signal, router.name)
            source = logits_submodule(router.module)
            if source is not None:
                self._handles.append(source.register_forward_hook(self._capture(router)))
            self._handles.append(router.module.register_forward_hook(self._hook(router)))
        self._handles.append(model.register_forward_pre_hook(self._take_inputs, with_kwargs=True))

    @property
    def names(self) -> list[str]:
        """The routers' clean names, in model order."""
        return [r.name for r in self.routers]

    # ------------------------------------------------------------------ hooks (sampled steps only)

    def _take_inputs(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not self._sampling() or not module.training:
            return
        mask = kwargs.get("attention_mask")
        self._mask = mask if isinstance(mask, Tensor) else None
        asked = kwargs.get("output_router_logits")
        if asked is not None:
            self._asked_router_logits = bool(asked)

    def _capture(self, router: Router) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._sampling() and module.training and isinstance(output, Tensor):
                router.captured = output

        return hook

    def _hook(self, router: Router) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._sampling() or not module.training or router.name in self.disabled:
                return
            try:
                self._measure(router, output)
            except Exception as error:  # a monitor never breaks a step
                message = str(error).splitlines()[0][:200] if str(error) else ""
                self.disabled.add(router.name)
                self._failed(router.name, f"measuring its router output raised {type(error).__name__}: {message}")

        return hook

    def _measure(self, router: Router, output: Any) -> None:
        logits = router_logits_of(output, router.index) if router.captured is None else router.captured
        router.captured = None
        if logits is None or not logits.is_floating_point() or logits.dim() == 0:
            raise ValueError("its output holds no floating-point router logits")
        logits = expert_logits(router.module, logits)
        rows = logits.reshape(-1, logits.shape[-1])
        chosen, experts = family_choice(router.module, rows, chosen_experts(output, rows.shape[0]))
        if chosen is None:
            if router.top_k is None:
                raise ValueError("it returns no chosen experts and no top_k is known: set RouterConfig(top_k=...)")
            chosen = torch.topk(rows.detach(), min(router.top_k, rows.shape[-1]), dim=-1).indices
        mask = self._mask
        weights = None
        if mask is not None and mask.numel() == rows.shape[0]:
            weights = mask.detach().reshape(-1).to(device=rows.device, dtype=torch.float32).clamp(0, 1)
        counts, tokens, entropy, z = router_step_sums(rows, chosen, weights, router.scoring, experts)
        router.experts, router.k = experts, chosen.shape[-1]
        if (
            router.counts is None
            or router.tokens is None
            or router.entropy is None
            or router.z is None
            or router.counts.shape != counts.shape
        ):
            router.counts, router.tokens, router.entropy, router.z = counts, tokens, entropy, z
        else:
            router.counts = router.counts + counts
            router.tokens = router.tokens + tokens
            router.entropy = router.entropy + entropy
            router.z = router.z + z
        router.pending = True

    # ------------------------------------------------------------------ the monitor's side (host code)

    def begin_step(self, sampling: bool) -> None:
        """Before a step's forward passes: finish the step before it; say once if the aux loss is off."""
        self.finish()
        self._mask = None
        for router in self.routers:
            router.streak_before = router.streak
        if sampling:
            self._prime()
        if self._seen_sample and not self._aux_checked:
            self._check_aux_loss()

    def _prime(self) -> None:
        """Zero sums for every router whose expert count is known, so a compiled model's hooks always add
        to tensors (one graph for every sampled forward pass, the first micro-batch's included)."""
        for router in self.routers:
            if router.experts and router.counts is None:
                router.counts = torch.zeros(router.experts, device=self.device)
                router.tokens = torch.zeros((), device=self.device)
                router.entropy = torch.zeros((), device=self.device)
                router.z = torch.zeros((), device=self.device)

    def finish(self, agree: bool = False) -> dict[str, Tensor]:
        """Turn the counts of the sampled step just run into its values (recorded, and returned by key for
        the skip rules); the values of an unsampled step are NaN. No host sync.

        ``agree``: the call made when the step is decided, on every rank: on a sampled step under
        ``torch.distributed`` (and ``across_ranks``) the sums are added across ranks first, one all-reduce.
        """
        if agree and self.routers and self.config.across_ranks and self._sampling() and is_distributed():
            measured = self._sum_across_ranks()
        else:
            measured = [r for r in self.routers if r.pending]
        if not measured:
            return self._unsampled
        self._seen_sample = True
        out = dict(self._unsampled)
        for router in measured:
            assert router.counts is not None and router.tokens is not None
            assert router.entropy is not None and router.z is not None
            stats = router_stats(router.counts, router.tokens, router.entropy, router.z)
            down = collapsed(
                stats["expert_load_max"],
                stats["experts_dead"],
                router.counts.sum(),
                router.experts,
                router.k,
                self.config,
            )
            # counted from the streak before this step: a step measured twice (a rerun recomputes its forward)
            # counts once
            streak = router.streak_before if router.streak_before is not None else torch.zeros((), device=down.device)
            # a router no rank measured (an all-reduce of zeros) keeps its streak
            router.streak = torch.where(
                router.tokens > 0, torch.where(down, streak + 1.0, torch.zeros_like(streak)), streak
            )
            stats["router_collapsed"] = router.streak
            for signal, value in stats.items():
                self._keep(signal, router.name, value)
                out[f"monitors/{signal}/{router.name}"] = value
            router.last_counts = router.counts
            router.counts = router.tokens = router.entropy = router.z = None
            router.pending = False
        self._mask = None
        return out

    def _sum_across_ranks(self) -> list[Router]:
        """Add every router's sums across ranks in one SUM all-reduce (a router this rank did not measure
        adds zeros); returns the routers, each now holding the global sums. Runs on every rank alike: the
        layout is the routers in model order, each with its expert count, the same on every rank."""
        parts: list[Tensor] = []
        for router in self.routers:
            experts = router.experts
            if router.pending and router.counts is not None:
                assert router.tokens is not None and router.entropy is not None and router.z is not None
                parts += [router.counts.float(), torch.stack([router.tokens, router.entropy, router.z]).float()]
            else:
                parts += [torch.zeros(experts + 3, device=self.device)]
        packed = torch.cat(parts)
        all_reduce(packed, torch.distributed.ReduceOp.SUM)
        offset = 0
        summed: list[Router] = []
        for router in self.routers:
            experts = router.experts
            chunk = packed[offset : offset + experts + 3]
            offset += experts + 3
            if experts == 0:  # its expert count is not known yet (never measured here): no values
                router.counts = router.tokens = router.entropy = router.z = None
                router.pending = False
                continue
            router.counts, router.tokens, router.entropy, router.z = chunk[:experts], chunk[-3], chunk[-2], chunk[-1]
            router.pending = True
            summed.append(router)
        return summed

    def discard(self) -> None:
        """Forget what was measured since the last read and every streak (a rollback undid those steps)."""
        for router in self.routers:
            router.counts = router.tokens = router.entropy = router.z = None
            router.pending, router.streak, router.streak_before, router.warned = False, None, None, False

    def events(self, step: int, values: Mapping[str, float]) -> list[Event]:
        """``"router_collapse"`` events from a logging step's host values: one per streak that reached
        ``collapse_steps`` (again only after the router recovered). An event reads the router's expert
        counts to name the experts: one more copy, at the step it is raised only."""
        events: list[Event] = []
        for router in self.routers:
            streak = values.get(f"monitors/router_collapsed/{router.name}")
            if streak is None or not math.isfinite(streak):
                continue
            if streak < self.config.collapse_steps:
                router.warned = False
                continue
            if router.warned:
                continue
            router.warned = True
            events.append(self._collapse_event(router, step, values, int(streak)))
        return events

    def _collapse_event(self, router: Router, step: int, values: Mapping[str, float], streak: int) -> Event:
        counts = router.last_counts.tolist() if router.last_counts is not None else []
        total = sum(counts)
        mean = total / len(counts) if counts else 0.0
        loaded = [i for i, c in enumerate(counts) if mean > 0 and c > 2.0 * mean]
        dead = [i for i, c in enumerate(counts) if c == 0]
        load = values.get(f"monitors/expert_load_max/{router.name}", math.nan)
        dead_share = values.get(f"monitors/experts_dead/{router.name}", math.nan)
        parts = []
        if loaded:
            parts.append(f"expert(s) {', '.join(map(str, loaded))} take {load:.2f}x the mean load")
        if dead:
            parts.append(f"{len(dead)} of {len(counts)} experts got no token")
        what = "; ".join(parts) or f"the load is {load:.2f}x the mean"
        if router.balancing_bias is not None:
            advice = (
                f"This router balances its load with a score-correction bias ({router.balancing_bias}) that the "
                "training loop must update after each step (aux-loss-free balancing: bias += gamma * sign(mean load "
                "- expert load)); transformers does not update it in training, so without that update nothing "
                "balances the router and the concentration is real. Update the bias, or add a load-balancing loss."
            )
        else:
            advice = (
                "Check the load-balancing loss (output_router_logits, router_aux_loss_coef), the router's learning "
                "rate and its z-loss."
            )
        message = (
            f"router {router.name} has collapsed for {streak} sampled steps in a row: {what} "
            f"(most concentrated possible: {router.experts / max(router.k, 1):.2f}x). {advice}"
        )
        details = {
            "router": router.name,
            "experts": loaded,
            "dead_experts": dead,
            "expert_tokens": counts,
            "expert_load_max": load,
            "experts_dead": dead_share,
            "steps": streak,
            "balancing_bias": router.balancing_bias,
        }
        return Event("router_collapse", step, message, details)

    # ------------------------------------------------------------------ the aux-loss trap

    def _check_aux_loss(self) -> None:
        """Once, after the first sampled step: warn when the model has a positive load-balancing loss
        coefficient but does not output router logits, so that loss is not in the loss it returns."""
        if self._aux_checked:
            return
        self._aux_checked = True
        config = getattr(self.model, "config", None)
        text = getattr(config, "text_config", None)
        coefficient = None
        for source in (self.model, config, text):
            for attr in ("router_aux_loss_coef", "aux_loss_coef"):
                value = getattr(source, attr, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    coefficient = float(value)
                    break
            if coefficient is not None:
                break
        if coefficient is None or coefficient <= 0:
            return
        asked = self._asked_router_logits
        if asked is None:
            asked = bool(getattr(config, "output_router_logits", False) or getattr(text, "output_router_logits", False))
        if asked:
            return
        warnings.warn(
            f"stabilitykit monitors: {type(self.model).__name__} has router_aux_loss_coef={coefficient:g} but does not "
            "output router logits, so the load-balancing loss is not in your loss: set "
            "`output_router_logits=True` (in the model config, or as a keyword of its forward)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
