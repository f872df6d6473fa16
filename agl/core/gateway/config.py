"""The gateway's options (``python -m agl.gateway key=value ...``) and its bind policy:
loopback unless a secret was configured for the network."""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from agl.core.gateway.upstream import load_key
from agl.core.ports import check_port

MIN_SECRET_CHARS = 16


@dataclass
class GatewayConfig:
    """Options of ``python -m agl.gateway key=value ...``.

    ``host`` is loopback unless told otherwise. Binding anything else (``0.0.0.0``,
    ``::``, a LAN address, a host name other than ``localhost``) needs *a secret
    configured*: an admin token given explicitly, by ``AGL_ADMIN_TOKEN`` or by
    ``admin_token_file`` (say a mounted Secret), of at least 16 characters. The token
    the gateway makes for itself in ``run_dir/admin_token`` is fine on loopback, but
    nobody chose it for a network, so it does not count. The attempt keys' signing
    secret needs no setting: it is 32 random bytes made once and kept in the store (the
    same store, the same keys after a restart), never derived from the admin token.

    ``attempt_rps`` / ``attempt_burst``: a token bucket per attempt key over everything
    that key can call (proxy, events, reading its rollout, finishing its attempt); a call
    over it gets 429 with ``Retry-After``. ``attempt_rps=0`` turns the limit off. The
    admin token is never limited. An event batch counts as its number of events, and
    one POST holds at most ``max_events_per_post`` of them (413 past it, nothing stored),
    so no request holds the event loop for long.

    ``header_timeout_s`` / ``body_timeout_s``: a request whose headers are not all in
    that long after its first byte (or the connection's opening), or whose body goes that
    long without a byte while the gateway reads it, gets 408 and its connection closed
    (:mod:`agl.core.gateway.connections`). ``refusal_delay_s``: how late a 401, 403, 413 or 429
    is answered (0: at once), so that refusals cost a client time, not the gateway CPU.

    ``inference_key_file``: a file holding the key sent to every inference endpoint as
    ``Authorization: Bearer`` (:mod:`agl.core.gateway.upstream`); without it the key is
    ``$AGL_INFERENCE_KEY``, and without that none is sent. There is no option for the key
    itself: a command line is readable by every user of the machine.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    run_dir: str = "runs/gateway"
    # The store: sqlite:///path or a path (embedded, one process; default
    # run_dir/gateway.db), or postgresql://user@host:port/db, shared by replicas.
    store: str = ""
    max_body_mb: float = 32.0
    # All request bodies in flight together (BodyLimit): past it a chunk gets 503.
    max_buffered_mb: float = 256.0
    upstream_retries: int = 3
    upstream_backoff_s: float = 0.1
    upstream_timeout_s: float = 600.0
    sweep_interval_s: float = 1.0
    fsync: bool = False  # also survive power loss, not only kill -9 (an fsync per commit)
    access_log: bool = False
    log_level: str = "info"
    admin_token_file: str = ""  # read the admin token from this file instead
    attempt_rps: float = 50.0  # calls per second per attempt key, sustained (0: no limit)
    attempt_burst: int = 100  # calls per attempt key above the rate before 429s start
    max_events_per_post: int = 1000
    # The run folder the viewer (/ui) reads: config (merge, advantage, tokenizer) and
    # agent logs. Default: run_dir's parent when it holds a config.yaml.
    ui_run: str = ""
    ui_session_hours: float = 12.0  # a viewer login lasts this long (then log in again)
    header_timeout_s: float = 10.0
    # A stalled body holds its connection this long, then its 408 (issue 43 asks for
    # at most ~15 s); an honest client's body never pauses that long mid-way.
    body_timeout_s: float = 10.0
    # A refusal (401, 403, 413, 429) is answered this late (agl/core/gateway/connections.py,
    # RefusalDelay): a client looping on refusals waits instead of taking the CPU.
    refusal_delay_s: float = 1.0
    # FastAPI's /docs and /redoc: off by default, because they load Swagger UI's and
    # ReDoc's scripts from a CDN onto the gateway's origin. /openapi.json is always served.
    api_docs: bool = False
    # Each request without a ``seed`` of its own gets one derived from this seed, its
    # rollout, attempt and bytes (agl/core/gateway/seeding.py): the same seed gives the
    # same rollouts. -1: off (the engine's own, shared generator samples them).
    sampling_seed: int = -1
    inference_key_file: str = ""
    # Memory (per process) for each running attempt's recent calls, which a call that
    # extends one is parsed, checked and stored against (agl/core/gateway/prompt_chain.py).
    # An attempt dropped from it stores its next call whole. 0: every call stored whole.
    prompt_cache_mb: float = 256.0
    # The store's password, for a postgresql:// store (a mounted Secret); without it,
    # $AGL_STORE_PASSWORD. Never in the URL: a command line is readable by every user.
    store_password_file: str = ""
    # Replicas sharing a PostgreSQL store (agl/core/gateway/replicas.py): each says it
    # is alive every replica_heartbeat_s; one silent for replica_lease_s is dead (its
    # pending answers are replayed by the others, admission stops waiting for it).
    replica_heartbeat_s: float = 1.0
    replica_lease_s: float = 5.0

    def __post_init__(self) -> None:
        check_port(self.port)
        try:
            # Read now: a bad key is a one-line error before the gateway starts (a
            # ValueError names its source already).
            self.inference_key  # noqa: B018
        except OSError as error:
            raise ValueError(
                f"inference_key_file={self.inference_key_file}: {error.strerror}"
            ) from None
        for name in ("ui_session_hours", "header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.sampling_seed < -1:
            raise ValueError(f"sampling_seed={self.sampling_seed}: a seed >= 0, or -1 for off")
        if self.refusal_delay_s < 0:
            raise ValueError(f"refusal_delay_s={self.refusal_delay_s} must be 0 (off) or more")
        if self.prompt_cache_mb < 0:
            raise ValueError(f"prompt_cache_mb={self.prompt_cache_mb} must be 0 (off) or more")
        if not 0 < self.replica_heartbeat_s < self.replica_lease_s:
            raise ValueError(
                f"replica_heartbeat_s={self.replica_heartbeat_s} must be positive and less "
                f"than replica_lease_s={self.replica_lease_s} (a live replica beats within it)"
            )
        if self.max_body_mb <= 0:
            raise ValueError(f"max_body_mb={self.max_body_mb} must be positive")
        if self.max_buffered_mb < self.max_body_mb:
            raise ValueError(
                f"max_buffered_mb={self.max_buffered_mb} must be at least max_body_mb "
                f"({self.max_body_mb}): one body must fit"
            )
        if self.attempt_rps < 0:
            raise ValueError(f"attempt_rps={self.attempt_rps} must be 0 (no limit) or positive")
        if self.attempt_burst < 1:
            raise ValueError(f"attempt_burst={self.attempt_burst} must be at least 1")
        if self.max_events_per_post < 1:
            raise ValueError(f"max_events_per_post={self.max_events_per_post} must be at least 1")

    @functools.cached_property
    def inference_key(self) -> str | None:
        """The key sent upstream: ``inference_key_file``'s, else ``$AGL_INFERENCE_KEY``'s,
        else None. A property, not a field, so that no repr or log of the config shows it."""
        return load_key(self.inference_key_file)

    @property
    def store_url(self) -> str:
        return self.store or str(Path(self.run_dir) / "gateway.db")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the gateway on this machine. A host name other than
    ``localhost`` is not trusted to resolve to loopback."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(config: GatewayConfig, token_source: str, token: str) -> str | None:
    """Why the gateway must not start on ``config.host`` with this admin token, or None."""
    if is_loopback(config.host):
        return None
    if token_source not in ("AGL_ADMIN_TOKEN", "admin_token_file"):
        return (
            f"refusing to listen on {config.host} (not loopback) without a secret configured: "
            "set AGL_ADMIN_TOKEN or admin_token_file=PATH (e.g. `openssl rand -hex 32`), "
            "or keep host=127.0.0.1"
        )
    if len(token) < MIN_SECRET_CHARS:
        return (
            f"refusing to listen on {config.host} (not loopback): the admin token from "
            f"{token_source} has {len(token)} characters, fewer than {MIN_SECRET_CHARS} "
            "(make one with `openssl rand -hex 32`)"
        )
    return None
