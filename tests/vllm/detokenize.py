"""Run in vLLM's environment: the text vLLM's own detokenizer makes of sampled ids.

Reads ``{"tokenizer": folder, "cases": [...]}`` as JSON on stdin, each case
``{"prompt_ids", "response_ids", "stops", "rule": {three TextRule fields}, "eos_stop"}``
(``eos_stop``: the engine stopped on the last id, an eos), and writes one JSON list of
``{"text", "stop_reason", "kept"}`` (``kept``: how many ids vLLM keeps) to stdout.
The ids go through ``IncrementalDetokenizer.from_new_request`` one at a time, as vLLM's
output processor feeds them, so this is vLLM's text, not a re-implementation of it.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from vllm.sampling_params import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.v1.engine.detokenizer import IncrementalDetokenizer


def main() -> None:
    job = json.load(sys.stdin)
    tokenizer = get_tokenizer(job["tokenizer"])
    out = []
    for i, case in enumerate(job["cases"]):
        params = SamplingParams(
            stop=case["stops"] or None, max_tokens=len(case["response_ids"]), **case["rule"]
        )
        request = SimpleNamespace(
            request_id=str(i),
            prompt_token_ids=case["prompt_ids"],
            prompt_embeds=None,
            sampling_params=params,
        )
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        ids = case["response_ids"]
        stop = None
        for k, token in enumerate(ids):
            stop = detokenizer.update([token], case["eos_stop"] and k == len(ids) - 1)
            if stop is not None:
                break
        out.append(
            {
                "text": detokenizer.get_next_output_text(finished=True, delta=False),
                "stop_reason": stop,
                "kept": len(detokenizer.output_token_ids),
            }
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
