"""The embedded inference server: an OpenAI-compatible chat endpoint over ``Engine``.

It speaks vLLM's dialect, so the gateway's recording proxy treats it exactly like vLLM:
asked for ``logprobs`` and ``return_token_ids``, an answer carries ``prompt_token_ids`` at
the top, ``token_ids`` and ``logprobs.content[].logprob`` on each choice, and the same
fields chunk by chunk when streaming.

``POST /v1/completions`` (text completions) follows vLLM too: one prompt, a string or a
list of token ids; ``logprobs`` is an integer and comes back completions-style
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``); ``return_token_ids``
puts ``prompt_token_ids`` and ``token_ids`` on each choice (in a stream, a choice's first
chunk carries its ``prompt_token_ids``). ``POST /tokenize`` counts a prompt as vLLM's does.

Text and tokens follow vLLM's conventions:
- the prompt is the tokenizer's chat template rendered to text and tokenized without
  added special tokens;
- ``token_ids`` is everything sampled, the final eos included; the text leaves the eos out
  (special tokens such as ``<tool_call>`` stay in the text: the tool parser needs them);
- a stop string ends the text before it, while ``token_ids`` keeps the tokens sampled up
  to the one that completed it (so those ids decode to the text plus the stop string);
- tool calls (``<tool_call>{json}</tool_call>``, the Hermes/Qwen format) become
  ``message.tool_calls``, their arguments re-serialized with ``json.dumps``: the text a
  harness sends back next turn is therefore not the text the model sampled, one of the
  drift sources agl studies, left visible on purpose. Malformed tool JSON stays content.
  ``tool_choice`` ``required`` or a named function is accepted but not enforced (no
  guided decoding): the model is free to answer in text.

Every route but ``GET /health`` needs the inference key, ``Authorization: Bearer <key>``,
when the app is given one (``agl.backends.inference.guard``): the trainer's server always is.

The modules, from the wire inwards (each imports only those below it):

- ``app``: ``create_app``, the routes, the error handlers and the key's guard;
- ``chat``, ``completions``, ``model_info``: the endpoints;
- ``streaming``: a generation as a server-sent event stream;
- ``responses``: JSON answers, the policy-version header, token usage;
- ``prompts``: a request's prompt ids, and the room the context leaves them;
- ``requests``: reading and validating request bodies;
- ``text``: one choice's text as its tokens arrive (stop strings, what a stream may show);
- ``tokens``: the tokenizer, and incremental detokenization;
- ``tools``: tool-call blocks in the sampled text to ``tool_calls``.

This ``__init__`` imports none of them: importing ``tools`` alone (a parser) should not
load Starlette.
"""
