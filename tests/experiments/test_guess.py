"""The guessing game (experiments/guess): data, the harness against the real stack (gateway
process + ``python -m agl.serve model=tiny``), and the random-player warm-up.

The warm-up tests play through an in-process ``Engine`` with the chat template, exactly
as the inference server would (no HTTP), with seeded requests so that the figures are
reproducible. They print the random player's reward and the retokenization drift rate
(how often the sampled ids are not the tokenizer's encoding of their text): the warm-up's
BPE-dropout makes it real, and the merge strategies are checked on the resulting calls.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.agent import ENV_REPORT_FD, AgentContext, holding_report_key, report_pipe
from agl.backends.inference.engine import Engine, SamplingParams
from agl.backends.inference.models import LoadedModel, load_model
from agl.core.client import GatewayClient
from agl.core.contracts.records import Status
from agl.core.contracts.samples import BreakReason, ModelCall, Sample
from agl.strategies.registry import get
from agl.testing.processes import GatewayProcess, ServeProcess, gateway_process, serve_process
from experiments.guess.data import train_inputs, val_inputs
from experiments.guess.harness import (
    FEEDBACK_IN_RANGE,
    HIGHER,
    LOWER,
    NOT_A_NUMBER,
    REPEATED_GUESSES,
    Ask,
    Game,
    GameInputError,
    Message,
    feedback,
    parse_guess,
    play,
    run,
)
from experiments.guess.harness import main as harness_main
from experiments.guess.warmup import (
    DropoutBPE,
    encode_game,
    induction_batch,
    ordinary_tokens,
    random_game,
    warm_up,
)

ROOT = Path(__file__).resolve().parents[2]
TASK = yaml.safe_load((ROOT / "conf/task/guess.yaml").read_text())
OPTIONS: dict[str, int] = TASK["options"]
SAMPLING: dict[str, Any] = TASK["sampling"]
SAMPLES = 400
GAMES = 128  # two-call games: ~240 replies
# chi-square, 7 degrees of freedom: P(X > 24.3) = 0.001 for a uniform player.
CHI2_BOUND = 24.3


# ------------------------------------------------------------------------------ data


def test_train_inputs_are_deterministic_in_seed_and_step() -> None:
    batch = train_inputs(3, 64, 7, **OPTIONS, **SAMPLING)
    assert batch == train_inputs(3, 64, 7, **OPTIONS, **SAMPLING)
    assert batch != train_inputs(4, 64, 7, **OPTIONS, **SAMPLING)
    assert batch != train_inputs(3, 64, 8, **OPTIONS, **SAMPLING)
    assert len(batch) == 64
    for example in batch:
        assert OPTIONS["low"] <= example["target"] <= OPTIONS["high"]
        assert Game.from_input(example).max_tokens == SAMPLING["max_tokens"]
    assert len({e["target"] for e in batch}) > 4  # spread, not one target


def test_val_inputs_are_fixed_and_follow_the_house_weights() -> None:
    val = val_inputs(64, **OPTIONS)
    assert val == val_inputs(64, **OPTIONS)
    weights = OPTIONS["target_weights"]
    assert Counter(e["target"] for e in val) == {
        t: 64 * w // sum(weights) for t, w in enumerate(weights, start=1)
    }
    assert all(e["max_turns"] == OPTIONS["max_turns"] for e in val)
    assert all("target_weights" not in e for e in val)  # the harness never sees the habit
    uniform = val_inputs(64, **(OPTIONS | {"target_weights": None}))
    assert Counter(e["target"] for e in uniform) == {t: 8 for t in range(1, 9)}


def test_the_uniform_validation_set_is_fixed_and_uniform() -> None:
    """``task.val_sets.uniform``: the same fixed games with uniform targets, where the
    best feedback-blind player scores 3/8 (baselines.py), so a reward above it shows the
    feedback was read."""
    extra = TASK["val_sets"]["uniform"]
    options = OPTIONS | extra["options"]
    assert options["target_weights"] is None
    val = val_inputs(128, **options, **(SAMPLING | extra.get("sampling", {})))
    assert val == val_inputs(128, **options, **SAMPLING)
    assert Counter(e["target"] for e in val) == {t: 16 for t in range(1, 9)}
    assert val != val_inputs(128, **OPTIONS, **SAMPLING)


def test_train_targets_follow_the_house_weights() -> None:
    counts = Counter(e["target"] for e in train_inputs(0, 4000, 0, **OPTIONS))
    weights = OPTIONS["target_weights"]
    for target, weight in enumerate(weights, start=1):
        assert abs(counts[target] / 4000 - weight / sum(weights)) < 0.03


# ------------------------------------------------------------------------------ game


def test_the_game_rules() -> None:
    assert [parse_guess(t) for t in ("7", " 12!", "I say 3 or 4", "none", "")] == [
        7,
        12,
        3,
        None,
        None,
    ]
    # The answer restates the range the target is known to lie in.
    assert [feedback(g, 9, 1, 16) for g in (3, 12, None, 9)] == [
        (f"{HIGHER}, 4 to 16", 4, 16),
        (f"{LOWER}, 1 to 11", 1, 11),
        (f"{NOT_A_NUMBER}, 1 to 16", 1, 16),
        (None, 1, 16),
    ]
    assert feedback(2, 7, 5, 8) == (f"{HIGHER}, 5 to 8", 5, 8)  # a guess out of range
    replies = iter(["maybe 3", "hmm", "maybe 12", "maybe 7", "6"])

    async def ask(messages: list[Message]) -> str:
        return next(replies)

    episode = asyncio.run(play(Game(target=6, high=16, max_turns=5), ask))
    assert episode.guesses == [3, None, 12, 7, 6] and episode.reward == 1.0
    assert [m["content"] for m in episode.messages if m["role"] == "user"][1:] == [
        f"{HIGHER}, 4 to 16",
        f"{NOT_A_NUMBER}, 4 to 16",
        f"{LOWER}, 4 to 11",
        f"{LOWER}, 4 to 6",
    ]
    lost = asyncio.run(play(Game(target=1), ask_constant("maybe 2")))
    assert lost.guesses == [2] * Game(target=1).max_turns and lost.reward == 0.0
    with pytest.raises(GameInputError, match="target"):
        Game.from_input({"target": 17})
    with pytest.raises(GameInputError, match="max_turns"):
        Game.from_input({"target": 3, "max_turns": True})


def ask_constant(text: str) -> Ask:
    async def ask(messages: list[Message]) -> str:
        return text

    return ask


def ask_replies(*replies: str) -> Ask:
    texts = iter(replies)

    async def ask(messages: list[Message]) -> str:
        return next(texts)

    return ask


def test_an_episode_reports_how_it_used_the_feedback() -> None:
    def metrics(target: int, *replies: str) -> dict[str, float]:
        return asyncio.run(play(Game(target=target), ask_replies(*replies))).metrics

    # "higher, 4 to 8", then 2 and 3 outside it; 3 repeats a refuted number.
    assert metrics(6, "maybe 3", "maybe 2", "maybe 3") == {
        FEEDBACK_IN_RANGE: 0.0,
        REPEATED_GUESSES: 0.5,
    }
    # No number keeps the range at 1..8: 5 lies in it, then 6 in "higher, 6 to 8".
    assert metrics(6, "hmm", "maybe 5", "maybe 6") == {FEEDBACK_IN_RANGE: 1.0, REPEATED_GUESSES: 0}
    # A reply with no number after the first counts as outside, and repeats nothing.
    assert metrics(1, "maybe 4", "no idea", "maybe 2") == {
        FEEDBACK_IN_RANGE: 0.5,
        REPEATED_GUESSES: 0.0,
    }
    # Won at the first guess: no later guess, nothing to say about the feedback.
    assert metrics(4, "maybe 4") == {}


_STATED = re.compile(r"(\d+) to (\d+)")


def stated_ranges(messages: list[Message]) -> list[tuple[int, int]]:
    """The range stated in the user message before each assistant turn, read from text."""
    return [
        (int(low), int(high))
        for before, message in itertools.pairwise(messages)
        if message["role"] == "assistant"
        for low, high in [_STATED.findall(before["content"])[-1]]
    ]


def expected_metrics(guesses: list[int | None], ranges: list[tuple[int, int]]) -> dict[str, float]:
    """The metrics, recomputed from the guesses and the ranges the model was shown."""
    if len(guesses) < 2:
        return {}
    later = list(zip(guesses[1:], ranges[1:], strict=True))
    inside = [g is not None and lo <= g <= hi for g, (lo, hi) in later]
    repeats = [g is not None and g in guesses[:i] for i, g in enumerate(guesses) if i]
    return {
        FEEDBACK_IN_RANGE: sum(inside) / len(later),
        REPEATED_GUESSES: sum(repeats) / len(later),
    }


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 5),
    st.lists(st.one_of(st.none(), st.integers(0, 10)), min_size=5, max_size=5),
)
def test_the_metrics_follow_what_the_model_was_shown(
    target: int, max_turns: int, guesses: list[int | None]
) -> None:
    replies = ["hmm" if g is None else f"maybe {g}" for g in guesses]
    episode = asyncio.run(play(Game(target=target, max_turns=max_turns), ask_replies(*replies)))
    assert episode.ranges == stated_ranges(episode.messages)
    assert episode.metrics == pytest.approx(expected_metrics(episode.guesses, episode.ranges))
    for value in episode.metrics.values():
        assert 0 <= value <= 1


def test_the_harness_can_think_before_each_call() -> None:
    """bench/async.py's agent latency: a lognormal wait before every model call."""
    game = Game.from_input({"target": 2, "think_median_s": 0.01, "think_sigma": 0.0})
    calls: list[float] = []

    async def ask(messages: list[Message]) -> str:
        calls.append(time.monotonic())
        return "1"

    async def timed() -> float:
        start = time.monotonic()
        await play(game, ask)
        return start

    start = asyncio.run(timed())
    assert len(calls) == game.max_turns
    assert all(b - a >= 0.009 for a, b in zip([start, *calls], calls, strict=False))


