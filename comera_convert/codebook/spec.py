"""CodebookSpec: the shape of a product-quantized table (slices, centres per slice), validated on
construction, and what it stores counted as the dense model counts its parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ShapeError, expected
from .product import check_codebook_shape

LAYOUT = "codebook"  # how reports and records name the format beside tt and ttm
# A planned table has at least this many rows per centre on average (256 centres from 4,096 rows
# on): a small table's budget then goes to its codes, not to centres that each hold a row or two.
ROWS_PER_CENTRE = 16


@dataclass(frozen=True)
class CodebookSpec:
    rows: int
    cols: int
    subspaces: int
    codewords: int = 256
    # Bytes of one of the table's floats (4 for float32): a row's codes are one byte per slice, so
    # ``element_size`` of them cost what one parameter does.
    element_size: int = 4

    def __post_init__(self):
        check_codebook_shape(self.rows, self.cols, self.subspaces, self.codewords)
        if self.element_size not in (1, 2, 4, 8):
            raise ShapeError(expected("element_size in (1, 2, 4, 8) bytes", self.element_size))

    @classmethod
    def plan(cls, rows: int, cols: int, width: int, element_size: int = 4) -> "CodebookSpec":
        """Slices of ``width`` columns (the nearest width dividing ``cols`` evenly, at most ``cols``)."""
        width = min(max(1, width), cols)
        while cols % width:
            width += 1
        return cls(rows, cols, cols // width, max(2, min(256, rows // ROWS_PER_CENTRE)), element_size)

    @property
    def layout(self) -> str:
        return LAYOUT

    @property
    def width(self) -> int:
        """Columns per slice."""
        return self.cols // self.subspaces

    @property
    def codebook_params(self) -> int:
        return self.subspaces * self.codewords * self.width

    @property
    def code_params(self) -> int:
        """The codes (one byte per row and slice) in units of the table's parameters, rounded up."""
        return math.ceil(self.rows * self.subspaces / self.element_size)

    @property
    def stored_params(self) -> int:
        return self.codebook_params + self.code_params

    def to_dict(self) -> dict:
        return {"layout": LAYOUT, "rows": self.rows, "cols": self.cols, "subspaces": self.subspaces,
                "codewords": self.codewords}

    @classmethod
    def from_dict(cls, data: dict, element_size: int = 4) -> "CodebookSpec":
        try:
            return cls(int(data["rows"]), int(data["cols"]), int(data["subspaces"]), int(data["codewords"]),
                       element_size)
        except (KeyError, TypeError, ValueError) as err:
            raise ShapeError(expected("a codebook spec with rows, cols, subspaces, codewords", data)) from err
