"""``bench/routing.py`` at the shapes it reports: the router keeps the busiest of 4 or 8
replicas within 1.25x of its fair share with the trainer's own rollout ids, where the
crc32 rendezvous it replaced gave the busiest twice its share or more."""

from __future__ import annotations

from bench.routing import REPLICAS, SHAPES, measure, report


def test_the_router_spreads_the_trainers_rollouts_where_crc32_did_not() -> None:
    rows = measure()
    print(report(rows))  # the figures, side by side (pytest -s)
    assert {(r.replicas, r.groups, r.group_size) for r in rows} == {
        (n, g, k) for n in REPLICAS for g, k in SHAPES
    }
    for row in rows:
        for ratios in (row.batch, row.churn):
            assert ratios["router"] <= 1.25, row
            assert ratios["crc32"] >= 2.0, row  # what the router before did
