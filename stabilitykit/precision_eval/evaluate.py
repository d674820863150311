"""Layer-wise precision report: each variant's per-module error against an fp32 reference."""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.precision_eval.capture import Capture
from stabilitykit.precision_eval.fp8 import Fp8Transform

#: Floor of the reference scale in rms_rel, so exact zeros do not divide by zero.
EPS = 1e-12
#: Loss scale of the "fp16" variant; captured input gradients are divided by it again.
FP16_LOSS_SCALE = 2.0**12

LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass
class Variant:
    """One way of running the model: a context around forward+backward and/or a model transform."""

    name: str
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    transform: Callable[[nn.Module], nn.Module] | None = None
    grad_scale: float = 1.0


@contextlib.contextmanager
def _matmul_precision(precision: str, allow_tf32: bool) -> Iterator[None]:
    """Float32 matmul precision and the cuBLAS/cuDNN TF32 switches, restored afterwards."""
    previous = torch.get_float32_matmul_precision()
    cuda_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(precision)
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
        torch.backends.cuda.matmul.allow_tf32 = cuda_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _fp32_reference() -> contextlib.AbstractContextManager[None]:
    """Matmul precision "highest", TF32 off."""
    return _matmul_precision("highest", allow_tf32=False)


def _tf32() -> contextlib.AbstractContextManager[None]:
    """Matmul precision "high", TF32 on."""
    return _matmul_precision("high", allow_tf32=True)


#: The variants known by name (``evaluate(variants=[...])``, ``stabilitykit precision --variants``).
BUILTIN_VARIANTS = ("bf16", "fp16", "tf32", "fp32", "fp8")


def _builtin(name: str, device_type: str) -> Variant:
    if name == "bf16":
        return Variant("bf16", lambda: torch.autocast(device_type, dtype=torch.bfloat16))
    if name == "fp16":
        return Variant("fp16", lambda: torch.autocast(device_type, dtype=torch.float16), grad_scale=FP16_LOSS_SCALE)
    if name == "tf32":
        return Variant("tf32", _tf32)
    if name == "fp32":
        return Variant("fp32", _fp32_reference)
    if name == "fp8":
        return Variant("fp8", transform=Fp8Transform())
    raise ValueError(f"unknown built-in variant {name!r}: use 'bf16', 'fp16', 'tf32', 'fp32', 'fp8' or pass a Variant")


def _as_variant(name: str, spec: Any, device_type: str) -> Variant:
    """A Variant from a built-in name, a Variant, a context factory, a context, or a model transform."""
    if isinstance(spec, Variant):
        return spec
    if spec is None or isinstance(spec, str):
        return _builtin(spec or name, device_type)
    if isinstance(spec, type) and hasattr(spec, "__enter__"):
        return Variant(name, context=spec)  # a context-manager class: a new instance per run
    if hasattr(spec, "__enter__"):
        return Variant(name, lambda: spec)
    if callable(spec):
        params = [p for p in inspect.signature(spec).parameters.values() if p.default is inspect.Parameter.empty]
        if params:
            return Variant(name, transform=spec)
        return Variant(name, context=spec)
    raise TypeError(
        f"variant {name!r}: expected a name, Variant, context manager or callable, got {type(spec).__name__}"
    )


def compare(test: Tensor, ref: Tensor, eps: float = EPS) -> dict[str, float]:
    """Errors of ``test`` against ``ref`` (both fp32): rms_rel, rms_abs, max_abs, max_rel, scale."""
    if test.shape != ref.shape:
        nan = math.nan
        return {"rms_rel": nan, "rms_abs": nan, "max_abs": nan, "max_rel": nan, "scale": nan}
    diff = (test - ref).abs()
    rms_ref = ref.pow(2).mean().sqrt().item()
    rms_abs = diff.pow(2).mean().sqrt().item()
    max_abs = diff.max().item() if diff.numel() else 0.0
    max_ref = ref.abs().max().item() if ref.numel() else 0.0
    return {
        "rms_rel": rms_abs / math.sqrt(rms_ref**2 + eps**2),
        "rms_abs": rms_abs,
        "max_abs": max_abs,
        "max_rel": max_abs / (max_ref + eps),
        "scale": rms_ref,
    }


