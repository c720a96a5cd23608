import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers as tf

import comera_convert
from comera_convert import CodebookEmbedding, TiedTTHead, TTModule
from comera_convert.conversion import count_params
from comera_convert.errors import ModelLoadError
from comera_convert.hf.config import WEIGHTS_GUARD

from .conftest import rel_err
from .tiny_models import CASE_IDS, build, inputs, outputs

AUTO = {"bert": tf.AutoModel, "gpt2": tf.AutoModel, "bert-mlm": tf.AutoModelForMaskedLM,
        "roberta-mlm": tf.AutoModelForMaskedLM, "distilbert-mlm": tf.AutoModelForMaskedLM,
        "bert-seqcls": tf.AutoModelForSequenceClassification,
        "gpt2-seqcls": tf.AutoModelForSequenceClassification, "gpt2-clm": tf.AutoModelForCausalLM,
        "llama-clm": tf.AutoModelForCausalLM, "mistral-clm": tf.AutoModelForCausalLM}


def converted(case, tmp_path, ratio=3):
    model = build(case)
    comera_convert.convert(model, ratio=ratio)
    path = tmp_path / case
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("case", CASE_IDS)
def test_saved_checkpoint_loads_with_transformers_and_gives_the_same_outputs(case, tmp_path):
    model, path = converted(case, tmp_path)
    loaded = AUTO[case].from_pretrained(path).eval()
    assert type(loaded) is type(model)
    assert torch.equal(outputs(loaded), outputs(model))
    assert count_params(loaded) == count_params(model)
    # Only TT cores and the remaining dense tensors are stored.
    assert (path / "model.safetensors").stat().st_size < 4.2 * count_params(model) + 65536


@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm", "llama-clm"])
def test_save_load_save_round_trip(case, tmp_path):
    model, path = converted(case, tmp_path)
    loaded = comera_convert.from_pretrained(path)
    loaded.save_pretrained(tmp_path / "again")
    again = comera_convert.from_pretrained(tmp_path / "again")
    assert torch.equal(outputs(again), outputs(model))
    first = json.loads((path / "config.json").read_text())["quantization_config"]
    second = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert first["modules"] == second["modules"]


def test_tied_head_is_tied_after_loading(tmp_path):
    _, path = converted("gpt2-clm", tmp_path)
    loaded = comera_convert.from_pretrained(path)
    assert isinstance(loaded.lm_head, TiedTTHead)
    assert loaded.lm_head.embedding is loaded.transformer.wte


@pytest.mark.parametrize("case", ["bert-mlm", "gpt2-clm"])
def test_loading_a_tied_head_never_builds_the_embedding_table(case, tmp_path, monkeypatch):
    model, path = converted(case, tmp_path)
    tables = []
    original = comera_convert.TTEmbedding.dense_matrix
    monkeypatch.setattr(comera_convert.TTEmbedding, "dense_matrix",
                        lambda self: tables.append(1) or original(self))
    loaded = comera_convert.from_pretrained(path)
    assert tables == []  # transformers' tying reads head.weight.shape; that would build the table
    head = loaded.get_output_embeddings()
    assert isinstance(head, TiedTTHead)
    if head.bias is not None:  # BERT's decoder bias, tied to cls.predictions.bias, spans the vocabulary
        assert head.bias.shape == (head.out_features,) and head.bias is loaded.cls.predictions.bias
    monkeypatch.setattr(comera_convert.TTEmbedding, "dense_matrix", original)
    assert torch.equal(outputs(loaded.eval()), outputs(model))


def test_checkpoint_layout(tmp_path):
    model, path = converted("bert-mlm", tmp_path)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "comera_report.json", "README.md", "comera_remote.py"} <= names
    mask = os.umask(0)
    os.umask(mask)
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # readable as a new file is
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    config = json.loads((path / "config.json").read_text())
    assert config["transformers_weights"] == WEIGHTS_GUARD
    assert config["auto_map"]["AutoModelForMaskedLM"] == "comera_remote.BertForMaskedLM"
    records = config["quantization_config"]["modules"]
    live = {n for n, m in model.named_modules() if isinstance(m, (TTModule, TiedTTHead, CodebookEmbedding))}
    assert set(records) == live
    report = json.loads((path / "comera_report.json").read_text())
    assert report["params_after"] == count_params(model)
    card = (path / "README.md").read_text()
    assert "## Converted modules" in card and "| `cls.predictions.decoder` | 1 | tied |" in card


def test_pruned_ranks_are_saved_smaller(tmp_path):
    model = build("bert")
    comera_convert.convert(model, rank=8)
    layer = model.encoder.layer[0].attention.self.query
    with torch.no_grad():
        layer.gates[2][4:] = 0
    layer.prune_ranks()
    expected = outputs(model)
    model.save_pretrained(tmp_path / "pruned")
    loaded = comera_convert.from_pretrained(tmp_path / "pruned")
    assert loaded.encoder.layer[0].attention.self.query.bond_dims[2] == 4
    assert torch.equal(outputs(loaded), expected)


