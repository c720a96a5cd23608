"""Layer-level cases: TTLinear against nn.Linear (and tensorly-torch), TTEmbedding against nn.Embedding."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..conversion.allocate import LayoutChoice, allocate_ranks
from ..conversion.targets import find_candidates
from ..layers import TTEmbedding, TTLinear
from ..tt import linear_forward_flops, num_params
from ..tt.counting import dense_linear_flops
from .timing import PeakMemory, graphed, median_seconds

COMERA_RANK = 30  # CoMERA's linear configuration: tt layout, 3 + 3 modes, internal ranks 30
LAYER_SHAPES = [(768, 768), (768, 3072), (3072, 768), (4096, 11008)]
QUICK_SHAPES = [(128, 128), (128, 512)]


def ratio4_rank(quick: bool) -> int:
    """The shared rank `comera convert bert-base --ratio 4` allocates (computed on a meta-device model)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512) \
        if quick else BertConfig()
    with torch.device("meta"):
        model = BertForMaskedLM(config)
    candidates, _, _ = find_candidates(model)
    _, rank = allocate_ranks(candidates, sum(p.numel() for p in model.parameters()), 4.0, LayoutChoice())
    return rank


def _fwd_bwd(layer, x, grad):
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)
    return step


def _timings(layer, x, grad, device: str, repeats: int) -> tuple[float, float | None]:
    """(eager, CUDA-graph replay) seconds of one fwd+bwd; the graph on CUDA only. Eager CUDA timings
    of small layers measure the host launching kernels; the replay measures the GPU's work."""
    step = _fwd_bwd(layer, x, grad)
    eager = median_seconds(step, repeats, device=device)
    return eager, (median_seconds(graphed(step), repeats, device=device) if device == "cuda" else None)


def layer_case(device: str, dtype: torch.dtype, quick: bool, repeats: int) -> list[dict]:
    tokens = 128 if quick else (4096 if device == "cuda" else 1024)
    shapes = QUICK_SHAPES if quick else [s for s in LAYER_SHAPES if device == "cuda" or s[0] * s[1] < 4e7]
    configs = [("comera r30", COMERA_RANK), ("--ratio 4", ratio4_rank(quick))]
    rows = []
    for rows_in, cols_out in shapes:
        dense = nn.Linear(rows_in, cols_out, device=device, dtype=dtype)
        x = torch.randn(tokens, rows_in, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, cols_out, device=device, dtype=dtype)
        dense_times = _timings(dense, x, grad, device, repeats)
        dense_flops = dense_linear_flops(rows_in, cols_out, tokens)
        for name, rank in configs:
            tt = TTLinear.from_linear(dense, rank=rank)
            flop_ratio = dense_flops / linear_forward_flops(tt.spec, tokens)
            rows.append(_layer_row(f"TTLinear {name}", device, dtype, rows_in, cols_out, tokens, tt.spec.ranks,
                                   rows_in * cols_out / num_params(tt.spec), flop_ratio, dense_times,
                                   _timings(tt, x, grad, device, repeats)))
            rows.extend(_peer_row(dense, rank, x, grad, dense_times, name, device, dtype, tokens, repeats,
                                  num_params(tt.spec)))
    return rows


def _layer_row(method, device, dtype, rows_in, cols_out, tokens, ranks, params_ratio, flop_ratio, dense_times,
               times):
    row = {"case": "layer", "method": method, "device": device, "dtype": str(dtype).replace("torch.", ""),
           "shape": f"{rows_in}x{cols_out}", "tokens": tokens, "ranks": list(ranks),
           "params_ratio": round(params_ratio, 2), "flop_ratio": round(flop_ratio, 2)}
    for column, dense_seconds, seconds in zip(("speedup", "graph_speedup"), dense_times, times):
        if seconds is not None:
            row[column] = round(dense_seconds / seconds, 2)
            row[f"{column}_per_flop_ratio"] = round(dense_seconds / seconds / flop_ratio, 2)
    return row


def _peer_row(dense, rank, x, grad, dense_times, name, device, dtype, tokens, repeats, tt_params):
    """tensorly-torch's FactorizedLinear (block TT) at about the same parameter count, when installed."""
    try:
        import tltorch
    except ImportError:
        return []
    params = dense.in_features * dense.out_features
    # Its SVD initialization runs in float32 (torch has no bf16 SVD); then it is cast like ours.
    peer = tltorch.FactorizedLinear.from_linear(copy.deepcopy(dense).float(), n_tensorized_modes=3,
                                                factorization="blocktt", rank=min(1.0, tt_params / params))
    peer = peer.to(device=device, dtype=dtype)
    peer_params = sum(p.numel() for p in peer.parameters() if p is not getattr(peer, "bias", None))
    flops = 2 * tokens * dense.in_features * dense.out_features  # it rebuilds W, then one dense GEMM
    return [_layer_row(f"tltorch blocktt ~{name}", device, dtype, dense.in_features, dense.out_features, tokens,
                       [], params / peer_params, 2 * tokens * params / flops, dense_times,
                       _timings(peer, x, grad, device, repeats))]


def embedding_case(device: str, dtype: torch.dtype, quick: bool, repeats: int) -> list[dict]:
    vocab, dim = (4096, 128) if quick else (30522, 768)
    batch = 4 if quick else 32
    ids = torch.randint(0, vocab, (batch, 128), device=device)
    dense = nn.Embedding(vocab, dim, device=device, dtype=dtype)
    # Inference lookups (eval mode, autograd off), as `comera bench embedding` measures them.
    tt = TTEmbedding.from_embedding(dense, rank=COMERA_RANK, layout="ttm").eval()  # ttm, as CoMERA
    tt_layout = TTEmbedding.from_embedding(dense, rank=COMERA_RANK, layout="tt").eval()  # the converter's default

    def naive():  # one chain contraction per token, no sharing: the baseline TT lookup
        cores = tt.gated_cores()
        digits, rest = [], ids.reshape(-1)
        for m in reversed(tt.spec.row_modes):
            digits.append(rest % m)
            rest = rest // m
        digits.reverse()
        row = cores[0][0, digits[0]]                        # (T, n_1, r_1)
        for core, digit in zip(cores[1:], digits[1:]):
            nxt = core[:, digit].permute(1, 0, 2, 3)          # (T, r, n_k, r')
            row = torch.einsum("tar,trbs->tabs", row, nxt).reshape(row.shape[0], -1, nxt.shape[-1])
        return row.reshape(*ids.shape, -1)[..., :dim]

    rows = []
    for method, layer, fn in (("nn.Embedding", None, lambda: dense(ids)),
                              ("TTEmbedding ttm (shared halves)", tt, lambda: tt(ids)),
                              ("TTEmbedding tt (shared halves)", tt_layout, lambda: tt_layout(ids)),
                              ("TT ttm per-row chain (naive)", tt, naive)):
        with torch.no_grad():
            seconds = median_seconds(fn, repeats, device=device)
            with PeakMemory(device) as peak:
                fn()
        rows.append({"case": "embedding", "method": method, "device": device,
                     "dtype": str(dtype).replace("torch.", ""), "shape": f"{vocab}x{dim}",
                     "tokens": ids.numel(), "ranks": list(layer.spec.ranks) if layer else [],
                     "params": num_params(layer.spec) if layer else vocab * dim,
                     "ms": round(seconds * 1e3, 3), "peak_mb": round(peak.bytes / 2 ** 20, 2)})
    return rows
