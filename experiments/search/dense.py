"""The retriever's dense option, for GPU users: passages and queries embedded by any
Hugging Face encoder folder (Search-R1's is ``intfloat/e5-base-v2``: mean pooling over
the last hidden state, ``query: `` and ``passage: `` prefixes, unit vectors), ranked by
exact inner product as Search-R1's flat FAISS index ranks them. Same ``search`` as the
BM25 ``Index``; the embeddings stay on ``device``, so a corpus the size of wiki-18
(21M passages, 768 floats each) needs a GPU's memory or a smaller corpus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

POOLINGS = ("mean", "cls")


class DenseIndex:
    def __init__(
        self,
        rows: Sequence[dict[str, str]],
        encoder: str,
        *,
        device: str = "cpu",
        pooling: str = "mean",
        query_prefix: str = "query: ",
        passage_prefix: str = "passage: ",
        batch_size: int = 256,
        max_length: int = 256,
    ) -> None:
        from transformers import AutoModel, AutoTokenizer

        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: choose one of {POOLINGS}")
        if not encoder:
            raise ValueError("retriever=dense needs encoder=<a Hugging Face encoder folder>")
        self.rows = list(rows)
        self.device = torch.device(device)
        self.pooling = pooling
        self.query_prefix = query_prefix
        self.batch_size = batch_size
        self.max_length = max_length
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(encoder)
            self.model = AutoModel.from_pretrained(encoder).to(self.device).eval()
        except OSError as error:
            raise ValueError(f"encoder={encoder}: {error}") from None
        self.embeddings = self.encode([passage_prefix + r["contents"] for r in self.rows])

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit vectors, one row a text."""
        out = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**batch).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            out.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
        return torch.cat(out)

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]:
        """Each query's ``topk`` passages by inner product, best first."""
        if not queries:
            return []
        k = min(topk, len(self.rows))
        scores = self.encode([self.query_prefix + q for q in queries]) @ self.embeddings.T
        best, found = scores.topk(k, dim=-1)
        return [
            [
                {"document": dict(self.rows[int(doc)]), "score": float(score)}
                for doc, score in zip(docs.tolist(), values.tolist(), strict=True)
            ]
            for docs, values in zip(found, best, strict=True)
        ]
