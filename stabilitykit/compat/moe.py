"""Where a Hugging Face model says its router logits come from.

``transformers`` models record ``router_logits`` (for their load-balancing loss) with an
``OutputRecorder`` in the model class's ``_can_record_outputs``: the router module's class (or a
suffix of its class name), optionally a sub-module name, and which element of the router's output
holds the logits. Reading that table is how the router monitors find the router of every MoE family
``transformers`` ships, the same way the model itself does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class RouterSpec:
    """One kind of router in a model: modules of ``target`` (a class, or a class-name suffix), whose
    name contains ``layer_name`` when given, with the router logits at ``index`` of their output."""

    target: type | str
    index: int = 0
    layer_name: str | None = None

    def matches(self, name: str, module: nn.Module) -> bool:
        """``module`` (named ``name``) is a router of this kind."""
        if isinstance(self.target, str):
            hit = type(module).__name__.endswith(self.target)
        else:
            hit = isinstance(module, self.target)
        return hit and (self.layer_name is None or self.layer_name in name)


def hf_router_specs(model: nn.Module) -> list[RouterSpec]:
    """The router kinds every ``transformers`` model class inside ``model`` records as ``router_logits``
    (none for a model that is not a ``transformers`` MoE)."""
    specs: list[RouterSpec] = []
    for module in model.modules():
        table = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(table, dict):
            continue
        recorders = table.get("router_logits")
        for recorder in recorders if isinstance(recorders, (list, tuple)) else [recorders]:
            if recorder is None:
                continue
            target = getattr(recorder, "target_class", None) or getattr(recorder, "class_name", None)
            if target is None and isinstance(recorder, type):
                target = recorder  # a bare class: the logits are its output's first element
            if target is None:
                continue
            spec = RouterSpec(target, int(getattr(recorder, "index", 0) or 0), getattr(recorder, "layer_name", None))
            if spec not in specs:
                specs.append(spec)
    return specs


#: ``transformers`` model types whose routers score the experts with a sigmoid of the router logits (each
#: expert on its own, DeepSeek-V3 style) instead of a softmax over them: their routing distribution is the
#: sigmoid scores normalised to sum to 1. Read from each family's router ``forward`` in transformers 5.24.
SIGMOID_SCORED = frozenset(
    {
        "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "deepseek_v3", "deepseek_v32", "dots1", "dots3_note",
        "dots3_note_text", "exaone_moe", "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "hy_v3", "hy_v4",
        "kimi_linear", "kolibri1", "laguna", "lfm2_moe", "llama4", "llama4_text", "mimo_v2_flash", "minimax_m2",
        "nemotron_h", "solar_open",
    }
)  # fmt: skip

#: Config fields that name a family's scoring function, where the family lets the config choose.
_SCORING_FIELDS = ("expert_selection_fn", "scoring_func")


def router_scoring(model: nn.Module) -> str | None:
    """How a ``transformers`` MoE turns router logits into routing probabilities: ``"softmax"``,
    ``"sigmoid"`` (normalised sigmoid scores) or the name its config gives (``scoring_func``); None for a
    model that is not a ``transformers`` model."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        for field in _SCORING_FIELDS:
            value = getattr(source, field, None)
            if isinstance(value, str) and value:
                return value
        if getattr(source, "model_type", None) in SIGMOID_SCORED:
            return "sigmoid"
    return "softmax"


#: Routers whose output holds routing probabilities where other families put their logits (Gemma 4's text
#: router returns the softmax of its ``proj``): the sub-module whose output is the router logits.
LOGITS_SUBMODULES = {"Gemma4TextRouter": "proj"}


def logits_submodule(router: nn.Module) -> nn.Module | None:
    """The sub-module of ``router`` whose output is its logits, for a router whose own output holds
    probabilities instead (None for every other router)."""
    name = LOGITS_SUBMODULES.get(type(router).__name__)
    child = getattr(router, name, None) if name is not None else None
    return child if isinstance(child, nn.Module) else None


def expert_logits(router: nn.Module, logits: Tensor) -> Tensor:
    """The router's logits over its experts, from what its output holds.

    A product-key router (Doge's ``DogeCDMoE``: ``num_keys`` keys on each of two axes, expert
    ``i * num_keys + j`` scored ``x[i] + y[j]``) returns its two key-score halves as a ``(2, tokens,
    num_keys)`` tensor; its logit for every expert is that sum, as its forward computes it before its
    top-k. Every other router's output already is its logits."""
    keys = getattr(router, "num_keys", None)
    if isinstance(keys, int) and logits.dim() == 3 and logits.shape[0] == 2 and logits.shape[-1] == keys:
        return (logits[0][:, :, None] + logits[1][:, None, :]).reshape(logits.shape[1], keys * keys)
    return logits


def family_choice(router: nn.Module, rows: Tensor, chosen: Tensor | None) -> tuple[Tensor | None, int]:
    """(the experts each token went to, the number of real experts) for routers with a routing rule of their own.

    ZAYA's router scores ``num_experts + 1`` classes, the last a skip expert with no compute, and chooses the
    top-k of its softmax plus its ``balancing_biases``; the indices it returns have the skip class replaced by
    expert 0 (its probability zeroed), so its choice is taken again by that rule, the skip class counting for no
    expert. Every other router: its own choice (or None) and as many experts as logits.
    """
    biases = getattr(router, "balancing_biases", None)
    experts = getattr(router, "num_experts", None)
    k = getattr(router, "top_k", None)
    if (
        isinstance(biases, Tensor)
        and isinstance(experts, int)
        and isinstance(k, int)
        and rows.shape[-1] == experts + 1 == biases.numel()
    ):
        scores = torch.softmax(rows.detach(), dim=-1).float() + biases.to(rows.device)
        return torch.topk(scores, k, dim=-1).indices, experts
    return chosen, rows.shape[-1]
