"""Calibration: what the dense model's layers see on real text, for data-aware conversion.

Forward hooks on every module the converter may replace record, over a few hundred sequences,
the Gram matrix X^T X of each linear layer's inputs (float64, accumulated from float32 batch
products) and how often each embedding row is looked up. ``weighted_decomposer`` turns them into
the decomposition each layer gets (``tt.weighted``): whitened TT-SVD for tt-layout linears,
row-weighted TTM-SVD refined by ALS on the Gram matrix for ttm-layout linears, token-frequency
weights for embeddings (row-weighted TTM-SVD when they are ttm), whose rows are
also reordered by frequency (``token_order``). The inputs' means also let ``correct_bias``
remove the mean of each linear layer's output error.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..errors import ConfigError
from ..request import CALIBRATION_BATCH
from ..text import read_for, sample
from ..tt import weighted
from .targets import Candidate, find_candidates

logger = logging.getLogger("comera_convert")

# What `comera convert` calibrates on unless told: english passages interleaved with pieces of the
# standard library (their training splits). It keeps more than english alone on text the project
# never reads; code alone loses prose. docs/findings.md
DEFAULT_CALIBRATION = "english+python-stdlib"
DEFAULT_SEQUENCES = 128  # a few hundred sequences is what activation-aware SVD methods use
DEFAULT_SEQ_LEN = 128
PROBE_SEQUENCES = 32  # enough for a stable mean cosine, few enough for one quick forward
BATCH = CALIBRATION_BATCH  # sequences per pass (the request's: reconstruction holds the last one out)
# The option that names the calibration text, in the messages of a source that cannot be read.
CALIBRATION_OPTION = "--calibration"
# Token frequencies come from up to this many tokens of the calibration text (all of python-stdlib,
# most of english): they cost no forward pass, and the calibration sequences alone miss most of the
# vocabulary held-out text uses.
COUNTED_TOKENS = 4_000_000
# Weight of a token never seen in calibration, relative to one occurrence: rare tokens keep some
# weight (held-out text has words the calibration text lacks), frequent ones dominate.
UNSEEN_TOKEN_PRIOR = 1.0
# Embedding rows are weighted by (occurrences + prior) ** (TOKEN_WEIGHT_POWER / 2): 1 fits the text
# read, 0 treats every row alike; tempered counts spread the fit over the tokens other text uses.
# docs/findings.md
TOKEN_WEIGHT_POWER = 0.5


@dataclass
class Calibration:
    """Input statistics of a model's layers, keyed by module name."""

    grams: dict[str, torch.Tensor] = field(default_factory=dict)  # linear: (in, in) X^T X
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # linear: (in,) sum of the input rows
    rows: dict[str, int] = field(default_factory=dict)  # linear: how many input rows were summed
    counts: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding: (rows,) lookups
    # Error-compensating calibration (``pipeline/compensating.py``): the grams and sums above then describe
    # the inputs X^ the already compressed layers before a linear produce; ``cross`` is X^T X against
    # the dense model's inputs X, ``dense_sums`` the sum of X's rows.
    cross: dict[str, torch.Tensor] = field(default_factory=dict)  # linear: (in, in) X^T X
    dense_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # linear: (in,) sum of X's rows
    sequences: int = 0
    tokens: int = 0
    source: str | None = None
    counted_tokens: int = 0  # text read for the input embedding's token frequencies
    # A few of the calibration sequences, kept to measure converted models end to end
    # (``allocation="measured"``).
    probe: torch.Tensor | None = None
    # Input factors already computed (rank allocation and decomposition both need them).
    _factors: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def forget(self, name: str) -> None:
        """Drop a layer's statistics once it is converted (a layer-by-layer calibration holds one
        block's Gram matrices at a time)."""
        for table in (self.grams, self.sums, self.rows, self.cross, self.dense_sums, self._factors):
            table.pop(name, None)

    def describe(self) -> str:
        """One line on what was read: sequences, tokens and token counts."""
        text = f"{self.sequences} sequences ({self.tokens} tokens) of {self.source or 'calibration data'}"
        return text + (f", token frequencies from {self.counted_tokens} tokens" if self.counted_tokens else "")

    def input_factor(self, name: str) -> torch.Tensor | None:
        """S with S^T S = the layer's input Gram (damped, with a warning, when singular), or None
        without statistics. Computed once per layer. (Damping every Gram by 0.1 of its mean
        diagonal, so that directions the calibration text barely excited keep weight, was measured
        and changed nothing out of domain: docs/findings.md.)"""
        if name not in self._factors:
            gram = self.grams.get(name)
            if gram is None:
                return None
            twin = next((other for other, factor in self._factors.items() if self.grams.get(other) is gram), None)
            if twin is not None:  # a layer reading the same input (q, k, v): the same factor
                self._factors[name] = self._factors[twin]
                return self._factors[name]
            factor, damping = weighted.input_factor(gram)
            if damping:
                logger.warning("%s: the calibration inputs' Gram matrix is singular; damped by %.0e of its mean "
                               "diagonal (more, or more varied, calibration text avoids this)", name, damping)
            self._factors[name] = factor
        return self._factors[name]

    def token_order(self, name: str) -> torch.Tensor | None:
        """An embedding's token ids by descending calibration frequency (ties by id), or None without
        statistics: the order its TT rows hold them in, so the leading mode groups frequent tokens."""
        counts = self.counts.get(name)
        return None if counts is None else torch.sort(counts, descending=True, stable=True).indices

    def token_weights(self, name: str) -> torch.Tensor | None:
        """sqrt(occurrences + prior) per row of an embedding, in ``token_order``, or None without statistics."""
        counts = self.counts.get(name)
        if counts is None:
            return None
        return (counts + UNSEEN_TOKEN_PRIOR).pow(TOKEN_WEIGHT_POWER / 2)[self.token_order(name)]


