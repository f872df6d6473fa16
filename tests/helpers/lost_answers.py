"""An answer a gateway recorded but never sent: a big answer to a harness that does not
read, so the answer stays inside the gateway until it dies (tests of the replay of
pending answers: tests/core/gateway/test_durability.py for one process,
test_replicas.py across replicas)."""

from __future__ import annotations

import socket

import httpx
import orjson

# More than a loopback connection's kernel buffers hold (tcp_wmem allows 4 MiB), so with
# a harness that does not read, the answer stays inside the gateway until it dies.
BIG = "x" * (8 << 20)


def vllm_answer(content: str, stream: bool = False) -> bytes:
    """vLLM's chat answer of ``content`` (unary, or its event stream), with the ids the
    proxy records."""
    ids = {"token_ids": [100, 101], "logprobs": {"content": []}}
    if not stream:
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, **ids}
        return orjson.dumps(
            {"id": "c", "choices": [{**choice, "finish_reason": "stop"}], "prompt_token_ids": [1]}
        )
    first = {
        "id": "c",
        "prompt_token_ids": [1],
        "choices": [{"index": 0, "delta": {"role": "assistant"}}],
    }
    last = {
        "id": "c",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": "stop", **ids}],
    }
    return (
        b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in (first, last)) + b"data: [DONE]\n\n"
    )


def post_and_never_read(url: str, path: str, key: str, body: bytes) -> socket.socket:
    """POST ``body`` with a tiny receive window and never read the answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def content_of(response: httpx.Response) -> str:
    """A chat answer's content, unary or streamed."""
    if response.headers["content-type"].startswith("application/json"):
        return str(response.json()["choices"][0]["message"]["content"])
    chunks = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join(orjson.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks)
