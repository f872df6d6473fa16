"""An attempt's model calls as the trainer reads them, numbered as they were made (``call
i`` everywhere in this tool), and how a run's merge strategy made samples of them: what
``show`` renders and ``scan --run`` flags."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agl.core.contracts.records import Event
from agl.core.contracts.samples import ModelCall
from agl.core.trainer.calls import read_calls
from agl.core.trainer.explain import Explanation, explain
from agl.core.user_error import UserError
from agl.rollouts.select import of_attempt
from agl.strategies.dedup import dedup


@dataclass(frozen=True)
class Requests:
    """An attempt's ``model_request`` events in order, numbered as they were made (``call
    i`` everywhere in this tool), and the calls the trainer reads from them."""

    events: list[Event]
    calls: list[ModelCall]  # the valid ones, before dedup
    number: dict[int, int]  # id(call) -> its call number (dedup keeps the very objects)
    left_out: dict[int, str]  # call number -> why the trainer leaves it out

    @classmethod
    def of(
        cls,
        events: Sequence[Event],
        attempt: int,
        decode: Callable[[list[int]], str] | None = None,
    ) -> Requests:
        """``decode``: the run's tokenizer, which the trainer checks ids against too."""
        requests = [e for e in of_attempt(events, attempt) if e.type == "model_request"]
        calls: list[ModelCall] = []
        number: dict[int, int] = {}
        left_out: dict[int, str] = {}
        for i, event in enumerate(requests):
            if not isinstance(event.data, dict):
                left_out[i] = "not an object"
                continue
            read = read_calls([event], decode)
            for call in read.calls:
                calls.append(call)
                number[id(call)] = i
            for reason in read.invalid:
                left_out[i] = reason
        return cls(requests, calls, number, left_out)

    def labels(self) -> dict[int, str]:
        """``call i`` per event sequence, and why it is not trained on, if it is not."""
        trained = {self.number[id(c)] for c in dedup(self.calls)}
        labels = {}
        for i, e in enumerate(self.events):
            why = f" (left out: {self.left_out[i]})" if i in self.left_out else ""
            if not why and i not in trained:
                why = " (retried: not trained)"
            labels[e.sequence] = f"call {i}{why}"
        return labels

    def explain(self, run: Any) -> Explained | str:
        """How the run's merge made samples of these calls, or why it could not."""
        try:
            x = explain(self.calls, run.merge(), run.decode_token())
        except ValueError as error:  # stitch without a tokenizer
            return f"cannot merge these calls: {error}"
        return Explained(x, [self.number[id(c)] for c in x.calls])


@dataclass(frozen=True)
class Explained:
    """An explanation and the call number of each deduplicated call it names."""

    explanation: Explanation
    numbers: list[int]


def explained(events: Sequence[Event], attempt: int, run: Any) -> Explained | str:
    return Requests.of(events, attempt, run.merge().decode).explain(run)


def load_run_folder(folder: str) -> Any:
    """The run (``agl.core.run_folder`` loads torch and the tokenizer: only when asked)."""
    from agl.core.run_folder import RunFolderError, load_run

    try:
        return load_run(folder)
    except RunFolderError as error:
        raise UserError(str(error)) from None