# ------------------------------------------------------------------ the real stack


@dataclass
class Stack:
    gateway: GatewayProcess
    server: ServeProcess

    def attempt(self, game_input: dict[str, Any]) -> AgentContext:
        """A fresh running rollout (one attempt allowed) and its agent's context."""
        rollout_id = f"guess-{uuid.uuid4().hex[:12]}"
        with GatewayClient(self.gateway.url, self.gateway.token) as admin:
            admin.create_rollouts(
                [
                    {
                        "rollout_id": rollout_id,
                        "group_id": "g",
                        "input": game_input,
                        "max_attempts": 1,
                    }
                ]
            )
            rollout = admin.patch_rollout(rollout_id, "running")
        assert rollout.attempt_key
        return AgentContext(
            gateway_url=self.gateway.url,
            rollout_id=rollout_id,
            attempt=rollout.attempt,
            mode=rollout.mode,
            model=self.server.model,
            api_key=rollout.attempt_key,
            input=game_input,
            report_key=rollout.report_key or "",
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with (
        serve_process("tiny", torch_threads=1, log_level="warning") as server,
        gateway_process(tmp_path_factory.mktemp("gateway")) as gateway,
        GatewayClient(gateway.url, gateway.token) as admin,
    ):
        admin.register_models([{"model": server.model, "endpoint": server.url}])
        yield Stack(gateway, server)


def assert_played(stack: Stack, agent: AgentContext) -> None:
    """The attempt succeeded with a 0/1 reward that follows from the recorded calls: each
    call's response is the text the harness parsed and sent back in the next prompt."""
    with GatewayClient(stack.gateway.url, stack.gateway.token) as admin:
        rollout = admin.get_rollout(agent.rollout_id)
        calls = [e.data for e in admin.get_events(agent.rollout_id, type="model_request")]
        reported = [e.data for e in admin.get_events(agent.rollout_id, type="reward")]
    rewards = [data["value"] for data in reported]
    assert rollout.status == Status.SUCCEEDED, rollout.error
    assert 1 <= len(calls) <= agent.input["max_turns"]
    game = Game.from_input(agent.input)
    low, high = game.low, game.high
    for i, call in enumerate(calls):
        assert len(call["response_ids"]) <= game.max_tokens
        answer, low, high = feedback(parse_guess(call["response"] or ""), game.target, low, high)
        if i + 1 < len(calls):  # the reply went back verbatim, then the feedback
            assert answer is not None
            assert calls[i + 1]["messages"][-2:] == [
                {"role": "assistant", "content": call["response"] or ""},
                {"role": "user", "content": answer},
            ]
    won = answer is None
    assert len(calls) == agent.input["max_turns"] or won
    assert rewards == [1.0 if won else 0.0]
    # The metrics, as the model saw the game: its replies and the ranges in its prompts.
    guesses = [parse_guess(call["response"] or "") for call in calls]
    ranges = [stated_ranges([*call["messages"], {"role": "assistant"}])[-1] for call in calls]
    assert reported[0].get("metrics", {}) == pytest.approx(expected_metrics(guesses, ranges))


def play_in_process(agent: AgentContext) -> None:
    """Run the harness as a worker does: the report key held apart from its env."""
    with holding_report_key(agent.rollout_id, agent.attempt, agent.report_key):
        asyncio.run(run(agent.to_env()))


@pytest.mark.slow
def test_the_harness_plays_through_the_gateway(stack: Stack) -> None:
    agent = stack.attempt({"target": 5, **OPTIONS, **SAMPLING})
    play_in_process(agent)
    assert_played(stack, agent)


def test_the_harness_runs_as_a_command(stack: Stack) -> None:
    agent = stack.attempt({"target": 7, **OPTIONS, **SAMPLING})
    # As the local executor runs a command harness: the report key on a pipe, not in env.
    with report_pipe(agent.report_key) as fd:
        done = subprocess.run(
            [sys.executable, "-m", "experiments.guess.harness"],
            env={**os.environ, **agent.to_env(), ENV_REPORT_FD: str(fd)},
            pass_fds=(fd,),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert_played(stack, agent)


def test_finish_puts_the_finite_metrics_on_the_reward_event(stack: Stack) -> None:
    sent = [
        {"a": 0.25, "n": 3, "nan": math.nan, "inf": math.inf},
        {"nan": math.nan},
        None,
    ]
    received = []
    for metrics in sent:
        agent = stack.attempt({"target": 5, **OPTIONS})
        asyncio.run(agent.finish(reward=0.5, metrics=metrics))
        with GatewayClient(stack.gateway.url, stack.gateway.token) as admin:
            received.append([e.data for e in admin.get_events(agent.rollout_id, type="reward")])
            assert admin.get_rollout(agent.rollout_id).status == Status.SUCCEEDED
    assert received == [
        [{"value": 0.5, "metrics": {"a": 0.25, "n": 3.0}}],
        [{"value": 0.5}],  # nothing finite left: no key
        [{"value": 0.5}],
    ]


def test_a_bad_input_fails_the_attempt_with_a_reason(stack: Stack) -> None:
    agent = stack.attempt({"target": 40, **OPTIONS})
    play_in_process(agent)
    with GatewayClient(stack.gateway.url, stack.gateway.token) as admin:
        rollout = admin.get_rollout(agent.rollout_id)
    assert rollout.status == Status.FAILED and "target 40" in (rollout.error or "")


def test_the_command_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith(("AGL_", "OPENAI_"))]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit, match="lacks"):
        harness_main()


