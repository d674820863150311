"""Layer naming and grouping: the same names for the same model under every wrapper.

Parameter names are cleaned of what wrappers add (DDP's ``module.``, FSDP1's
``_fsdp_wrapped_module.`` and ``_flat_param``, ``torch.compile``'s ``_orig_mod.``, activation
checkpointing's ``_checkpoint_wrapped_module.``) before they are grouped, so a model logs
``model.lm_head`` whether it runs bare, under DDP, FSDP1, FSDP2 or compiled. Layers are listed in
the model's registration order (close to forward order), whatever order the optimizer's param
groups use, so "the last non-finite layer in this list" is the first one reached in backward.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from stabilitykit.compat.private import WRAPPER_NAME_PARTS, compiled_inner_module, fsdp1_inner_module

#: Path parts that wrappers insert between a model and its own modules.


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's own module inside DDP, FSDP1 and ``torch.compile`` wrappers (any nesting)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
            continue
        inner = compiled_inner_module(model) or fsdp1_inner_module(model)
        if inner is not None:
            model = inner
            continue
        return model


def clean_name(name: str) -> str:
    """A parameter or module path without wrapper parts: ``blocks.0.attn``, never ``_orig_mod.blocks.0.attn``."""
    parts = [p for p in name.split(".") if p and p not in WRAPPER_NAME_PARTS and p != "_flat_param"]
    return ".".join(parts)


def _wrapper_prefix(model: nn.Module) -> str:
    """Where the user's module sits inside its wrappers: ``module`` under DDP, "" for a bare model."""
    inner = unwrap_model(model)
    if inner is model:
        return ""
    return next((name for name, m in model.named_modules() if m is inner), "")


def user_name(name: str, prefix: str) -> str:
    """A name from a wrapper's ``named_parameters()`` as the user's model says it (``prefix``: the wrapper's)."""
    if prefix and name.startswith(prefix + "."):
        name = name[len(prefix) + 1 :]
    return clean_name(name)


def _block_prefix(module_names: Sequence[tuple[str, nn.Module]]) -> str | None:
    """The largest ModuleList/Sequential whose children all share one type (the model's blocks)."""
    best: tuple[tuple[int, int], str] | None = None
    for name, module in module_names:
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(child) for child in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        key = (size, len(children))
        if best is None or key > best[0]:
            best = (key, name)
    return None if best is None else best[1]


def find_blocks(model: nn.Module) -> str | None:
    """The clean path of ``model``'s block list (``model.layers`` in an HF Llama), None without one.

    The same rule that groups parameters into layers: the largest ModuleList/Sequential whose
    children share one type. ``model`` may be wrapped (DDP, FSDP1, ``torch.compile``).
    """
    return _block_prefix([(clean_name(n), m) for n, m in unwrap_model(model).named_modules()])


def _auto_layer(name: str, blocks: str | None) -> str:
    """``<blocks>.3`` for a block's parameter; else the shortest module path that does not contain
    the blocks (``model.lm_head`` when the blocks are ``model.model.layers``), at any depth."""
    module_path = name.rsplit(".", 1)[0] if "." in name else ""
    if blocks is None:
        return name.split(".", 1)[0]
    head = f"{blocks}." if blocks else ""
    if name.startswith(head):
        return head + name[len(head) :].split(".", 1)[0]
    ancestors = blocks.split(".")
    parts = module_path.split(".") if module_path else []
    for depth, part in enumerate(parts):
        if depth >= len(ancestors) or part != ancestors[depth]:
            return ".".join(parts[: depth + 1])
    return module_path or name  # a parameter held by an ancestor of the blocks itself


def layer_names_for(
    named_params: Sequence[tuple[str, Tensor]],
    model: nn.Module | None,
    grouping: str | Sequence[str] = "auto",
) -> list[str]:
    """The layer name of each parameter under a grouping rule ("auto", "top", "param" or regexes).

    Names are expected clean (see ``clean_name``); ``model`` is searched for the block list.
    """
    blocks = None
    if model is not None and grouping not in ("param", "top"):
        blocks = _block_prefix([(clean_name(n), m) for n, m in unwrap_model(model).named_modules()])
    patterns = [re.compile(p) for p in grouping] if not isinstance(grouping, str) else []
    names: list[str] = []
    for name, _ in named_params:
        if grouping == "param":
            names.append(name)
        elif grouping == "top":
            names.append(name.split(".", 1)[0])
        else:
            layer = None
            for pattern in patterns:
                match = pattern.match(name)
                if match:
                    layer = match.group(0)
                    break
            names.append(layer if layer is not None else _auto_layer(name, blocks))
    return [n or "root" for n in names]


@dataclass
class LayerMap:
    """Which layer each parameter belongs to, and the layers in model order."""

    param_names: list[str]  # clean name of each parameter, in the caller's order
    layer_names: list[str]  # in model order: the last non-finite one is the first reached in backward
    layer_of: list[int]  # index into layer_names for each parameter


def build_layer_map(
    params: Sequence[Tensor],
    model: nn.Module | None,
    grouping: str | Sequence[str] = "auto",
    names: Sequence[str] | None = None,
) -> LayerMap:
    """Name and group ``params`` (any order, e.g. an optimizer's param groups) after ``model``'s tree."""
    order: dict[int, int] = {}
    by_id: dict[int, str] = {}
    if model is not None:
        prefix = _wrapper_prefix(model)
        for i, (name, p) in enumerate(model.named_parameters(remove_duplicate=False)):
            order.setdefault(id(p), i)
            by_id.setdefault(id(p), user_name(name, prefix))
    if names is None:
        names = [by_id.get(id(p), f"param_{i}") for i, p in enumerate(params)]
    else:
        names = [clean_name(n) for n in names]
    layer_of_param = layer_names_for(list(zip(names, params, strict=True)), model, grouping)
    first_seen: dict[str, int] = {}
    for i, (param, layer) in enumerate(zip(params, layer_of_param, strict=True)):
        position = order.get(id(param), len(order) + i)
        first_seen[layer] = min(first_seen.get(layer, position), position)
    layer_names = sorted(first_seen, key=first_seen.__getitem__)
    index = {name: i for i, name in enumerate(layer_names)}
    return LayerMap(list(names), layer_names, [index[n] for n in layer_of_param])
