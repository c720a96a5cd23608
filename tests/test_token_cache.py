"""The built-in corpora's token ids kept on disk (token_cache.py): a later process reads what an earlier
one tokenized, and the ids are the tokenizer's own."""

import os

import pytest

from comera_convert import text, token_cache
from tests.tiny_models import word_tokenizer

DOCUMENTS = [f"w{i} w{i + 1} w{i + 2} and more words" for i in range(40)]


@pytest.fixture
def small_corpus(monkeypatch, tmp_path):
    """The built-in corpus names read a few short documents, into an empty cache folder, with no ids kept
    in the process (as a fresh process starts)."""
    documents = list(DOCUMENTS)
    monkeypatch.setattr(text, "training_documents", lambda source: iter(documents))
    monkeypatch.setattr(text, "_KEPT_IDS", {})
    monkeypatch.setenv(token_cache.CACHE_VARIABLE, str(tmp_path / "cache"))
    return documents


def tokenized(tokenizer, documents):
    return [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents]


def kept_files(tmp_path):
    return sorted((tmp_path / "cache" / "token-ids").glob("*.safetensors"))


def test_a_later_process_reads_the_ids_an_earlier_one_tokenized(small_corpus, tmp_path, monkeypatch):
    tokenizer = word_tokenizer()
    first = list(text.training_token_ids("english", tokenizer))
    assert first == tokenized(tokenizer, small_corpus)
    assert len(kept_files(tmp_path)) == 1

    monkeypatch.setattr(text, "_KEPT_IDS", {})  # a new process: nothing kept in memory

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the kept ids should have been read, not tokenized again")

    monkeypatch.setattr(text, "_token_ids", no_tokenizing)
    assert list(text.training_token_ids("english", tokenizer)) == first


def test_another_tokenizer_or_other_text_is_kept_apart(small_corpus, tmp_path, monkeypatch):
    list(text.training_token_ids("english", word_tokenizer()))
    monkeypatch.setattr(text, "_KEPT_IDS", {})
    smaller = word_tokenizer(size=20)  # fewer words: most become [UNK]
    assert list(text.training_token_ids("english", smaller)) == tokenized(smaller, small_corpus)
    small_corpus[0] = "w9 w8 w7"  # the corpus's text changed
    monkeypatch.setattr(text, "_KEPT_IDS", {})
    assert list(text.training_token_ids("english", smaller))[0] == tokenized(smaller, ["w9 w8 w7"])[0]
    assert len(kept_files(tmp_path)) == 3


def test_a_damaged_file_is_tokenized_again_and_a_folder_that_cannot_be_written_is_skipped(small_corpus, tmp_path,
                                                                                        monkeypatch):
    tokenizer = word_tokenizer()
    expected = tokenized(tokenizer, small_corpus)
    list(text.training_token_ids("english", tokenizer))
    [kept] = kept_files(tmp_path)
    kept.write_bytes(kept.read_bytes()[:20])  # cut short
    monkeypatch.setattr(text, "_KEPT_IDS", {})
    assert list(text.training_token_ids("english", tokenizer)) == expected
    assert token_cache.read_ids(kept) is not None  # written anew, whole

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(token_cache.CACHE_VARIABLE, str(blocked))
    monkeypatch.setattr(text, "_KEPT_IDS", {})
    assert list(text.training_token_ids("english", tokenizer)) == expected
    assert blocked.read_text() == "not a folder" and not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


def test_the_cache_folder_follows_its_variable_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv(token_cache.CACHE_VARIABLE, str(tmp_path / "mine"))
    assert token_cache.cache_folder() == tmp_path / "mine"
    monkeypatch.delenv(token_cache.CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache.cache_folder() == tmp_path / "xdg" / "comera_convert"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert token_cache.cache_folder() == tmp_path / "home" / ".cache" / "comera_convert"

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(token_cache.Path, "home", staticmethod(no_home))
    monkeypatch.setattr(token_cache.tempfile, "gettempdir", lambda: str(tmp_path / "temporary"))
    assert token_cache.cache_folder() == tmp_path / "temporary" / "comera_convert"