# -------------------------------------------------------------------------- warm-up


def test_warm_up_transcripts_are_the_harness_chats() -> None:
    tokenizer = load_model("tiny").tokenizer
    messages = random_game(target=3, guesses=[8, 12, 3, 5], low=1, high=16)
    assert [m["content"] for m in messages] == [
        "Guess my number, 1 to 16.",
        "maybe 8",
        f"{LOWER}, 1 to 7",
        "maybe 12",
        f"{LOWER}, 1 to 7",
        "maybe 3",
    ]
    ids, mask = encode_game(tokenizer, messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "maybe 8<|im_end|>maybe 12<|im_end|>maybe 3<|im_end|>"
    # With BPE-dropout: the same text, the same context tokens, other reply segmentations.
    dropout = DropoutBPE(tokenizer, 0.5, random.Random(0))
    seen = set()
    for _ in range(20):
        noisy, noisy_mask = encode_game(tokenizer, messages, dropout)
        assert tokenizer.decode(noisy, skip_special_tokens=False) == text
        assert [t for t, m in zip(noisy, noisy_mask, strict=True) if not m] == [
            t for t, m in zip(ids, mask, strict=True) if not m
        ]
        seen.add(tuple(noisy))
    assert len(seen) > 5


def test_bpe_dropout_segments_the_same_text_in_many_ways() -> None:
    tokenizer = load_model("tiny").tokenizer
    texts = ["maybe 7", "maybe 12", "Guess my number, 1 to 8.", "higher, it's  4 to 8\n!"]
    canonical = DropoutBPE(tokenizer, 0.0, random.Random(0))
    for text in texts:
        assert canonical.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    dropout = DropoutBPE(tokenizer, 0.1, random.Random(0))
    segmentations = Counter(tuple(dropout.encode("maybe 7")) for _ in range(2000))
    assert all(tokenizer.decode(list(ids)) == "maybe 7" for ids in segmentations)
    share = segmentations[tuple(tokenizer.encode("maybe 7", add_special_tokens=False))] / 2000
    assert len(segmentations) >= 3 and 0.8 < share < 0.95, segmentations  # ~0.89
    # Seeded: the warm-up is a function of its seed.
    one, two = (DropoutBPE(tokenizer, 0.3, random.Random(1)) for _ in range(2))
    assert [one.encode("maybe 7") for _ in range(50)] == [two.encode("maybe 7") for _ in range(50)]
    with pytest.raises(ValueError, match="dropout"):
        DropoutBPE(tokenizer, 1.0, random.Random(0))


@dataclass
class Warmed:
    loaded: LoadedModel
    engine: Engine
    metrics: dict[str, float]


@pytest.fixture(scope="module")
def warmed() -> Iterator[Warmed]:
    loaded = load_model("tiny")
    # One thread: two threads on a busy 2-core machine are several times slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        metrics = warm_up(
            loaded.model, loaded.tokenizer, seed=0, **TASK["warmup_options"], **OPTIONS
        )
    finally:
        torch.set_num_threads(threads)
    engine = Engine(
        loaded.model, loaded.tokenizer, max_batch_size=64, max_context=512, num_threads=1
    )
    try:
        yield Warmed(loaded, engine, metrics)
    finally:
        engine.close()


