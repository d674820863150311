"""How far one skipped step, and one rollback, travel through the library: every stabilitykit
function called from ``guard.backward`` of the bad step to its JSONL line, with the modules crossed.

    python benchmarks/hops.py            # the table
    python benchmarks/hops.py --list     # and the call list of each path

A "hop" is one call of a function defined in the ``stabilitykit`` package (``sys.setprofile``);
dunder methods, pydantic and torch are not counted. Lower is easier to follow and to change.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import stabilitykit as sk

PACKAGE = str(Path(sk.__file__).parent)


def trace(fn: Callable[[], None]) -> list[str]:
    """The stabilitykit functions ``fn`` calls, in call order (``module:qualname``)."""
    calls: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        path = frame.f_code.co_filename
        name = frame.f_code.co_qualname
        if path.startswith(PACKAGE) and not name.split(".")[-1].startswith("__") and "<" not in name:
            module = Path(path).relative_to(Path(PACKAGE).parent).with_suffix("").as_posix().replace("/", ".")
            calls.append(f"{module}:{name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def skipped_step(out: Path) -> list[str]:
    """A NaN step on a plain loop (non-fused AdamW, logging every step, a JSONL sink)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sk.StabilityConfig(log_every_n_steps=1, nan_trace=sk.NaNTraceConfig(mode="off"))
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(out / "skip.jsonl")])
    for _ in range(3):
        guard.backward(model(torch.randn(4, 8)).pow(2).mean())
        guard.step()
        guard.zero_grad()

    def bad_step() -> None:
        guard.backward(model(torch.randn(4, 8)).pow(2).mean() * float("nan"))
        guard.step()

    calls = trace(bad_step)
    guard.close()
    return calls


def rollback(out: Path) -> list[str]:
    """A divergence (three NaN steps) rolled back by recovery on a plain loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sk.StabilityConfig(
        log_every_n_steps=1,
        nan_trace=sk.NaNTraceConfig(mode="off"),
        skip=sk.SkipConfig(max_consecutive=3),
        recovery=sk.RecoveryConfig(enabled=True, snapshot_every=2, keep=2),
    )
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(out / "rollback.jsonl")])
    for i in range(8):
        guard.backward(model(torch.randn(4, 8)).pow(2).mean() * (float("nan") if i >= 6 else 1.0))
        guard.step()
        guard.zero_grad()

    def last_bad_step() -> None:
        guard.backward(model(torch.randn(4, 8)).pow(2).mean() * float("nan"))
        guard.step()

    calls = trace(last_bad_step)
    guard.close()
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print each path's calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"skipped step": skipped_step(Path(tmp)), "rollback": rollback(Path(tmp))}
    print("| path | hops (calls) | distinct functions | modules |")
    print("| --- | --- | --- | --- |")
    for name, calls in paths.items():
        modules = sorted({c.split(":")[0] for c in calls})
        print(f"| {name} | {len(calls)} | {len(set(calls))} | {len(modules)} |")
    for name, calls in paths.items():
        modules = sorted({c.split(":")[0] for c in calls})
        print(f"\n{name}: modules: {', '.join(m.removeprefix('stabilitykit.') for m in modules)}")
        if args.list:
            for call in calls:
                print("  ", call.removeprefix("stabilitykit."))


if __name__ == "__main__":
    main()
