"""Helpers for testing training stability: a tiny GPT and synthetic data that run in seconds on a CPU,
and faults injected on purpose (``inject_fault``, ``flip_bit``) to test a configuration against them."""

from stabilitykit.testing.faults import Fault, flip_bit, inject_fault
from stabilitykit.testing.tiny_gpt import char_batches, tiny_gpt

__all__ = ["Fault", "char_batches", "flip_bit", "inject_fault", "tiny_gpt"]