@dataclass
class Reply:
    game: int  # the index of its game in the batch
    text: str
    token_ids: list[int]  # sampled, the final end-of-turn token left out
    canonical: bool  # token_ids == the tokenizer's encoding of text
    call: ModelCall  # as the proxy records it: prompt, every sampled id, their logprobs


def engine_ask(warmed: Warmed, game: Game, index: int, replies: list[Reply]) -> Ask:
    """``ask`` through the engine, as the inference server does it: the chat template
    rendered to text, tokenized; the reply's text without its end-of-turn token."""
    tokenizer = warmed.loaded.tokenizer

    async def ask(messages: list[Message]) -> str:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(
            max_tokens=game.max_tokens,
            temperature=game.temperature,
            seed=index * 16 + len(messages),
        )
        (choice,) = await warmed.engine.submit(prompt, params).wait()
        ids = choice.token_ids[:-1] if choice.finish_reason == "stop" else choice.token_ids
        reply = tokenizer.decode(ids, skip_special_tokens=False)
        canonical = tokenizer.encode(reply, add_special_tokens=False) == ids
        call = ModelCall(prompt, list(choice.token_ids), list(choice.logprobs))
        replies.append(Reply(index, reply, ids, canonical, call))
        return reply

    return ask


async def play_many(warmed: Warmed, games: list[Game]) -> tuple[list[Any], list[Reply]]:
    replies: list[Reply] = []
    episodes = await asyncio.gather(
        *(play(game, engine_ask(warmed, game, i, replies)) for i, game in enumerate(games))
    )
    return list(episodes), replies


