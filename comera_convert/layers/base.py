"""TTModule: what TTLinear and TTEmbedding share: cores, diagonal rank gates, truncation.

CoMERA puts a learnable diagonal gate on every internal bond of the chain. A gate entry that is
(driven to) zero switches that rank index off; ``prune_ranks`` then removes it physically, so
the layer gets smaller in memory and on disk.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ShapeError, expected
from ..tt import apply_gates, cores_to_matrix
from ..tt.counting import num_params
from ..tt.spec import TTSpec


class TTModule(nn.Module):
    """Cores of a TT matrix with optional rank gates. Subclasses define ``forward``."""

    def _init_factors(self, spec: TTSpec, gates: bool, device=None, dtype=None) -> None:
        self._shape = spec
        self.cores = nn.ParameterList(
            nn.Parameter(torch.empty(shape, device=device, dtype=dtype)) for shape in spec.core_shapes()
        )
        self.gates = None
        if gates:
            # Gates start at 1.0: the gated chain equals the plain chain until training moves them.
            self.gates = nn.ParameterList(
                nn.Parameter(torch.ones(r, device=device, dtype=dtype)) for r in spec.ranks
            )

    # -- shape -----------------------------------------------------------------------------------
    @property
    def spec(self) -> TTSpec:
        """The layer's TT spec, with the ranks its cores have now."""
        ranks = tuple(core.shape[-1] for core in self.cores[:-1])
        if ranks != self._shape.ranks:
            self._shape = self._shape.with_ranks(ranks)
        return self._shape

    @property
    def layout(self) -> str:
        return self._shape.layout

    @property
    def bond_dims(self) -> tuple[int, ...]:
        """The physical size of each internal bond (what the cores hold)."""
        return self.spec.ranks

    @property
    def ranks(self) -> tuple[int, ...]:
        """The active rank of each internal bond: nonzero gate entries (all of them ungated)."""
        if self.gates is None:
            return self.bond_dims
        return tuple(int(torch.count_nonzero(g.detach())) for g in self.gates)

    @property
    def gated(self) -> bool:
        return self.gates is not None

    def gated_cores(self) -> list[torch.Tensor]:
        """The cores with the gates folded in: what the forward pass contracts."""
        return apply_gates(list(self.cores), None if self.gates is None else list(self.gates))

    def num_tt_parameters(self) -> int:
        """Entries in the cores (what the TT format stores for the matrix)."""
        return num_params(self.spec)

    def dense_matrix(self) -> torch.Tensor:
        """The R x C matrix the gated cores represent (rows = in / vocab, cols = out / dim)."""
        return cores_to_matrix(self.gated_cores(), self.spec)

    # -- initialization -----------------------------------------------------------------------------
    def _load_cores(self, cores: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, core in zip(self.cores, cores):
                if tuple(param.shape) != tuple(core.shape):
                    raise ShapeError(expected(f"a core of shape {tuple(param.shape)}", tuple(core.shape)))
                param.copy_(core)

    def _random_init(self, target_std: float) -> None:
        """Gaussian cores whose product has entries of standard deviation ``target_std``.

        An entry of the product sums prod(r_k) products of K core entries, so each core gets
        std (target_std^2 / prod(r_k)) ** (1 / 2K).
        """
        spec = self.spec
        bonds = math.prod(spec.ranks)
        core_std = (target_std ** 2 / bonds) ** (1 / (2 * spec.num_cores))
        with torch.no_grad():
            for core in self.cores:
                core.normal_(0.0, core_std)

    # -- rank truncation ----------------------------------------------------------------------------
    @torch.no_grad()
    def prune_ranks(self, threshold: float = 0.0) -> tuple[int, ...]:
        """Physically drop bond indices whose gate magnitude is <= threshold.

        The remaining gate values are folded into the cores and the gates reset to 1.0, so the
        represented matrix is unchanged (up to the dropped indices). Returns the new bond sizes.
        """
        if self.gates is None:
            return self.bond_dims
        keep = []
        for gate in self.gates:
            kept = (gate.abs() > threshold).nonzero().flatten()
            if kept.numel() == 0:  # a bond of size 0 would make the matrix zero: keep its strongest
                kept = gate.abs().argmax().reshape(1)
            keep.append(kept)
        cores = [core.detach() for core in self.cores]
        new_cores = []
        for k, core in enumerate(cores):
            if k > 0:
                core = core.index_select(0, keep[k - 1])
            if k < len(cores) - 1:
                core = core.index_select(core.dim() - 1, keep[k]) * self.gates[k][keep[k]]
            new_cores.append(core.contiguous())
        requires_grad = self.cores[0].requires_grad
        self.cores = nn.ParameterList(nn.Parameter(c, requires_grad=requires_grad) for c in new_cores)
        self.gates = nn.ParameterList(
            nn.Parameter(torch.ones_like(g[idx]), requires_grad=g.requires_grad)
            for g, idx in zip(self.gates, keep)
        )
        return self.bond_dims

    def _tt_repr(self) -> str:
        s = self.spec
        return (f"layout={s.layout}, row_modes={s.row_modes}, col_modes={s.col_modes}, "
                f"ranks={self.ranks}, gated={self.gated}")
