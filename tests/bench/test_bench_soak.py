"""``bench/soak.py``'s hostile mode in miniature: a few honest agents, alone and then beside
attackers, on a real gateway killed -9 half-way. It checks what must hold under attack
(nothing acknowledged lost, nothing recorded twice, no forged reward or status stored,
every forging attack refused, no 5xx), not how fast anything is."""

from __future__ import annotations

import pytest

from bench.attacks import ATTACKS, MUST_REFUSE
from bench.soak import Settings, comparison, measure, refused, server_errors


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hostile_soak_loses_nothing_and_refuses_every_forged_reward() -> None:
    quiet, hostile = measure(
        [Settings(honest=4, calls=6), Settings(honest=4, calls=6, attackers=2, hold_s=0.5)],
        fail_rate=0.0,
    )
    for run in (quiet, hostile):
        assert run["answered"] == run["made"] == 24, run
        assert run["answered_not_recorded"] == 0 and run["events_lost"] == 0, run
        assert run["duplicates"] == 0, run
        assert run["forged_landed"] == 0, run
    attacks = hostile["attacks"]
    assert quiet["attacks"] == {} and set(attacks) == set(ATTACKS)
    for kind in MUST_REFUSE:  # answered by a gateway at least once, not only around the kill
        assert any(outcome.startswith("4") for outcome in attacks[kind]), (kind, attacks[kind])
    assert refused(attacks) == dict.fromkeys(sorted(MUST_REFUSE), 0), attacks
    assert server_errors(attacks) == 0, attacks
    assert quiet["p99_steady_ms"] > 0 and hostile["restart_s"] > 0
    report = "\n".join(comparison([quiet], [hostile]))
    assert "hostile/quiet" in report and "reward_model_key" in report
