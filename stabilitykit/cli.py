"""The ``stabilitykit`` command: ``stabilitykit precision ...`` and ``stabilitykit report ...``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stabilitykit import __version__


class _UsageError(Exception):
    """A command-line argument the command cannot use: one line on stderr and exit status 2."""


def _load_factory(spec: str) -> Any:
    """``package.module:function`` -> the function (the working directory is importable)."""
    if ":" not in spec:
        raise _UsageError(f"--model must look like package.module:function, got {spec!r}")
    module_name, attr = spec.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _UsageError(f"--model {spec}: cannot import {module_name!r}: {exc}") from exc
    try:
        factory = getattr(module, attr)
    except AttributeError as exc:
        raise _UsageError(f"--model {spec}: {module_name} has no attribute {attr!r}") from exc
    if not callable(factory):
        raise _UsageError(
            f"--model {spec}: {module_name}.{attr} is a {type(factory).__name__}, not a function returning "
            "(model, batch, loss_fn)"
        )
    return factory


def _parse_variants(text: str) -> list[str]:
    """The comma-separated built-in variant names of ``--variants``, checked before any model is built."""
    from stabilitykit.precision_eval.evaluate import BUILTIN_VARIANTS

    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise _UsageError(f"--variants names no variant (got {text!r}): use {', '.join(BUILTIN_VARIANTS)}")
    for name in names:
        if name not in BUILTIN_VARIANTS:
            raise _UsageError(f"--variants: unknown built-in variant {name!r}: use {', '.join(BUILTIN_VARIANTS)}")
    if "fp8" in names:
        from stabilitykit.compat.torchao_float8 import INSTALL_HINT, available

        if not available():
            raise _UsageError(f"--variants fp8: {INSTALL_HINT}")
    return names


def _precision(args: argparse.Namespace) -> int:
    """Run the report; a --model, --variants or --out it cannot use is one line on stderr and exit status 2."""
    try:
        return _run_precision(args)
    except _UsageError as exc:
        print(f"stabilitykit precision: error: {exc}", file=sys.stderr)
        return 2


def _run_precision(args: argparse.Namespace) -> int:
    from stabilitykit.precision_eval import evaluate

    variants = _parse_variants(args.variants)
    if args.max_elements < 1:
        raise _UsageError(f"--max-elements must be at least 1, got {args.max_elements}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)  # before the (slow) evaluation, not after it
    except OSError as exc:
        raise _UsageError(f"--out {out}: cannot create the folder: {exc}") from exc
    built = _load_factory(args.model)()
    if not (isinstance(built, tuple) and len(built) == 3):
        raise _UsageError(
            f"--model {args.model}: the factory must return (model, batch, loss_fn), got {type(built).__name__}"
        )
    model, batch, loss_fn = built
    report = evaluate(model, batch, loss_fn, variants=variants, max_elements=args.max_elements, seed=args.seed)
    report.print(per_layer=args.per_layer)
    try:
        json_path = report.save_json(out / "precision.json")
        png_path = report.plot(out / "precision.png")
    except OSError as exc:
        raise _UsageError(f"--out {out}: cannot write the report: {exc}") from exc
    print(f"wrote {json_path} and {png_path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    """Draw the picture; a log or output it cannot use is one line on stderr and exit status 2."""
    import warnings
    from pathlib import Path

    from stabilitykit.report_plot import check_output, draw_report, load_run_log

    def one_line(message: Warning | str, *_: object, **__: object) -> None:  # showwarning's signature
        text = str(message).removeprefix("stabilitykit: ")
        print(f"stabilitykit report: warning: {text}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line  # a skipped truncated line is worth a line, not a traceback-like block
            check_output(Path(args.output))  # before the log is read: a long log is not read for nothing
            run = load_run_log(args.log, prefix=args.prefix)
            for note in run.notes:
                print(f"stabilitykit report: {note}")
            path = draw_report(run, args.output, title=args.title, prefix=args.prefix)
    except (ValueError, OSError) as exc:  # ReportError, JsonlError, unreadable files: the message names the file
        print(f"stabilitykit report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stabilitykit`` console script."""
    parser = argparse.ArgumentParser(prog="stabilitykit", description="Training stability tools.")
    parser.add_argument("--version", action="version", version=f"stabilitykit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    prec = sub.add_parser("precision", help="layer-wise error of bf16/fp16/TF32/FP8 against an fp32 reference")
    prec.add_argument("--model", required=True, help="package.module:factory returning (model, batch, loss_fn)")
    prec.add_argument("--variants", default="bf16,fp16,tf32", help="comma-separated: bf16, fp16, tf32, fp32, fp8")
    prec.add_argument("--out", default="precision-report", help="folder for precision.json and precision.png")
    prec.add_argument("--max-elements", type=int, default=4096, help="samples kept per captured tensor")
    prec.add_argument("--seed", type=int, default=0)
    prec.add_argument("--per-layer", action="store_true", help="also print every module's row")
    prec.set_defaults(func=_precision)

    rep = sub.add_parser("report", help="one picture of a run: loss, grad norm, z-score, skips, per-layer heatmap")
    rep.add_argument("log", help="the guard's JSONL log or a Lightning CSVLogger metrics.csv")
    rep.add_argument("-o", "--output", default="report.png", help="the PNG to write (default: report.png)")
    rep.add_argument("--title", default=None)
    rep.add_argument("--prefix", default=None, help="the run's metric_prefix (found in the log when not given)")
    rep.set_defaults(func=_report)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
