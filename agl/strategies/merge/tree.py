"""Tree (prefix-shared) training: one packed sample per rollout, every shared token
prefix stored once.

Tokens are the nodes of a trie over the rollout's calls (prompt, then response). Each
node's ``parents`` entry points at its parent (-1 for a root) and ``position_ids`` is
its depth, so attending only to ancestors (the branch-aware causal mask) gives every
token exactly the context of an independent causal sequence. Parents always come
before children. A response token reuses a context node (the same token after the same
tokens); a second sampling of an already-sampled node gets a branch of its own, so every
recorded action is trained exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

from agl.core.contracts.samples import ModelCall, Sample
from agl.strategies.registry import register


@register("merge", "tree")
def tree(calls: Sequence[ModelCall], rollout_id: str, group_id: str) -> list[Sample]:
    if not calls:
        return []
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    action: list[int] = []
    logprobs: list[float] = []
    call_index: list[int] = []
    children: dict[tuple[int, int], int] = {}

    def add(parent: int, token: int) -> int:
        tokens.append(token)
        parents.append(parent)
        depth.append(0 if parent < 0 else depth[parent] + 1)
        action.append(0)
        logprobs.append(0.0)
        call_index.append(-1)
        node = len(tokens) - 1
        children.setdefault((parent, token), node)
        return node

    for i, call in enumerate(calls):
        node = -1
        for token in call.prompt_ids:
            found = children.get((node, token))
            node = found if found is not None else add(node, token)
        for token, logprob in zip(call.response_ids, call.logprobs, strict=True):
            found = children.get((node, token))
            node = found if found is not None and not action[found] else add(node, token)
            action[node], logprobs[node], call_index[node] = 1, logprob, i
    return [
        Sample(
            tokens=tokens,
            action_mask=action,
            logprobs=logprobs,
            rollout_id=rollout_id,
            group_id=group_id,
            call_index=call_index,
            position_ids=depth,
            parents=parents,
        )
    ]
