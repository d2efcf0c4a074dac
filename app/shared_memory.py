"""Where a client's tensors lie in its registered shared-memory regions (Triton's shared-memory extension): values
the inference protocol's codec produces and the engines read. Only the engine processes map the regions; their
bytes never pass through an HTTP worker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SharedTensor:
    """An operand a client left in a registered shared-memory region: where, and what it is."""

    region: str
    offset: int
    shape: tuple[int, ...]
    """A matrix's, or a stack's (app/shapes.py)."""
    dtype: np.dtype


@dataclass(frozen=True)
class SharedOutput:
    """Where a client asked for the product: `byte_size` bytes at `offset` of a registered region."""

    region: str
    offset: int
    byte_size: int


Matrix = np.ndarray | SharedTensor
"""An operand: an array in this process, or a tensor in a client's region."""