def widest_input(candidates: list[Candidate]) -> int:
    """The most inputs any candidate linear layer has (its Gram matrix is that wide)."""
    return max((c.rows for c in candidates if c.kind == "linear"), default=0)


def required_sequences(candidates: list[Candidate], seq_len: int) -> int:
    """Enough sequences for the widest linear's Gram matrix to have full rank (and at least 8)."""
    return max(8, math.ceil(widest_input(candidates) / seq_len))


def calibrate(model: nn.Module, tokenizer, data: str = DEFAULT_CALIBRATION,
              sequences: int = DEFAULT_SEQUENCES,
              seq_len: int = DEFAULT_SEQ_LEN, targets=None, exclude=None, d: int = 3) -> Calibration:
    """Input statistics of every module ``convert`` would replace, from ``sequences`` blocks of
    ``seq_len`` tokens (at most the model's maximum) of ``data`` (any source `comera train --data`
    takes; its training split). The blocks start at documents spread evenly over the text (one
    per document while there are enough), so they see many documents rather than the first few;
    the input embedding's token frequencies count all the text read (``COUNTED_TOKENS`` at most)."""
    candidates = find_candidates(model, targets, exclude, d)[0]
    plan = plan_calibration(model, candidates, tokenizer, data, sequences, seq_len)
    stats = collect(model, candidates, plan.batches, source=data, min_sequences=plan.needed)
    plan.count_tokens(stats)
    return stats


def calibrate_as_planned(model: nn.Module, tokenizer, options) -> Calibration:
    """``calibrate`` on the text, sequences and modules a conversion's plan (``ConvertPlan``) names: what a
    model converted in memory is weighted by, from the Python API and the CLI alike."""
    return calibrate(model, tokenizer, options.calibration, options.calibration_sequences,
                     options.calibration_seq_len, options.targets, options.exclude, options.d)


@dataclass
class CalibrationPlan:
    """What a calibration reads: the batches of token ids, and the text's token counts for the input
    embedding (``words``)."""

    batches: list[torch.Tensor]
    needed: int  # the fewest sequences the widest layer's Gram matrix needs
    words: Candidate | None
    counts: torch.Tensor
    tokens: int

    def count_tokens(self, stats: Calibration) -> None:
        """Add all the text's token counts to the input embedding's (the batches' own are a sliver)."""
        if self.words is not None:
            stats.counts[self.words.name] = stats.counts.get(self.words.name, 0) + self.counts
            stats.counted_tokens = self.tokens


def plan_calibration(model: nn.Module, candidates: list[Candidate], tokenizer, data: str, sequences: int,
                     seq_len: int) -> CalibrationPlan:
    """Read ``data`` into ``sequences`` blocks of ``seq_len`` tokens in batches, refusing too few."""
    seq_len = min(seq_len, max_positions(model) or seq_len)
    needed = required_sequences(candidates, seq_len)
    if sequences < needed:
        raise ConfigError(f"--calibration-sequences {sequences} is too few: at least {needed} sequences of "
                          f"{seq_len} tokens are needed (the widest converted layer has "
                          f"{widest_input(candidates)} inputs)")
    words = _input_embedding(model, candidates)
    vocab_size = words.rows if words is not None else len(tokenizer)
    with read_for(CALIBRATION_OPTION):
        text = sample(data, tokenizer, seq_len, vocab_size, COUNTED_TOKENS)
    blocks = text.spread(sequences)
    batches = [torch.stack(blocks[i:i + BATCH]) for i in range(0, len(blocks), BATCH)]
    return CalibrationPlan(batches, needed, words, text.counts, text.tokens)


