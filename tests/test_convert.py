import re

import pytest
import torch

import comera_convert
from comera_convert import CodebookEmbedding, TiedTTHead, TTEmbedding, TTLinear, TTModule
from comera_convert.conversion import count_params
from comera_convert.errors import ConfigError, RatioError

from .conftest import rel_err
from .tiny_models import CASE_IDS, build, outputs

FULL = 10 ** 6


@pytest.mark.parametrize("case", CASE_IDS)
def test_full_rank_conversion_reproduces_the_dense_model(case):
    model = build(case)
    expected = outputs(model)
    comera_convert.convert(model, rank=FULL)
    assert any(isinstance(m, TTModule) for m in model.modules())
    assert rel_err(outputs(model), expected) < 1e-4


@pytest.mark.parametrize("case", CASE_IDS)
def test_ratio_is_met_and_reported(case):
    model = build(case)
    before = count_params(model)
    report = comera_convert.convert(model, ratio=3)
    assert report.params_before == before
    assert report.params_after == count_params(model)
    assert 3 <= report.ratio < 3 * 1.1  # at least the ratio requested, and close to it
    assert report.shared_rank >= 1
    assert all(row.tt_params < row.dense_params for row in report.modules if row.kind != "tied_head")


@pytest.mark.parametrize("table", [TTEmbedding, CodebookEmbedding])
@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm", "distilbert-mlm", "roberta-mlm"])
def test_tied_head_follows_its_embedding_without_copying_it(case, table):
    model = build(case)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    comera_convert.convert(model, ratio=3, word_embedding="tt" if table is TTEmbedding else "codebook")
    new_head = model.get_submodule(head_name)
    assert isinstance(new_head, TiedTTHead)
    assert isinstance(new_head.embedding, table)
    assert new_head.embedding is model.get_input_embeddings()
    assert [n for n, _ in model.named_parameters() if n.startswith(head_name)] in ([], [f"{head_name}.bias"])
    batch = torch.randn(3, new_head.in_features)
    assert rel_err(new_head(batch) - (new_head.bias if new_head.bias is not None else 0),
                   batch @ new_head.embedding.dense_matrix().T) < 1e-5


@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm"])
def test_by_default_a_tied_head_trains_through_the_halves_never_the_table(case, monkeypatch):
    # Embeddings default to the tt layout, whose tied head contracts x R^T L^T; building the table
    # (or running the ttm head's slabs) would cost the dense head's GEMM again.
    model = build(case)
    comera_convert.convert(model, ratio=3, word_embedding="tt")
    assert model.get_input_embeddings().layout == "tt"

    def refuse(*args, **kwargs):
        raise AssertionError("the head built the embedding table")

    monkeypatch.setattr(TTEmbedding, "dense_matrix", refuse)
    monkeypatch.setattr("comera_convert.layers.tied_head.tied_logits", refuse)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model.train()(input_ids=ids, labels=ids).loss.backward()
    assert all(core.grad is not None for core in model.get_input_embeddings().cores)


def test_tied_head_stays_dense_when_its_embedding_is_excluded():
    model = build("gpt2-clm")
    report = comera_convert.convert(model, ratio=1.5, exclude=["wte"])
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "tied to the dense" in report.skipped["lm_head"]


def test_targets_and_exclude_patterns():
    model = build("bert")
    comera_convert.convert(model, rank=4, targets=["encoder.layer.*.attention.*"], exclude=["value"])
    converted = {n for n, m in model.named_modules() if isinstance(m, TTLinear)}
    assert converted == {f"encoder.layer.{i}.attention.{p}" for i in range(2)
                         for p in ("self.query", "self.key", "output.dense")}


def test_gpt2_conv1d_becomes_a_tt_linear():
    model = build("gpt2")
    comera_convert.convert(model, rank=4)
    assert isinstance(model.h[0].attn.c_attn, TTLinear)
    assert model.h[0].attn.c_attn.dense_class == "Conv1D"


def test_tiny_layers_stay_dense_with_a_reason():
    model = build("bert-seqcls")
    report = comera_convert.convert(model, ratio=2)
    assert isinstance(model.classifier, torch.nn.Linear)  # 64 x 2
    assert "classifier" in report.skipped


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_device_and_dtype_follow_the_model(dtype):
    model = build("bert").to(dtype)
    device = next(model.parameters()).device
    dense = build("bert").to(dtype)
    comera_convert.convert(model, rank=10 ** 6)  # full rank: the function is kept, in the model's dtype
    assert {p.dtype for p in model.parameters()} == {dtype} and {p.device for p in model.parameters()} == {device}
    query = model.encoder.layer[0].attention.self.query
    assert isinstance(query, TTModule) and all(core.dtype == dtype and core.device == device for core in query.cores)
    got, want = outputs(model), outputs(dense)
    assert got.dtype == dtype
    assert rel_err(got, want) < (1e-8 if dtype == torch.float64 else 5e-2)


