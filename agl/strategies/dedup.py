"""Which of one attempt's recorded calls the harness went on with (``dedup``): the
choices of an ``n > 1`` request it did not use, and retries, are left out before merging."""

from __future__ import annotations

from collections.abc import Sequence

from agl.core.contracts.samples import ModelCall

DEDUP_RULES = ("continued", "last")


def dedup(calls: Sequence[ModelCall], rule: str = "continued") -> list[ModelCall]:
    """The calls the harness went on with, in the order they were made.

    Two calls with identical ``prompt_ids`` are the choices of one ``n > 1`` request, a
    retry (the harness timed out, or its answer was lost: the paper's "Network Issues"),
    or a prompt sent again on purpose (a context reset, a subagent started from the same
    opening). ``rule``:

    - ``continued`` (default; loses no call the harness used): a call is *continued* when
      a later call's prompt extends its prompt and, of the calls with that prompt made
      before it, matches this one's response furthest (ties: the latest request, then its
      lowest choice). A call is kept when it is continued, or when nothing continued its
      request and no later request has its prompt: then its request's choice 0 (what a
      client takes by default). So a retry is dropped, an unused choice is dropped, and a
      prompt sent again after its first answer was used keeps both calls.
    - ``last``: of calls with identical ``prompt_ids``, keep the last (the paper's rule).

    Invariants (property-tested): the result is a subsequence of ``calls``; every call
    that a later prompt continues is in it under ``continued``; of calls with one prompt
    and nothing continuing them, exactly one is kept.
    """
    if rule == "last":
        latest = {tuple(c.prompt_ids): i for i, c in enumerate(calls)}
        return [c for i, c in enumerate(calls) if latest[tuple(c.prompt_ids)] == i]
    if rule != "continued":
        raise ValueError(f"unknown dedup rule {rule!r}; use one of {', '.join(DEDUP_RULES)}")
    requests = _requests(calls)
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    continued: set[int] = set()
    for j, call in enumerate(calls):
        for members in by_prompt.values():
            prompt = calls[members[0]].prompt_ids
            n = len(prompt)
            if len(call.prompt_ids) > n and call.prompt_ids[:n] == prompt:
                continued.add(_best_match(calls, members, call.prompt_ids, n, requests))
        by_prompt.setdefault(tuple(call.prompt_ids), []).append(j)
    used = {requests[i] for i in continued}
    last = {requests[m[-1]] for m in by_prompt.values()}
    first_choice: dict[int, int] = {}
    for i, r in enumerate(requests):
        first_choice.setdefault(r, i)
    return [
        c
        for i, c in enumerate(calls)
        if i in continued
        or (requests[i] not in used and requests[i] in last and first_choice[requests[i]] == i)
    ]


def _requests(calls: Sequence[ModelCall]) -> list[int]:
    """Which request each call is a choice of: a new one starts at each choice 0 (or a
    choice index that does not follow the one before, or another prompt)."""
    out: list[int] = []
    for i, c in enumerate(calls):
        same = i > 0 and c.choice > calls[i - 1].choice and c.prompt_ids == calls[i - 1].prompt_ids
        out.append(out[-1] if same else (out[-1] + 1 if out else 0))
    return out


def _best_match(
    calls: Sequence[ModelCall],
    members: Sequence[int],
    later_prompt: Sequence[int],
    n: int,
    requests: Sequence[int],
) -> int:
    """Of ``members`` (calls with the prompt of length ``n``), the one whose response the
    later prompt matches furthest: ties go to the latest request, then its first choice."""

    def key(i: int) -> tuple[int, int, int]:
        response = calls[i].response_ids
        rest = later_prompt[n : n + len(response)]
        match = 0
        while match < len(rest) and rest[match] == response[match]:
            match += 1
        return (match, requests[i], -calls[i].choice)

    return max(members, key=key)