def _input_embedding(model: nn.Module, candidates: list[Candidate]) -> Candidate | None:
    """The candidate that looks up the model's token ids (not positions or token types), if any."""
    get = getattr(model, "get_input_embeddings", None)
    module = get() if get is not None else None
    return next((c for c in candidates if c.module is module), None)


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model takes (BERT-likes' max_position_embeddings, GPT-2's n_positions),
    less the rows before the first position where the table numbers positions after its padding
    row (RoBERTa's and MPNet's 514 rows take 512 tokens)."""
    config = getattr(model, "config", None)
    rows = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    table = next((m for name, m in model.named_modules() if name.endswith("position_embeddings")), None)
    padding = getattr(table, "padding_idx", None)
    return rows - (padding + 1) if rows is not None and padding is not None else rows


@torch.no_grad()
def collect(model: nn.Module, candidates: list[Candidate], batches: list[torch.Tensor],
            source: str | None = None, min_sequences: int = 1) -> Calibration:
    """Run ``batches`` through the dense model and record every candidate's input statistics."""
    stats = empty_statistics(batches, source, min_sequences)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with Recorder(stats, candidates) as recorder:
            for batch in batches:
                recorder.next_batch()
                model(input_ids=batch.to(device))
    finally:
        model.train(was_training)
    return stats


def empty_statistics(batches: list[torch.Tensor], source: str | None, min_sequences: int) -> Calibration:
    """The statistics of these batches before any is run, refusing too few sequences."""
    sequences = sum(b.shape[0] for b in batches)
    if sequences < min_sequences:
        raise ConfigError(f"calibration data {source or ''} gave {sequences} sequences; at least "
                          f"{min_sequences} are needed (the widest converted layer must see at least as many "
                          f"tokens as it has inputs): give more calibration text")
    return Calibration(sequences=sequences, tokens=sum(b.numel() for b in batches), source=source,
                       probe=torch.cat(batches)[:PROBE_SEQUENCES].cpu())


class Recorder:
    """Forward pre-hooks that add each candidate's inputs to ``stats`` while the context is open;
    ``next_batch`` before each batch (inputs shared by several layers, such as q, k and v, are
    reduced once per batch)."""

    def __init__(self, stats: Calibration, candidates: list[Candidate]):
        self.stats, self.candidates, self.shared, self.handles = stats, candidates, {}, []

    def __enter__(self) -> "Recorder":
        self.handles = [c.module.register_forward_pre_hook(partial(_record, self.stats, self.shared, c))
                        for c in self.candidates]
        return self

    def next_batch(self) -> None:
        self.shared.clear()

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.shared.clear()


def _record(stats: Calibration, shared: dict, candidate: Candidate, module, args) -> None:
    inputs = args[0]
    if candidate.kind == "embedding":
        counts = torch.bincount(inputs.reshape(-1).cpu(), minlength=candidate.rows)[: candidate.rows]
        stats.counts[candidate.name] = stats.counts.get(candidate.name, 0) + counts.to(torch.float64)
        return
    key = (inputs.data_ptr(), tuple(inputs.shape), inputs.stride())
    if key not in shared:
        flat = inputs.reshape(-1, inputs.shape[-1]).float()
        # The input is kept until the batch ends, so that its memory cannot be reused by a later
        # tensor that would then look like the same input.
        shared[key] = _SharedInput(inputs, flat, flat.sum(0).to(torch.float64).cpu())
    entry = shared[key]
    name = candidate.name
    stats.rows[name] = stats.rows.get(name, 0) + entry.flat.shape[0]
    if name not in stats.grams and entry.first_owner is not None:
        # Layers reading one input (q, k and v; gate and up) share one sum from the first batch on.
        stats.grams[name], stats.sums[name] = stats.grams[entry.first_owner], stats.sums[entry.first_owner]
        return
    if name not in stats.grams:
        width = entry.flat.shape[1]
        stats.grams[name] = torch.zeros(width, width, dtype=torch.float64)
        stats.sums[name] = torch.zeros(width, dtype=torch.float64)
        entry.first_owner = name
    elif id(stats.grams[name]) in entry.added:
        return
    add_gram(stats.grams[name], entry.flat)
    stats.sums[name].add_(entry.total)
    entry.added.add(id(stats.grams[name]))


