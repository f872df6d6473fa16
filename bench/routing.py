"""Router benchmark: how evenly the gateway's router spreads the trainer's rollouts over
inference replicas. The figure is busiest/fair: the rollouts placed on the busiest
replica over its fair share (rollouts / replicas); 1.00 is a perfect spread.

Three routers side by side, fed the trainer's own rollout ids (``t<batch>.<group>.<k>``,
``agl.core.trainer.loop``) and replicas on local ports (``http://127.0.0.1:<port>/v1``):

- crc32: the router before, rendezvous over ``zlib.crc32(f"{rollout_id}|{endpoint}")``;
- blake2b: the same rendezvous over a good hash, a multinomial spread;
- router: ``agl.core.gateway.router.Router``, least loaded at a rollout's first call, then
  sticky, forgetting a rollout when it completes.

Two shapes of work:

- batch (the synchronous trainer): a batch's rollouts all start, their first calls in a
  shuffled order, before any completes; then all complete. The worst batch of several.
- churn (the asynchronous trainer, or a controller's concurrency limit): at most one
  batch's worth running; a random running rollout completes, the next one starts. The
  worst moment once the first batch is running.

    python -m bench.routing
"""

from __future__ import annotations

import argparse
import hashlib
import random
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from agl.core.contracts.records import ModelEndpoint
from agl.core.gateway.router import Router

MODEL = "policy"
# groups_per_step x group_size of conf/swe_gpu.yaml, conf/general_gpu.yaml,
# conf/general.yaml, conf/smollm2_calc.yaml and conf/swe.yaml.
SHAPES = ((32, 8), (8, 8), (16, 8), (4, 4), (2, 4))
REPLICAS = (4, 8)


def endpoints(replicas: int, first_port: int = 8001) -> list[ModelEndpoint]:
    """``replicas`` vLLM servers on local ports, as the vLLM backend registers them."""
    return [
        ModelEndpoint(model=MODEL, endpoint=f"http://127.0.0.1:{first_port + i}/v1")
        for i in range(replicas)
    ]


def trainer_ids(batch: int, groups: int, group_size: int) -> list[str]:
    """The ids the trainer gives one training batch's rollouts."""
    return [f"t{batch}.{j}.{k}" for j in range(groups) for k in range(group_size)]


class Rendezvous:
    """Stateless rendezvous hashing: the endpoint with the highest ``weight`` for the
    rollout. Over crc32, the router before this one."""

    def __init__(self, models: Sequence[ModelEndpoint], weight: Callable[[str], int]) -> None:
        self.models = list(models)
        self.weight = weight

    def pick(self, model: object, rollout_id: str) -> ModelEndpoint:
        return max(self.models, key=lambda m: self.weight(f"{rollout_id}|{m.endpoint}"))

    def forget(self, rollout_id: str) -> None:
        """Nothing to forget: it keeps no state."""


def _crc32(key: str) -> int:
    return zlib.crc32(key.encode())


def _blake2b(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def _router(models: Sequence[ModelEndpoint]) -> Router:
    router = Router()
    router.load(list(models))
    return router


Make = Callable[[Sequence[ModelEndpoint]], Rendezvous | Router]

ROUTERS: dict[str, Make] = {
    "crc32": lambda models: Rendezvous(models, _crc32),
    "blake2b": lambda models: Rendezvous(models, _blake2b),
    "router": _router,
}


def _ratio(placed: Counter[str], replicas: int) -> float:
    return max(placed.values()) / (sum(placed.values()) / replicas)


def batch_ratio(
    make: Make,
    replicas: int,
    groups: int,
    group_size: int,
    batches: int = 10,
    seed: int = 0,
) -> float:
    """The worst busiest/fair over ``batches`` synchronous batches (see the module)."""
    router = make(endpoints(replicas))
    rng = random.Random(seed)
    worst = 0.0
    for batch in range(batches):
        ids = trainer_ids(batch, groups, group_size)
        rng.shuffle(ids)
        first = {r: router.pick(MODEL, r).endpoint for r in ids}
        # A rollout's later calls go where its first went (checked, not assumed).
        if any(router.pick(MODEL, r).endpoint != first[r] for r in ids):
            raise AssertionError(f"a rollout of batch {batch} moved between its calls")
        worst = max(worst, _ratio(Counter(first.values()), replicas))
        for r in ids:
            router.forget(r)
    return worst


def churn_ratio(
    make: Make,
    replicas: int,
    groups: int,
    group_size: int,
    completions: int = 2000,
    seed: int = 0,
) -> float:
    """The worst busiest/fair while one batch's worth of rollouts runs and they complete
    in a random order (see the module)."""
    router = make(endpoints(replicas))
    rng = random.Random(seed)
    running: dict[str, str] = {}
    ids = _endless_ids(groups, group_size)
    worst = 0.0
    width = groups * group_size
    for _ in range(completions):
        while len(running) < width:
            r = next(ids)
            running[r] = router.pick(MODEL, r).endpoint
        worst = max(worst, _ratio(Counter(running.values()), replicas))
        done = rng.choice(list(running))
        del running[done]
        router.forget(done)
    return worst


def _endless_ids(groups: int, group_size: int) -> Iterator[str]:
    batch = 0
    while True:
        yield from trainer_ids(batch, groups, group_size)
        batch += 1


@dataclass(frozen=True)
class Row:
    replicas: int
    groups: int
    group_size: int
    batch: dict[str, float]  # router name -> worst busiest/fair
    churn: dict[str, float]


def measure(
    shapes: Sequence[tuple[int, int]] = SHAPES,
    replicas: Sequence[int] = REPLICAS,
    seed: int = 0,
) -> list[Row]:
    """busiest/fair for each router, replica count and batch shape, in one run."""
    return [
        Row(
            n,
            groups,
            size,
            {name: batch_ratio(make, n, groups, size, seed=seed) for name, make in ROUTERS.items()},
            {name: churn_ratio(make, n, groups, size, seed=seed) for name, make in ROUTERS.items()},
        )
        for n in replicas
        for groups, size in shapes
    ]


def report(rows: Sequence[Row]) -> str:
    names = list(ROUTERS)
    head = ["replicas", "groups x size", *(f"batch {n}" for n in names)]
    head += [f"churn {n}" for n in names]
    lines = [
        "Busiest replica / fair share, the trainer's rollout ids (worst batch of 10; worst"
        " moment of 2000 completions)",
        "  ".join(f"{h:>13}" for h in head),
    ]
    for row in rows:
        cells = [str(row.replicas), f"{row.groups} x {row.group_size}"]
        cells += [f"{row.batch[n]:.2f}" for n in names] + [f"{row.churn[n]:.2f}" for n in names]
        lines.append("  ".join(f"{c:>13}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(report(measure(seed=args.seed)))


if __name__ == "__main__":
    main()
