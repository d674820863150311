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


def _name(frame) -> str | None:  # type: ignore[no-untyped-def]
    path = frame.f_code.co_filename
    name = frame.f_code.co_qualname
    if path.startswith(PACKAGE) and not name.split(".")[-1].startswith("__") and "<" not in name:
        module = Path(path).relative_to(Path(PACKAGE).parent).with_suffix("").as_posix().replace("/", ".")
        return f"{module}:{name}"
    return None


#: The same paths measured on the tree before the driver core was merged into the base and the engine
#: (three layers under the driver then: the base, one ``DriverCore`` per optimizer, the engine): calls,
#: distinct functions, modules, and the chain to the JSONL line as frames / modules. Printed beside
#: today's, for comparison; remeasure both on one machine and interpreter.
BEFORE: dict[str, tuple[int, int, int, str]] = {
    "skipped step": (153, 113, 32, "8 / 7"),
    "rollback": (406, 182, 45, "8 / 7"),
}
#: The same paths on the tree before the drivers were cut to their line budget (DeepSpeed on the loop's
#: step, each job moved to the module that owns it), measured on the same machine and interpreter as today's.
BEFORE_CUT: dict[str, tuple[int, int, int, str]] = {
    "skipped step": (145, 106, 32, "8 / 6"),
    "rollback": (397, 175, 46, "8 / 6"),
}

#: The chain of stabilitykit frames (outermost first) when the path's event (the skip, the rollback)
#: had its JSONL line written.
CHAINS: dict[str, list[str]] = {}


def trace(fn: Callable[[], None], label: str = "", kind: str = "skipped") -> list[str]:
    """The stabilitykit functions ``fn`` calls, in call order (``module:qualname``); the frame chain that
    writes the JSONL line of the first event of ``kind`` goes to ``CHAINS[label]``."""
    calls: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        name = _name(frame)
        if name is None:
            return
        calls.append(name)
        event = frame.f_locals.get("event") if name.endswith("JsonlSink.log_event") else None
        if event is not None and label not in CHAINS and event.kind == kind:
            chain, f = [], frame
            while f is not None:
                outer = _name(f)
                if outer is not None:
                    chain.append(outer)
                f = f.f_back
            CHAINS[label] = chain[::-1]

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

    calls = trace(bad_step, "skipped step")
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

    calls = trace(last_bad_step, "rollback", kind="rollback")
    guard.close()
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print each path's calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"skipped step": skipped_step(Path(tmp)), "rollback": rollback(Path(tmp))}
    print("| path | hops (calls) | distinct functions | modules | chain to its JSONL line: frames / modules |")
    print("| --- | --- | --- | --- | --- |")
    for name, calls in paths.items():
        modules = sorted({c.split(":")[0] for c in calls})
        chain = CHAINS.get(name, [])
        chain_modules = len({c.split(":")[0] for c in chain})
        print(f"| {name} | {len(calls)} | {len(set(calls))} | {len(modules)} | {len(chain)} / {chain_modules} |")
    for label, before in (("before DriverCore merged away", BEFORE), ("before the drivers' line cut", BEFORE_CUT)):
        for name, (hops, distinct, modules_before, chain_before) in before.items():
            print(f"| {name}, {label} | {hops} | {distinct} | {modules_before} | {chain_before} |")
    for name, calls in paths.items():
        modules = sorted({c.split(":")[0] for c in calls})
        print(f"\n{name}: modules: {', '.join(m.removeprefix('stabilitykit.') for m in modules)}")
        print(f"{name}: chain to its event's JSONL line:")
        for frame in CHAINS.get(name, []):
            print("   ", frame.removeprefix("stabilitykit."))
        if args.list:
            for call in calls:
                print("  ", call.removeprefix("stabilitykit."))


if __name__ == "__main__":
    main()
