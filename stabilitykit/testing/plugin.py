"""pytest plugin (entry point ``stabilitykit``): device-keyed grad-norm and precision regression fixtures.

``grad_norm_regression(name, module, rtol=0.1)`` compares the L2 norm of block 0's grads (the
first child of the model's repeated blocks; any selector you pass) with a reference stored in
``grad_norm_refs.json`` beside the test file: ``{name: {device_key: norm}}``. The device key comes
from a substring map of device names ("H100", "A100", "L40S", ..., "CPU").

``precision_regression(name, model, batch, loss_fn, variants=("bf16",))`` pins the per-module
rms_rel of ``stabilitykit.precision_eval`` in ``precision_refs.json``.

Record or refresh references with ``pytest --stabilitykit-update-refs`` (or
``STABILITYKIT_UPDATE_REFS=1``): the fixtures then write and skip. A missing reference skips
with a message saying how to seed it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

__all__ = ["device_key"]

#: Substring of ``torch.cuda.get_device_name()`` -> reference key; the first match wins.
DEFAULT_DEVICE_KEYS: dict[str, str] = {
    "H200": "H200",
    "H100": "H100",
    "A100": "A100",
    "L40S": "L40S",
    "A10G": "A10G",
    "L4": "L4",
    "V100": "V100",
    "T4": "T4",
}

_UPDATE_HELP = "record grad-norm / precision references instead of comparing (skips those tests)"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stabilitykit")
    group.addoption("--stabilitykit-update-refs", action="store_true", default=False, help=_UPDATE_HELP)
    parser.addini(
        "stabilitykit_device_keys",
        type="linelist",
        default=[],
        help="extra 'substring=key' lines mapping device names to reference keys (checked first)",
    )


def device_key(device: torch.device | str | None = None, mapping: dict[str, str] | None = None) -> str:
    """The reference key of ``device`` (default: the current CUDA device, else "CPU")."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type != "cuda":
        return dev.type.upper()
    name = torch.cuda.get_device_name(dev)
    for substring, key in {**(mapping or {}), **DEFAULT_DEVICE_KEYS}.items():
        if substring in name:
            return key
    return name.replace(" ", "_")


