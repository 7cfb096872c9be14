"""A search tool over a document collection, ranked by BM25 (the ``bm25s`` library).

``SearchIndex`` holds the documents and their index; ``search`` returns ranked hits and
``as_tool`` makes the ``search(query)`` tool a model calls, whose result lists the top-k
documents with their titles and a snippet of each. Collections load from jsonl: one
object per line with ``text`` (or Search-R1's ``contents``, whose first line is the
quoted title), and optional ``title`` and ``id``.

Tokenization is ours and deterministic (lower-cased word characters, English stop words
removed), the same for documents and queries; a query with no indexed word has no hits.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.errors import ConfigError
from turnrl.jsonl import read_jsonl_lines
from turnrl.tools.tool import Tool

_WORD_RE = re.compile(r"(?u)\b\w\w+\b")
# A short, fixed English stop list: words that carry no topic and would only add noise.
# fmt: off
_STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "from", "has", "have", "he",
    "her", "his", "how", "in", "into", "is", "it", "its", "of", "on", "or", "she", "that",
    "the", "their", "them", "then", "there", "these", "they", "this", "to", "was", "were",
    "what", "when", "where", "which", "who", "whom", "why", "will", "with", "you", "your",
))
# fmt: on


@dataclass(frozen=True)
class Document:
    """One document of a collection: ``id`` unique, ``title`` may be empty."""

    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Hit:
    """A ranked search result: 1-based ``rank``, BM25 ``score`` (> 0)."""

    document: Document
    score: float
    rank: int


def tokenize(text: str) -> list[str]:
    """Lower-cased words of two or more word characters, stop words removed."""
    return [w for w in _WORD_RE.findall(text.lower()) if w not in _STOPWORDS]


class SearchIndex:
    """BM25 over documents (``k1``, ``b``: the usual BM25 parameters; Lucene scoring).

    Documents are ``Document`` objects, plain strings (id = position) or mappings with
    ``text`` or ``contents`` and optional ``title``, ``id``. The title is indexed with
    the text. An empty collection or a duplicate id is a ``ConfigError``.
    """

    def __init__(
        self, documents: Iterable[Document | str | Mapping[str, Any]], *, k1: float = 1.5,
        b: float = 0.75,
    ) -> None:  # fmt: skip
        import bm25s  # imported here: only search users pay for it

        self.documents: list[Document] = [_document(d, i) for i, d in enumerate(documents)]
        if not self.documents:
            raise ConfigError("a search index needs at least one document")
        counts = Counter(d.id for d in self.documents)
        if dups := sorted(i for i, n in counts.items() if n > 1):
            raise ConfigError(f"duplicate document id(s) {dups[:5]} in the search collection")
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        # bm25s needs one token per document at least; an empty document gets a blank one.
        corpus = [tokenize(f"{d.title} {d.text}") or [""] for d in self.documents]
        self._bm25.index(corpus, show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: Any) -> SearchIndex:
        """Load a collection from a jsonl file (see the module docstring for the fields);
        a bad line is a ``ConfigError`` naming the file and line."""
        docs: list[Mapping[str, Any]] = []
        for n, row in read_jsonl_lines(path):
            if not isinstance(row, Mapping) or not isinstance(
                row.get("text", row.get("contents")), str
            ):
                raise ConfigError(
                    f"{path}:{n}: expected an object with a string 'text' or 'contents'"
                )
            docs.append(row)
        return cls(docs, **kwargs)

    def __len__(self) -> int:
        return len(self.documents)

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The top ``k`` documents for ``query``, best first; only documents that share a
        word with the query (score > 0)."""
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        """``search`` for many queries in one call (faster per query)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not queries:
            return []
        k = min(k, len(self.documents))
        found = self._bm25.retrieve(
            [tokenize(q) for q in queries], k=k, show_progress=False, n_threads=0
        )
        out: list[list[Hit]] = []
        for ids, scores in zip(found.documents.tolist(), found.scores.tolist(), strict=True):
            hits = [(int(i), float(s)) for i, s in zip(ids, scores, strict=True) if s > 0]
            out.append([Hit(self.documents[i], s, r) for r, (i, s) in enumerate(hits, 1)])
        return out

    def as_tool(
        self, *, name: str = "search", k: int = 3, snippet_chars: int = 300,
        timeout_s: float | None = 10.0, max_output_chars: int = 4000,
    ) -> Tool:  # fmt: skip
        """The ``search(query)`` tool: the top ``k`` hits, each as ``[rank] title`` and
        the first ``snippet_chars`` of its text (cut at a word, marked with ``...``)."""
        if k < 1 or snippet_chars < 1:
            raise ConfigError(
                f"search tool: k and snippet_chars must be >= 1 (got {k}, {snippet_chars})"
            )

        def search(query: str) -> str:
            """Search the document collection.

            Args:
                query: words to look for
            """
            hits = self.search(query, k)
            if not hits:
                return f"No results for {query!r}."
            return "\n\n".join(render_hit(h, snippet_chars) for h in hits)

        return Tool.from_function(
            search, name=name, timeout_s=timeout_s, max_output_chars=max_output_chars
        )


def render_hit(hit: Hit, snippet_chars: int) -> str:
    """``[rank] title`` then a snippet of the text (the whole text if it is short)."""
    head = f"[{hit.rank}] {hit.document.title}".rstrip()
    return f"{head}\n{snippet(hit.document.text, snippet_chars)}"


def snippet(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with ``...``."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip() + " ..."


def _document(item: Document | str | Mapping[str, Any], position: int) -> Document:
    if isinstance(item, Document):
        return item
    if isinstance(item, str):
        return Document(str(position), "", item)
    if not isinstance(item, Mapping):
        raise ConfigError(
            f"document {position}: expected a str, mapping or Document, got {type(item).__name__}"
        )
    title = item.get("title")
    text = item.get("text")
    if text is None and isinstance(item.get("contents"), str):
        # Search-R1 / FlashRAG wiki dumps: '"Title"\nbody'
        first, _, rest = item["contents"].partition("\n")
        if title is None and len(first) >= 2 and first[0] == first[-1] == '"':
            title, text = first[1:-1], rest
        else:
            text = item["contents"]
    if not isinstance(text, str):
        raise ConfigError(f"document {position}: needs a string 'text' or 'contents'")
    return Document(str(item.get("id", position)), str(title or ""), text)
