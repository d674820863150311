"""Modules that keep transformers numerically stable: z-loss and qk-norm."""

from __future__ import annotations

from stabilitykit.nn.qk_norm import QKNorm, QKNormAttention
from stabilitykit.nn.z_loss import ZLoss, ZLossOutput, cross_entropy_with_z_loss, log_z, z_loss

__all__ = ["QKNorm", "QKNormAttention", "ZLoss", "ZLossOutput", "cross_entropy_with_z_loss", "log_z", "z_loss"]
