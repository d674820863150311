"""Tiny random-init mixture-of-experts models of every ``transformers`` MoE family with a causal-LM head
(2 layers, 8 experts, top-2, hidden size 32), built from the installed ``transformers`` (no downloads)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 96
EXPERTS = 8
TOP_K = 2

#: Config fields shrunk wherever a family's config has them.
SMALL: dict[str, Any] = {
    "hidden_size": 32,
    "d_model": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "n_layers": 2,
    "num_attention_heads": 4,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "num_local_experts": EXPERTS,
    "num_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_routed_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "top_k": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    # linear-attention and state-space layers of hybrid stacks (Qwen3-Next, Nemotron-H)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "ssm_state_size": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 1,
    "chunk_size": 16,
    "moe_shared_expert_intermediate_size": 32,
}

#: Per-family changes to ``SMALL`` (None: leave the family's default).
OVERRIDES: dict[str, dict[str, Any]] = {
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_state": 16, "mamba_chunk_size": 16},
    "zaya": {"num_experts_per_tok": 1},  # top-1 only, its config says
    # families whose default layer pattern leaves a 2-layer model without a routed layer
    "beam": {"mlp_layer_types": ["sparse", "sparse"]},
    # hash-routed first (a fixed token -> expert table, not recorded as router logits), then top-k, as it ships
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]},
    "doge": {"is_moe": True, "num_experts": 16},  # product keys: 4 x 4 experts
    "gemma4": {
        "enable_moe_block": True,
        "top_k_experts": TOP_K,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 8,
        "global_head_dim": 8,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # its sliding-window layers double the key heads: 2 -> 4, the query heads
    "mimo_v2_flash": {"num_key_value_heads": 2},
    # its config's own names for the expert groups and k (n_group / num_experts_per_tok are aliases)
    "bailing_hybrid": {"num_expert_group": 1, "num_experts_per_token": 2, "layer_group_size": 2},
    "kimi_linear": {"linear_head_dim": 8, "linear_num_heads": 4},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "nemotron_h": {"layers_block_type": ["mamba", "moe"], "mtp_layers_block_type": []},
    "longcat_flash": {
        "num_layers": 2,
        "ffn_hidden_size": 64,
        "expert_ffn_hidden_size": 32,
        "zero_expert_num": 2,
        "qk_head_dim": 16,
    },
    "dbrx": {
        "ffn_config": {"moe_num_experts": EXPERTS, "moe_top_k": TOP_K, "ffn_hidden_size": 64},
        # clip_qkv as DBRX ships it: its attention cannot run with the config's default (None)
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
    },
}


def moe_families() -> list[str]:
    """Every model type of the installed transformers with a causal-LM head whose model records router logits."""
    out = []
    models = Path(transformers.__file__).parent / "models"
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        module_name = model_type.replace("-", "_")
        source = models / module_name / f"modeling_{module_name}.py"
        if not source.is_file() or "router_logits" not in source.read_text():
            continue  # imported only where the source names router logits: the import of all is 10 s
        try:
            module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except Exception:
            continue
        cls = getattr(module, class_name, None)
        if cls is None:
            continue
        tables = [getattr(c, "_can_record_outputs", None) for c in vars(module).values() if isinstance(c, type)]
        if any(isinstance(t, dict) and "router_logits" in t for t in tables):
            out.append(model_type)
    return out


def tiny_config(model_type: str) -> Any:
    """A tiny config of ``model_type``: ``SMALL`` wherever the family's config has the field (its text
    config's, for a multimodal family whose causal LM is its text model: Llama 4, Qwen3.5-MoE)."""
    cls = transformers.CONFIG_MAPPING[model_type]
    cls = getattr(cls, "sub_configs", {}).get("text_config", cls)
    names = set(cls().to_dict())
    kwargs = {k: v for k, v in {**SMALL, **OVERRIDES.get(model_type, {})}.items() if k in names and v is not None}
    return cls(**kwargs)


def tiny_moe(model_type: str, seed: int = 0, **changes: Any) -> torch.nn.Module:
    """A tiny random-init causal LM of ``model_type`` (``changes``: config fields set on top)."""
    config = tiny_config(model_type)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    if config.model_type != model_type:  # a text config: the family's causal-LM class builds from it
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        # the text model's own causal-LM class where it has one (Gemma 4), else the family's
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        return getattr(module, name)(config)  # type: ignore[no-any-return]
    return AutoModelForCausalLM.from_config(config)


def tiny_mixtral(seed: int = 0, **changes: Any) -> MixtralForCausalLM:
    """A 2-layer Mixtral with 8 experts, top-2 (~110k parameters), random init (``changes``: config fields)."""
    torch.manual_seed(seed)
    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "max_position_embeddings": 64,
    }
    config = MixtralConfig(**{**fields, **changes})
    return MixtralForCausalLM(config)


def padded_batch(batch_size: int = 4, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens whose first row ends in padding (``attention_mask`` 0, labels -100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, seq // 2 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
