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
from ..integer import fake_quantize
from ..tt import apply_gates, cores_to_matrix
from ..tt.counting import num_params
from ..tt.spec import TTSpec


def check_size(name: str, value) -> None:
    """A layer dimension must be a positive int (not a bool, not a float)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(expected(f"{name} as a positive int", value))


def checked_padding_idx(padding_idx: int | None, num_embeddings: int) -> int | None:
    """``padding_idx`` as nn.Embedding takes it (negative counts from the end), made nonnegative."""
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(expected(f"padding_idx within [-{num_embeddings}, {num_embeddings})", padding_idx))
    return padding_idx % num_embeddings


def check_token_ids(indices: torch.Tensor, size: int) -> bool:
    """Refuse token ids outside [0, size) (a compressed table would otherwise return valid-looking
    rows for them). On CPU a host check gives a clear error; on CUDA and under torch.compile a
    device-side assert does, as ``nn.Embedding`` does on CUDA, without a host sync per step.
    Returns whether the caller should stay free of host syncs too."""
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(expected("integer token indices", indices.dtype))
    sync_free = indices.is_cuda or torch.compiler.is_compiling()
    if not indices.numel():
        return sync_free
    if sync_free:
        in_range = (indices >= 0).all() & (indices < size).all()
        torch._assert_async(in_range, f"token ids outside [0, {size})")
        return sync_free
    low, high = (int(v) for v in torch.aminmax(indices))  # one pass, one host sync
    if low < 0 or high >= size:
        raise IndexError(expected(f"indices in [0, {size})", (low, high)))
    return sync_free


def padding_rows_frozen(rows: torch.Tensor, indices: torch.Tensor, padding_idx: int | None,
                        training: bool) -> torch.Tensor:
    """``rows`` with the padding token's rows cut from the graph in training, as nn.Embedding's
    padding row gets no gradient."""
    if padding_idx is None or not training:
        return rows
    is_pad = (indices == padding_idx).unsqueeze(-1)
    return torch.where(is_pad, rows.detach(), rows)


def embedding_repr(num_embeddings: int, embedding_dim: int, padding_idx: int | None) -> str:
    """The start of an embedding's ``extra_repr``, as nn.Embedding writes it."""
    pad = f", padding_idx={padding_idx}" if padding_idx is not None else ""
    return f"{num_embeddings}, {embedding_dim}{pad}"


def listed(params: nn.ParameterList | None) -> list[torch.Tensor]:
    """A ParameterList's tensors in order, read from its registry. Iterating the list itself indexes
    it item by item (12 us for six cores against 0.3 us): every forward reads its cores and gates,
    and on a GPU that host time, not the kernels, bounds an eager step of small layers."""
    return [] if params is None else list(params._parameters.values())


def placed_like(mask: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``mask`` ready to multiply ``tensor``: replicated on every worker when ``tensor`` is a shard
    of a parameter split across workers (an FSDP2 DTensor; the gates stay whole), as is otherwise."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # torch 2.4: no public DTensor, so no --fsdp and no shards
        return mask
    if not isinstance(tensor, DTensor):
        return mask
    mesh = tensor.device_mesh
    return DTensor.from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False)


class InferenceCache(nn.Module):
    """A module that remembers what inference builds from its weights (merged TT halves, a table).

    Subclasses say which tensors the cache depends on (``_stamped_tensors``)."""

    def _stamped_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def cached(self, name: str, compute):
        """``compute()``, remembered in inference: eval mode with autograd off. What it builds (the
        merged halves, a table) does not depend on the input, so inference builds it once per state
        of the weights; each entry is stamped with the storage and version counter of the
        ``_stamped_tensors`` (cores, gates and buffers; codebooks and codes), so an
        in-place write (load_state_dict, pruning, closing gates) rebuilds it. Leaving eval mode
        (``train()``) drops the cache: training steps happen in train mode, and fused optimizer
        kernels write parameters without bumping their version counters. (A fused optimizer step
        taken in eval mode needs ``clear_cache()`` before the next inference.) With autograd on it is
        always recomputed (the graph must reach the cores), and under torch.compile it is traced
        into the graph (the stamps are host-side state a compiled graph cannot guard on cheaply)."""
        if self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return compute()
        stamp = tuple((t.data_ptr(), t._version) for t in self._stamped_tensors())
        cache = self.__dict__.setdefault("_inference_cache", {})
        if name not in cache or cache[name][0] != stamp:
            cache[name] = (stamp, compute())
        return cache[name][1]

    def clear_cache(self) -> None:
        """Forget what inference built (``cached``)."""
        self.__dict__.pop("_inference_cache", None)

    def train(self, mode: bool = True):
        self.clear_cache()
        return super().train(mode)


