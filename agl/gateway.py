"""``python -m agl.gateway host=127.0.0.1 port=8000 run_dir=runs/gateway``

The gateway's command, apart from its package (``agl/core/gateway/``, the library the
trainer and this command both run) because ``python -m agl.gateway`` is the public
command (the deploy manifests', ``ChildGateway``'s), and a package's ``__main__`` could
only give ``python -m agl.core.gateway``.

A host other than loopback needs a secret configured (``GatewayConfig``): without one the
gateway refuses to start, with one line and exit status 2.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import uvicorn

from agl.core.command_line import parse_or_exit
from agl.core.gateway.app import create_app
from agl.core.gateway.auth import load_admin_token
from agl.core.gateway.config import GatewayConfig, bind_refusal
from agl.core.gateway.connections import http_protocol
from agl.core.gateway.private_files import private_dir

log = logging.getLogger("agl.gateway")


def main(argv: list[str] | None = None) -> None:
    config = parse_or_exit(
        GatewayConfig, sys.argv[1:] if argv is None else argv, "agl.gateway", about=__doc__ or ""
    )
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_dir = Path(config.run_dir)
    try:
        # Its store holds the attempt keys' signing secret; its admin_token, the admin's.
        private_dir(run_dir)
    except OSError as error:
        sys.stderr.write(f"agl.gateway: cannot set up run_dir {run_dir}: {error}\n")
        raise SystemExit(2) from None
    try:
        token, source = load_admin_token(run_dir, config.admin_token_file)
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        what = "read admin_token_file" if config.admin_token_file else f"set up run_dir {run_dir}"
        sys.stderr.write(f"agl.gateway: cannot {what}: {error}\n")
        raise SystemExit(2) from None
    refusal = bind_refusal(config, source, token)
    if refusal:
        sys.stderr.write(f"agl.gateway: {refusal}\n")
        raise SystemExit(2)
    log.info(
        "gateway on http://%s:%d, store %s, admin token from %s",
        config.host,
        config.port,
        config.store_url,
        source,
    )
    uvicorn.run(
        create_app(config, token),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        loop="auto",
        http=http_protocol(config.header_timeout_s),
        timeout_graceful_shutdown=5,
        proxy_headers=False,
        server_header=False,
    )


if __name__ == "__main__":
    main()
