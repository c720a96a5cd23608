"""TTSpec: the shape of a tensor-train matrix (layout, modes, ranks), validated on construction.

A TT matrix represents an R x C matrix M (for a linear layer M = W^T, in x out; for an
embedding the table, vocab x dim) whose padded sizes are prod(row_modes) x prod(col_modes).

Layouts:
  * ``tt``  (CoMERA's linear layout): cores G_1..G_{d+e} of shape (r_{k-1}, s_k, r_k) over the
    modes s = row_modes + col_modes; M = (G_1..G_d) (G_{d+1}..G_{d+e}). The bond between the
    row half and the column half is the rank of M.
  * ``ttm`` (TT-matrix): d cores of shape (r_{k-1}, row_k, col_k, r_k), one per mode pair.

``ranks`` lists the internal bonds (r_1..r_{K-1}); r_0 = r_K = 1 are implicit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..choices import LAYOUTS
from ..errors import ShapeError, expected
from .shapes import check_modes, plan_modes



@dataclass(frozen=True)
class TTSpec:
    layout: str
    rows: int
    cols: int
    row_modes: tuple[int, ...]
    col_modes: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ShapeError(expected(f"a layout in {LAYOUTS}", self.layout))
        object.__setattr__(self, "row_modes", check_modes(self.row_modes, self.rows, "row modes"))
        object.__setattr__(self, "col_modes", check_modes(self.col_modes, self.cols, "column modes"))
        if self.layout == "ttm" and len(self.row_modes) != len(self.col_modes):
            raise ShapeError(
                f"the ttm layout pairs row and column modes, expected as many of each "
                f"(got {self.row_modes} and {self.col_modes})"
            )
        ranks = tuple(int(r) for r in self.ranks)
        if len(ranks) != self.num_cores - 1:
            raise ShapeError(expected(f"{self.num_cores - 1} internal ranks", ranks))
        if any(r < 1 for r in ranks):
            raise ShapeError(expected("ranks >= 1", ranks))
        object.__setattr__(self, "ranks", ranks)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def plan(cls, rows: int, cols: int, rank, layout: str = "tt", d: int = 3,
             row_modes=None, col_modes=None) -> "TTSpec":
        """A spec for an R x C matrix: modes planned unless given, ranks clipped to the shape.

        ``rank`` is an int (the same maximum for every bond) or a tuple with one rank per bond.
        """
        if layout not in LAYOUTS:
            raise ShapeError(expected(f"a layout in {LAYOUTS}", layout))
        row_modes = tuple(row_modes) if row_modes is not None else plan_modes(rows, d)
        col_modes = tuple(col_modes) if col_modes is not None else plan_modes(cols, d)
        modes = _bond_modes(layout, check_modes(row_modes, rows, "row modes"),
                            check_modes(col_modes, cols, "column modes"))
        ranks = clip_ranks(_as_rank_tuple(rank, len(modes) - 1), modes)
        return cls(layout, rows, cols, row_modes, col_modes, ranks)

    def with_ranks(self, ranks) -> "TTSpec":
        """The same shape with these bond sizes, as cores hold them: not clipped. Pruning can
        leave a bond larger than its neighbours allow (r_k > s_{k+1} r_{k+1} once bond k+1 lost
        indices); such a bond holds redundant entries, but its cores and records have that size."""
        return TTSpec(self.layout, self.rows, self.cols, self.row_modes, self.col_modes,
                      _as_rank_tuple(ranks, self.num_cores - 1))

    # -- derived shape facts ------------------------------------------------------------------
    @property
    def padded_rows(self) -> int:
        return math.prod(self.row_modes)

    @property
    def padded_cols(self) -> int:
        return math.prod(self.col_modes)

    @property
    def bond_modes(self) -> tuple[int, ...]:
        """The size of each core's physical index, in chain order."""
        return _bond_modes(self.layout, self.row_modes, self.col_modes)

    @property
    def num_cores(self) -> int:
        return len(self.row_modes) + len(self.col_modes) if self.layout == "tt" else len(self.row_modes)

    @property
    def full_ranks(self) -> tuple[int, ...]:
        """r_0 .. r_K, boundary ones included."""
        return (1,) + self.ranks + (1,)

    @property
    def max_ranks(self) -> tuple[int, ...]:
        """The largest rank each bond can have for this shape."""
        return clip_ranks((10 ** 12,) * (self.num_cores - 1), self.bond_modes)

    @property
    def split(self) -> int:
        """For the tt layout, the index of the bond between the row half and the column half."""
        return len(self.row_modes)

    def core_shapes(self) -> list[tuple[int, ...]]:
        r = self.full_ranks
        if self.layout == "tt":
            return [(r[k], s, r[k + 1]) for k, s in enumerate(self.bond_modes)]
        return [(r[k], m, n, r[k + 1]) for k, (m, n) in enumerate(zip(self.row_modes, self.col_modes))]

    def to_dict(self) -> dict:
        return {"layout": self.layout, "rows": self.rows, "cols": self.cols,
                "row_modes": list(self.row_modes), "col_modes": list(self.col_modes),
                "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, data: dict) -> "TTSpec":
        try:
            return cls(data["layout"], int(data["rows"]), int(data["cols"]), tuple(data["row_modes"]),
                       tuple(data["col_modes"]), tuple(data["ranks"]))
        except (KeyError, TypeError) as err:
            raise ShapeError(expected("a TT spec with layout, rows, cols, row_modes, col_modes, ranks",
                                      data)) from err


def _bond_modes(layout: str, row_modes, col_modes) -> tuple[int, ...]:
    if layout == "tt":
        return tuple(row_modes) + tuple(col_modes)
    if len(row_modes) != len(col_modes):
        raise ShapeError(f"the ttm layout pairs row and column modes, expected as many of each "
                         f"(got {tuple(row_modes)} and {tuple(col_modes)})")
    return tuple(m * n for m, n in zip(row_modes, col_modes))


def _as_rank_tuple(rank, bonds: int) -> tuple[int, ...]:
    if isinstance(rank, bool):
        raise ShapeError(expected("a rank as a positive int or a tuple of them", rank))
    if isinstance(rank, int):
        if rank < 1:
            raise ShapeError(expected("a rank >= 1", rank))
        return (rank,) * bonds
    try:
        ranks = tuple(rank)
    except TypeError:
        raise ShapeError(expected("a rank as a positive int or a tuple of them", rank)) from None
    if len(ranks) != bonds or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1
                                      for r in ranks):
        raise ShapeError(expected(f"{bonds} positive integer ranks, one per internal bond", ranks))
    return ranks


def clip_ranks(ranks, bond_modes) -> tuple[int, ...]:
    """Clip internal ranks to what a chain with these mode sizes can hold.

    r_k <= r_{k-1} * s_k (sweeping right) and r_k <= s_{k+1} * r_{k+1} (sweeping left): no
    unfolding of the tensor has a larger rank, so a larger bond would only hold zeros.
    """
    full = [1] + list(ranks) + [1]
    for k in range(1, len(full) - 1):
        full[k] = min(full[k], full[k - 1] * bond_modes[k - 1])
    for k in range(len(full) - 2, 0, -1):
        full[k] = min(full[k], bond_modes[k] * full[k + 1])
    return tuple(full[1:-1])
