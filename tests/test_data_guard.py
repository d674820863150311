"""The data guard walks every container a PyTorch user passes: HF BatchEncoding, dataclasses, namedtuples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from transformers import BatchEncoding

import stabilitykit as sk
from stabilitykit.batch_walk import walk_batch


@dataclass
class LMBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None


class Pair(NamedTuple):
    x: torch.Tensor
    labels: torch.Tensor


def _ids(bad_at: tuple[int, int] | None = None, value: int = 5000) -> torch.Tensor:
    ids = torch.arange(4 * 32).reshape(4, 32) % 100
    if bad_at is not None:
        ids[bad_at] = value
    return ids


def test_batch_encoding_labels_are_checked_and_named() -> None:
    good = BatchEncoding({"input_ids": _ids(), "labels": _ids()})
    assert not isinstance(good, dict)  # a UserDict: the old isinstance(dict) walk saw nothing
    sk.check_batch(good, num_classes=100)
    bad = BatchEncoding({"input_ids": _ids(), "labels": _ids((3, 17))})
    with pytest.raises(sk.BadBatchError, match=r"batch\['labels'\]\[3\]\[17\] is 5000, outside \[0, 100\)") as info:
        sk.check_batch(bad, num_classes=100, step=9)
    assert info.value.path == "batch['labels'][3][17]" and info.value.step == 9
    flag = sk.batch_is_bad(bad, num_classes=100)
    assert flag is not None and bool(flag)
    assert not bool(sk.batch_is_bad(good, num_classes=100))


def test_batch_encoding_nonfinite_float() -> None:
    mask = torch.ones(4, 32)
    mask[2, 5] = float("inf")
    bad = BatchEncoding({"input_ids": _ids(), "attention_mask": mask})
    with pytest.raises(sk.BadBatchError, match=r"batch\['attention_mask'\]\[2\]\[5\] is inf"):
        sk.check_batch(bad)
    assert bool(sk.batch_is_bad(bad))


def test_dataclass_batch_fields_are_paths() -> None:
    sk.check_batch(LMBatch(_ids(), _ids()), num_classes=100)
    with pytest.raises(sk.BadBatchError, match=r"batch\.labels\[3\]\[17\] is -7, outside"):
        sk.check_batch(LMBatch(_ids(), _ids((3, 17), -7)), num_classes=100)
    weights = torch.ones(4)
    weights[3] = float("nan")
    with pytest.raises(sk.BadBatchError, match=r"batch\.weights\[3\] is nan"):
        sk.check_batch(LMBatch(_ids(), _ids(), weights))
    assert bool(sk.batch_is_bad(LMBatch(_ids(), _ids((0, 0)), None), num_classes=100))
    assert not bool(sk.batch_is_bad(LMBatch(_ids(), _ids(), torch.ones(4)), num_classes=100))


def test_namedtuple_batch_by_field_name_and_position() -> None:
    labels = torch.tensor([1, 2, 3, 42])
    with pytest.raises(sk.BadBatchError, match=r"batch\.labels\[3\] is 42"):
        sk.check_batch(Pair(torch.zeros(4, 2), labels), num_classes=10)
    # (x, y) tuples name the label by position; a namedtuple answers to its position too
    with pytest.raises(sk.BadBatchError, match=r"batch\.labels\[3\] is 42"):
        sk.check_batch(Pair(torch.zeros(4, 2), labels), num_classes=10, label_keys=[1])
    sk.check_batch(Pair(torch.zeros(4, 2), labels), num_classes=10, label_keys=["targets"])
    assert bool(sk.batch_is_bad(Pair(torch.zeros(4, 2), labels), num_classes=10))


def test_nested_containers_and_empty_ones() -> None:
    nested = {"text": BatchEncoding({"input_ids": _ids()}), "extra": [LMBatch(_ids(), _ids(), torch.zeros(0))]}
    with pytest.raises(sk.BadBatchError, match=r"batch\['extra'\]\[0\]\.weights is empty"):
        sk.check_batch(nested)
    with pytest.raises(sk.BadBatchError, match=r"batch\['a'\] is an empty mapping"):
        sk.check_batch({"a": BatchEncoding({}), "b": torch.ones(1)})
    paths = [leaf.path for leaf in walk_batch(nested)]
    assert paths == ["batch['text']['input_ids']", "batch['extra'][0].input_ids", "batch['extra'][0].labels",
                     "batch['extra'][0].weights"]  # fmt: skip
    cyclic: list[object] = [torch.ones(1)]
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match=r"batch\[1\]: the batch contains itself"):
        sk.check_batch(cyclic)


def test_skip_mode_skips_a_bad_batch_encoding_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Embedding(100, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = sk.StabilityConfig(data=sk.DataGuardConfig(mode="skip", num_classes=100))
    guard = sk.StabilityGuard(model, opt, cfg)
    skipped = []
    for bad in (False, True, False):
        batch = BatchEncoding({"input_ids": _ids(), "labels": _ids((1, 1)) if bad else _ids()})
        guard.check_batch(batch)
        guard.backward(model(batch["input_ids"]).pow(2).mean())
        skipped.append(bool(guard.step().skipped))
        guard.zero_grad()
    guard.close()
    assert skipped == [False, True, False]