def drift(replies: list[Reply]) -> str:
    return f"{sum(not r.canonical for r in replies)}/{len(replies)} replies noncanonical"


@pytest.mark.slow
def test_the_warmed_model_guesses_uniformly(warmed: Warmed) -> None:
    """First guesses at temperature 1: "maybe N", N near-uniform over the range."""
    first = Game.from_input({"target": 1, **OPTIONS, **SAMPLING, "max_turns": 1})
    _, replies = asyncio.run(play_many(warmed, [first] * SAMPLES))
    guesses = [parse_guess(r.text) for r in replies]
    low, high = OPTIONS["low"], OPTIONS["high"]
    valid = [g for g in guesses if g is not None and low <= g <= high]
    counts = Counter(valid)
    expected = len(valid) / (high - low + 1)
    chi2 = sum((counts[n] - expected) ** 2 / expected for n in range(low, high + 1))
    print(
        f"\nwarm-up {warmed.metrics}\nfirst guesses: {len(valid) / SAMPLES:.3f} valid, "
        f"chi2 {chi2:.1f}, counts {[counts[n] for n in range(low, high + 1)]}\n"
        f"retokenization drift: {drift(replies)}"
    )
    assert len(valid) >= 0.95 * SAMPLES, [g for g in guesses if g not in counts]
    assert sum(r.text.startswith("maybe ") for r in replies) >= 0.95 * SAMPLES
    assert chi2 < CHI2_BOUND, counts


