"""``bench/engines.py``'s training part, small: TorchBackend vs verl (1 rank, in-process)
on 4 synthetic samples, one warm-up and one step each. It checks that the benchmark runs
and reports, not how fast anything is (no timing assertions). Skipped without verl."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: pip install --no-deps verl==0.9.1")
pytest.importorskip("peft", reason="verl's FSDP engine imports peft: pip install -e '.[verl]'")

from agl.backends.inference.models import load_model
from bench.engines import measure_training, synthetic_batch, train_table


def test_synthetic_samples_carry_the_models_logprobs_on_responses_only() -> None:
    samples, advantages = synthetic_batch(load_model("tiny"), samples=4, group_size=2)
    assert len(samples) == len(advantages) == 4
    assert {s.group_id for s in samples} == {"g0", "g1"}
    for s in samples:
        assert 192 <= len(s) <= 384
        assert all((lp < 0) == bool(a) for lp, a in zip(s.logprobs, s.action_mask, strict=True))
    for g in ("g0", "g1"):  # group-normalized: each group's advantages sum to 0
        assert (
            abs(sum(a for s, a in zip(samples, advantages, strict=True) if s.group_id == g)) < 1e-6
        )


@pytest.mark.timeout(300)
def test_training_part_runs_torch_and_verl_on_one_batch() -> None:
    run = measure_training(("torch", "verl"), samples=4, group_size=2, reps=1)
    assert set(run.step_s) == {"torch", "verl"}
    assert all(len(t) == 1 and t[0] > 0 for t in run.step_s.values())
    assert run.samples == 4 and run.tokens > 0
    text = train_table(run)
    assert "vs torch" in text and "1.00x" in text  # torch's own ratio
