"""Retrieval scores (recall@1, MRR) on query/document pairs, and the pair files users pass."""

import json

import pytest
import torch

from comera_convert.errors import ConfigError
from comera_convert.retrieval import (kept, pairs_from_texts, read_pairs, retrieval_scores, share_error,
                                      split_first_sentence)


def test_scores_count_where_each_right_document_ranks():
    documents = torch.eye(4)
    queries = documents.clone()
    queries[2] = torch.tensor([0.0, 0.9, 0.1, 0.0])  # nearest document 1, its own second
    queries[3] = torch.tensor([0.6, 0.5, 0.4, 0.3])  # its own document ranks fourth
    scores = retrieval_scores(queries, documents)
    assert scores["recall_at_1"] == pytest.approx(0.5)
    assert scores["mrr"] == pytest.approx((1 + 1 + 1 / 2 + 1 / 4) / 4)
    assert scores["found"].tolist() == [True, True, False, False]


def test_the_share_kept_carries_the_standard_error_a_bootstrap_of_the_queries_gives():
    generator = torch.Generator().manual_seed(0)
    dense = torch.rand(400, generator=generator) < 0.6
    compressed = dense & (torch.rand(400, generator=generator) < 0.9)  # loses a tenth of dense's hits...
    compressed |= ~dense & (torch.rand(400, generator=generator) < 0.1)  # ...and finds a few dense misses
    scores = kept({"recall_at_1": float(compressed.float().mean()), "mrr": 0.0, "found": compressed},
                  {"recall_at_1": float(dense.float().mean()), "mrr": 0.0, "found": dense})
    assert "found" not in scores  # the per-query list stays out of reports
    assert scores["recall_kept"] == pytest.approx(float(compressed.sum() / dense.sum()))
    draws = torch.randint(0, 400, (4000, 400), generator=generator)
    shares = compressed[draws].float().sum(1) / dense[draws].float().sum(1)
    assert scores["recall_kept_error"] == pytest.approx(float(shares.std()), rel=0.1)
    assert share_error(dense, dense) == 0.0  # agreeing on every query leaves nothing uncertain


def test_a_tie_counts_against_the_right_document():
    scores = retrieval_scores(torch.ones(3, 2), torch.ones(3, 2))  # every document alike
    assert scores["recall_at_1"] == 0.0 and scores["mrr"] == pytest.approx(1 / 3)


def test_passages_split_into_their_first_sentence_and_the_rest():
    passage = ("The gate closes a rank once its value stays small.  Training then prunes\nthe cores: "
               "the slices of a closed rank are removed, and the layer is smaller from that step on.")
    query, document = split_first_sentence(passage)
    assert query == "The gate closes a rank once its value stays small."
    assert document.startswith("Training then prunes the cores:") and "\n" not in document
    assert split_first_sentence("Too short. " + "x" * 200) is None  # a heading-like first sentence
    assert split_first_sentence("A first sentence of enough length here. Then little.") is None
    assert pairs_from_texts([passage, passage, "no sentence at all " * 3], count=5) == [(query, document)]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def pair(query, document):
    return json.dumps({"query": query, "document": document})


def test_a_pair_file_is_read_in_order(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [pair("q1", "d1"), "", pair("q2", "d2"), pair("q3", "d3")])
    assert read_pairs(path, 2) == [("q1", "d1"), ("q2", "d2")]


@pytest.mark.parametrize("lines, message", [
    ([pair("q1", "d1"), json.dumps({"query": "q2"})],
     "line 2: expected a JSON object with \"query\" and \"document\" strings (got \"no 'document' string"),
    ([pair("q1", "d1"), json.dumps({"query": "q2", "document": 7})], "line 2: expected a JSON object"),
    ([pair("q1", "d1"), "not json"],
     "line 2: expected a JSON object with \"query\" and \"document\" strings (got 'not json')"),
    ([pair("q1", "d1"), "[1, 2]"], "line 2: expected a JSON object"),
    ([pair("q1", "d1"), pair("q1", "d2")], "line 2: the same query as line 1"),
    ([pair("q1", "d1"), pair("q2", "d1")], "line 2: the same document as line 1"),
    ([pair("q1", "d1"), pair("q2", "d2")], "2 pairs, fewer than the 3 requested (--texts 3; pass --texts 2 or fewer)"),
])
def test_bad_pair_files_are_one_line_errors(tmp_path, lines, message):
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(ConfigError) as caught:
        read_pairs(path, 3)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_pair_file_that_is_not_utf8_or_missing_is_refused(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"query": "caf\u00e9", "document": "d"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 14 is 0xe9\)"):
        read_pairs(path, 1)
    with pytest.raises(ConfigError, match="no such file"):
        read_pairs(tmp_path / "none.jsonl", 1)
