"""Model factories for the ``stabilitykit precision`` command: each returns (model, batch, loss_fn).

    stabilitykit precision --model examples.models:tiny_gpt --variants bf16,fp16 --out report/

``examples.models`` is importable from the repository's root only; the same factories ship with
the package as ``stabilitykit.testing.models`` (``--model stabilitykit.testing.models:tiny_gpt``
works from any folder).
"""

from __future__ import annotations

from stabilitykit.testing.models import tiny_gpt, tiny_gpt_qk_norm

__all__ = ["tiny_gpt", "tiny_gpt_qk_norm"]
