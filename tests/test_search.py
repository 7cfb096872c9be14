"""The BM25 search tool: ranking, loading collections, the tool's text, bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.errors import ConfigError
from turnrl.tools.search import Document, SearchIndex, snippet, tokenize

DOCS = [
    {"id": "paris", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    {"id": "lyon", "title": "Lyon", "text": "Lyon is a city in France, known for its cuisine."},
    {"id": "berlin", "title": "Berlin", "text": "Berlin is the capital of Germany."},
    {"id": "cat", "title": "Cat", "text": "The cat is a small domesticated carnivorous mammal."},
]


SHARED = SearchIndex(DOCS)


@pytest.fixture
def index() -> SearchIndex:
    return SHARED


def test_ranks_the_relevant_document_first(index: SearchIndex) -> None:
    hits = index.search("capital of France", k=3)
    assert [h.document.id for h in hits][:1] == ["paris"]
    assert [h.rank for h in hits] == list(range(1, len(hits) + 1))
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    assert all(s > 0 for s in scores)
    # "capital" alone: Paris and Berlin, nothing else shares the word
    assert {h.document.id for h in index.search("capital", k=4)} == {"paris", "berlin"}


def test_titles_are_searchable_and_words_are_case_folded(index: SearchIndex) -> None:
    assert index.search("LYON")[0].document.id == "lyon"


def test_no_shared_word_means_no_hits(index: SearchIndex) -> None:
    assert index.search("quantum chromodynamics") == []
    assert index.search("") == []
    assert index.search("the of is") == []  # stop words only


def test_k_is_clamped_to_the_collection_and_must_be_positive(index: SearchIndex) -> None:
    assert len(index.search("city France capital cat", k=100)) == 4
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.search("paris", k=0)


def test_batch_search_matches_single_queries(index: SearchIndex) -> None:
    queries = ["capital of France", "cat", "Germany", "nothing here"]
    assert index.search_batch(queries, k=2) == [index.search(q, k=2) for q in queries]


def test_the_tool_lists_titles_and_word_cut_snippets(index: SearchIndex) -> None:
    search = index.as_tool(k=2, snippet_chars=25)
    assert search.name == "search"
    assert search.parameters["required"] == ["query"]
    out = asyncio.run(search.invoke({"query": "capital France"}))
    assert out.ok
    first, second = out.content.split("\n\n")
    assert first == "[1] Paris\nParis is the capital and ..."
    assert second.startswith("[2] ")
    empty = asyncio.run(search.invoke({"query": "zzz"}))
    assert empty.content == "No results for 'zzz'."
    bad = asyncio.run(search.invoke({"query": 3}))
    assert not bad.ok
    assert "argument 'query' must be a string" in str(bad.error)


def test_snippet_keeps_short_text_and_cuts_long_text_at_a_word() -> None:
    assert snippet("short  text\nhere", 100) == "short text here"
    assert snippet("alpha beta gamma delta", 12) == "alpha beta ..."
    assert snippet("x" * 30, 10) == "x" * 10 + " ..."  # one long word: a hard cut


def test_loads_jsonl_including_search_r1_contents(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    rows = [
        {"id": "d1", "title": "Oslo", "text": "Oslo is the capital of Norway."},
        {"id": "d2", "contents": '"Bergen"\nBergen is a city on the west coast of Norway.'},
        {"text": "No title and no id."},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    index = SearchIndex.from_jsonl(path)
    assert index.documents == [
        Document("d1", "Oslo", "Oslo is the capital of Norway."),
        Document("d2", "Bergen", "Bergen is a city on the west coast of Norway."),
        Document("2", "", "No title and no id."),
    ]
    assert index.search("west coast")[0].document.title == "Bergen"


def test_bad_collections_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not JSON"):
        SearchIndex.from_jsonl(bad)
    bad.write_text('{"title": "no text"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: expected an object"):
        SearchIndex.from_jsonl(bad)
    with pytest.raises(ConfigError, match="at least one document"):
        SearchIndex([])
    with pytest.raises(ConfigError, match=r"duplicate document id\(s\) \['a'\]"):
        SearchIndex([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}])
    with pytest.raises(ConfigError, match="snippet_chars"):
        SearchIndex(["some text"]).as_tool(snippet_chars=0)


def test_empty_documents_are_indexed_but_never_found() -> None:
    index = SearchIndex(["", "words here"])
    assert [h.document.id for h in index.search("words")] == ["1"]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_query_text_is_safe(query: str) -> None:
    hits = SHARED.search(query, k=3)
    assert all(h.score > 0 for h in hits)
    shared = set(tokenize(query))
    for h in hits:  # a hit always shares a word with the query
        assert shared & set(tokenize(f"{h.document.title} {h.document.text}"))
