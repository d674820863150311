"""Layer-wise precision report of the tiny GPT: bf16, fp16 and TF32 against fp32, plus a user variant.

    python examples/precision_report.py [--out runs/precision]

The user variant is bf16 with the LM head swapped for one that runs in fp32: how much of bf16's
drift does that remove, and where? The report prints rich tables, and writes JSON and a plot.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stabilitykit as sk
from stabilitykit.precision_eval import Variant, evaluate
from stabilitykit.testing import char_batches, tiny_gpt


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model.loss(*batch)  # type: ignore[operator,no-any-return]


def fp32_lm_head(model: nn.Module) -> nn.Module:
    """A module swap: the LM head always runs in fp32 (autocast off inside it)."""
    head = model.lm_head

    class Fp32Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast(x.device.type, enabled=False):
                return self.inner(x.float())  # type: ignore[no-any-return]

    model.lm_head = Fp32Head()
    return model


def main(argv: list[str] | None = None) -> sk.precision_eval.PrecisionReport:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/precision")
    args = parser.parse_args(argv)
    model = tiny_gpt(seed=0)
    batch = next(char_batches(batch_size=8, seed=0))
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    report = evaluate(
        model,
        batch,
        _loss,
        variants={
            "bf16": "bf16",
            "fp16": "fp16",
            "tf32": "tf32",
            "bf16 + fp32 head": Variant("bf16 + fp32 head", context=bf16, transform=fp32_lm_head),
        },
    )
    report.print()
    out = Path(args.out)
    print("wrote", report.save_json(out / "precision.json"), report.plot(out / "precision.png"))
    return report


if __name__ == "__main__":
    main()