@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm"])
def test_a_meta_device_model_plans_what_a_real_one_gets(case):
    """Planning a conversion of a model too big to hold: built on the meta device, it converts
    to the same modules, ranks and sizes as the model with weights (only the values are missing)."""
    real = build(case)
    with torch.device("meta"):
        meta = type(real)(real.config)
    planned = comera_convert.convert(meta, ratio=2, gates=True)
    converted = comera_convert.convert(real, ratio=2, gates=True)
    assert planned.modules and planned.modules == converted.modules
    assert (planned.params_before, planned.params_after) == (converted.params_before, converted.params_after)
    assert all(p.is_meta for p in meta.parameters())


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(ratio=1.0), ConfigError, "ratio greater than 1"),
    (dict(ratio=0.5), ConfigError, "ratio greater than 1"),
    (dict(ratio="abc"), ConfigError, "ratio as a number"),
    (dict(ratio=4, layout="cp"), ConfigError, "layout in"),
    (dict(ratio=4, targets=["nothing.matches"]), ConfigError, "matches no Linear or Embedding"),
    (dict(ratio=50, targets=["query"]), RatioError, r"largest reachable ratio is \d+\.\d\d"),
    (dict(rank=0), ConfigError, "rank as a positive integer"),
    (dict(ratio=4, rank_multiple=0), ConfigError, "rank_multiple as a positive integer"),
    (dict(rank=30, rank_multiple=8), ConfigError, "a fixed --rank 30 is used as given"),
    (dict(ratio=4, last_block_rank_scale=0), ConfigError, r"last_block_rank_scale as a number in \(0, 16\]"),
    (dict(ratio=4, last_block_rank_scale="2x"), ConfigError, "last_block_rank_scale as a number"),
    (dict(ratio=4, keep_last_attention_output="yes"), ConfigError,
     r"keep_last_attention_output as true or false \(got 'yes'\)"),
])
def test_bad_options_say_what_was_expected(kwargs, error, message):
    with pytest.raises(error, match=message):
        comera_convert.convert(build("bert"), **kwargs)