def test_a_pruned_bond_larger_than_its_neighbours_allow_round_trips(tmp_path):
    # Closing all but one index of bond k+1 leaves bond k larger than s_{k+1} r_{k+1}, the most a
    # freshly planned spec would give it: the records must keep the size the cores have.
    model = build("bert-mlm")
    comera_convert.convert(model, rank=16, embedding_layout="tt")
    layer = model.bert.embeddings.word_embeddings
    k = next(k for k in range(len(layer.gates) - 1) if layer.bond_dims[k] > layer.spec.bond_modes[k + 1])
    with torch.no_grad():
        layer.gates[k + 1][1:] = 0
    layer.prune_ranks()
    assert layer.bond_dims[k] > layer.spec.bond_modes[k + 1] * layer.bond_dims[k + 1]
    expected = outputs(model)
    model.save_pretrained(tmp_path / "pruned")
    loaded = comera_convert.from_pretrained(tmp_path / "pruned")
    assert loaded.bert.embeddings.word_embeddings.bond_dims == layer.bond_dims
    assert torch.equal(outputs(loaded), expected)


def test_decompress_gives_an_ordinary_dense_checkpoint(tmp_path):
    model, path = converted("gpt2-clm", tmp_path)
    dense = comera_convert.decompress_model(comera_convert.from_pretrained(path))
    dense.save_pretrained(tmp_path / "dense")
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert "quantization_config" not in config and "transformers_weights" not in config
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    assert not any(isinstance(m, (TTModule, TiedTTHead)) for m in plain.modules())
    assert plain.lm_head.weight is plain.transformer.wte.weight
    assert rel_err(outputs(plain), outputs(model)) < 1e-5


def test_trainer_accepts_a_loaded_compressed_model(tmp_path):
    _, path = converted("bert-mlm", tmp_path)
    model = tf.AutoModelForMaskedLM.from_pretrained(path)
    batch = inputs()
    rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            for ids in batch["input_ids"]]
    args = tf.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                                report_to=[], save_steps=2, use_cpu=True, learning_rate=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    tf.Trainer(model=model, args=args, train_dataset=rows).train()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert json.loads((checkpoint / "config.json").read_text())["quantization_config"]["quant_method"] == "comera"
    reloaded = comera_convert.from_pretrained(checkpoint)
    assert torch.equal(outputs(reloaded), outputs(model.eval()))


def test_ranks_that_disagree_with_the_tensors_are_refused(tmp_path):
    _, path = converted("bert", tmp_path)
    config = json.loads((path / "config.json").read_text())
    record = config["quantization_config"]["modules"]["encoder.layer.0.attention.self.query"]
    record["spec"]["ranks"] = [r - 1 for r in record["spec"]["ranks"]]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="recorded ranks disagree with its tensors"):
        comera_convert.from_pretrained(path)


def test_truncated_weights_are_refused(tmp_path):
    _, path = converted("bert", tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        comera_convert.from_pretrained(path)


def test_dense_directory_is_not_a_compressed_checkpoint(tmp_path):
    build("bert").save_pretrained(tmp_path / "dense")
    with pytest.raises(ModelLoadError, match="not a comera compressed checkpoint"):
        comera_convert.from_pretrained(tmp_path / "dense")


# The loading ways, each as a user's fresh process meets them, two processes in all: plain transformers
# first (it must refuse, and then trust_remote_code opens the checkpoint with no import of ours), and
# `import comera_convert` first (AutoModel opens it through the registered method, and so does
# comera_convert.from_pretrained). Each writes the logits it got, or the refusal it got.
WITHOUT_IMPORT = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForMaskedLM
    path, batch, out = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3]
    try:
        AutoModelForMaskedLM.from_pretrained(path)
    except Exception as err:
        open(out + ".refused", "w").write(str(err))
    model = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True).eval()
    assert "comera_convert" in sys.modules  # the checkpoint's remote code imported it
    with torch.no_grad():
        torch.save(model(**batch).logits, out + ".trust_remote_code")
""")
WITH_IMPORT = textwrap.dedent("""
    import sys, torch
    import comera_convert
    from transformers import AutoModelForMaskedLM
    path, batch, out = sys.argv[1], torch.load(sys.argv[2]), sys.argv[3]
    for way, model in [("import", lambda: AutoModelForMaskedLM.from_pretrained(path)),
                       ("comera_from_pretrained", lambda: comera_convert.from_pretrained(path))]:
        with torch.no_grad():
            torch.save(model().eval()(**batch).logits, out + "." + way)
