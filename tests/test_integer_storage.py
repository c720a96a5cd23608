"""Integer storage of the factors: the rounding against torch's own quantizer and a plain per-group
loop, checkpoints that load back as the model that was saved (in memory and streamed), training
from them, and every bad input refused in one line."""

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import comera_convert
from comera_convert.api import convert_checkpoint
from comera_convert.conversion import ConvertOptions
from comera_convert.conversion.storage import integer_axes, integer_format
from comera_convert.errors import ConfigError, ModelLoadError
from comera_convert.hf.config import FORMAT_VERSION
from comera_convert.integer import IntegerFormat, dequantize, quantize
from comera_convert.integer.rounding import pack_int4, unpack_int4

from .conftest import rel_err
from .tiny_models import build, outputs


def test_int8_per_channel_matches_torchs_quantizer_at_the_same_scales():
    x = torch.randn(3, 96, 20)
    values, scales = quantize(x, IntegerFormat(8), axis=2)
    assert values.dtype == torch.int8 and values.shape == (20, 288) and scales.shape == (20, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's quantized tensors are deprecated, still the reference
        reference = torch.quantize_per_channel(x.movedim(2, 0).reshape(20, -1), scales.float().flatten(),
                                               torch.zeros(20, dtype=torch.long), 0, torch.qint8)
    assert torch.equal(reference.int_repr(), values)
    back = dequantize(values, scales, IntegerFormat(8), x.shape, axis=2)
    assert back.shape == x.shape and rel_err(back, x) < 0.01


def test_int4_groups_round_each_group_to_its_own_scale():
    x = torch.randn(5, 64) * torch.linspace(0.1, 10, 64)  # groups of very different ranges
    fmt = IntegerFormat(4, 16)
    values, scales = quantize(x, fmt)
    assert values.dtype == torch.uint8 and values.shape == (5, 32) and scales.shape == (5, 4)
    back = dequantize(values, scales, fmt, x.shape)
    for channel in range(5):  # a plain loop: every group within half a step of its own scale
        for group in range(4):
            part = slice(16 * group, 16 * group + 16)
            step = float(scales[channel, group])
            ints = torch.round(x[channel, part] / step).clamp(-7, 7)
            assert torch.allclose(back[channel, part], ints * step, atol=1e-6)
    assert rel_err(back, x) < 0.15
    clipped = quantize(x, fmt)[1].float() * 7 < x.abs().reshape(5, 4, 16).amax(-1)
    assert clipped.any()  # the clip search shrank some scales below the group's largest value


def test_fake_quantize_rounds_the_forward_pass_and_passes_gradients_through():
    from comera_convert.integer import fake_quantize

    x = torch.randn(6, 32, requires_grad=True)
    fmt = IntegerFormat(4, 16)
    y = fake_quantize(x, fmt)
    grid = IntegerFormat(4, 16, clip_search=False)  # each group's largest value sets its scale
    values, scales = quantize(x, grid)
    assert torch.equal(y, dequantize(values, scales, grid, x.shape))
    assert not torch.equal(quantize(x, fmt)[1], scales)  # the clip search shrank some of those scales
    assert 0 < rel_err(y, x) < 0.2
    (y * torch.arange(32.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(32.0).expand(6, 32))  # the straight-through estimator


def test_int4_packs_two_values_a_byte():
    ints = torch.tensor([[-7, 7, 0, -1, 3, -8]], dtype=torch.int8)
    packed = pack_int4(ints)
    assert packed.shape == (1, 3) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), ints)


def test_bad_values_and_scales_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="int4 group size 48 does not divide the width 64 of w"):
        quantize(torch.randn(4, 64), IntegerFormat(4, 48), what="w")
    with pytest.raises(ConfigError, match="w holds NaN or infinite values: it cannot be stored as int8"):
        quantize(torch.tensor([[1.0, float("nan")]]), IntegerFormat(8), what="w")
    values, scales = quantize(torch.randn(4, 64), IntegerFormat(8))
    with pytest.raises(ModelLoadError, match="has a scale that is zero, negative or not finite"):
        dequantize(values, scales.zero_(), IntegerFormat(8), (4, 64))
    with pytest.raises(ConfigError, match="expected a group size as an even integer"):
        IntegerFormat(4, 7)
    # A width the default group size does not divide gets fewer, evenly sized groups (a requested size
    # must divide it): 96 = 2 x 48, 200 = 2 x 100.
    assert integer_format("int4").groups(96, "w") == 1 and integer_format("int4").groups(200, "w") == 2


