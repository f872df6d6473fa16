"""``inference.weight_sync``: the trainer's weights reach vLLM over torch.distributed.

What is proved:
- a plan sends every parameter once, a tied one under each of its names, in buckets no
  larger than the bound (a larger tensor alone), at aligned offsets; packed and unpacked
  (the receiver's own code) every tensor comes back in the serving dtype;
- against two real vLLM replicas (CPU, the tiny model, gloo): after an optimizer step,
  ``publish`` writes no weights file, and each replica then serves the new policy
  version with prompt logprobs equal to the trainer's forward pass; a second step and
  publish reuse the group; switching the same servers to ``file`` rewrites the file and
  still matches;
- the errors are one line: a replica that cannot reach the trainer's store, a replica
  without agl's receiver (``file`` still reaches it), a trainer whose replicas another
  trainer took over (refused at once; its next publish rebuilds the group).

vLLM lives in its own environment: skipped where it is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from agl.backends.inference.models import LoadedModel, load_model
from agl.backends.inference.vllm import WEIGHTS_FILE, VllmOptions, VllmServers, find_vllm_python
from agl.backends.inference.weight_receiver import unpack
from agl.backends.inference.weight_sync import ALIGN, pack, plan, serving_dtype, world_of
from agl.core.ports import free_port
from tests.helpers.prompt_logprobs import LOGPROB_TOL, PROMPT, module_logprobs, served_logprobs

VLLM_MISSING = "vLLM is not installed: bash tests/vllm/install.sh (or set AGL_VLLM_PYTHON)"


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 300)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_a_plan_sends_each_storage_once_in_bounded_aligned_buckets() -> None:
    model = Tied()
    buckets = plan(model, torch.bfloat16, bucket_bytes=512)
    entries = [e for b in buckets for e in b.entries]
    assert [e.names for e in entries] == [
        ["embed.weight", "head.weight"],
        ["body.weight"],
        ["body.bias"],
    ]
    # body.weight (2400 bytes in bf16) exceeds the bound: a bucket of its own.
    assert [[e.names[0] for e in b.entries] for b in buckets] == [
        ["embed.weight"],
        ["body.weight"],
        ["body.bias"],
    ]
    assert all(b.nbytes <= 512 or len(b.entries) == 1 for b in buckets)
    assert all(e.offset % ALIGN == 0 for e in entries)
    received = {
        name: tensor
        for b in buckets
        for name, tensor in unpack(
            pack(b, torch.bfloat16, torch.device("cpu")), b.manifest(torch.bfloat16)["tensors"]
        )
    }
    expected = dict(model.named_parameters(remove_duplicate=False))
    assert received.keys() == expected.keys()
    for name, tensor in received.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].detach().to(torch.bfloat16))


def test_small_tensors_share_a_bucket() -> None:
    buckets = plan(torch.nn.Linear(3, 2), torch.float32, bucket_bytes=1024)
    assert len(buckets) == 1
    weight, bias = buckets[0].entries
    assert (weight.offset, bias.offset, buckets[0].nbytes) == (0, ALIGN, ALIGN + 8)


def test_world_of_gives_each_replica_its_ranks_after_the_trainer() -> None:
    assert world_of([1, 2, 1]) == (5, [1, 2, 4])


def test_serving_dtype_reads_vllms_names() -> None:
    model = torch.nn.Linear(2, 2)
    assert serving_dtype("auto", model) is torch.float32
    assert serving_dtype("half", model) is torch.float16
    assert serving_dtype("bfloat16", model) is torch.bfloat16
    with pytest.raises(ValueError, match="not a torch dtype"):
        serving_dtype("fp7", model)


# ------------------------------------------------------------------- against vLLM


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoadedModel, VllmServers]]:
    python = find_vllm_python()
    if python is None:
        pytest.skip(VLLM_MISSING)
    loaded = load_model("tiny")
    options = VllmOptions(python=python, replicas=2, max_model_len=256, startup_timeout_s=900)
    run_dir = tmp_path_factory.mktemp("weight-sync")
    with VllmServers(loaded.model, loaded.tokenizer, "tiny", run_dir, options, api_key=None) as s:
        yield loaded, s


def optimizer_step(model: torch.nn.Module) -> None:
    """One real step (next-token loss on the prompt, a large learning rate): every
    parameter the loss reaches moves, the embeddings and the LM head included."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.tensor([PROMPT])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def weight_info(url: str) -> str:
    return str(httpx.get(f"{url.removesuffix('/v1')}/weight_info", timeout=30).json())


