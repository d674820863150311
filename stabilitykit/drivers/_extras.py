"""One place for the "install the extra" message every integration raises without its framework."""

from __future__ import annotations


def missing(module: str, extra: str, package: str) -> ImportError:
    """An ImportError that says which extra (and which package) ``module`` needs."""
    return ImportError(f"{module} needs {package}: pip install 'stabilitykit[{extra}]' (or pip install {package})")