# Columns of X^T X computed at a time: the float32 product of a 5632-wide input would be 127 MB
# at once, a block of 1024 columns is 23 MB; each block is added to the float64 sum in place.
GRAM_BLOCK = 1024


def add_gram(total: torch.Tensor, flat: torch.Tensor) -> None:
    """total += flat^T flat: float32 products summed into the float64 ``total`` a block of columns
    at a time, each block computed from the diagonal down and mirrored above it (the matrix is
    symmetric: 0.47 s against 0.74 s for 2048 rows of a 5632-wide input on 2 cores, equal sums)."""
    for start in range(0, flat.shape[1], GRAM_BLOCK):
        block = slice(start, start + GRAM_BLOCK)
        lower = (flat[:, start:].T @ flat[:, block]).cpu()  # rows start.. of the block's columns
        width = lower.shape[1]
        total[start:, block].add_(lower)
        total[block, start + width:].add_(lower[width:].T)


@dataclass
class _SharedInput:
    """One batch's input to one or more layers, reduced once."""

    inputs: torch.Tensor
    flat: torch.Tensor  # the rows, float32
    total: torch.Tensor  # float64 sum of the rows
    first_owner: str | None = None  # the layer that started a shared sum with this batch
    added: set = field(default_factory=set)  # the sums this batch was added to


@torch.no_grad()
def correct_bias(layer, dense_weight: torch.Tensor, name: str, stats: Calibration) -> None:
    """Shift a converted linear layer's bias by the mean change of its output on the calibration
    inputs, W mu - W_tt mu^, so that the compression error has zero mean there (as bias correction
    does for quantization); mu^ = mu but where the calibration compensates (the inputs the
    compressed layers before it produce). Layers without a bias are left as they are. ``layer`` is a
    TTLinear or an nn.Linear (``weight``: the (out, in) matrix either represents)."""
    if layer.bias is None or name not in stats.sums:
        return
    rows = stats.rows[name]
    mean_input = (stats.sums[name] / rows).to(layer.bias.device)
    dense_mean = (stats.dense_sums[name] / rows).to(layer.bias.device) if name in stats.dense_sums else mean_input
    change = dense_weight.double() @ dense_mean - layer.weight.double() @ mean_input  # (out, in) weights
    layer.bias.add_(change.to(layer.bias.dtype))


def weighted_decomposer(candidate: Candidate, stats: Calibration, layout: str):
    """The ``decompose(matrix, spec)`` that minimizes this layer's error on the calibration inputs,
    or None when there are no statistics for it."""
    if candidate.kind == "embedding":
        weights = stats.token_weights(candidate.name)
        if weights is None:
            return None
        return partial(_scaled if layout == "ttm" else _whitened, weights)
    gram = stats.grams.get(candidate.name)
    if gram is None:
        return None
    if layout == "ttm":
        decompose = partial(_whitened_ttm, gram)
    else:
        decompose = partial(_whitened, stats.input_factor(candidate.name))
    cross = stats.cross.get(candidate.name)
    return decompose if cross is None else partial(_compensated, gram, cross, decompose)


def compensated_matrix(matrix: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
    """The (in x out) matrix M* that best maps the inputs the compressed model gives a layer, X^, onto
    the dense layer's outputs on the dense inputs X: argmin ||X^ M* - X M|| = G^-1 X^T X M, with
    G = X^T X^ (``gram``, damped) and X^T X (``cross``). Decomposed whitened by G, its TT cores then
    minimize ||X^ M_tt - X M||: the layer makes up for the error of the layers before it."""
    target = torch.linalg.solve(gram.to(matrix.device), cross.to(matrix.device) @ matrix.detach().double())
    return target.to(matrix.dtype)


def _compensated(gram, cross, decompose, matrix, spec):
    return decompose(compensated_matrix(matrix, gram, cross), spec)


def _whitened(factor, matrix, spec):
    return weighted.whitened_tt_cores(matrix, spec, factor.to(matrix.device))


def _whitened_ttm(gram, matrix, spec):
    return weighted.whitened_ttm_cores(matrix, spec, gram.to(matrix.device))


def _scaled(weights, matrix, spec):
    return weighted.scaled_ttm_cores(matrix, spec, weights.to(matrix.device))
