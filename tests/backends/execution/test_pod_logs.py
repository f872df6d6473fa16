"""Reading a pod's log as the Kubernetes executor keeps it (``pod_logs``), and the test
kubelet's answer to ``tailLines`` / ``limitBytes`` (``agl.testing.k8s.kubelet``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agl.backends.execution.k8s.pod_logs import container_reason, keep_tail, pod_containers
from agl.testing.k8s.kubelet import select

lines = st.lists(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"), max_size=30),
    max_size=60,
)


@given(lines, st.integers(1, 400))
def test_the_kept_tail_fits_starts_at_a_line_and_is_the_end(parts: list[str], cap: int) -> None:
    data = "".join(p + "\n" for p in parts).encode()
    text, truncated = keep_tail(data, cap)
    assert truncated == (len(data) > cap)
    assert len(text.encode()) <= cap or not truncated
    assert data.decode("utf-8", "replace").endswith(text)
    if truncated and text:
        # It starts where a line did (or is the cut end of one overlong line).
        kept = data[len(data) - len(text.encode()) :]
        assert data[: len(data) - len(kept)].endswith(b"\n") or "\n" not in text[:-1]


def test_a_log_sent_in_part_is_marked_cut() -> None:
    assert keep_tail(b"a\nb\n", 100, more_lines=True) == ("a\nb\n", True)


def test_how_a_container_ended() -> None:
    assert container_reason({"terminated": {"reason": "Error", "exitCode": 3}}) == (
        "Error, exit code 3"
    )
    assert container_reason(
        {"terminated": {"reason": "StartError", "exitCode": 128, "message": "no such file"}}
    ) == ("StartError, exit code 128: no such file")
    assert container_reason({"waiting": {"reason": "ImagePullBackOff"}}) == (
        "waiting: ImagePullBackOff"
    )
    assert container_reason({"running": {}}) == "running"
    assert container_reason(None) is None


def test_init_containers_come_first_each_with_its_state() -> None:
    pod = {
        "spec": {"initContainers": [{"name": "harness"}], "containers": [{"name": "grader"}]},
        "status": {
            "initContainerStatuses": [
                {"name": "harness", "state": {"terminated": {"reason": "Completed", "exitCode": 0}}}
            ],
            "containerStatuses": [],
        },
    }
    assert pod_containers(pod) == [("harness", "Completed, exit code 0"), ("grader", None)]


@given(lines, st.one_of(st.none(), st.integers(0, 80)), st.one_of(st.none(), st.integers(0, 900)))
def test_the_kubelet_sends_the_last_lines_then_the_first_bytes_of_them(
    parts: list[str], tail: int | None, limit: int | None
) -> None:
    data = "".join(p + "\n" for p in parts).encode()
    sent = select(data, tail, limit)
    chosen = parts if tail is None else parts[-tail:] if tail else []  # all if fewer
    expected = "".join(p + "\n" for p in chosen).encode()
    assert sent == (expected if limit is None else expected[:limit])