@dataclass
class PrecisionReport:
    """Per-variant, per-module errors against the fp32 reference; rows in execution order."""

    variants: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    reference: str = "fp32"
    #: What a variant did to the model, by variant name: the "fp8" variant's converted layers and the
    #: layers it left in high precision, with the reason (``{"fp8": {"converted": [...], ...}}``).
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``{"reference": "fp32", "variants": {name: {"forward": [row...], "backward": [row...]}}}``,
        plus ``"notes"`` (by variant name) when a variant left notes (the "fp8" variant does)."""
        out: dict[str, Any] = {"reference": self.reference, "variants": copy.deepcopy(self.variants)}
        if self.notes:
            out["notes"] = copy.deepcopy(self.notes)
        return out

    def save_json(self, path: str | Path) -> Path:
        """Write ``to_dict()`` as JSON (NaN allowed for modules a variant did not run)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def load_json(cls, path: str | Path) -> PrecisionReport:
        """Read a report written by ``save_json``."""
        data = json.loads(Path(path).read_text())
        return cls(variants=data["variants"], reference=data.get("reference", "fp32"), notes=data.get("notes", {}))

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per variant and phase: rms_rel of the first module, median and max of the middle ones, the last.

        Keys are headed by the real module names: ``{"first: tok_emb": x, "median (22 middle)": y, ...}``.
        """
        out: dict[str, dict[str, dict[str, float]]] = {}
        for variant, phases in self.variants.items():
            out[variant] = {}
            for phase, rows in phases.items():
                if not rows:
                    continue
                values = [r["rms_rel"] for r in rows]
                middle = [v for v in values[1:-1] if not math.isnan(v)]
                entry = {f"first: {rows[0]['module']}": values[0]}
                if middle:
                    entry[f"median of {len(middle)} middle"] = statistics.median(middle)
                    entry[f"max of {len(middle)} middle"] = max(middle)
                if len(rows) > 1:
                    entry[f"last: {rows[-1]['module']}"] = values[-1]
                out[variant][phase] = entry
        return out

    def print(self, per_layer: bool = False) -> None:
        """Rich tables: the summary per variant, and with ``per_layer`` every module's row."""
        from rich.console import Console
        from rich.table import Table

        console = Console()
        for variant, phases in self.summary().items():
            for phase, entry in phases.items():
                table = Table(title=f"{variant} vs {self.reference}: {phase} rms_rel")
                for key in entry:
                    table.add_column(key, justify="right")
                table.add_row(*(f"{v:.2e}" for v in entry.values()))
                console.print(table)
        for variant, notes in self.notes.items():
            kept = notes.get("high_precision") or {}
            converted = notes.get("converted") or []
            how = "emulated" if notes.get("emulated") else "FP8 matmuls"
            console.print(f"{variant}: {len(converted)} layers converted ({notes.get('recipe')}, {how})")
            for module, reason in kept.items():
                console.print(f"  kept in high precision: {module}: {reason}")
        if per_layer:
            for variant, variant_phases in self.variants.items():
                for phase, rows in variant_phases.items():
                    table = Table(title=f"{variant} {phase}")
                    for col in ("module", "rms_rel", "rms_abs", "max_abs", "max_rel", "scale"):
                        table.add_column(col, justify="left" if col == "module" else "right")
                    for r in rows:
                        table.add_row(
                            r["module"], *(f"{r[c]:.2e}" for c in ("rms_rel", "rms_abs", "max_abs", "max_rel", "scale"))
                        )
                    console.print(table)

    def plot(self, path: str | Path) -> Path:
        """rms_rel by depth: one line per variant, forward and backward side by side (PNG)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, phase in zip(axes, ("forward", "backward"), strict=True):
            for variant, phases in self.variants.items():
                rows = phases.get(phase, [])
                ys = [max(r["rms_rel"], 1e-12) if not math.isnan(r["rms_rel"]) else float("nan") for r in rows]
                ax.plot(range(len(rows)), ys, marker=".", label=variant)
            ax.set_yscale("log")
            ax.set_title(f"{phase}: rms_rel vs {self.reference} by depth")
            ax.set_xlabel("module, in execution order")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("rms(test - ref) / rms(ref)")
        axes[1].legend()
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _run(model: nn.Module, batch: Any, loss_fn: LossFn, variant: Variant, seed: int, max_elements: int) -> Capture:
    torch.manual_seed(seed)
    capture = Capture(model, max_elements, grad_scale=variant.grad_scale)
    context = variant.context() if variant.context is not None else contextlib.nullcontext()
    with capture, context:
        loss = loss_fn(model, batch)
        params = [p for p in model.parameters() if p.requires_grad]
        (loss.float() * variant.grad_scale).backward(inputs=params or None)
    for p in model.parameters():
        p.grad = None
    return capture


def evaluate(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    variants: Sequence[str] | Mapping[str, Any] = ("bf16", "fp16", "tf32"),
    seed: int = 0,
    max_elements: int = 4096,
    progress: bool = True,
) -> PrecisionReport:
    """Run an fp32 reference and each variant on the same weights, batch and seed; compare per module.

    ``loss_fn(model, batch) -> loss``. ``variants``: built-in names ("bf16", "fp16", "tf32", "fp32", "fp8")
    or a mapping name -> spec, where a spec is a built-in name, a ``Variant``, a context manager (or
    a function returning one), or a function ``model -> model`` (a module swap). The model runs in
    eval mode (dropout off); its training mode and grads are restored afterwards.

    "fp8" converts a copy's linear layers with torchao (the ``fp8`` extra; emulated on a device
    without FP8 matmuls) and keeps everything else as the reference runs it; ``report.notes["fp8"]``
    lists the converted layers and those left in high precision, with the reason.
    """
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    if isinstance(variants, Mapping):
        specs = [_as_variant(name, spec, device_type) for name, spec in variants.items()]
    else:
        specs = [_as_variant(name, None, device_type) for name in variants]
    was_training = model.training
    saved_grads = [p.grad for p in model.parameters()]
    model.eval()
    report = PrecisionReport()
    try:
        with _fp32_reference():
            ref = _run(model, batch, loss_fn, Variant("fp32"), seed, max_elements)
        bar = _progress(progress, len(specs))
        for spec in specs:
            target = spec.transform(copy.deepcopy(model)) if spec.transform is not None else model
            test = _run(target, batch, loss_fn, spec, seed, max_elements)
            notes = getattr(spec.transform, "notes", None)
            if notes:
                report.notes[spec.name] = dict(notes)
            phases: dict[str, list[dict[str, Any]]] = {}
            for phase, ref_values, test_values in (
                ("forward", ref.forward, test.forward),
                ("backward", ref.backward, test.backward),
            ):
                rows = []
                for module, ref_sample in ref_values.items():
                    other = test_values.get(module)
                    errors = compare(other, ref_sample) if other is not None else compare(ref_sample[:0], ref_sample)
                    rows.append({"module": module, **errors})
                phases[phase] = rows
            report.variants[spec.name] = phases
            bar(spec.name)
    finally:
        model.train(was_training)
        for p, g in zip(model.parameters(), saved_grads, strict=True):
            p.grad = g
    return report


def _progress(enabled: bool, total: int) -> Callable[[str], None]:
    """A rich progress bar over the variants (a no-op when disabled or rich is missing)."""
    if not enabled:
        return lambda name: None
    try:
        from rich.progress import Progress
    except ImportError:  # pragma: no cover - rich comes with the plots extra
        return lambda name: None
    bar = Progress(transient=True)
    task = bar.add_task("precision variants", total=total)
    bar.start()
    done = {"n": 0}

    def advance(name: str) -> None:
        done["n"] += 1
        bar.update(task, advance=1, description=f"variant {name}")
        if done["n"] >= total:
            bar.stop()

    return advance
