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


@dataclass
class MonitorTargets:
    """The modules a monitor hooks, by clean name, in model order."""

    activations: list[tuple[str, nn.Module]] = field(default_factory=list)
    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)  # every module, for attention probes
    head: tuple[str, nn.Module] | None = None
    root: nn.Module = field(default_factory=nn.Module)  # the module that owns the head: its output holds the logits
    model: nn.Module = field(default_factory=nn.Module)  # the unwrapped model: its call holds the attention mask


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


def _is_stack(module: nn.Module) -> bool:
    """A ModuleList / Sequential of two or more children of one type, each with children of its own
    (blocks, not a list of Linear layers)."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    return (
        len(children) >= 2
        and len({type(c) for c in children}) == 1
        and all(next(c.children(), None) is not None for c in children)
    )


def block_stacks(named: list[tuple[str, nn.Module]]) -> list[str]:
    """The clean paths of every stack of blocks in ``named``: each encoder and decoder of an
    encoder-decoder, each stage of a CNN. A stack is a ModuleList / Sequential of same-typed blocks;
    one that holds other stacks inside its blocks (a CNN's list of stages, each with its blocks) gives
    way to them, and lists of experts are not blocks."""
    stacks = {n: m for n, m in named if _is_stack(m) and not n.rsplit(".", 1)[-1].startswith("expert")}
    return [o for o in stacks if not any(n != o and n.startswith(o + ".") for n in stacks)]


def select_targets(model: nn.Module, patterns: Sequence[str] | None = None) -> MonitorTargets:
    """Blocks, activation modules (``patterns``: names or globs; None: blocks, embeddings, final
    norm), every module and the LM head of ``model`` (wrapped or not)."""
    inner = unwrap_model(model)
    named = [(clean_name(n), m) for n, m in inner.named_modules() if n]
    prefix = find_blocks(inner)
    stacks = block_stacks(named) or ([prefix] if prefix else [])
    blocks = [(n, m) for n, m in named if "." in n and n.rsplit(".", 1)[0] in stacks]
    if not stacks and prefix == "":  # the model itself is the block list
        blocks = [(n, m) for n, m in named if "." not in n]
    head = _head(inner, named)
    if patterns is not None:
        activations = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    else:
        insides = tuple(f"{stack}." for stack in stacks)
        outside = [(n, m) for n, m in named if not insides or not (n + ".").startswith(insides)]
        embeddings = [(n, m) for n, m in outside if isinstance(m, nn.Embedding)]
        norms = [(n, m) for n, m in outside if _is_norm(m)]
        chosen = {n for n, _ in [*embeddings, *blocks, *norms[-1:]]}
        activations = [(n, m) for n, m in named if n in chosen]
    # the module that owns the head returns the model's logits (HF: ``.logits``, after any final soft-cap)
    owner = next((m for m in inner.modules() if head is not None and any(c is head[1] for c in m.children())), inner)
    return MonitorTargets(activations=activations, blocks=blocks, modules=named, head=head, root=owner, model=inner)
