"""tests/cuda runs only where a GPU is: everywhere else each test is collected and skipped, with the reason."""

from __future__ import annotations

import pytest
import torch

REASON = "CUDA not available: tests/cuda runs on a GPU machine (scripts/gpu_check.sh)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if "tests/cuda/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