# On these tiny random models rounding moved the outputs by 0.011-0.013 (int8, a scale per channel) and
# 0.18-0.21 (int4, a scale per group of 128) of their size.
ROUNDING_MOVES = {"int8": 0.03, "int4": 0.3}


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm", "llama-clm"])
def test_an_integer_checkpoint_loads_back_as_the_model_that_was_saved(case, dtype, tmp_path):
    model = build(case)
    # One rank for every block: the bound below was set with it on these random weights (a tiny
    # random model's error is near 1 at --ratio 3 whatever the allocation).
    comera_convert.convert(model, ratio=3, dtype=dtype, last_block_rank_scale=1)
    dense = build(case)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["version"] == 4 and config["storage"] == {"format": dtype, "group_size": None, "clip_search": True}
    with safe_open(tmp_path / "model.safetensors", "pt") as stored:
        integer = {k for k in stored.keys() if stored.get_slice(k).get_dtype() in ("I8", "U8")}
        axes = integer_axes(model)
        assert {f"{k}_scale" for k in axes} <= set(stored.keys())  # every factor as values and scales
    assert integer >= set(axes)
    loaded = comera_convert.from_pretrained(tmp_path).eval()
    # The conversion rounds each factor as it makes it: in memory it is what the checkpoint holds.
    assert torch.equal(outputs(loaded), outputs(model))
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert torch.allclose(outputs(comera_convert.decompress_model(loaded)), outputs(model), atol=1e-5)
    bigger, float_model = tmp_path / "float", build(case)
    comera_convert.convert(float_model, ratio=3, last_block_rank_scale=1)  # the same conversion as floats
    # Rounding moves the outputs from the same conversion in floats by ROUNDING_MOVES at most, and adds
    # to the factorization's own error against the dense model a little, not a second error of its size.
    assert rel_err(outputs(loaded), outputs(float_model)) < ROUNDING_MOVES[dtype]
    factorized, rounded = rel_err(outputs(float_model), outputs(dense)), rel_err(outputs(loaded), outputs(dense))
    assert rounded < factorized + 0.03, (rounded, factorized)
    float_model.save_pretrained(bigger)
    assert (tmp_path / "model.safetensors").stat().st_size < 0.6 * (bigger / "model.safetensors").stat().st_size


@pytest.mark.slow  # a whole conversion twice, streamed and in memory
def test_a_streamed_conversion_writes_the_same_integers(tmp_path):
    from .test_streaming import _with_tokenizer

    dense, tokenizer, cls = _with_tokenizer(tmp_path, "bert-mlm")
    options = ConvertOptions(ratio=3, calibration="english", calibration_sequences=16, calibration_seq_len=32,
                             dtype="int4", compensate=False)
    torch.manual_seed(0)  # the codebook's centres are fit on a random sample of rows
    result = convert_checkpoint(str(dense), tmp_path / "streamed", options)
    assert result.report.extra["streamed"] and result.report.extra["storage_dtype"] == "int4, groups of 128"
    loaded = cls.from_pretrained(tmp_path / "streamed").eval()
    reference = cls.from_pretrained(dense).eval()
    statistics = comera_convert.calibrate(reference, tokenizer, "english", sequences=16, seq_len=32)
    torch.manual_seed(0)
    comera_convert.convert(reference, options, calibration=statistics)
    assert torch.allclose(outputs(loaded), outputs(reference), atol=1e-4)
    stored = load_file(tmp_path / "streamed" / "model.safetensors")
    assert stored["bert.embeddings.word_embeddings.codebooks"].dtype == torch.uint8
    assert stored["bert.embeddings.word_embeddings.codebooks_scale"].dtype == torch.float16


def test_a_damaged_or_unreadable_integer_checkpoint_is_refused_in_one_line(tmp_path):
    model = build("bert")
    comera_convert.convert(model, ratio=3, dtype="int8")
    model.save_pretrained(tmp_path)
    config_path, weights = tmp_path / "config.json", tmp_path / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("cores.0_scale"))
    damaged = dict(tensors, **{name: torch.zeros_like(tensors[name])})
    save_file(damaged, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{name[:-len('_scale')]} has a scale that is zero"):
        comera_convert.from_pretrained(tmp_path)
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads(config_path.read_text())
    config["quantization_config"]["storage"]["format"] = "int3"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="stores its factors as 'int3', which this comera_convert cannot read"):
        comera_convert.from_pretrained(tmp_path)
    newer = FORMAT_VERSION + 1  # what an older release sees: a newer format
    config["quantization_config"]["version"] = newer
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"format version {newer}, newer than this comera_convert understands"):
        comera_convert.from_pretrained(tmp_path)


def test_integer_options_are_checked_before_converting():
    with pytest.raises(ConfigError, match="--group-size applies to integer storage"):
        ConvertOptions(ratio=3, dtype="bfloat16", group_size=64)
    with pytest.raises(ConfigError, match="expected one of float32, bfloat16, float16, int8, int4"):
        ConvertOptions(ratio=3, dtype="int3")
    model = build("bert")
    with pytest.raises(ConfigError, match="group size 48 does not divide the width"):
        comera_convert.convert(model, ratio=3, dtype="int4", group_size=48)
