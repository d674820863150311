"""Which modules a monitor measures: blocks, embeddings, the final norm, attention, the LM head.

Names are clean paths in the user's model (``engine.layers.clean_name``: no ``module.`` of DDP, no
``_orig_mod.`` of ``torch.compile``), the same names the grad-norm metrics use.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from stabilitykit.engine.layers import clean_name, find_blocks, unwrap_model

__all__ = ["MonitorTargets", "select_targets"]


@dataclass
class MonitorTargets:
    """The modules a monitor hooks, by clean name, in model order."""

    activations: list[tuple[str, nn.Module]] = field(default_factory=list)
    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)  # every module, for attention probes
    head: tuple[str, nn.Module] | None = None


def _is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and the norms models define themselves (``LlamaRMSNorm``)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _head(model: nn.Module, named: list[tuple[str, nn.Module]]) -> tuple[str, nn.Module] | None:
    """The causal LM head: HF's ``get_output_embeddings()``, else a module called ``lm_head``."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    for name, module in named:
        if (head is not None and module is head) or (head is None and name.rsplit(".", 1)[-1] == "lm_head"):
            return name, module
    return None


def select_targets(model: nn.Module, patterns: Sequence[str] | None = None) -> MonitorTargets:
    """Blocks, activation modules (``patterns``: names or globs; None: blocks, embeddings, final
    norm), every module and the LM head of ``model`` (wrapped or not)."""
    inner = unwrap_model(model)
    named = [(clean_name(n), m) for n, m in inner.named_modules() if n]
    prefix = find_blocks(inner)
    blocks = [(n, m) for n, m in named if prefix is not None and n.rsplit(".", 1)[0] == prefix and n != prefix]
    head = _head(inner, named)
    if patterns is not None:
        activations = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    else:
        inside = f"{prefix}." if prefix else None
        outside = [(n, m) for n, m in named if inside is None or not (n + ".").startswith(inside)]
        embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
        norms = [(n, m) for n, m in outside if _is_norm(m)]
        chosen = {n for n, _ in [*embeddings, *blocks, *norms[-1:]]}
        activations = [(n, m) for n, m in named if n in chosen]
    return MonitorTargets(activations=activations, blocks=blocks, modules=named, head=head)
