"""The "random player" start: a short supervised warm-up before RL.

The tiny model's weights are random, so it would answer with random tokens and never
score. RL starts instead from a player that knows the *format* but not the game: it is
trained on synthetic transcripts, rendered with the tokenizer's chat template exactly as
the harness builds its chats, in which every assistant turn is ``"maybe N"`` with ``N``
drawn uniformly from the range (independent of the feedback) followed by the end-of-turn
token. Since the answers carry no information about the target, the best the model can
learn is to ignore the feedback and guess uniformly: random play (1 - (7/8)^3 ≈ 0.33 on
1..8 with 3 turns), which leaves RL the whole strategy to learn.

Before the games, the model learns to *copy* (an induction phase: random token strings
written twice, loss on the repeat; Olsson et al., 2022), a skill, not a strategy: a
pretrained model has it, the random tiny one does not, and RL cannot use the range the
user states without it: copying is the tiny model's bottleneck (measured on this
project's 2-core machine, the tiny config, batch 32, lr 3e-3, greedy, 64 held-out names
copied from a question into ``<search> NAME </search>``: trained on task transcripts
alone, 31% at 900 steps and a 30% plateau by 1,500; after a 600-step induction phase, 84%
at 900 task steps and 92% at 1,100). The copying is
rehearsed through the game phase, which would otherwise erase it at once; the games
still teach nothing but the format and a uniform guess.

The loss is on assistant tokens only (the reply and its end-of-turn token). The replies
are tokenized with BPE-dropout (Provilkov et al., 2020: while encoding, each applicable
merge is skipped with probability ``dropout``), everything else canonically. A pretrained
model puts real mass on noncanonical segmentations of its own text; so does the warmed
tiny model, so sampling at temperature 1 produces replies whose ids are not the
tokenizer's encoding of their text, and the harness's decode -> retokenize of the history
breaks the token prefix (the drift the merge strategies handle differently). Without it
there is no drift at all: this BPE has no multi-digit tokens, so a bare number has one
tokenization. ``"maybe"`` is canonically ``m|ay|be``, two merges that dropout can skip.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar, cast

import torch

from experiments.guess.harness import Message, feedback, opening

# Measured on 2 CPU cores (README): ~0.1 s a step under load, so ~8-10 s on an idle
# machine; after it the loss is at its floor (~0.41 per assistant token), >99.5% of the
# replies are "maybe N" with N within ~15% of 1/8, and ~13% of the sampled replies are
# noncanonical. With 100 steps the rare segmentations are under-learned (~9% drift).
STEPS = 150
BATCH_SIZE = 16  # two balanced decks of 1..8 per turn (see Deck)
LR = 5e-3
# The probability of skipping each merge in a reply. 0.1 leaves ~11% of the training
# replies noncanonical, and the warmed model samples about as many (README).
DROPOUT = 0.1
# The copying phase first (exact copying is the tiny model's bottleneck, the docstring's
# measurement: an induction phase of random strings repeated once lifted a copy task from
# 30% to 90%).
# It teaches no game: the strings are random tokens, never a chat.
INDUCTION_STEPS = 300
INDUCTION_LR = 3e-3
INDUCTION_BATCH = 16
INDUCTION_LENGTH = 16

# An assistant turn: its content and its end-of-turn token, the tokens the model learns.
_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?)(<\|im_end\|>)", re.DOTALL)
_IGNORE = -100  # the label HF's loss skips


def reply(guess: int) -> str:
    """The random player's reply: a word before the number, so that the reply has
    merges BPE-dropout can skip (the harness reads the first integer)."""
    return f"maybe {guess}"


def random_game(target: int, guesses: Sequence[int], low: int, high: int) -> list[Message]:
    """The chat the harness builds for a player making ``guesses`` (one per turn, in
    order): it ends at a hit or after the last guess (whose feedback is never sent)."""
    messages: list[Message] = [{"role": "user", "content": opening(low, high)}]
    known_low, known_high = low, high
    for guess in guesses:
        messages.append({"role": "assistant", "content": reply(guess)})
        answer, known_low, known_high = feedback(guess, target, known_low, known_high)
        if answer is None:
            break
        messages.append({"role": "user", "content": answer})
    if messages[-1]["role"] == "user":
        messages.pop()
    return messages


class Deck:
    """Uniform draws from ``[low, high]``, each value once per shuffled round.

    Every draw is uniform and independent of the game it lands in, so the transcripts
    still carry no strategy; but a batch's answers are spread evenly over the range, so
    the gradient points at the uniform player without iid sampling noise (a near-uniform
    player in fewer steps).
    """

    def __init__(self, rng: random.Random, low: int, high: int) -> None:
        self._rng = rng
        self._values = list(range(low, high + 1))
        self._left: list[int] = []

    def draw(self) -> int:
        if not self._left:
            self._left = self._values[:]
            self._rng.shuffle(self._left)
        return self._left.pop()


class DropoutBPE:
    """BPE-dropout over a byte-level BPE ``tokenizers`` model, seeded.

    The words come from the tokenizer's own pre-tokenizer; in each word, every step
    applies the best-ranked merge among those that survive a skip with probability
    ``p``, and stops when none does (Provilkov et al.'s algorithm). ``p = 0`` is the
    canonical encoding. Written here rather than ``tokenizers``' own ``dropout`` setting
    because that one draws from an unseedable thread RNG: the warm-up stays a function
    of its seed. Text with special tokens is not supported (encode them apart).
    """

    def __init__(self, tokenizer: Any, p: float, rng: random.Random) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {p}")
        backend = tokenizer.backend_tokenizer
        model = json.loads(backend.to_str())["model"]
        if model["type"] != "BPE":
            raise ValueError(f"BPE-dropout needs a BPE tokenizer, not {model['type']}")
        self.p = p
        self._rng = rng
        self._pre = backend.pre_tokenizer
        self._vocab: dict[str, int] = model["vocab"]
        merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
        self._ranks = {(a, b): rank for rank, (a, b) in enumerate(merges)}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word, _ in self._pre.pre_tokenize_str(text):
            symbols = list(word)
            while len(symbols) > 1:
                candidates = [
                    (rank, i)
                    for i, pair in enumerate(itertools.pairwise(symbols))
                    if (rank := self._ranks.get(pair)) is not None
                    and (self.p == 0.0 or self._rng.random() >= self.p)
                ]
                if not candidates:
                    break
                _, i = min(candidates)
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            ids += [self._vocab[symbol] for symbol in symbols]
        return ids


def encode_game(
    tokenizer: Any, messages: list[Message], dropout: DropoutBPE | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a 0/1 mask of its assistant tokens.

    The text is cut at assistant turns and each piece encoded alone; that must equal the
    encoding of the whole text (special tokens split the BPE), which is checked, so the
    mask is exact and the ids are the canonical tokenization. With ``dropout``, each
    assistant turn's content is then re-encoded with it (its end-of-turn token stays),
    checked to decode to the same text.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    pieces: list[tuple[str, int]] = []
    at = 0
    for match in _ASSISTANT.finditer(text):
        pieces += [(text[at : match.start(1)], 0), (match.group(1), 1), (match.group(2), 1)]
        at = match.end(2)
    pieces.append((text[at:], 0))
    # One batched call (the pieces and the whole text): per-call overhead dominates here.
    encoded = tokenizer([piece for piece, _ in pieces] + [text], add_special_tokens=False)
    *piece_ids, whole = encoded["input_ids"]
    if [token for one in piece_ids for token in one] != whole:
        raise ValueError("the chat template's turns do not tokenize independently")
    if dropout is not None:
        # A content piece is the one before an end-of-turn piece: every third from 1.
        for i in range(1, len(pieces) - 1, 3):
            ids = dropout.encode(pieces[i][0])
            if tokenizer.decode(ids, skip_special_tokens=False) != pieces[i][0]:
                raise ValueError(f"BPE-dropout changed the text {pieces[i][0]!r}")
            piece_ids[i] = ids
    ids = [token for one in piece_ids for token in one]
    mask = [label for one, (_, label) in zip(piece_ids, pieces, strict=True) for _ in one]
    return ids, mask


def _batch(
    tokenizer: Any,
    dropout: DropoutBPE,
    targets: Deck,
    turns: list[Deck],
    size: int,
    low: int,
    high: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 off the assistant turns).
    Targets and each turn's guesses come from their own decks (independent draws)."""
    games = [
        encode_game(
            tokenizer,
            random_game(targets.draw(), [deck.draw() for deck in turns], low, high),
            dropout,
        )
        for _ in range(size)
    ]
    return masked_batch(tokenizer, games)


def masked_batch(
    tokenizer: Any, rows: Sequence[tuple[list[int], list[int]]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 where a row's 0/1 mask is 0)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), _IGNORE, dtype=torch.long)
    for row, (row_ids, mask) in enumerate(rows):
        n = len(row_ids)
        ids[row, :n] = torch.tensor(row_ids)
        attention[row, :n] = 1
        labels[row, :n] = torch.where(torch.tensor(mask) == 1, ids[row, :n], _IGNORE)
    return ids, attention, labels


def assistant_loss(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of the assistant tokens. The LM head runs only where a token is
    predicted (about 1 position in 6): a third less work per step than ``labels=``."""
    hidden = model.base_model(input_ids=ids, attention_mask=attention).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != _IGNORE
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


def induction_batch(
    rng: random.Random, tokens: Sequence[int], size: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``size`` rows of ``length`` random tokens written twice, the labels on the repeat
    (its first token excepted: nothing before it says what it is). Predicting the repeat
    needs an induction head: look back for the current token, copy the one after it."""
    rows = []
    for _ in range(size):
        string = [rng.choice(tokens) for _ in range(length)]
        rows.append(string + string)
    ids = torch.tensor(rows)
    labels = ids.clone()
    labels[:, : length + 1] = _IGNORE
    return ids, torch.ones_like(ids), labels


def ordinary_tokens(tokenizer: Any) -> list[int]:
    """Every token id but the special ones."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def train_steps(
    model: torch.nn.Module, batches: Sequence[Callable[[], Batch]], steps: int, lr: float
) -> list[float]:
    """``steps`` AdamW updates on the sum of the losses of one batch of each of
    ``batches`` (a warm-up ramp over the first tenth, then a linear decay to 0, so the
    end settles instead of chasing the last batches); the first loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ramp = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / ramp, (steps - step) / (steps - ramp + 1))
    )
    device = next(model.parameters()).device
    losses: list[float] = []
    model.train()
    try:
        for _ in range(steps):
            parts = [
                assistant_loss(model, *(tensor.to(device) for tensor in batch()))
                for batch in batches
            ]
            optimizer.zero_grad(set_to_none=True)
            sum(parts).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(parts[0].detach()))
    finally:
        optimizer.zero_grad(set_to_none=True)  # the trainer starts from clean gradients
        model.eval()
    return losses


def trained(
    model: torch.nn.Module,
    batches: Sequence[Callable[[], Batch]],
    steps: int,
    lr: float,
    start: float,
) -> dict[str, float]:
    """``train_steps``, then a warm-up's figures: ``loss`` (the mean of the last 10
    steps), ``first_loss``, ``seconds`` since ``start`` (``time.perf_counter``), ``steps``."""
    losses = train_steps(model, batches, steps, lr)
    tail = losses[-10:]
    return {
        "loss": sum(tail) / len(tail),
        "first_loss": losses[0],
        "seconds": time.perf_counter() - start,
        "steps": float(steps),
    }


T = TypeVar("T")


def at_once(coroutine: Coroutine[Any, Any, T], what: str) -> T:
    """The result of ``coroutine``, which never waits (a scripted player's episode through
    a harness), run to its end without an event loop: also inside one, where the trainer
    calls the warm-up."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coroutine.close()
    raise RuntimeError(f"{what} waited on something")


def copying_phase(
    model: torch.nn.Module, tokenizer: Any, steps: int, lr: float, seed: str
) -> tuple[dict[str, float], list[Callable[[], Batch]]]:
    """``steps`` of the induction phase (none for 0); answers its ``induction_loss`` (last
    10 steps) and the batches that rehearse it through the game phase, which would
    otherwise overwrite it at once."""
    if steps <= 0:
        return {}, []
    rng = random.Random(seed)
    tokens = ordinary_tokens(tokenizer)

    def copying() -> Batch:
        return induction_batch(rng, tokens, INDUCTION_BATCH, INDUCTION_LENGTH)

    losses = train_steps(model, [copying], steps, lr)
    return {"induction_loss": sum(losses[-10:]) / len(losses[-10:])}, [copying]


def warm_up(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    steps: int = STEPS,
    batch_size: int = BATCH_SIZE,
    lr: float = LR,
    seed: int = 0,
    low: int = 1,
    high: int = 8,
    max_turns: int = 3,
    dropout: float = DROPOUT,
    induction_steps: int = INDUCTION_STEPS,
    induction_lr: float = INDUCTION_LR,
    target_weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place into a random player that can copy; answers ``loss``
    (mean of the last 10 steps, per assistant token), ``first_loss``, ``induction_loss``
    (with ``induction_steps``) and ``seconds``.

    First ``induction_steps`` of random token strings written twice (loss on the repeat):
    the tiny model learns to copy, which a pretrained model can and a random one cannot,
    and without which it reads the feedback only after hundreds of RL steps, if at all
    (README). The strings are not chats and carry no game. Then ``steps`` of games, the
    copying rehearsed alongside (the games alone would overwrite it within a few steps).

    Fresh games every step, their replies segmented with BPE-dropout ``dropout``
    (deterministic in ``seed``), AdamW with a linear decay to 0
    (the end of the run settles on the uniform answer instead of chasing the last
    batches). The model is left in eval mode. Run it before an inference engine serves
    the model (or inside the engine's ``paused()``): it changes the weights in place.

    ``target_weights`` (the house's habit) is accepted and ignored: a random player does
    not know it.
    """
    if steps < 1 or batch_size < 1 or not low <= high or max_turns < 1:
        raise ValueError("warm_up needs steps, batch_size, max_turns >= 1 and low <= high")
    start = time.perf_counter()
    metrics, rehearsal = copying_phase(
        model, tokenizer, induction_steps, induction_lr, f"guess-warmup-induction:{seed}"
    )
    rng = random.Random(f"guess-warmup:{seed}")
    targets = Deck(rng, low, high)
    turns = [Deck(rng, low, high) for _ in range(max_turns)]
    segment = DropoutBPE(tokenizer, dropout, random.Random(f"guess-warmup-dropout:{seed}"))

    def games() -> Batch:
        return _batch(tokenizer, segment, targets, turns, batch_size, low, high)

    return {**metrics, **trained(model, [games, *rehearsal], steps, lr, start)}
