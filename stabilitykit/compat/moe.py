"""Where a Hugging Face model says its router logits come from.

``transformers`` models record ``router_logits`` (for their load-balancing loss) with an
``OutputRecorder`` in the model class's ``_can_record_outputs``: the router module's class (or a
suffix of its class name), optionally a sub-module name, and which element of the router's output
holds the logits. Reading that table is how the router monitors find the router of every MoE family
``transformers`` ships, the same way the model itself does.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


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
        "exaone_moe", "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "hy_v3", "hy_v4", "kimi_linear",
        "kolibri1", "laguna", "lfm2_moe", "llama4", "llama4_text", "mimo_v2_flash", "minimax_m2", "nemotron_h",
        "solar_open",
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