@pytest.mark.slow
def test_the_warmed_model_is_a_random_player(warmed: Warmed) -> None:
    """Games at temperature 1 score like random play (1 - (7/8)^3 ≈ 0.33), and the
    guesses ignore the feedback: after "higher", the next guess is higher about as often
    as chance has it."""
    targets = [e["target"] for e in val_inputs(SAMPLES, **OPTIONS)]
    games = [Game.from_input({"target": t, **OPTIONS, **SAMPLING}) for t in targets]
    episodes, replies = asyncio.run(play_many(warmed, games))
    reward = sum(e.reward for e in episodes) / len(episodes)
    followed = [
        (after > before) == answer.startswith(HIGHER)
        for e in episodes
        for before, after, answer in zip(
            e.guesses, e.guesses[1:], [m["content"] for m in e.messages[2::2]], strict=False
        )
        if before is not None and after is not None and answer.startswith((HIGHER, LOWER))
    ]
    print(
        f"\nrandom player: reward {reward:.3f} over {len(episodes)} games; follows the "
        f"feedback {sum(followed) / len(followed):.2f} of {len(followed)} times; "
        f"{drift(replies)}"
    )
    # 400 games: one standard deviation is ~0.024. A player that follows the feedback
    # consistently scores ~0.62.
    assert 0.24 <= reward <= 0.43
    # Chance is ~0.69 on 1..8 (a guess below the target leaves more room above it); a
    # player that learned the game would be near 1.
    assert sum(followed) / len(followed) < 0.8


def test_induction_strings_are_written_twice_and_scored_on_the_repeat() -> None:
    tokens = list(range(10, 60))
    ids, attention, labels = induction_batch(random.Random(0), tokens, 4, 6)
    assert ids.shape == labels.shape == attention.shape == (4, 12)
    assert torch.equal(ids[:, :6], ids[:, 6:]) and bool(attention.all())
    assert set(ids.flatten().tolist()) <= set(tokens)
    # The first copy and the repeat's first token cannot be predicted: no loss there.
    assert bool((labels[:, :7] == -100).all()) and torch.equal(labels[:, 7:], ids[:, 7:])
    again, _, _ = induction_batch(random.Random(0), tokens, 4, 6)
    assert torch.equal(ids, again)  # a function of its generator


