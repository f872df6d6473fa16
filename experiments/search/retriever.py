"""The retriever: BM25 (``bm25s``) over a passage corpus, as an HTTP service that speaks
Search-R1's retrieval API, so the harness works unchanged against Search-R1's own dense
retriever (``search_r1/search/retrieval_server.py``, e5 + FAISS) on a GPU machine.

``POST /retrieve`` with ``{"queries": [...], "topk": 3, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``, one list a query,
best first. ``GET /healthz`` answers ``{"ok": true, "passages": N}`` once the index is
built.

``python -m experiments.search.retriever corpus=geonames host=127.0.0.1 port=8010``:
``corpus`` is ``geonames`` (``experiments.search.facts``) or a FlashRAG-style jsonl file
(``{"id", "contents"}`` a line, Search-R1's ``wiki-18.jsonl``). ``retriever=dense
encoder=<folder> device=cuda`` embeds it instead (``experiments.search.dense``). A
training run starts it with the task (``task.services``) and stops it with the run.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

log = logging.getLogger("experiments.search.retriever")

MAX_QUERIES = 256
MAX_QUERY_CHARS = 1000
MAX_TOPK = 50


def read_corpus(path: str | Path) -> list[dict[str, str]]:
    """A FlashRAG corpus: one ``{"id", "contents"}`` object a line."""
    rows = []
    with Path(path).open(encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as error:
                raise ValueError(f"{path}:{number}: not JSON: {error}") from None
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise ValueError(f'{path}:{number}: a passage needs a string "contents"')
            rows.append({"id": str(row.get("id", number - 1)), "contents": row["contents"]})
    if not rows:
        raise ValueError(f"{path}: no passages")
    return rows


def load_corpus(corpus: str) -> list[dict[str, str]]:
    if corpus == "geonames":
        from experiments.search.facts import passages, world

        return passages(world())
    return read_corpus(corpus)


class Searchable(Protocol):
    rows: list[dict[str, str]]

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]: ...


class Index:
    """BM25 over the passages' contents (English stopwords left out, as bm25s does)."""

    def __init__(self, rows: Sequence[dict[str, str]]) -> None:
        import bm25s

        self.rows = list(rows)
        self._bm25s = bm25s
        self._bm25 = bm25s.BM25()
        tokens = bm25s.tokenize(
            [r["contents"] for r in self.rows], stopwords="en", show_progress=False
        )
        self._bm25.index(tokens, show_progress=False)

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]:
        """Each query's ``topk`` passages (fewer in a smaller corpus), best first; a query
        without a searchable word finds nothing."""
        k = min(topk, len(self.rows))
        results: list[list[dict[str, Any]]] = [[] for _ in queries]
        tokens = self._bm25s.tokenize(list(queries), stopwords="en", show_progress=False)
        searchable = [i for i, ids in enumerate(tokens.ids) if ids]
        if not searchable or k == 0:
            return results
        # bm25s keys its query vocabulary by id: rebuild the searchable queries as strings
        words = {v: w for w, v in tokens.vocab.items()}
        texts = [[words[t] for t in tokens.ids[i]] for i in searchable]
        found, scores = self._bm25.retrieve(texts, k=k, show_progress=False, n_threads=1)
        for row, i in enumerate(searchable):
            results[i] = [
                {"document": dict(self.rows[int(doc)]), "score": float(score)}
                for doc, score in zip(found[row], scores[row], strict=True)
                if score > 0
            ]
        return results


class RetrieveRequest(BaseModel):
    queries: list[str] = Field(max_length=MAX_QUERIES)
    topk: int = Field(default=3, ge=1, le=MAX_TOPK)
    return_scores: bool = False


def create_app(index: Searchable) -> Any:
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="agl retriever")

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "passages": len(index.rows)}

    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        if any(len(q) > MAX_QUERY_CHARS for q in request.queries):
            raise HTTPException(413, f"a query holds at most {MAX_QUERY_CHARS} characters")
        result = index.search(request.queries, request.topk)
        if not request.return_scores:
            result = [[{"document": hit["document"]} for hit in hits] for hits in result]
        return {"result": result}

    return app


@dataclass
class RetrieverConfig:
    corpus: str = "geonames"
    host: str = "127.0.0.1"
    port: int = 8010
    log_level: str = "warning"
    retriever: str = "bm25"  # bm25 | dense (experiments.search.dense)
    # dense only: an encoder folder (e5-base-v2 for Search-R1), where it runs, its pooling
    encoder: str = ""
    device: str = "cpu"
    pooling: str = "mean"
    query_prefix: str = "query: "
    passage_prefix: str = "passage: "


def build_index(config: RetrieverConfig) -> Searchable:
    """The index ``config`` names, over its corpus."""
    rows = load_corpus(config.corpus)
    if config.retriever == "bm25":
        return Index(rows)
    if config.retriever != "dense":
        raise ValueError(f"retriever={config.retriever!r}: bm25 or dense")
    from experiments.search.dense import DenseIndex

    return DenseIndex(
        rows,
        config.encoder,
        device=config.device,
        pooling=config.pooling,
        query_prefix=config.query_prefix,
        passage_prefix=config.passage_prefix,
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from agl.core.command_line import parse_or_exit

    config = parse_or_exit(
        RetrieverConfig, sys.argv[1:] if argv is None else argv, "experiments.search.retriever"
    )
    logging.basicConfig(level=config.log_level.upper())
    try:
        index = build_index(config)
    except (OSError, ValueError) as error:
        sys.exit(f"experiments.search.retriever: corpus={config.corpus}: {error}")
    log.info("retriever: %d passages on %s:%d", len(index.rows), config.host, config.port)
    uvicorn.run(create_app(index), host=config.host, port=config.port, log_level=config.log_level)


if __name__ == "__main__":
    main()
