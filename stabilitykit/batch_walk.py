"""Walking a training batch: every leaf inside the containers PyTorch users pass, with its path.

Mappings (``dict``, ``UserDict`` such as HF ``BatchEncoding``, any ``Mapping``), dataclasses,
namedtuples, lists and tuples are opened; everything else is a leaf. Paths read like Python:
``batch['labels'][3]`` for mapping keys and positions, ``batch.labels`` for dataclass and
namedtuple fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchLeaf:
    """One value found in a batch: a non-container, or an empty container (``empty`` says which)."""

    path: str
    value: Any
    is_label: bool
    empty: str | None = None  # "mapping" | "sequence" | "dataclass" for an empty container


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


def walk_batch(
    batch: Any, label_keys: Sequence[str | int] = (), root: str = "batch", max_depth: int = 64
) -> Iterator[BatchLeaf]:
    """Every leaf of ``batch`` in order; ``is_label`` when a key, field or position on its path is in ``label_keys``.

    A container met again on its own path (a cycle) or nesting deeper than ``max_depth`` raises
    ``ValueError`` naming the path, rather than recursing forever.
    """
    labels = set(label_keys)

    def visit(value: Any, path: str, is_label: bool, open_ids: tuple[int, ...]) -> Iterator[BatchLeaf]:
        if len(open_ids) > max_depth:
            raise ValueError(f"{path}: batch nested deeper than {max_depth} containers")
        if isinstance(value, (str, bytes, bytearray)):
            yield BatchLeaf(path, value, is_label)
            return
        container = isinstance(value, (Mapping, list, tuple)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        )
        if not container:
            yield BatchLeaf(path, value, is_label)
            return
        if id(value) in open_ids:
            raise ValueError(f"{path}: the batch contains itself (a reference cycle)")
        inner = (*open_ids, id(value))
        if isinstance(value, Mapping):
            if not value:
                yield BatchLeaf(path, value, is_label, "mapping")
            for key, item in value.items():
                is_key_label = isinstance(key, (str, int)) and key in labels
                yield from visit(item, f"{path}[{key!r}]", is_label or is_key_label, inner)
        elif _is_namedtuple(value):
            if not value:
                yield BatchLeaf(path, value, is_label, "sequence")
            for i, (name, item) in enumerate(zip(type(value)._fields, value, strict=True)):
                yield from visit(item, f"{path}.{name}", is_label or name in labels or i in labels, inner)
        elif isinstance(value, (list, tuple)):
            if not value:
                yield BatchLeaf(path, value, is_label, "sequence")
            for i, item in enumerate(value):
                yield from visit(item, f"{path}[{i}]", is_label or i in labels, inner)
        else:
            fields = dataclasses.fields(value)
            if not fields:
                yield BatchLeaf(path, value, is_label, "dataclass")
            for f in fields:
                yield from visit(getattr(value, f.name), f"{path}.{f.name}", is_label or f.name in labels, inner)

    yield from visit(batch, root, False, ())
