"""`expertd cluster` for real on CPU: three shard processes serve, one killed with
SIGKILL comes back on its address and serves again, SIGTERM stops them all; and
`expertd health`, the probe of the container image."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from expertd.cli import main
from expertd.cluster import plan
from expertd.launcher import health_status

SERVING = 1
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


class Lines:
    """The cluster's stdout, read on a thread so waits can time out."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [self._q.put(x.rstrip()) for x in stream], daemon=True
        ).start()

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line {prefix!r} within {timeout} s; got {self.seen}")


def wait_health(address: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while health_status(address) != SERVING:
        assert time.monotonic() < deadline, f"{address} not SERVING within {timeout} s"
        time.sleep(0.2)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


CLUSTER = (
    "cluster --synthetic small --layers 1 --shards 3 --device cpu --grace 2 --log-level WARNING"
)


@pytest.fixture(scope="module")
def cluster():
    proc = subprocess.Popen(
        [sys.executable, "-m", "expertd", *CLUSTER.split()],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # our SIGTERM reaches the supervisor alone, as in a pod
    )
    lines = Lines(proc.stdout)
    try:
        lines.wait_for("SERVING", timeout=60)
        shards = {}
        for line in lines.seen:
            if line.startswith("shard "):
                _, s, address, _, pid, *_ = line.split()
                shards[int(s)] = (address, int(pid))
        yield SimpleNamespace(proc=proc, lines=lines, shards=shards)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_health_command(cluster, capsys, monkeypatch):
    address = cluster.shards[0][0]
    assert main(["health", address]) == 0
    assert capsys.readouterr().out.strip() == f"{address}: SERVING"
    # No address: EXPERTD_LISTEN, with a wildcard host reached on loopback.
    monkeypatch.setenv("EXPERTD_LISTEN", "0.0.0.0:" + address.rsplit(":", 1)[1])
    assert main(["health"]) == 0


def test_cluster_serves_restarts_and_stops(cluster):
    assert sorted(cluster.shards) == [0, 1, 2]
    addresses = [cluster.shards[s][0] for s in range(3)]
    assert cluster.lines.seen[3] == "ADDRESSES " + ",".join(addresses)
    for address in addresses:
        assert health_status(address) == SERVING

    # The example frontend of compose.yaml covers every expert through the three shards.
    done = subprocess.run(
        [sys.executable, str(DEPLOY / "example_client.py"), "--tokens", "16", *addresses],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "layer 0: 16 tokens" in done.stdout and "finite=True" in done.stdout

    address, pid = cluster.shards[1]
    os.kill(pid, signal.SIGKILL)
    line = cluster.lines.wait_for("shard 1 ", timeout=30)
    new_pid = int(line.split()[4])
    assert line.split()[2] == address and new_pid != pid, "restarted on the same address"
    wait_health(address, timeout=30)

    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(timeout=30) == 0
    pids = [p for _, p in cluster.shards.values()] + [new_pid]
    assert all(gone(p) for p in pids), "every shard process exited with the cluster"


def test_health_command_fails_without_server(capsys):
    assert main(["health", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    assert "127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err


def _args(**kw):
    base = dict(checkpoint=None, synthetic="small", layers=None, seed=0, shards=4, gpus=None)
    base |= dict(device="cpu", host="127.0.0.1", base_port=0, grace=30.0, torch_threads=None)
    return SimpleNamespace(**(base | {"log_level": "INFO"} | kw))


def test_plan_places_shards_on_gpus():
    slots = plan(_args(gpus="0,1"))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0", "1", "0", "1"]
    assert all(s.serve_args[s.serve_args.index("--device") + 1] == "cuda" for s in slots)
    assert [s.serve_args[s.serve_args.index("--shard") + 1] for s in slots] == ["0", "1", "2", "3"]
    assert [s.listen for s in plan(_args(base_port=6000))] == [
        f"127.0.0.1:{6000 + s}" for s in range(4)
    ]
    assert all(s.env == {} and s.listen.endswith(":0") for s in plan(_args()))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"checkpoint": "/x"}, "exactly one of --checkpoint"),
        ({"synthetic": None}, "exactly one of --checkpoint"),
        ({"shards": 0}, "--shards must be >= 1"),
        ({"gpus": ","}, "names no GPU"),
    ],
)
def test_plan_names_bad_arguments(kw, message):
    with pytest.raises(ValueError, match=message):
        plan(_args(**kw))
