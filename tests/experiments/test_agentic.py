"""The agentic game's harness (experiments/agentic): each mechanism does to the chats what
its docstring says, bad inputs get a clear error, and the merge structure the harness
alone makes (experiments/agentic/structure.py: the random player, the real tokenizer,
template, dedup and merges, no sampling noise) is what the README documents."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from fractions import Fraction

import pytest

from agl.study.spec import load_study
from experiments.agentic.baselines import TASK_CONFIG
from experiments.agentic.harness import (
    Game,
    GameInputError,
    Mechanisms,
    play,
    read_reply,
    split_reasoning,
    tool_call_text,
)
from experiments.agentic.structure import NONE, SUMMARY_CHARS, rollouts, structure
from experiments.agentic.warmup import ScriptedPlayer, transcripts
from experiments.guess.baselines import Setting, best_blind, optimal_reward, task_options

DEFAULT = Mechanisms(retry_rate=0.1, format_retries=0)


def _calls(mechanisms: Mechanisms, target: int = 8, seed: int = 0) -> list:
    player = ScriptedPlayer(random.Random(seed), 1, 8, mechanisms)
    # A player that first guesses 4 misses 8 and then gets a second turn.
    player._guesses.draw = lambda: 4  # type: ignore[method-assign]
    return transcripts(player, [Game(target=target, max_turns=2)], mechanisms, random.Random(seed))


def test_a_tool_call_is_parsed_and_sent_back_in_the_templates_layout() -> None:
    (first, text), (second, _) = _calls(dataclasses.replace(NONE, tools=True))
    assert (
        text == tool_call_text(4) == '<tool_call>{"name":"guess","arguments":{"n":4}}</tool_call>'
    )
    assistant, result = second[1], second[2]
    assert assistant["tool_calls"][0]["function"] == {"name": "guess", "arguments": '{"n": 4}'}
    assert result == {"role": "tool", "tool_call_id": "call_0", "content": "higher, 5 to 8"}
    assert first == second[:1]


def test_thinking_is_split_off_as_reasoning_and_the_reply_read_after_it() -> None:
    reasoning, content = split_reasoning("<think>\n1 to 8\n</think>\n\nmaybe 3")
    assert (reasoning, content) == ("1 to 8", "maybe 3")
    reply = read_reply(
        "<think>\n5 to 8\n</think>\n\nmaybe 6", dataclasses.replace(NONE, think=True), "c"
    )
    assert reply.guess == 6 and reply.reasoning == "5 to 8"
    (_, _), (second, _) = _calls(dataclasses.replace(NONE, think=True))
    assert second[1] == {"role": "assistant", "content": "maybe 4", "reasoning_content": "1 to 8"}
    assert second[2] == {"role": "user", "content": "higher, 5 to 8"}


def test_the_subagent_reads_the_raw_output_in_a_fresh_context_and_its_report_is_passed_on() -> None:
    (_, _), (question, report), (main, _) = _calls(dataclasses.replace(NONE, subagent=True))
    assert question == [
        {"role": "user", "content": "Tool output: Checked 4: higher. Left: 5 6 7 8. Report it."}
    ]
    assert report == "higher, 5 to 8"
    assert main[-1] == {"role": "user", "content": report}


async def _one_game(mechanisms: Mechanisms, replies: list[str]) -> tuple[list, object]:
    asked: list = []

    async def ask(messages: list, max_tokens: int) -> str:
        asked.append(messages)
        return replies.pop(0)

    episode = await play(Game(target=8, max_turns=2), mechanisms, ask, random.Random(0))
    return asked, episode


def test_a_wrong_report_misleads_the_main_agent_and_is_counted() -> None:
    asked, episode = asyncio.run(
        _one_game(dataclasses.replace(NONE, subagent=True), ["maybe 4", "lower, 1 to 3", "maybe 2"])
    )
    assert asked[2][-1] == {"role": "user", "content": "lower, 1 to 3"}
    assert episode.metrics["subagent_correct"] == 0.0 and episode.reward == 0.0


def test_past_the_budget_the_history_is_replaced_by_a_summary() -> None:
    asked, episode = asyncio.run(
        _one_game(dataclasses.replace(NONE, summary_chars=SUMMARY_CHARS), ["maybe 4", "maybe 8"])
    )
    assert asked[1] == [
        {"role": "user", "content": "Guess my number, 1 to 8. So far: 4, higher, 5 to 8."}
    ]
    assert episode.reward == 1.0 and episode.metrics["summaries"] == 1.0


def test_an_unreadable_reply_is_asked_again_then_costs_its_turn() -> None:
    mechanisms = dataclasses.replace(NONE, tools=True, format_retries=1)
    asked, episode = asyncio.run(
        _one_game(mechanisms, ["no call", "still none", tool_call_text(8)])
    )
    assert asked[0] == asked[1]  # the retry: the same request
    assert asked[2][-1] == {"role": "user", "content": "a number, please, 1 to 8"}
    assert episode.metrics["retried_calls"] == 1.0 and episode.reward == 1.0


def test_dropped_answers_are_asked_again_the_same_way_in_every_run() -> None:
    mechanisms = dataclasses.replace(NONE, retry_rate=0.9)
    runs = [asyncio.run(_one_game(mechanisms, ["maybe 4"] * 20)) for _ in range(2)]
    assert runs[0][1].metrics == runs[1][1].metrics  # type: ignore[attr-defined]
    assert runs[0][1].metrics["retried_calls"] > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"target": 3, "tools": "yes"}, "'tools' must be true or false"),
        ({"target": 3, "summary_chars": -1}, "'summary_chars' must be an integer >= 0"),
        ({"target": 3, "retry_rate": 1.0}, "'retry_rate' must be a number in \\[0, 1\\)"),
        ({"target": 3, "format_retries": True}, "'format_retries' must be an integer"),
    ],
)
def test_bad_mechanism_options_get_a_clear_error(data: dict, message: str) -> None:
    with pytest.raises(GameInputError, match=message):
        Mechanisms.from_input(data)


def test_a_malformed_tool_call_guesses_nothing() -> None:
    tools = dataclasses.replace(NONE, tools=True)
    for text in [
        "<tool_call>{bad}</tool_call>",
        '<tool_call>{"name":"guess","arguments":{"n":"4"}}</tool_call>',
        '<tool_call>{"name":"other","arguments":{"n":4}}</tool_call>',
        "maybe 4",
    ]:
        assert read_reply(text, tools, "c").guess is None
    assert json.loads(
        read_reply(tool_call_text(7), tools, "c").tool_call["function"]["arguments"]
    ) == {"n": 7}  # type: ignore[index]


# The harness alone, 200 games of the random player: the README's table, in bounds
# (the figures move with the games' targets only).
@pytest.fixture(scope="module")
def default_calls() -> list:
    return rollouts(DEFAULT, 200, seed=0)


def test_the_default_harness_splits_rollouts_as_the_paper_reports(default_calls: list) -> None:
    s = structure(default_calls, "prefix")
    assert 2.0 <= s.samples_per_rollout <= 3.0
    assert s.single_sample_rollouts <= 0.4
    assert s.calls_per_rollout > s.trained_calls_per_rollout  # retries left out
    tree = structure(default_calls, "tree")
    assert tree.samples_per_rollout == 1.0 and tree.tokens_per_unique_token == 1.0
    assert structure(default_calls, "independent").tokens_per_unique_token > 1.1


@pytest.mark.parametrize("mechanism", ["tools", "think", "summary", "subagent"])
def test_each_mechanism_alone_splits_what_nothing_splits(mechanism: str) -> None:
    options = {
        "tools": {"tools": True},
        "think": {"think": True},
        "summary": {"summary_chars": SUMMARY_CHARS},
        "subagent": {"subagent": True},
    }
    calls = rollouts(dataclasses.replace(NONE, **options[mechanism]), 100, seed=1)
    plain = structure(rollouts(NONE, 100, seed=1), "prefix")
    alone = structure(calls, "prefix")
    assert plain.samples_per_rollout == 1.0
    # Every game that reaches a second turn splits (the subagent's adds its own sample).
    assert alone.samples_per_rollout == pytest.approx(
        1 + (2 if mechanism == "subagent" else 1) * (1 - alone.single_sample_rollouts), abs=0.02
    )
    assert alone.single_sample_rollouts < 0.3


def test_the_studys_baselines_are_the_games_exact_blind_optimum() -> None:
    """The blind baselines conf/study/strategies.yaml compares against are what
    experiments.guess.baselines computes for the task's options (house and uniform)."""
    options = task_options(TASK_CONFIG)
    study = load_study("strategies")
    blind = {
        "val/reward": options["target_weights"],
        "val/uniform/reward": None,
    }
    assert {b.metric for b in study.baselines} == set(blind)
    for baseline in study.baselines:
        setting = Setting.of(
            int(options["low"]),
            int(options["high"]),
            int(options["max_turns"]),
            blind[baseline.metric],
        )
        exact, _ = best_blind(setting)
        assert baseline.value == pytest.approx(float(exact), abs=5e-5), baseline
        # Reading the feedback is worth something: the optimum is above the baseline.
        assert optimal_reward(setting) > exact


def test_figure9s_baseline_is_the_long_games_exact_blind_bound() -> None:
    """Under uniform targets a blind player wins at most one target per distinct guess:
    max_turns / size (checked exactly on a small game), so conf/study/figure9.yaml's 5/32
    is the bound for conf/task/agentic_long.yaml; binary search's 31/32 is the optimum."""
    small = Setting.of(1, 6, 3, None)
    assert best_blind(small)[0] == Fraction(3, 6)
    options = task_options(TASK_CONFIG.with_name("agentic_long.yaml"))
    assert options["target_weights"] is None
    low, high, turns = int(options["low"]), int(options["high"]), int(options["max_turns"])
    (baseline,) = load_study("figure9").baselines
    assert baseline.metric == "val/reward"
    assert baseline.value == float(Fraction(turns, high - low + 1)) == 5 / 32
    assert optimal_reward(Setting.of(low, high, turns, None)) == Fraction(31, 32)
