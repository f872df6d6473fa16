"""What a refused client may cost the gateway (issue 18's hostile soak): a refusal is
answered late while honest calls go on, and an upload refused before it was read whole
is not read on (its answer closes the connection)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agl.testing.processes import GatewayProcess, gateway_process
from tests.helpers.raw_http import connect, head, status, until_closed

TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
DELAY_S = 10.0  # long enough that six honest calls beat it on the busiest machine


@pytest.fixture(scope="module")
def delaying(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    run_dir = tmp_path_factory.mktemp("refusals")
    with gateway_process(run_dir, token=TOKEN, refusal_delay_s=DELAY_S) as gateway:
        yield gateway


@pytest.mark.slow
def test_a_refusal_waits_while_the_gateway_serves_others(delaying: GatewayProcess) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=delaying.url, timeout=60) as http:
            refused_at: list[float] = []
            served_at: list[float] = []
            started = time.monotonic()

            async def refused() -> None:
                answer = await http.get("/api/rollouts", headers={"Authorization": "Bearer x"})
                assert answer.status_code == 401
                assert answer.json()["error"]["type"] == "authentication_error"
                refused_at.append(time.monotonic())

            async def served() -> None:
                await asyncio.sleep(0.2)  # the refusals are in first
                for _ in range(5):
                    answer = await http.get("/healthz")
                    assert answer.status_code == 200
                # A 404 is an honest client's question (a poll for what is not there
                # yet), not a refusal: answered at once too.
                missing = await http.get("/api/rollouts/no-such", headers=ADMIN)
                assert missing.status_code == 404
                served_at.append(time.monotonic())

            await asyncio.gather(*(refused() for _ in range(20)), served())
            # Held back, not worked on: twenty refusals at once all wait their delay, and
            # the calls started after them (and not refused) are through before any.
            assert min(refused_at) - started >= DELAY_S
            assert served_at[0] < min(refused_at)

    asyncio.run(main())


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    run_dir = tmp_path_factory.mktemp("unread")
    with gateway_process(run_dir, token=TOKEN, max_body_mb=1) as gateway:
        yield gateway


def _refused_upload(gateway: GatewayProcess, announce: str, sent: bytes) -> bytes:
    sock = connect(gateway)
    path = "/api/rollouts/r/attempt/1/events"
    sock.sendall(head("POST", path, "Authorization: Bearer agl-not.a-key", announce) + sent)
    return until_closed(sock)  # fails unless the gateway closes the connection


def test_a_big_upload_refused_unread_closes_its_connection(prompt: GatewayProcess) -> None:
    # Announced at 512 KiB, refused (401) on its head: the rest is never read.
    answer = _refused_upload(prompt, f"Content-Length: {512 * 1024}", b"[")
    assert status(answer) == 401 and b"connection: close" in answer.lower()
    # Streamed without a length: the same.
    answer = _refused_upload(prompt, "Transfer-Encoding: chunked", b"1\r\n[\r\n")
    assert status(answer) == 401 and b"connection: close" in answer.lower()


def test_a_small_refused_body_keeps_its_connection(prompt: GatewayProcess) -> None:
    """A small rest is discarded as it comes: the client's next request on the same
    connection is answered."""
    body = b"[" + b" " * 1000 + b"]"
    first = head(
        "POST",
        "/api/rollouts/r/attempt/1/events",
        "Authorization: Bearer agl-not.a-key",
        f"Content-Length: {len(body)}",
    )
    with connect(prompt) as sock:
        sock.sendall(first + body + head("GET", "/healthz"))
        received = b""
        while received.count(b"HTTP/1.1 ") < 2 or not received.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, f"closed after {received!r}"
            received += chunk
    assert status(received) == 401
    assert b"HTTP/1.1 200" in received


def test_an_upload_over_the_limit_closes_and_frees_its_budget(prompt: GatewayProcess) -> None:
    """Refused mid-stream (413 past 1 MiB): the connection closes, and what it held is
    let go, so the next upload of the same size fits the budget again."""
    for _ in range(3):
        sock = connect(prompt)
        sock.sendall(
            head(
                "POST",
                "/api/rollouts",
                f"Authorization: Bearer {TOKEN}",
                "Transfer-Encoding: chunked",
            )
        )
        chunk = b"x" * 65536
        try:
            for _ in range(40):  # 2.5 MiB, past the 1 MiB limit
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while we still sent: the answer is in the socket's buffer
        answer = until_closed(sock)
        assert status(answer) == 413, answer[:200]
    assert httpx.get(f"{prompt.url}/api/rollouts", headers=ADMIN).status_code == 200


def test_refusal_delay_must_not_be_negative(tmp_path: Path) -> None:
    from agl.core.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="refusal_delay_s"):
        GatewayConfig(run_dir=str(tmp_path), refusal_delay_s=-1)
