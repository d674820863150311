"""Helpers for testing training stability: a tiny GPT and synthetic data that run in seconds on a CPU."""

from stabilitykit.testing.tiny_gpt import char_batches, tiny_gpt

__all__ = ["char_batches", "tiny_gpt"]