def core_channel_axis(index: int, core: torch.Tensor) -> int:
    """The axis integer storage gives a core's scales along: its largest bond, the last axis of the
    first core and the first of the others (a low-rank pair's rank index: one singular direction)."""
    return core.dim() - 1 if index == 0 else 0


class TTModule(InferenceCache):
    """Cores of a TT matrix with optional rank gates. Subclasses define ``forward``.

    ``integer_format`` (None: float): the integer format the layer's checkpoint stores its cores in;
    set, the forward pass runs on the cores rounded to it (``fake_quantize``), so that training
    learns what the rounding keeps (quantization-aware training, `comera train` on an integer
    checkpoint)."""

    integer_format = None

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
        cores = listed(self.cores)
        ranks = tuple(core.shape[-1] for core in cores[:-1])
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
        if self.gates is None or self.cores[0].is_meta:  # meta gates have no values: all start open
            return self.bond_dims
        return tuple(int(torch.count_nonzero(g.detach())) for g in self.gates)

    @property
    def gated(self) -> bool:
        return self.gates is not None

    def _stamped_tensors(self) -> list[torch.Tensor]:
        """What the inference cache is stamped with: the cores, gates and buffers (read from their
        registries: see ``listed``)."""
        buffers = [b for b in self._buffers.values() if b is not None]
        return listed(self.cores) + listed(self.gates) + buffers

    def gated_cores(self) -> list[torch.Tensor]:
        """The cores with the gates folded in (rounded to ``integer_format`` when set): what the
        forward pass contracts, and what a checkpoint stores once the gates are folded."""
        cores = apply_gates(listed(self.cores), None if self.gates is None else listed(self.gates))
        if self.integer_format is None:
            return cores
        return [fake_quantize(core, self.integer_format, core_channel_axis(i, core)) for i, core in enumerate(cores)]

    def num_tt_parameters(self) -> int:
        """Entries in the cores (what the TT format stores for the matrix)."""
        return num_params(self.spec)

    def dense_matrix(self) -> torch.Tensor:
        """The R x C matrix the gated cores represent (rows = in / vocab, cols = out / dim). While an
        integer checkpoint loads, its cores are integer buffers until transformers has read them
        (``hf/integer_storage.py``): then a stand-in on the meta device (GPT-2's weight initializer
        reads ``c_proj.weight`` of loaded layers too; it writes nothing that is kept)."""
        if len(self.cores._parameters) != self._shape.num_cores:
            return torch.empty(self._shape.rows, self._shape.cols, device="meta")
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
    def zero_pruned_(self) -> None:
        """Zero the core slices on both sides of every closed gate entry (gate == 0).

        A closed index then contributes nothing and receives no gradient, so truncating it away
        (``prune_ranks``) and scattering it back (``expand_``) are exact inverses.
        """
        if self.gates is None:
            return
        for k, gate in enumerate(self.gates):
            is_open = (gate != 0).to(gate.dtype)  # a multiply, not a masked write: no host sync on CUDA
            left, right = self.cores[k], self.cores[k + 1]
            left.mul_(placed_like(is_open, left))
            right.mul_(placed_like(is_open.reshape(-1, *[1] * (right.dim() - 1)), right))

    def kept_indices(self, threshold: float = 0.0) -> list[torch.Tensor]:
        """Per bond, the indices whose gate magnitude is above ``threshold`` (at least one)."""
        keep = []
        for gate in self.gates:
            kept = (gate.detach().abs() > threshold).nonzero().flatten()
            if kept.numel() == 0:  # a bond of size 0 would make the matrix zero: keep its strongest
                kept = gate.detach().abs().argmax().reshape(1)
            keep.append(kept)
        return keep

    @torch.no_grad()
    def prune_ranks(self, threshold: float = 0.0, fold: bool = True) -> tuple[int, ...]:
        """Physically drop bond indices whose gate magnitude is <= threshold. Returns the new bond sizes.

        fold=True folds the remaining gate values into the cores and resets the gates to 1.0 (the
        represented matrix is unchanged up to the dropped indices); fold=False keeps the gate
        values as they are, so ``expand_`` can restore the exact parameters (training checkpoints).
        """
        if self.gates is None:
            return self.bond_dims
        keep = self.kept_indices(threshold)
        new_cores = []
        for k, core in enumerate(self.cores):
            core = cut_core(core.detach(), k, keep)
            if fold and k < len(self.cores) - 1:
                core = core * self.gates[k][keep[k]]
            new_cores.append(core.contiguous())
        new_gates = [torch.ones_like(g[idx]) if fold else g.detach()[idx].clone()
                     for g, idx in zip(self.gates, keep)]
        self._replace_factors(new_cores, new_gates)
        return self.bond_dims

    @torch.no_grad()
    def cut_to_open_ranks_(self, on_cut=None) -> list[torch.Tensor]:
        """Drop the closed bond indices in place, during training: each core and gate stays the same
        ``nn.Parameter`` object, only smaller, so an optimizer holding it keeps stepping it (and a
        step over the smaller cores is cheaper). Gate values are kept, not folded. ``on_cut(param,
        cut)`` is called before each parameter shrinks, with the function that shrinks a tensor of
        its shape the same way (an optimizer's moments go through it). Returns the kept indices per
        bond (at least one each: ``kept_indices``)."""
        keep = self.kept_indices()
        cuts = [(core, lambda t, k=k: cut_core(t, k, keep)) for k, core in enumerate(self.cores)]
        cuts += [(gate, lambda t, idx=idx: t.index_select(0, idx)) for gate, idx in zip(self.gates, keep)]
        for param, cut in cuts:
            if on_cut is not None:
                on_cut(param, cut)
            param.data = cut(param.data).contiguous()
            param.grad = None
        self.clear_cache()
        return keep

    @torch.no_grad()
    def expand_(self, cores: list[torch.Tensor], gates: list[torch.Tensor], kept: list[list[int]]) -> None:
        """Load truncated cores and gates into this (larger) layer at the ``kept`` bond indices;
        every other index gets a closed gate and zero core slices. Inverse of prune_ranks(fold=False)."""
        kept = [torch.as_tensor(idx, dtype=torch.long, device=self.cores[0].device) for idx in kept]
        last = len(self.cores) - 1
        for k, (param, small) in enumerate(zip(self.cores, cores)):
            full = small.to(param)
            if k > 0:
                full = expand_axis(full, kept[k - 1], param.shape[0], 0)
            if k < last:
                full = expand_axis(full, kept[k], param.shape[-1], param.dim() - 1)
            param.copy_(full)
        for gate, small, idx in zip(self.gates, gates, kept):
            gate.copy_(expand_axis(small.to(gate), idx, gate.shape[0], 0))

    def resize_bonds_(self, ranks) -> None:
        """New, uninitialized cores (and open gates) with these bond sizes, exactly as given: for
        loading a checkpoint whose pruned bonds a planned spec would clip."""
        core = self.cores[0]
        self._init_factors(self._shape.with_ranks(ranks), self.gated, device=core.device, dtype=core.dtype)

    def _replace_factors(self, cores: list[torch.Tensor], gates: list[torch.Tensor]) -> None:
        requires_grad = self.cores[0].requires_grad
        self.cores = nn.ParameterList(nn.Parameter(c, requires_grad=requires_grad) for c in cores)
        self.gates = nn.ParameterList(
            nn.Parameter(g, requires_grad=old.requires_grad) for g, old in zip(gates, self.gates))

    def _tt_repr(self) -> str:
        s = self.spec
        return (f"layout={s.layout}, row_modes={s.row_modes}, col_modes={s.col_modes}, "
                f"ranks={self.ranks}, gated={self.gated}")


def cut_core(core: torch.Tensor, k: int, keep: list[torch.Tensor]) -> torch.Tensor:
    """Core ``k`` (or a tensor of its shape) with only the ``keep`` indices of the bonds on either
    side of it: its first axis is bond k-1, its last bond k (the last core has no bond on its right)."""
    if k > 0:
        core = core.index_select(0, keep[k - 1])
    if k < len(keep):
        core = core.index_select(core.dim() - 1, keep[k])
    return core


def expand_axis(tensor: torch.Tensor, index: torch.Tensor, size: int, axis: int) -> torch.Tensor:
    """A zero tensor of ``size`` along ``axis`` holding ``tensor`` at positions ``index``."""
    shape = list(tensor.shape)
    shape[axis] = size
    return tensor.new_zeros(shape).index_copy_(axis, index, tensor)
