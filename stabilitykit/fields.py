"""Constrained field types for the dataclasses a saved state mirrors.

The saved state's schema (``state.schema_of``) is read from the owners' dataclasses (the ledger's
counters, the journal's row notes, recovery's rollback records), constraints included. This module
imports nothing of the package, so every owner can use it without an import cycle.
"""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge

#: An int that is never negative (a count, a step number).
NonNegativeInt = Annotated[int, Ge(0)]
