"""Modules that keep transformers numerically stable: z-loss, qk-norm, QK-clip and soft-capping."""

from __future__ import annotations

from stabilitykit.nn.qk_clip import QKClip, QKClipTarget, QKLayout
from stabilitykit.nn.qk_norm import QKNorm, QKNormAttention
from stabilitykit.nn.softcap import SoftCap, softcap
from stabilitykit.nn.z_loss import ZLoss, ZLossOutput, cross_entropy_with_z_loss, log_z, z_loss

__all__ = [
    "QKClip",
    "QKClipTarget",
    "QKLayout",
    "QKNorm",
    "QKNormAttention",
    "SoftCap",
    "ZLoss",
    "ZLossOutput",
    "cross_entropy_with_z_loss",
    "log_z",
    "softcap",
    "z_loss",
]
