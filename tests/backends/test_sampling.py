"""One rule for what a token was sampled from (``agl.backends.sampling``): the transform's
properties, vLLM's order of truncation, what the proxy records and refuses, and the end to
end check: through the real gateway and the embedded engine, an unchanged policy scores
every sampled token with ratio 1 at temperature 0.7, top-p 0.9 and top-k."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agl.backends.sampling import transformed_logprobs
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from agl.core.client import GatewayClient
from agl.core.contracts.records import Status
from agl.core.contracts.samples import Sampling
from agl.core.contracts.sampling import SamplingError, requested_sampling
from agl.core.trainer.assemble import FinishedRollout, MergeStrategy, assemble
from agl.core.trainer.calls import read_calls
from agl.strategies.registry import get
from tests.conftest import agent, model_requests
from tests.helpers.tiny_gateway import Tiny, start, tiny, tiny_admin  # noqa: F401 - fixtures


def vllm_top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` for one row, written its way (ascending sort; top-k
    by the k-th largest logit, then top-p on the renormalised rest): the kept mask."""
    ordered, order = logits.sort(descending=False)
    if k:
        kth = ordered[len(ordered) - k]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if p < 1:
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - p
        drop[-1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    kept = torch.isfinite(ordered)
    return torch.zeros_like(kept).scatter(0, order, kept)


def mass_up_to(logits: torch.Tensor, k: int, token: int) -> float:
    """The renormalised probability of ``token`` and every less likely token after top-k:
    what vLLM's top-p compares with ``1 - p``."""
    if k:
        logits = logits.masked_fill(logits < logits.sort(descending=True).values[k - 1], -math.inf)
    probs = logits.softmax(-1)
    return probs[probs <= probs[token]].sum().item()


# Distinct logits: which of two tied tokens a truncation drops is the sort's choice (the
# engine and the trainer share this code, so they agree even then; vLLM may not).
rows = st.lists(st.floats(-8, 8), min_size=2, max_size=40, unique=True)


@settings(max_examples=200, deadline=None)
@given(
    logits=rows,
    temperature=st.floats(0.2, 2.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.05, 1.0),
)
def test_the_transform_is_vllms_truncation_renormalised(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> None:
    x = torch.tensor([logits], dtype=torch.float64)
    out = transformed_logprobs(
        x,
        torch.tensor([temperature], dtype=torch.float64),
        torch.tensor([top_k]),
        torch.tensor([top_p], dtype=torch.float64),
    )[0]
    kept = torch.isfinite(out)
    scaled = x[0] / temperature
    # Distinct logits can tie once divided (8.0 and 8.0 - 1 ulp at T = 0.75): a tie is
    # the sort's choice, as above.
    assume(scaled.unique().numel() == scaled.numel())
    expected = vllm_top_k_top_p(scaled, min(top_k, len(logits)), top_p)
    # Float rounding can flip a token whose mass below it sits on the top-p edge (at
    # top-p 1 - 1e-16 every token of mass under 1e-16 does); nothing else.
    for token in (kept != expected).nonzero().flatten().tolist():
        assert abs(mass_up_to(scaled, min(top_k, len(logits)), token) - (1 - top_p)) < 1e-9
    assert kept[scaled.argmax()]  # the mode always stays
    assert torch.logsumexp(out[kept], 0).item() == pytest.approx(0.0, abs=1e-9)
    # Within the kept set, the relative probabilities are the tempered model's.
    i, j = kept.nonzero().flatten()[[0, -1]].tolist()
    assert (out[i] - out[j]).item() == pytest.approx((scaled[i] - scaled[j]).item(), abs=1e-9)


def test_top_k_keeps_ties_at_the_kth_logit() -> None:
    x = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    out = transformed_logprobs(x, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]


def test_requested_sampling_resolves_defaults_and_refuses_what_cannot_be_scored() -> None:
    assert requested_sampling({}) == Sampling(1.0, 1.0, 0)
    assert requested_sampling({"temperature": 0.7, "top_p": 0.9, "top_k": -1}) == Sampling(
        0.7, 0.9, 0
    )
    assert requested_sampling({"frequency_penalty": 0, "presence_penalty": 0.0}) == Sampling()
    for field, value in [
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("repetition_penalty", 1.1),
        ("min_p", 0.05),
    ]:
        with pytest.raises(SamplingError, match=field):
            requested_sampling({field: value})
    with pytest.raises(SamplingError, match="logit_bias"):
        requested_sampling({"logit_bias": {"42": 5}})
    with pytest.raises(SamplingError, match="top_p"):
        requested_sampling({"top_p": 1.5})
    with pytest.raises(SamplingError, match="temperature"):
        requested_sampling({"temperature": "hot"})
    assert Sampling(temperature=0.0, top_p=0.5).scored == Sampling()  # greedy: untransformed


SETTINGS: dict[str, dict[str, Any]] = {
    "T=0.7": {"temperature": 0.7},
    "T=0.7 top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_k=20": {"extra_body": {"top_k": 20}},
    "T=1": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_unchanged_policy_has_ratio_one_through_the_gateway(
    tiny: Tiny,  # noqa: F811
    tiny_admin: GatewayClient,  # noqa: F811
    stream: bool,
) -> None:
    """Every setting, two choices each, through the proxy to the embedded engine; the
    trainer (the same weights, another process) rescores what was sampled: every token's
    ratio is 1 within 1e-4. Scored at T = 1, as before this fix, it is not."""
    from agl.backends.inference.models import load_model

    rollouts = []
    for name, kwargs in SETTINGS.items():
        r = start(tiny_admin)
        client = agent(tiny.gateway, r)
        messages = [{"role": "user", "content": f"say something ({name})"}]
        answer = client.chat.completions.create(
            model=tiny.model, messages=messages, max_tokens=24, n=2, stream=stream, **kwargs
        )
        if stream:
            list(answer)
        recorded = model_requests(tiny_admin, r)
        assert [c["choice"] for c in recorded] == [0, 1]
        wanted = requested_sampling({**kwargs, **kwargs.get("extra_body", {})})
        assert all(c["sampling"] == vars(wanted) for c in recorded)
        read = read_calls(tiny_admin.get_events(r.rollout_id, type="model_request"))
        rollouts.append(
            FinishedRollout(r.rollout_id, "g", "train", Status.SUCCEEDED, 1.0, read.calls)
        )
    # Both choices of each call trained (dedup keeps one; independent merge: one each).
    independent = MergeStrategy(get("merge", "independent"))
    batch = assemble(rollouts, independent, lambda s, r: [1.0] * len(s), dedup_rule="last")
    model = load_model("tiny").model
    lr0 = TorchBackendConfig(lr=0.0, num_mini_batches=1)
    metrics = TorchBackend(model, lr0).train(
        batch.samples, batch.advantages, get("loss", "token_mean")
    )
    assert metrics["tokens_trained"] > 50
    assert metrics["logprob_mismatch"] < 1e-4
    assert metrics["clip_fraction"] == 0.0
    untransformed = [s.__class__(**{**vars(s), "sampling": None}) for s in batch.samples]
    wrong = TorchBackend(model, lr0).train(
        untransformed, batch.advantages, get("loss", "token_mean")
    )
    assert wrong["logprob_mismatch"] > 1e-2


def test_unscorable_sampling_is_a_400_and_nothing_is_recorded(
    tiny: Tiny,  # noqa: F811
    tiny_admin: GatewayClient,  # noqa: F811
) -> None:
    r = start(tiny_admin)
    client = agent(tiny.gateway, r)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(
            model=tiny.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            frequency_penalty=0.5,
        )
    assert model_requests(tiny_admin, r) == []


def test_greedy_is_recorded_and_scored_untransformed(
    tiny: Tiny,  # noqa: F811
    tiny_admin: GatewayClient,  # noqa: F811
) -> None:
    r = start(tiny_admin)
    agent(tiny.gateway, r).chat.completions.create(
        model=tiny.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        top_p=0.5,
    )
    (call,) = read_calls(tiny_admin.get_events(r.rollout_id, type="model_request")).calls
    assert call.sampling.scored == Sampling()
    assert all(lp <= 0 and math.isfinite(lp) for lp in call.logprobs)
