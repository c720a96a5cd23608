"""Block-wise reconstruction: each compressed block tuned to reproduce the dense block's outputs,
kept only where it lowers the held-out error, never saving a diverged block."""

import logging

import pytest
import torch

import comera_convert
from comera_convert.api import convert_checkpoint
from comera_convert.conversion import ConvertOptions
from comera_convert.conversion.plan import ModelShape, plan_for
from comera_convert.conversion.storage import integer_axes, integer_format, round_in_place
from comera_convert.errors import ConfigError
from comera_convert.pipeline.reconstruction import held_out_distance, reconstruct_block
from comera_convert.pipeline.sequential import BlockInputs, hidden_of
from comera_convert.integer import dequantize, quantize

from .test_streaming import _with_tokenizer
from .tiny_models import build, outputs

# A fixed rank: a ratio would compress only the tiny models' vocabulary-sized table. 64 x 32 tokens:
# four calibration batches, the last held out.
SMALL = dict(rank=4, calibration="english", calibration_sequences=64, calibration_seq_len=32, word_embedding="tt")


def _converted(tmp_path, name, **options):
    torch.manual_seed(0)
    return convert_checkpoint(str(tmp_path / "dense"), tmp_path / name, ConvertOptions(**{**SMALL, **options}))


def test_reconstruction_lowers_each_kept_blocks_held_out_error_and_reports_it(tmp_path):
    _, _, cls = _with_tokenizer(tmp_path, "bert")
    plain = _converted(tmp_path, "plain", reconstruct_steps=0)
    tuned = _converted(tmp_path, "tuned", reconstruct_steps=60, reconstruct_lr=1e-2)
    fits = tuned.report.extra["reconstruction"]
    assert [fit["block"] for fit in fits] == [0, 1]
    assert all(fit["steps"] == 60 and fit["lr"] == 1e-2 for fit in fits)
    assert any(fit["kept"] for fit in fits)
    for fit in fits:
        assert fit["error_after"] < fit["error_before"] if fit["kept"] else fit["error_after"] == fit["error_before"]
    assert "reconstruction" not in plain.report.extra
    # The tuned blocks stand closer to the dense model on text the calibration did not read.
    dense = cls.from_pretrained(tmp_path / "dense").eval()
    ids = torch.randint(1000, 20000, (4, 24), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    reference = outputs(dense, batch)
    errors = {name: float((outputs(cls.from_pretrained(tmp_path / name).eval(), batch) - reference).norm())
              for name in ("plain", "tuned")}
    assert errors["tuned"] < errors["plain"], errors


def test_a_diverging_block_keeps_its_closed_form_fit_with_a_warning(tmp_path, caplog):
    _, _, cls = _with_tokenizer(tmp_path, "bert")
    _converted(tmp_path, "plain", reconstruct_steps=0)
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        result = _converted(tmp_path, "diverged", reconstruct_steps=5, reconstruct_lr=1e30)
    assert not any(fit["kept"] for fit in result.report.extra["reconstruction"])
    warnings = [r.getMessage() for r in caplog.records if "reconstruction" in r.getMessage()]
    assert len(warnings) == 2 and all("kept the closed-form fit" in w and "\n" not in w for w in warnings)
    plain, diverged = (cls.from_pretrained(tmp_path / name).eval() for name in ("plain", "diverged"))
    assert all(torch.isfinite(p).all() for p in diverged.parameters())
    assert torch.equal(outputs(diverged), outputs(plain))


def test_a_block_that_rejects_its_tuning_is_tuned_once_more_at_a_lower_rate(tmp_path, caplog, monkeypatch):
    from comera_convert.pipeline import reconstruction

    _with_tokenizer(tmp_path, "bert")
    # 1e30 diverges; the retry's share brought down so that the second try runs at the first test's 1e-2.
    monkeypatch.setattr(reconstruction, "RETRY_LR_SHARE", 1e-32)
    tried, tune = [], reconstruction._tuned

    def recorded(block, index, *args):
        tried.append((index, args[-3]))  # (block, rate)
        return tune(block, index, *args)

    monkeypatch.setattr(reconstruction, "_tuned", recorded)
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        result = _converted(tmp_path, "retried", reconstruct_steps=60, reconstruct_lr=1e30)
    fits = result.report.extra["reconstruction"]
    assert fits[0]["kept"] and any(fit["kept"] for fit in fits)
    assert all(fit["lr"] == pytest.approx(1e-2) for fit in fits if fit["kept"])
    assert all(fit["error_after"] < fit["error_before"] for fit in fits if fit["kept"])
    # The first block tried 1e30, then 1e-2; the blocks after it start at the rate it kept.
    assert tried[:2] == [(0, 1e30), (0, pytest.approx(1e-2))]
    assert [rate for block, rate in tried[2:] if block == 1][0] == pytest.approx(1e-2)
    failed = [fit["block"] for fit in fits if not fit["kept"]]
    warnings = [r.getMessage() for r in caplog.records if "reconstruction" in r.getMessage()]
    assert len(warnings) == len(failed) and all("1e+30" in w and "0.01" in w for w in warnings)


def _fit(block, kept, lr):
    """A block's reconstruction record: kept or not, at rate ``lr``."""
    from comera_convert.pipeline.reconstruction import BlockFit

    return BlockFit(block, 0.05, 0.04 if kept else 0.05, kept, 36, lr)


def test_a_block_tries_first_the_rate_the_last_block_that_kept_its_tuning_kept():
    from comera_convert.pipeline.reconstruction import RETRY_LR_SHARE, rates_to_try

    lower = 1e-3 * RETRY_LR_SHARE
    assert rates_to_try(1e-3, []) == (1e-3, lower)
    assert rates_to_try(1e-3, [_fit(0, True, 1e-3)]) == (1e-3, lower)
    assert rates_to_try(1e-3, [_fit(0, True, lower)]) == (lower, 1e-3)
    assert rates_to_try(1e-3, [_fit(0, True, lower), _fit(1, False, 1e-3)]) == (lower, 1e-3)  # rejected: no say
    assert rates_to_try(1e-3, [_fit(0, True, lower), _fit(1, True, 1e-3)]) == (1e-3, lower)


@pytest.mark.parametrize("options, message", [
    (dict(reconstruct_steps=-1), "reconstruct_steps as a whole number of steps (0: off)"),
    (dict(reconstruct_steps=2.5), "reconstruct_steps as a whole number of steps (0: off)"),
    (dict(reconstruct_steps=10, reconstruct_lr=0), "reconstruct_lr as a positive number"),
    (dict(reconstruct_steps=10, reconstruct_lr=float("nan")), "reconstruct_lr as a positive number"),
    (dict(reconstruct_steps=10, calibration="english", calibration_sequences=16),
     "give at least 32 (--calibration-sequences 16)"),
])
def test_bad_reconstruction_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConvertOptions(ratio=4, **options)


def _planned(params=22_713_216, cut=2.3, **options):
    """The plan for a model of ``params`` parameters whose layers the ratio cuts ``cut`` times (MiniLM at 4)."""
    return plan_for(ConvertOptions(**options), ModelShape(params=params, cut=cut))


def test_reconstruction_follows_the_cut_as_compensation_does():
    assert _planned(ratio=4).reconstruct_steps == 300
    assert _planned(ratio=2, cut=1.05).reconstruct_steps == 300  # MiniLM at --ratio 2
    assert _planned(ratio=1.9, cut=0.99).reconstruct_steps == 0  # the layers need no cut
    assert _planned(ratio=2, cut=2.0, word_embedding="tt").reconstruct_steps == 0  # a TT table: from --ratio 3
    assert _planned(rank=8, cut=None).reconstruct_steps == 0
    assert _planned(ratio=4, calibration_sequences=16).reconstruct_steps == 0  # too few to hold 16 out
    assert _planned(ratio=4, reconstruct_steps=0).reconstruct_steps == 0
    planned = _planned(ratio=4)
    assert planned.reasons["reconstruct_steps"] == "where compensating" and planned.request.reconstruct_steps is None


def test_calibration_sequences_follow_the_model_size_where_compensating():
    assert ConvertOptions(ratio=4).calibration_sequences is None  # the request leaves it to the plan
    assert _planned(ratio=4).calibration_sequences == 512  # MiniLM
    assert _planned(109_482_240, 3.4, ratio=4).calibration_sequences == 144  # bert-base's shape
    assert _planned(1_100_000_000, ratio=4).calibration_sequences == 128  # a 1.1 B Llama: never below the default
    assert _planned(1_000, ratio=4).calibration_sequences == 512  # a tiny model: never above the cap
    # MiniLM at --ratio 1.9: the codebook table alone reaches it, the layers need no cut, no compensation
    assert _planned(ratio=1.9, cut=0.99).calibration_sequences == 128
    assert _planned(ratio=4, compensate=False).calibration_sequences == 128
    assert _planned(ratio=4, calibration_sequences=64).calibration_sequences == 64  # as requested
    with pytest.raises(ConfigError, match="calibration_sequences as a positive integer"):
        ConvertOptions(ratio=4, calibration_sequences=0)


def test_a_model_that_cannot_stream_block_by_block_says_reconstruction_was_skipped(tmp_path):
    _with_tokenizer(tmp_path, "bert")  # the sensitivity allocation converts a model loaded whole
    result = convert_checkpoint(str(tmp_path / "dense"), tmp_path / "out",
                                ConvertOptions(ratio=3, allocation="sensitivity", word_embedding="tt",
                                               calibration="english", calibration_sequences=32,
                                               calibration_seq_len=32, reconstruct_steps=10))
    assert any("block reconstruction runs in a calibrated conversion" in note for note in result.notes)


def _bert_with_strong_layers():
    """The tiny BERT with its encoder's weights five times their initial scale: at BERT's init a
    block's output is nearly its residual input, and the sublayers' rounding would not show."""
    model = build("bert")
    with torch.no_grad():
        for module in model.encoder.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(5)
    return model


def _block_tuned(grid, inputs, targets):
    """Block 0 of that BERT converted at rank 24 with int4 factors in groups of 16 (rounded as the
    conversion makes them), then reconstructed on ``grid`` (None: in float)."""
    model = _bert_with_strong_layers()
    comera_convert.convert(model, rank=24, d=1, dtype="int4", group_size=16, targets=["encoder.layer.0.*"])
    block = model.encoder.layer[0]
    fit = reconstruct_block(block, 0, inputs, targets, steps=80, lr=1e-2, grid=grid)
    return block, fit


def test_with_integer_storage_a_block_is_tuned_on_the_grid_it_is_written_on():
    fmt = integer_format("int4", 16)
    dense = _bert_with_strong_layers().encoder.layer[0]
    torch.manual_seed(0)
    hidden = [torch.randn(8, 16, 64) for _ in range(4)]
    inputs = [BlockInputs((h,), {}) for h in hidden]
    with torch.no_grad():
        targets = [hidden_of(dense(h)) for h in hidden]
    on_grid, fit = _block_tuned(fmt, inputs, targets)
    assert fit.kept
    axes = integer_axes(on_grid)
    assert any(".cores." in name for name in axes)
    for name, axis in axes.items():  # the writer's rounding (the clip search) leaves every factor as it is
        factor = on_grid.get_parameter(name)
        values, scales = quantize(factor, fmt, axis)
        assert torch.equal(dequantize(values, scales, fmt, factor.shape, axis, factor.dtype), factor), name
    assert all(getattr(m, "integer_format", None) is None for m in on_grid.modules())
    # What reconstruction reports is what the rounded block does, and it errs less than the block
    # tuned in float and rounded after (0.062 against 0.064 to 0.067 on four draws of the inputs).
    assert held_out_distance(on_grid, inputs[-1:], targets[-1:]) == pytest.approx(fit.error_after, rel=1e-5)
    in_float, _ = _block_tuned(None, inputs, targets)
    round_in_place(in_float, fmt)
    assert fit.error_after < held_out_distance(in_float, inputs[-1:], targets[-1:])


def test_the_report_says_how_many_blocks_were_tuned_at_the_lower_rate():
    from comera_convert.cli.render import reconstruction_text

    def fit(block, kept, lr):
        return _fit(block, kept, lr).to_dict()

    text = reconstruction_text([fit(0, True, 1e-3), fit(1, True, 3e-4), fit(2, False, 3e-4)])
    assert text.endswith("(2 of 3 blocks tuned, 36 steps each at 0.001, 2 at 0.0003)")
    assert reconstruction_text([fit(0, True, 1e-3)]).endswith("(1 of 1 blocks tuned, 36 steps each at 0.001)")
    older = [{k: v for k, v in fit(0, True, 1e-3).items() if k not in ("lr", "steps")}]  # a report before them
    assert reconstruction_text(older).endswith("(1 of 1 blocks tuned)")
