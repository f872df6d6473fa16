"""``python -m agl.serve model=tiny host=127.0.0.1 port=8001``: the embedded inference server
(``model=hf path=<folder or hub id>`` for any Hugging Face causal LM).

An OpenAI-compatible ``/v1/chat/completions`` (vLLM's token-id and logprob extensions
included) over one model, with batched generation; see ``agl.backends.inference.server``.
``python -m agl.serve --help`` prints this and the options.

The key: given one, by ``AGL_INFERENCE_KEY=<key>`` in the environment or by
``key_file=PATH`` (a file holding it), every route but ``GET /health`` needs
``Authorization: Bearer <key>``: the ``openai`` client's ``api_key``; a gateway sends it
when its own ``AGL_INFERENCE_KEY`` or ``inference_key_file`` holds it. The key is never
an option itself, since a command line is readable by every user of the machine.

Without a key it serves anyone who can connect, with a warning, as vLLM does: a server
started by hand has clients pointed at it by hand (a harness, a benchmark, a gateway),
which a key made up at start would all break, while on the loopback of one's own machine
it keeps no one out. Where other users or agents share the machine, give it a key.
Binding a host other than loopback without one is refused. ``python -m agl.train`` never
runs this server: its embedded server always requires the run's own key.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from agl.core.command_line import parse_or_exit
from agl.core.gateway.config import is_loopback
from agl.core.gateway.upstream import KEY_ENV_VAR, load_key
from agl.core.ports import check_port

log = logging.getLogger("agl.serve")


@dataclass
class ServeConfig:
    model: str = "tiny"  # tiny | smollm2 | hf
    path: str = ""  # model=hf: a model folder or a hub id
    dtype: str = "float32"  # model=hf
    chat_template: str = ""  # model=hf: a jinja file replacing the tokenizer's template
    trust_remote_code: bool = False  # model=hf
    tool_parser: str = "hermes"  # the model's tool-call format (hermes | llama3_json | none)
    host: str = "127.0.0.1"
    port: int = 8001
    max_batch_size: int = 32
    max_context: int = 0  # 0: the model's own
    cache_dir: str = ""  # converted weights (smollm2); empty: $AGL_CACHE_DIR or ~/.cache/agl
    seed: int = 0  # the tiny model's weights, and unseeded sampling
    served_name: str = ""  # the name clients use; empty: the model's name
    device: str = "auto"  # auto (cuda if present) | cpu | cuda | cuda:N
    torch_threads: int = 0  # 0: CPUs minus one (one serves HTTP), between 1 and 8
    log_level: str = "info"
    access_log: bool = False
    key_file: str = ""  # a file holding the key clients must send; else $AGL_INFERENCE_KEY

    def __post_init__(self) -> None:
        check_port(self.port)
        try:
            key = self.key  # read now: a bad key is a one-line error before the model loads
        except OSError as error:
            raise ValueError(f"key_file={self.key_file}: {error.strerror}") from None
        if key is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} (not loopback) without a key: set "
                f"{KEY_ENV_VAR} or key_file=PATH, or keep host=127.0.0.1"
            )

    @functools.cached_property
    def key(self) -> str | None:
        """What clients must send: ``key_file``'s key, else ``$AGL_INFERENCE_KEY``'s, else
        None (no key). A property, not a field, so that no repr of the config shows it."""
        return load_key(self.key_file)


def _threads(config: ServeConfig) -> int:
    if config.torch_threads > 0:
        return config.torch_threads
    # More threads than this only add synchronization for models this small.
    return min(8, max(1, (os.cpu_count() or 2) - 1))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    config = parse_or_exit(ServeConfig, args, "agl.serve", about=__doc__ or "")
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Heavy imports after the command line is checked: a typo answers at once.
    import torch

    from agl.backends.inference.engine import Engine
    from agl.backends.inference.models import ModelUnavailable, load_model
    from agl.backends.inference.pretrained import PretrainedOptions
    from agl.backends.inference.server.app import create_app
    from agl.backends.inference.server.tools import tool_parser

    parser = None if config.tool_parser == "none" else config.tool_parser
    try:
        tool_parser(parser)
        pretrained = None
        if config.model == "hf":
            pretrained = PretrainedOptions(
                path=config.path,
                dtype=config.dtype,
                chat_template=config.chat_template or None,
                trust_remote_code=config.trust_remote_code,
            )
        loaded = load_model(
            config.model,
            cache_dir=Path(config.cache_dir) if config.cache_dir else None,
            seed=config.seed,
            pretrained=pretrained,
        )
    except (ValueError, ModelUnavailable) as error:
        sys.stderr.write(f"agl.serve: {error}\n")
        raise SystemExit(2) from None
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # transformers types PreTrainedModel.to through a decorator that loses its signature
    model = loaded.model.to(device)  # type: ignore[arg-type]
    try:
        engine = Engine(
            model,
            loaded.tokenizer,
            max_batch_size=config.max_batch_size,
            max_context=config.max_context or loaded.max_context,
            seed=config.seed,
            num_threads=_threads(config) if device == "cpu" else None,
        )
    except ValueError as error:
        sys.stderr.write(f"agl.serve: {error}\n")
        raise SystemExit(2) from None
    if config.key is None:
        log.warning(
            "no key: any process that can connect may use the model; set %s or key_file=PATH "
            "to require 'Authorization: Bearer <key>'",
            KEY_ENV_VAR,
        )
    name = config.served_name or loaded.name
    log.info(
        "serving %s as %r on http://%s:%d/v1 (%s, batch %d, context %d)",
        loaded.name,
        name,
        config.host,
        config.port,
        device,
        config.max_batch_size,
        engine.max_context,
    )
    try:
        uvicorn.run(
            create_app(engine, loaded.tokenizer, name, parser, api_key=config.key),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.access_log,
            timeout_graceful_shutdown=5,
            proxy_headers=False,
            server_header=False,
        )
    finally:
        engine.close()


if __name__ == "__main__":
    main()