def select_block0(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameters of the first repeated block (``blocks.0``), or all parameters without blocks."""
    from stabilitykit.engine.layers import layer_names_for

    named: list[tuple[str, Tensor]] = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    layers = layer_names_for(named, module, "auto")
    blocks = [layer for layer in dict.fromkeys(layers) if layer.endswith(".0")]
    if not blocks:
        return named
    return [(n, p) for (n, p), layer in zip(named, layers, strict=True) if layer == blocks[0]]


def _update_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("--stabilitykit-update-refs")) or os.environ.get("STABILITYKIT_UPDATE_REFS") == "1"


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise pytest.UsageError(f"{path}: expected a JSON object at the top level")
    return data


def _save(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_SEED_HINT = "run `pytest --stabilitykit-update-refs` (or STABILITYKIT_UPDATE_REFS=1) on this device to record it"


def _reference(path: Path, name: str, key: str, value: Any, update: bool, what: str) -> Any:
    """The stored reference ``{name: {key: ...}}`` in ``path``; records ``value`` and skips when updating,
    skips with a seeding hint when there is none."""
    refs = _load(path)
    if update:
        refs.setdefault(name, {})[key] = value
        _save(path, refs)
        shown = f": {value:.6g}" if isinstance(value, float) else ""
        pytest.skip(f"recorded {what} reference {name!r} on {key}{shown} in {path}")
    ref = refs.get(name, {}).get(key)
    if ref is None:
        pytest.skip(f"no {what} reference for {name!r} on device {key!r} in {path}; {_SEED_HINT}")
    return ref


@pytest.fixture
def stabilitykit_device_key(request: pytest.FixtureRequest) -> str:
    """The device key references are stored under; override this fixture to choose your own."""
    lines = request.config.getini("stabilitykit_device_keys")
    mapping = dict(line.split("=", 1) for line in lines if "=" in line)
    return device_key(mapping={k.strip(): v.strip() for k, v in mapping.items()})


@pytest.fixture
def grad_norm_regression(request: pytest.FixtureRequest, stabilitykit_device_key: str) -> Callable[..., float]:
    """``grad_norm_regression(name, module, rtol=0.1, selector=None, refs_file=None) -> norm``.

    Call it after ``loss.backward()``. ``selector``: a parameter-name prefix, a function
    ``(name, param) -> bool``, or None for block 0.
    """
    update = _update_requested(request.config)
    default_file = Path(str(request.node.path)).parent / "grad_norm_refs.json"

    def check(
        name: str,
        module: nn.Module,
        rtol: float = 0.1,
        selector: str | Callable[[str, Tensor], bool] | None = None,
        refs_file: str | Path | None = None,
    ) -> float:
        if selector is None:
            chosen = select_block0(module)
        elif isinstance(selector, str):
            chosen = [(n, p) for n, p in module.named_parameters() if n.startswith(selector)]
        else:
            chosen = [(n, p) for n, p in module.named_parameters() if selector(n, p)]
        grads = [p.grad for _, p in chosen if p.grad is not None]
        if not grads:
            raise pytest.UsageError(
                f"grad_norm_regression({name!r}): no grads on the selected parameters "
                f"({[n for n, _ in chosen][:3]}...); call loss.backward() first"
            )
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)  # type: ignore[arg-type]
        norm = float(torch.stack(norms).norm())
        path = Path(refs_file) if refs_file is not None else default_file
        key = stabilitykit_device_key
        ref = _reference(path, name, key, norm, update, "grad-norm")
        rel = abs(norm - ref) / abs(ref) if ref else abs(norm)
        if not rel <= rtol:
            pytest.fail(
                f"grad norm of {name!r} on {key}: got {norm:.6g}, reference {ref:.6g}, "
                f"relative error {rel:.3g} > rtol {rtol}",
                pytrace=False,
            )
        return norm

    return check


@pytest.fixture
def precision_regression(request: pytest.FixtureRequest, stabilitykit_device_key: str) -> Callable[..., Any]:
    """``precision_regression(name, model, batch, loss_fn, variants=("bf16",), rtol=0.5, atol=1e-6)``.

    Fails when a module's rms_rel grows beyond ``ref * (1 + rtol) + atol`` (smaller errors pass);
    lists the worst modules. References live in ``precision_refs.json`` beside the test file.
    """
    update = _update_requested(request.config)
    default_file = Path(str(request.node.path)).parent / "precision_refs.json"

    def check(
        name: str,
        model: nn.Module,
        batch: Any,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        variants: Sequence[str] = ("bf16",),
        rtol: float = 0.5,
        atol: float = 1e-6,
        refs_file: str | Path | None = None,
    ) -> Any:
        from stabilitykit.precision_eval import evaluate

        report = evaluate(model, batch, loss_fn, variants=variants, progress=False)
        got = {
            variant: {phase: {row["module"]: row["rms_rel"] for row in rows} for phase, rows in phases.items()}
            for variant, phases in report.variants.items()
        }
        path = Path(refs_file) if refs_file is not None else default_file
        key = stabilitykit_device_key
        ref = _reference(path, name, key, got, update, "precision")
        failures = []
        for variant, phases in got.items():
            for phase, modules in phases.items():
                for module, value in modules.items():
                    expected = ref.get(variant, {}).get(phase, {}).get(module)
                    if expected is None or math.isnan(expected):
                        continue
                    limit = expected * (1 + rtol) + atol
                    if not value <= limit:
                        failures.append((value / max(limit, 1e-30), variant, phase, module, value, expected))
        if failures:
            failures.sort(reverse=True)
            lines = [
                f"  {variant} {phase} {module}: got rms_rel {value:.3g}, reference {expected:.3g} "
                f"(limit {expected * (1 + rtol) + atol:.3g})"
                for _, variant, phase, module, value, expected in failures[:10]
            ]
            pytest.fail(
                f"precision of {name!r} on {key} regressed in {len(failures)} module(s), rtol {rtol}, atol {atol}:\n"
                + "\n".join(lines),
                pytrace=False,
            )
        return report

    return check