""")


def _fresh_process(script, *args):
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_loads_three_ways_in_fresh_processes_and_plain_transformers_refuses(tmp_path):
    model, path = converted("bert-mlm", tmp_path)
    torch.save(inputs(), tmp_path / "batch.pt")
    out = tmp_path / "out"
    for script in (WITHOUT_IMPORT, WITH_IMPORT):
        result = _fresh_process(script, path, tmp_path / "batch.pt", out)
        assert result.returncode == 0, result.stderr[-2000:]
    # Plain transformers stops on the guard file name instead of loading random weights.
    assert "pip-install-comera-convert--then-import-comera_convert" in (tmp_path / "out.refused").read_text()
    for way in ("trust_remote_code", "import", "comera_from_pretrained"):
        assert torch.equal(torch.load(tmp_path / f"out.{way}"), outputs(model)), way


def test_an_interrupted_save_leaves_nothing_half_written(tmp_path, monkeypatch):
    from comera_convert.hf import saving

    model = build("bert")
    comera_convert.convert(model, rank=4)

    def interrupted(directory):
        raise KeyboardInterrupt

    monkeypatch.setattr(saving, "_patch_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_saving_over_a_checkpoint_with_folders_replaces_them_whole(tmp_path):
    """A sentence model's checkpoint holds folders (1_Pooling): saving over it again (a training
    run's --overwrite) replaces each folder with the new one, where a rename onto it fails."""
    from comera_convert.hf.saving import atomic_directory

    out = tmp_path / "out"
    (out / "1_Pooling").mkdir(parents=True)
    (out / "1_Pooling" / "stale.json").write_text("old")
    (out / "kept.txt").write_text("kept")
    with atomic_directory(out, replace_dir=False) as tmp:
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "config.json").write_text("new")
        (tmp / "model.safetensors").write_text("weights")
    assert sorted(p.name for p in (out / "1_Pooling").iterdir()) == ["config.json"]
    assert (out / "kept.txt").read_text() == "kept" and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


def test_reordered_embedding_round_trips_and_needs_format_2(tmp_path):
    """A calibrated conversion holds the vocabulary frequent-first; the checkpoint records it (format
    version 2, which older readers refuse instead of looking up the wrong rows) and loads back equal."""
    from comera_convert.conversion.calibration import collect
    from comera_convert.conversion.targets import find_candidates

    model = build("bert-mlm")
    batches = [torch.randint(0, 40, (8, 16)) for _ in range(4)]
    stats = collect(model, find_candidates(model)[0], batches, source="test")
    comera_convert.convert(model, ratio=2, embedding_layout="tt", word_embedding="tt", calibration=stats)
    assert model.bert.embeddings.word_embeddings.row_of_token is not None
    model.save_pretrained(tmp_path / "ordered")
    quantization = json.loads((tmp_path / "ordered" / "config.json").read_text())["quantization_config"]
    assert quantization["version"] == 2
    assert quantization["modules"]["bert.embeddings.word_embeddings"]["reordered"] is True
    loaded = tf.AutoModelForMaskedLM.from_pretrained(tmp_path / "ordered").eval()
    assert torch.equal(outputs(loaded), outputs(model.eval()))
    dense = comera_convert.decompress_model(loaded)
    assert rel_err(outputs(dense), outputs(model)) < 1e-5
    plain = build("bert-mlm")
    comera_convert.convert(plain, ratio=2, word_embedding="tt")  # uncalibrated: token-id order
    plain.save_pretrained(tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["quantization_config"]["version"] == 1


@pytest.mark.parametrize("damage", ["repeated id", "another vocabulary's order"])
def test_a_row_order_that_is_no_permutation_of_the_vocabulary_is_refused(tmp_path, damage):
    """A checkpoint must never load with its rows shuffled: a stored row_of_token that repeats a row,
    or that was cut for a larger vocabulary, is refused in one line (remote code imports comera_convert
    and loads through the same quantizer)."""
    from safetensors.torch import load_file, save_file

    from comera_convert.errors import ModelLoadError
    from comera_convert.layers import TTEmbedding

    model = build("bert")
    comera_convert.convert(model, rank=4, targets=["embeddings.word_embeddings"])
    words = model.embeddings.word_embeddings
    model.embeddings.word_embeddings = TTEmbedding.from_embedding(
        torch.nn.Embedding.from_pretrained(words.dense_matrix()), rank=4,
        token_order=torch.arange(words.num_embeddings).flip(0))
    model.save_pretrained(tmp_path / "ok")
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    rows = tensors["embeddings.word_embeddings.row_of_token"]
    if damage == "repeated id":
        rows[1] = rows[0]
    else:
        rows += 1  # ids 1..n, as a table of n + 1 rows would hold them
    save_file(tensors, tmp_path / "ok" / "model.safetensors", metadata={"format": "pt"})
    for load in (lambda p: tf.AutoModel.from_pretrained(p), comera_convert.from_pretrained):
        with pytest.raises(ModelLoadError, match="row_of_token is not a permutation of the"):
            load(tmp_path / "ok")
