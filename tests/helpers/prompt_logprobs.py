"""One prompt's logprobs as a vLLM replica serves them and as the trainer's module computes
them: the check that a replica serves the weights the trainer holds after a publish."""

from __future__ import annotations

import httpx
import torch

LOGPROB_TOL = 2e-3  # test_vllm.py's: float32 kernels differ by ~1e-5
PROMPT = [1, 5, 9, 2, 7, 3, 8, 4, 6, 10, 11, 12]


def served_logprobs(url: str, model: str = "tiny") -> torch.Tensor:
    """log p(PROMPT[i] | PROMPT[:i]) as the replica at ``url`` computes it."""
    answer = httpx.post(
        f"{url}/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text[:500]
    rows = answer.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor(
        [row[str(token)]["logprob"] for row, token in zip(rows, PROMPT[1:], strict=True)]
    )


@torch.no_grad()
def module_logprobs(model: torch.nn.Module) -> torch.Tensor:
    """The same logprobs from ``model``'s teacher-forced forward pass."""
    logits = model(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
