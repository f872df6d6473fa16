"""The learning-rate schedule (``agl/backends/training/lr_schedule.py``): verl's formulas,
once per training step, kept across a checkpoint, in the torch backend as in verl's."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.backends.training.lr_schedule import LrSchedule
from agl.backends.training.torch import TorchBackend, TorchBackendConfig
from tests.helpers.torch_models import make_model, random_batch, token_mean

schedules = st.builds(
    LrSchedule,
    lr_scheduler_type=st.sampled_from(["constant", "cosine", "wsd"]),
    lr_warmup_steps_ratio=st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),
    min_lr_ratio=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    lr_stable_ratio=st.sampled_from([0.0, 0.5, 2 / 3, 0.9, 1.0]),
    total_training_steps=st.integers(1, 200),
)


def factors(schedule: LrSchedule) -> list[float]:
    return [schedule.lr_factor(s) for s in range(schedule.total_training_steps + 1)]


@given(schedules)
def test_the_factor_is_between_zero_and_one(schedule: LrSchedule) -> None:
    assert all(0.0 <= f <= 1.0 for f in factors(schedule))


@given(schedules)
def test_constant_is_one_after_the_warmup(schedule: LrSchedule) -> None:
    schedule.lr_scheduler_type = "constant"
    after = factors(schedule)[schedule.warmup_steps :]
    assert after == [1.0] * len(after)


@given(schedules, st.sampled_from(["cosine", "wsd"]))
def test_a_decay_never_rises_after_the_warmup_and_ends_at_the_floor(
    schedule: LrSchedule, kind: str
) -> None:
    schedule.lr_scheduler_type = kind
    after = factors(schedule)[schedule.warmup_steps :]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(after))
    if schedule.warmup_steps < schedule.total_training_steps:
        assert after[-1] == pytest.approx(schedule.min_lr_ratio)


@given(schedules)
def test_wsd_holds_the_full_rate_through_its_stable_phase(schedule: LrSchedule) -> None:
    schedule.lr_scheduler_type = "wsd"
    warmup = schedule.warmup_steps
    stable = int((schedule.total_training_steps - warmup) * schedule.lr_stable_ratio)
    assert factors(schedule)[warmup : warmup + stable] == [1.0] * stable


@settings(deadline=None)  # the first example imports verl
@given(schedules)
def test_the_factor_is_verls(schedule: LrSchedule) -> None:
    """verl's own LambdaLR builders (as its FSDP engine calls them) give the same factors."""
    tf = pytest.importorskip("verl.utils.torch_functional")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if schedule.lr_scheduler_type == "constant":
        verl = tf.get_constant_schedule_with_warmup(optimizer, schedule.warmup_steps)
    elif schedule.lr_scheduler_type == "wsd":
        verl = tf.get_wsd_schedule_with_warmup(
            optimizer,
            num_warmup_steps=schedule.warmup_steps,
            num_training_steps=schedule.total_training_steps,
            min_lr_ratio=schedule.min_lr_ratio,
            stable_ratio=schedule.lr_stable_ratio,
        )
    else:
        verl = tf.get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=schedule.warmup_steps,
            num_training_steps=schedule.total_training_steps,
            min_lr_ratio=schedule.min_lr_ratio,
        )
    expected = [verl.lr_lambdas[0](s) for s in range(schedule.total_training_steps + 1)]
    assert factors(schedule) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr_scheduler_type": "linear"}, "lr_scheduler_type must be one of constant, cosine, wsd"),
        ({"lr_stable_ratio": 2.0}, "lr_stable_ratio must be in [0, 1]"),
        ({"lr_warmup_steps_ratio": 1.5}, "lr_warmup_steps_ratio must be in [0, 1]"),
        ({"min_lr_ratio": -0.1}, "min_lr_ratio must be in [0, 1]"),
        ({"lr_scheduler_type": "cosine"}, "needs total_training_steps >= 1"),
        ({"lr_warmup_steps_ratio": 0.1}, "needs total_training_steps >= 1"),
    ],
)
def test_a_bad_schedule_is_refused_by_name(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TorchBackendConfig(**options)  # type: ignore[arg-type]


def test_the_guards_are_still_checked_beside_the_schedule() -> None:
    with pytest.raises(ValueError, match="kl_type must be one of"):
        TorchBackendConfig(kl_type="k9", lr_scheduler_type="cosine", total_training_steps=3)


def test_the_torch_backend_steps_the_schedule_once_per_train_call() -> None:
    """Each train() uses factor(step) for all its mini-batches and reports that lr; a
    snapshot taken mid-run resumes the schedule where it was."""
    torch.set_num_threads(1)
    config = TorchBackendConfig(
        lr=1e-2,
        num_mini_batches=2,
        lr_scheduler_type="cosine",
        lr_warmup_steps_ratio=0.25,
        min_lr_ratio=0.1,
        total_training_steps=8,
    )
    backend = TorchBackend(make_model(seed=4), config)
    rng = random.Random(0)
    seen: list[float] = []
    step = backend.optimizer.step

    def recording_step(*args: object, **kwargs: object) -> object:
        seen.append(backend.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    backend.optimizer.step = recording_step  # type: ignore[method-assign]
    reported = []
    for _ in range(5):
        batch = random_batch(rng, rollouts=4)
        reported.append(backend.train(batch, [1.0] * len(batch), token_mean)["lr"])
        if len(reported) == 3:
            state = backend.state_dict()
    expected = [1e-2 * config.lr_factor(s) for s in range(5)]
    assert reported == pytest.approx(expected)
    assert expected[0] == 0.0 and expected[2] == pytest.approx(1e-2)  # warm-up of 2 steps
    # both mini-batches of a step stepped at the step's lr (a step at lr 0 still steps)
    assert seen == pytest.approx([lr for lr in expected for _ in range(2)])

    other = TorchBackend(make_model(seed=5), config)
    other.load_state_dict(state)
    batch = random_batch(rng, rollouts=4)
    assert other.train(batch, [1.0] * len(batch), token_mean)["lr"] == pytest.approx(expected[3])
    assert math.isclose(other.optimizer.param_groups[0]["lr"], 1e-2 * config.lr_factor(4))
