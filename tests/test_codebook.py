"""Codebook (product-quantized) word embeddings: the k-means against scikit-learn's, the layer against
the dense table it replaces, the conversion's budget, and checkpoints that load back equal or refuse."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import comera_convert
from comera_convert import CodebookEmbedding, TiedTTHead, TTEmbedding
from comera_convert.codebook import CodebookSpec, dense_from_codes, kmeans, product_quantize
from comera_convert.conversion import ConvertOptions, count_params
from comera_convert.conversion.plan import word_table
from comera_convert.errors import ConfigError, ModelLoadError, ShapeError

from .tiny_models import build, outputs


def blobs(problems=3, n=400, dim=4, centres=8, seed=0):
    """Points around ``centres`` well-separated centres per problem."""
    g = torch.Generator().manual_seed(seed)
    middles = torch.randn(problems, centres, dim, generator=g) * 10
    which = torch.randint(centres, (problems, n), generator=g)
    return middles.gather(1, which.unsqueeze(-1).expand(-1, -1, dim)) + 0.3 * torch.randn(problems, n, dim, generator=g)


def table_of_slices(rows=300, cols=16, subspaces=4, codewords=6, seed=0):
    """A table whose every slice is one of ``codewords`` values: a codebook holds it exactly."""
    g = torch.Generator().manual_seed(seed)
    books = torch.randn(subspaces, codewords, cols // subspaces, generator=g)
    codes = torch.randint(codewords, (rows, subspaces), generator=g)
    return dense_from_codes(books, codes)


@pytest.mark.parametrize("sample", [None, 200])
def test_kmeans_matches_scikit_learn_from_the_same_start(sample):
    sklearn = pytest.importorskip("sklearn.cluster")
    points = blobs()
    g = torch.Generator().manual_seed(3)
    fit = points
    if sample is not None:  # the rows kmeans fits on: the first draw of its generator
        fit = points[:, torch.randperm(points.shape[1], generator=g)[:sample]]
    start = fit[:, :8]  # a poor start (the first points, maybe of one blob): Lloyd's steps alike from it
    centres, assignment = kmeans(points, 8, iterations=20, seed=3, sample=sample, start=start)
    for p in range(points.shape[0]):
        reference = sklearn.KMeans(8, init=start[p].numpy(), n_init=1, max_iter=20, tol=0, algorithm="lloyd")
        reference.fit(fit[p].double().numpy())
        assert torch.allclose(centres[p].double(), torch.from_numpy(reference.cluster_centers_), atol=1e-4)
        assert torch.equal(assignment[p], torch.from_numpy(reference.predict(points[p].double().numpy())).long())


def test_weighted_kmeans_pulls_centres_towards_heavy_points():
    points = torch.tensor([[[0.0], [1.0], [10.0]]])
    even, _ = kmeans(points, 2, iterations=5, seed=0)
    heavy, _ = kmeans(points, 2, iterations=5, seed=0, weights=torch.tensor([1.0, 9.0, 1.0]))
    assert sorted(even[0, :, 0].tolist()) == pytest.approx([0.5, 10.0])
    assert sorted(heavy[0, :, 0].tolist()) == pytest.approx([0.9, 10.0])


def test_product_quantization_with_a_centre_per_row_holds_the_table_exactly():
    table = torch.randn(64, 16)
    codebooks, codes = product_quantize(table, subspaces=4, codewords=64, iterations=3)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 4) and codebooks.shape == (4, 64, 4)
    assert torch.allclose(dense_from_codes(codebooks, codes), table, atol=1e-6)


def test_lloyd_steps_bring_the_codes_closer_to_the_table():
    table = table_of_slices()

    def error(iterations):
        codebooks, codes = product_quantize(table, subspaces=4, codewords=6, iterations=iterations)
        return float((dense_from_codes(codebooks, codes) - table).norm() / table.norm())

    assert error(30) < 0.8 * error(0)


@pytest.mark.parametrize("subspaces,codewords,fragment", [
    (5, 16, "a number of slices dividing the 16 columns"),
    (4, 300, "codewords between 2 and 256"),
    (4, 1, "codewords between 2 and 256"),
])
def test_bad_codebook_shapes_are_one_line(subspaces, codewords, fragment):
    with pytest.raises(ShapeError, match=fragment):
        product_quantize(torch.randn(400, 16), subspaces, codewords)


def test_the_layer_looks_up_the_rows_of_the_dense_table_it_replaces():
    dense = nn.Embedding(64, 16, padding_idx=0)
    layer = CodebookEmbedding.from_embedding(dense, subspaces=4, codewords=64, iterations=3)
    ids = torch.randint(0, 64, (3, 7))
    assert torch.allclose(layer(ids), dense(ids), atol=1e-5)
    assert torch.equal(layer(ids), layer.weight[ids])
    assert layer.codebooks.dtype == dense.weight.dtype and layer.codes.device == dense.weight.device


def test_an_approximate_table_keeps_most_of_a_random_one():
    dense = nn.Embedding(2000, 32)
    layer = CodebookEmbedding.from_embedding(dense, subspaces=16, codewords=64)
    error = (layer.weight - dense.weight).norm() / dense.weight.norm()
    assert error < 0.6  # 2 columns per slice, 64 centres for 2,000 Gaussian rows
    assert layer.stored_params() == 16 * 64 * 2 + 2000 * 16 // 4  # codes: four per float32


def test_training_moves_the_centres_and_leaves_the_padding_row_alone():
    layer = CodebookEmbedding(50, 8, padding_idx=1, subspaces=2, codewords=4)
    layer.codes[1] = torch.tensor([3, 3], dtype=torch.uint8)  # the padding row has its own centres
    layer.codes[2:] = torch.randint(0, 3, (48, 2), dtype=torch.uint8)
    layer(torch.tensor([[1, 2, 5]])).sum().backward()
    touched = layer.codebooks.grad.abs().sum(-1)
    assert touched[:, 3].eq(0).all() and touched[:, :3].sum() > 0


def test_bad_token_ids_are_refused():
    layer = CodebookEmbedding(50, 8, subspaces=2, codewords=4)
    with pytest.raises(IndexError, match=r"indices in \[0, 50\)"):
        layer(torch.tensor([0, 50]))
    with pytest.raises(TypeError, match="integer token indices"):
        layer(torch.tensor([0.0]))


def test_options_choose_the_codebook_with_a_ratio_and_check_it():
    assert word_table(ConvertOptions(ratio=4))[0] == "codebook"
    assert word_table(ConvertOptions(ratio=1.5))[0] == "codebook"
    assert word_table(ConvertOptions(rank=8))[0] == "tt"
    assert word_table(ConvertOptions(ratio=4, allocation="measured"))[0] == "tt"
    assert word_table(ConvertOptions(ratio=4, allocation="learned"))[0] == "codebook"
    assert word_table(ConvertOptions(ratio=4, word_embedding="tt")) == ("tt", "given")
    with pytest.raises(ConfigError, match="word_embedding in"):
        ConvertOptions(word_embedding="pq")
    with pytest.raises(ConfigError, match="the uniform and learned allocations, not 'sensitivity'"):
        ConvertOptions(word_embedding="codebook", allocation="sensitivity")
    with pytest.raises(ConfigError, match="codebook_width as a positive integer"):
        ConvertOptions(codebook_width=0)


def test_the_codebook_table_spends_less_of_the_ratio_and_the_linears_get_the_rest():
    with_codebook, with_tt = build("bert"), build("bert")
    report = comera_convert.convert(with_codebook, ratio=3)
    tt_report = comera_convert.convert(with_tt, ratio=3, word_embedding="tt")
    table = with_codebook.embeddings.word_embeddings
    assert isinstance(table, CodebookEmbedding) and isinstance(with_tt.embeddings.word_embeddings, TTEmbedding)
    assert report.ratio >= 3 and count_params(with_codebook) == report.params_after
    assert count_params(with_codebook) == sum(p.numel() for p in with_codebook.parameters()) + 512 * 16 // 4
    assert report.shared_rank > tt_report.shared_rank
    row = next(r for r in report.modules if r.name == "embeddings.word_embeddings")
    assert row.layout == "codebook" and row.tt_params == table.stored_params()


# A tied BERT MLM decoder, GPT-2's tied lm_head, and an untied Llama head (a linear of its own).
@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm", "llama-clm"])
def test_the_word_table_is_a_codebook_whatever_head_the_model_has(case, tmp_path):
    model = build(case)
    report = comera_convert.convert(model, ratio=3)
    table, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(table, CodebookEmbedding)
    assert report.ratio >= 3 and count_params(model) == report.params_after
    tied = model.config.tie_word_embeddings
    assert isinstance(head, TiedTTHead) == tied and (head.embedding is table if tied else True)
    hidden = torch.randn(2, 5, table.embedding_dim)
    if tied:  # the head multiplies by the very rows the table looks up
        bias = head.bias if head.bias is not None else 0
        assert torch.allclose(head(hidden), hidden @ table.weight.t() + bias, atol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = comera_convert.from_pretrained(tmp_path).eval()
    assert isinstance(loaded.get_input_embeddings(), CodebookEmbedding)
    assert isinstance(loaded.get_output_embeddings(), TiedTTHead) == tied
    assert torch.equal(outputs(loaded), outputs(model))
    dense = comera_convert.decompress_model(loaded)
    assert torch.allclose(outputs(dense), outputs(model), atol=1e-5)


def test_a_tied_codebook_head_trains_the_centres_and_builds_the_table_once_in_inference(monkeypatch):
    model = build("gpt2-clm")
    comera_convert.convert(model, ratio=3)
    table = model.get_input_embeddings()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model.train()(input_ids=ids, labels=ids).loss.backward()
    assert table.codebooks.grad is not None and table.codebooks.grad.abs().sum() > 0
    built = []
    real = CodebookEmbedding.dense_matrix
    monkeypatch.setattr(CodebookEmbedding, "dense_matrix", lambda self: built.append(1) or real(self))
    model.eval()
    with torch.no_grad():
        first = model(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, first) and len(built) == 1  # cached, as generation needs
        table.codebooks.mul_(2)  # an in-place write rebuilds it
        assert not torch.allclose(model(input_ids=ids).logits, first) and len(built) == 2


@pytest.mark.parametrize("case", ["bert", "llama-clm"])
def test_a_codebook_checkpoint_loads_back_equal_and_decompresses(case, tmp_path):
    model = build(case)
    comera_convert.convert(model, ratio=3)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["version"] == 3
    loaded = comera_convert.from_pretrained(tmp_path).eval()
    assert isinstance(loaded.get_input_embeddings(), CodebookEmbedding)
    assert torch.equal(outputs(loaded), outputs(model))
    dense = comera_convert.decompress_model(loaded)
    assert type(dense.get_input_embeddings()) is nn.Embedding
    assert torch.allclose(outputs(dense), outputs(model), atol=1e-5)


def test_codes_naming_centres_the_codebooks_lack_are_refused(tmp_path):
    model = build("bert")
    comera_convert.convert(model, ratio=3)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["embeddings.word_embeddings.codes"][5, 0] = 200  # the table has 32 centres per slice
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="codes names centre 200, but its codebooks hold 32"):
        comera_convert.from_pretrained(tmp_path)


def test_the_spec_counts_codes_in_the_tables_parameters():
    spec = CodebookSpec.plan(30522, 384, width=4)
    assert (spec.subspaces, spec.codewords, spec.width) == (96, 256, 4)
    assert spec.stored_params == 96 * 256 * 4 + 30522 * 96 // 4
    assert CodebookSpec.plan(30522, 384, width=4, element_size=2).code_params == 30522 * 96 // 2
    assert CodebookSpec.plan(600, 30, width=4).width == 5  # the nearest width dividing 30
    assert CodebookSpec.plan(600, 32, width=4).codewords == 37  # 16 rows per centre
    with pytest.raises(ShapeError, match="a codebook spec with"):
        CodebookSpec.from_dict({"rows": 10})


def test_a_record_that_disagrees_with_the_stored_codes_is_refused(tmp_path):
    model = build("bert")
    comera_convert.convert(model, ratio=3)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules"]["embeddings.word_embeddings"]["spec"]["subspaces"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"embeddings.word_embeddings.codebooks should be \(8, 32, 8\)"):
        comera_convert.from_pretrained(tmp_path)


def test_a_base_model_loaded_with_an_lm_head_gets_one_tied_to_its_codebook_table(tmp_path):
    model = build("bert")
    comera_convert.convert(model, ratio=3)
    model.save_pretrained(tmp_path)
    mlm = comera_convert.from_pretrained(tmp_path, task="mlm")
    head, table = mlm.cls.predictions.decoder, mlm.bert.embeddings.word_embeddings
    assert isinstance(table, CodebookEmbedding) and isinstance(head, TiedTTHead) and head.embedding is table
    hidden = torch.randn(2, 5, table.embedding_dim)
    logits = head(hidden)
    assert torch.allclose(logits, hidden @ table.weight.t() + head.bias, atol=1e-5)
    logits.square().sum().backward()  # the centres learn from the head as well
    assert table.codebooks.grad is not None and table.codebooks.grad.abs().sum() > 0