def test_rank_multiple_rounds_the_ranks_a_ratio_chooses():
    """bert-base planned on the meta device: --ratio 4 picks shared rank 163; with rank_multiple 8
    every bond is a multiple of 8 unless the shape caps it lower, and the ratio still holds."""
    from transformers import BertConfig, BertForMaskedLM

    def plan(**kwargs):
        with torch.device("meta"):
            model = BertForMaskedLM(BertConfig())
        # One shared rank for every block, so that a rank above it comes from the budget's rest.
        report = comera_convert.convert(model, ratio=4, last_block_rank_scale=1, **kwargs)
        return report, [m.spec for m in model.modules() if isinstance(m, (TTLinear, TTEmbedding))]

    plain, _ = plan()
    report, specs = plan(rank_multiple=8)
    assert report.shared_rank % 8 == 0 and plain.shared_rank - 8 < report.shared_rank <= plain.shared_rank
    assert report.ratio >= 4 and report.extra["rank_multiple"] == 8
    for spec in specs:
        assert all(r % 8 == 0 or r == cap for r, cap in zip(spec.ranks, spec.max_ranks)), spec.ranks
    assert any(r > report.shared_rank for spec in specs for r in spec.ranks if r % 8 == 0)  # the budget's rest


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_the_last_block_gets_its_rank_scale_and_the_ratio_still_holds(family):
    """bert-base and a Llama planned on the meta device at --ratio 4: the layers of the last repeated
    block get last_block_rank_scale times the shared rank, every other linear the shared rank (or
    the next, from the budget's rest), and the whole model still meets the ratio; at scale 1 the
    last block is like any other."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    def plan(scale):
        with torch.device("meta"):
            model = (BertModel(BertConfig()) if family == "bert" else
                     LlamaModel(LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                            num_attention_heads=8, vocab_size=4000)))
        report = comera_convert.convert(model, ratio=4, last_block_rank_scale=scale, word_embedding="tt")
        last = "encoder.layer.11." if family == "bert" else "layers.3."
        ranks = {name: max(m.spec.ranks) for name, m in model.named_modules() if isinstance(m, TTLinear)}
        inside = [r for name, r in ranks.items() if name.startswith(last)]
        outside = [r for name, r in ranks.items() if not name.startswith(last) and "pooler" not in name]
        return report, inside, outside

    report, inside, outside = plan(1.5)
    assert report.ratio >= 4 and "the last block's layers at 1.5x" in report.extra["allocation"]
    shared = report.shared_rank
    # The block's linears but its attention output projection, which stays dense.
    assert len(inside) in (5, 6) and all(r in (round(1.5 * shared), round(1.5 * (shared + 1))) for r in inside), \
        (shared, inside)
    assert all(r in (shared, shared + 1) for r in outside), (shared, outside)
    even, inside, outside = plan(1.0)
    assert even.shared_rank > shared and max(inside) <= even.shared_rank + 1  # the scale's rank came from the rest
    assert "last block's layers" not in even.extra["allocation"]


@pytest.mark.parametrize("family, kept", [("bert", "encoder.layer.11.attention.output.dense"),
                                          ("mpnet", "encoder.layer.3.attention.attn.o"),
                                          ("llama", "layers.3.self_attn.o_proj"), ("gpt2", "h.3.attn.c_proj")])
def test_the_last_blocks_attention_output_stays_dense_within_the_ratio(family, kept):
    """bert-base, an MPNet, a Llama and a GPT-2 planned on the meta device at --ratio 6: the last block's
    attention output projection stays a dense layer (the same projection of the first block is
    converted), the ratio holds, and its cost comes out of the shared rank; told to factorize it,
    it is converted like the rest."""
    from transformers import (BertConfig, BertModel, GPT2Config, GPT2Model, LlamaConfig, LlamaModel, MPNetConfig,
                              MPNetModel)

    def plan(**kwargs):
        with torch.device("meta"):
            model = {"bert": lambda: BertModel(BertConfig()),
                     "llama": lambda: LlamaModel(LlamaConfig(hidden_size=512, intermediate_size=1376,
                                                             num_hidden_layers=4, num_attention_heads=8,
                                                             vocab_size=4000)),
                     "mpnet": lambda: MPNetModel(MPNetConfig(hidden_size=512, intermediate_size=2048,
                                                             num_hidden_layers=4, num_attention_heads=8,
                                                             vocab_size=4000)),
                     "gpt2": lambda: GPT2Model(GPT2Config(n_embd=512, n_layer=4, n_head=8, vocab_size=4000))}[family]()
        return model, comera_convert.convert(model, ratio=6, word_embedding="tt", **kwargs)

    model, report = plan()
    first = re.sub(r"\.\d+\.", ".0.", kept, count=1)  # the same projection of the first block
    assert report.ratio >= 6 and report.extra["dense_last_attention_output"] == kept
    assert not isinstance(model.get_submodule(kept), TTModule) and isinstance(model.get_submodule(first), TTLinear)
    assert f"{kept} (the last block's attention output) dense" in report.extra["allocation"]
    factorized, plain = plan(keep_last_attention_output=False)
    assert isinstance(factorized.get_submodule(kept), TTLinear) and plain.ratio >= 6
    assert "dense_last_attention_output" not in plain.extra and "attention output" not in plain.extra["allocation"]
    assert report.shared_rank < plain.shared_rank  # the dense layer's parameters came from the others' rank


def test_rank_multiple_does_not_apply_to_the_sensitivity_ladder():
    from comera_convert.conversion import ConvertOptions

    with pytest.raises(ConfigError, match="climbs its own ladder"):
        ConvertOptions(ratio=4, calibration="python-stdlib", allocation="sensitivity", rank_multiple=8)


def test_converting_twice_is_refused():
    model = build("bert")
    comera_convert.convert(model, rank=4)
    with pytest.raises(ConfigError, match="already compressed"):
        comera_convert.convert(model, rank=4)


def test_progress_callback_sees_every_module():
    seen = []
    model = build("bert")
    report = comera_convert.convert(model, rank=4, progress=lambda name, i, n: seen.append((name, i, n)))
    assert [s[0] for s in seen] == [r.name for r in report.modules if r.kind != "tied_head"]
    assert seen[-1][1] == seen[-1][2] - 1


def test_a_model_with_no_module_the_converter_knows_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.LayerNorm(8))
    with pytest.raises(ConfigError) as error:
        comera_convert.convert(model, ratio=2)
    assert str(error.value) == ("no module to convert: expected Linear, Embedding or GPT-2 Conv1D layers, "
                                "found only Conv2d, LayerNorm")
    linear = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="every Linear and Embedding was excluded or is too small"):
        comera_convert.convert(linear, ratio=2, exclude=["0"])