@pytest.mark.slow
def test_the_warmed_model_copies_but_plays_blind(warmed: Warmed) -> None:
    """The warm-up's copying phase leaves a model that repeats a random string it has
    seen (an induction head: the skill reading the feedback needs) while the game phase
    keeps it a random player (the test above): copying is a skill, not a strategy."""
    tokenizer = warmed.loaded.tokenizer
    ids, _, labels = induction_batch(random.Random(7), ordinary_tokens(tokenizer), 32, 16)
    with torch.no_grad():
        logits = warmed.loaded.model(input_ids=ids).logits
    scored = labels[:, 1:] != -100
    copied = (logits[:, :-1].argmax(-1) == ids[:, 1:])[scored].float().mean().item()
    print(f"\ncopies {copied:.3f} of the repeated tokens (warm-up {warmed.metrics})")
    assert warmed.metrics["induction_loss"] < 0.5
    assert copied > 0.9  # random weights: ~1/1500


@dataclass
class Rollouts:
    """Two-call games played by the warmed model, their calls as the proxy records them."""

    calls: list[list[ModelCall]]  # per game, in order
    replies: list[Reply]


@pytest.fixture(scope="module")
def two_call_games(warmed: Warmed) -> Rollouts:
    game = {**OPTIONS, **SAMPLING, "max_turns": 2}
    games = [Game.from_input({**game, "target": 1 + i % 8}) for i in range(GAMES)]
    _, replies = asyncio.run(play_many(warmed, games))
    calls: list[list[ModelCall]] = [[] for _ in games]
    # Each game's calls are sequential, so the replies of a game are in call order.
    for reply in replies:
        calls[reply.game].append(reply.call)
    return Rollouts(calls, replies)


def test_sampling_at_temperature_1_drifts(two_call_games: Rollouts) -> None:
    """The warm-up's BPE-dropout left real mass on noncanonical segmentations (~13%)."""
    replies = two_call_games.replies
    rate = sum(not r.canonical for r in replies) / len(replies)
    print(f"\n{drift(replies)} ({rate:.3f})")
    assert len(replies) >= 200
    assert 0.02 <= rate <= 0.40


def action_prompts(sample: Sample) -> dict[int, list[int]]:
    """The context before each call's first action token in ``sample`` (linear ones)."""
    firsts: dict[int, int] = {}
    for at, (call, action) in enumerate(zip(sample.call_index, sample.action_mask, strict=True)):
        if action:
            firsts.setdefault(call, at)
    return {call: sample.tokens[:at] for call, at in firsts.items()}


def test_drift_breaks_the_prefix_merge(two_call_games: Rollouts) -> None:
    """A noncanonical first reply comes back retokenized in the second prompt: prefix
    splits that rollout in two; independent keeps every call apart; tree packs each
    rollout in one sample. Each keeps every action under the prompt it was sampled in."""
    prefix, independent, tree = (get("merge", n) for n in ("prefix", "independent", "tree"))
    replies_by_game: dict[int, list[Reply]] = {}
    for reply in two_call_games.replies:
        replies_by_game.setdefault(reply.game, []).append(reply)
    split = 0
    for game, calls in enumerate(two_call_games.calls):
        rollout = f"r{game}"
        merged = prefix(calls, rollout, "g")
        drifted = len(calls) == 2 and not replies_by_game[game][0].canonical
        assert len(merged) == 1 + drifted
        split += drifted
        if drifted:
            assert merged[1].break_reason == BreakReason.RESPONSE_RETOKENIZED
        else:
            last = calls[-1]
            assert merged[0].tokens == last.prompt_ids + last.response_ids
        for sample in merged:
            for call, context in action_prompts(sample).items():
                assert context == calls[call].prompt_ids
        alone = independent(calls, rollout, "g")
        assert [s.tokens for s in alone] == [c.prompt_ids + c.response_ids for c in calls]
        (packed,) = tree(calls, rollout, "g")
        assert packed.num_actions == sum(len(c.response_ids) for c in calls)
        if len(calls) == 2:  # the opening prompt is stored once
            assert len(packed) < sum(len(s) for s in alone)
    print(f"\nprefix split {split} of {len(two_call_games.calls)} two-call rollouts")
    assert split >= 3
