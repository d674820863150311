"""Tiny random-init Hugging Face models and token batches for real-client tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 96
SEQ = 16


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama (~60k parameters), random init."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (tied embeddings), random init."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def token_batches(n: int, batch_size: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of random tokens with ``labels == input_ids`` (causal LM)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out