def assert_serving(loaded: LoadedModel, servers: VllmServers, version: int) -> None:
    expected = module_logprobs(loaded.model)
    for url in servers.endpoints:
        diff = float((served_logprobs(url) - expected).abs().max())
        assert diff < LOGPROB_TOL, (url, diff)
        assert str(version) in weight_info(url)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_distributed_publish_writes_no_file_and_serves_the_trained_policy(
    served: tuple[LoadedModel, VllmServers],
) -> None:
    loaded, servers = served
    weights = servers.weights_dir / WEIGHTS_FILE
    written = weights.stat()
    before = module_logprobs(loaded.model)
    for version in (1, 2):
        optimizer_step(loaded.model)
        started = time.monotonic()
        servers.publish(version)
        assert time.monotonic() - started < servers.options.request_timeout_s
        assert_serving(loaded, servers, version)
    moved = float((module_logprobs(loaded.model) - before).abs().max())
    assert moved > 50 * LOGPROB_TOL  # the steps changed what a stale replica would serve
    after = weights.stat()
    assert (after.st_mtime_ns, after.st_size, after.st_ino) == (
        written.st_mtime_ns,
        written.st_size,
        written.st_ino,
    )
    assert sorted(p.name for p in servers.weights_dir.iterdir() if "safetensors" in p.name) == [
        WEIGHTS_FILE
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_same_servers_switch_to_the_file(
    served: tuple[LoadedModel, VllmServers], tmp_path: Path
) -> None:
    loaded, servers = served
    weights = servers.weights_dir / WEIGHTS_FILE
    before = weights.stat().st_mtime_ns
    optimizer_step(loaded.model)
    servers.options.weight_sync = "file"
    try:
        servers.publish(3)
    finally:
        servers.options.weight_sync = "distributed"
    assert weights.stat().st_mtime_ns != before
    assert_serving(loaded, servers, 3)
    optimizer_step(loaded.model)
    servers.publish(4)  # back on the group built before
    assert_serving(loaded, servers, 4)


@pytest.mark.slow
def test_a_replica_that_cannot_reach_the_trainer_fails_in_one_line(
    served: tuple[LoadedModel, VllmServers],
) -> None:
    """A store nobody serves (what a replica on another network sees): the join fails
    within its timeout, in one line naming the replica and the fallback; the replica keeps
    the group it had, so the next publish still reaches it."""
    loaded, servers = served
    replica = servers._replicas[0]
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        servers._join(replica, "127.0.0.1", free_port(), 1, 3, "gloo", timeout_s=3.0)
    message = str(caught.value)
    assert time.monotonic() - started < 60
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"vLLM at {replica.url}")
    assert "inference.weight_sync=file" in message
    optimizer_step(loaded.model)
    servers.publish(5)
    assert_serving(loaded, servers, 5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_replica_without_the_receiver_fails_in_one_line(tmp_path: Path) -> None:
    """A replica started without agl's extension (as an attached one may be): the first
    distributed publish fails in one line naming the flag and the fallback; ``file``
    still reaches it."""
    python = find_vllm_python()
    if python is None:
        pytest.skip(VLLM_MISSING)
    loaded = load_model("tiny")
    options = VllmOptions(
        python=python,
        max_model_len=256,
        startup_timeout_s=900,
        extra_args=["--worker-extension-cls", ""],  # the last flag wins: none
    )
    with VllmServers(loaded.model, loaded.tokenizer, "tiny", tmp_path, options, api_key=None) as s:
        with pytest.raises(RuntimeError) as caught:
            s.publish(1)
        message = str(caught.value)
        assert "\n" not in message and "Traceback" not in message
        assert "--worker-extension-cls agl_weight_receiver.WeightReceiver" in message
        assert "inference.weight_sync=file" in message
        s.options.weight_sync = "file"
        optimizer_step(loaded.model)
        s.publish(2)
        assert_serving(loaded, s, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_trainer_takes_the_replicas_over(
    served: tuple[LoadedModel, VllmServers],
) -> None:
    """Another trainer attaches to the replicas and publishes: they join its group. The
    first trainer's next publish fails at once, in one line (not at the broadcast's
    timeout); the one after builds its group again and serves its weights."""
    loaded, servers = served
    options = VllmOptions(urls=servers.endpoints, request_timeout_s=600)
    with VllmServers(
        loaded.model, loaded.tokenizer, "tiny", servers.run_dir, options, api_key=None
    ) as other:
        optimizer_step(loaded.model)
        other.publish(6)
        assert_serving(loaded, other, 6)
    optimizer_step(loaded.model)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        servers.publish(7)
    # The outcome tested: refused at once, not after the group's timeout (300 s).
    assert time.monotonic() - started < 120
    message = str(caught.value)
    assert "\n" not in message and "another trainer joined it" in message
    servers.publish(8)
    assert_serving(loaded, servers, 8)
