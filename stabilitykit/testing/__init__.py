"""Helpers for testing training stability: a tiny GPT and synthetic data that run in seconds on a CPU."""

from stabilitykit.testing.tiny_gpt import GPTConfig, TinyGPT, char_batches, tiny_gpt

__all__ = ["GPTConfig", "TinyGPT", "char_batches", "tiny_gpt"]
