"""Property 5: a tiny causal LM on the packed tree, with the branch-aware mask, gives
every action token the logprob it gets when its call runs on its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from transformers import Qwen2Config, Qwen2ForCausalLM

from agl.backends.training.tree import additive_mask, ancestor_mask, linear_parents, token_logprobs
from agl.core.contracts.samples import ModelCall
from agl.strategies.dedup import dedup
from agl.strategies.registry import get
from tests.helpers.toy_traces import VOCAB, traces


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def model(request: pytest.FixtureRequest) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=max(VOCAB) + 1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config._attn_implementation = request.param
    return Qwen2ForCausalLM(config).eval()


def logprobs_alone(model: Qwen2ForCausalLM, call: ModelCall) -> torch.Tensor:
    sequence = torch.tensor(call.prompt_ids + call.response_ids)
    with torch.no_grad():
        logits = model(input_ids=sequence[None]).logits[0]
    return token_logprobs(logits, sequence, linear_parents(len(sequence)))[len(call.prompt_ids) :]


@pytest.mark.slow
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=traces(max_calls=6))
def test_packed_tree_logprobs_equal_independent_calls(
    model: Qwen2ForCausalLM, calls: list[ModelCall]
) -> None:
    calls = dedup(calls)
    (tree,) = get("merge", "tree")(calls, "r", "g")
    assert tree.parents is not None and tree.position_ids is not None
    tokens = torch.tensor(tree.tokens)
    with torch.no_grad():
        logits = model(
            input_ids=tokens[None],
            attention_mask=additive_mask(tree.parents),
            position_ids=torch.tensor(tree.position_ids)[None],
        ).logits[0]
    packed = token_logprobs(logits, tokens, tree.parents)
    for i, call in enumerate(calls):
        positions = [p for p, c in enumerate(tree.call_index) if c == i]
        torch.testing.assert_close(
            packed[positions], logprobs_alone(model, call), atol=1e-5, rtol=0
        )


def test_a_plain_causal_mask_on_the_packed_tree_would_be_wrong(model: Qwen2ForCausalLM) -> None:
    calls = [ModelCall([9, 1, 2], [3, 4], [-1.0, -1.0]), ModelCall([9, 1, 6], [10], [-1.0])]
    (tree,) = get("merge", "tree")(calls, "r", "g")
    assert tree.parents is not None
    tokens = torch.tensor(tree.tokens)
    with torch.no_grad():
        logits = model(input_ids=tokens[None]).logits[0]  # causal over the packing
    packed = token_logprobs(logits, tokens, tree.parents)
    positions = [p for p, c in enumerate(tree.call_index) if c == 1]
    assert not torch.allclose(packed[positions], logprobs_alone(model, calls[1]), atol=1e-5)


def test_ancestor_mask() -> None:
    #   0 -> 1 -> 2
    #        1 -> 3
    mask = ancestor_mask([-1, 0, 1, 1])
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, True, False, True],
    ]
    with pytest.raises(ValueError, match="parents must come first"):
        ancestor_mask([-1, 2, 0])
