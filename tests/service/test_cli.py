"""The `expertd` command as a user runs it: the real entry point in a subprocess.

Bad values (flags or variables) exit 2 with one line on stderr; help and the probe import no
torch (checked with `python -X importtime`, not by timing); `describe` summarizes real servers
(experts as ranges, then their coverage); `health` finds the plaintext health port of a TLS
server through EXPERTD_HEALTH_LISTEN, or speaks TLS itself with --tls-ca.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import expertd
from expertd.launcher import start_shard, stop_shards, wait_serving

HEAVY = ("torch", "numpy", "safetensors")


def expertd_cmd(*argv: str, env: dict | None = None, importtime: bool = False, timeout=60):
    base = {k: v for k, v in os.environ.items() if not k.startswith("EXPERTD_")}
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "expertd", *argv],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=timeout,
    )


def imported(stderr: str) -> set[str]:
    """Top-level module names from `-X importtime` lines ('import time: a | b | name')."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def problems(done) -> str:
    return f"rc={done.returncode}\nstdout={done.stdout}\nstderr={done.stderr}"


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["serve", "--help"], ["health", "--help"], ["demo", "--help"], ["--version"]],
)
def test_help_and_version_import_no_torch(argv):
    done = expertd_cmd(*argv, importtime=True)
    assert done.returncode == 0, problems(done)
    loaded = imported(done.stderr)
    assert "expertd" in loaded, "importtime saw the package"
    assert not loaded & {*HEAVY, "grpc"}, sorted(loaded & {*HEAVY, "grpc"})
    if argv == ["--version"]:
        assert done.stdout.strip() == f"expertd {expertd.__version__}"
    else:
        assert "usage: expertd" in done.stdout


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["serve", "--synthetic", "small", "--log-level", "LOUD"], {}),
        (["serve", "--synthetic", "small", "--metrics-port", "99999"], {}),
        (["serve", "--synthetic", "small", "--health-listen", "bogus"], {}),
        (["serve", "--synthetic", "small", "--tcp-data-port", "70000"], {}),
        (["serve", "--synthetic", "small"], {"EXPERTD_TCP_DATA_PORT": "any"}),
        (["serve", "--synthetic", "small", "--max-tokens", "-5"], {}),
        (["serve", "--synthetic", "small", "--grace", "-1"], {}),
        (["serve", "--synthetic", "small"], {"EXPERTD_MAX_TOKENS": "abc"}),
        (["serve", "--synthetic", "small", "--shard", "2", "--num-shards", "2"], {}),
        (["serve"], {}),
        (["describe", "bogus"], {}),
        (["demo", "--shards", "0"], {}),
        (["cluster", "--synthetic", "small", "--shards", "-1"], {}),
        (["health", "--timeout", "soon"], {}),
    ],
)
def test_bad_values_are_one_line_and_exit_2(argv, env):
    done = expertd_cmd(*argv, env=env)
    assert done.returncode == 2, problems(done)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"expertd {argv[0]}: error: "), done.stderr
    assert done.stdout == ""


SMALL = ("serve", "--synthetic", "small", "--layers", "1", "--listen", "127.0.0.1:0")


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--trace", "zipkin"], {}, "argument --trace: "),
        (["--trace", "jsonl:"], {}, "argument --trace: "),
        ([], {"EXPERTD_TRACE": "zipkin"}, "EXPERTD_TRACE='zipkin': "),
        (["--metrics-listen", "nowhere"], {}, "argument --metrics-listen: "),
        ([], {"EXPERTD_METRICS_LISTEN": "9400"}, "EXPERTD_METRICS_LISTEN='9400': "),
    ],
)
def test_trace_and_metrics_address_are_refused_when_parsed(argv, env, named):
    """Checked with the other values, before torch is imported or anything binds, and named
    as given: a flag as the flag, a variable as the variable."""
    done = expertd_cmd(*SMALL, "--device", "cpu", *argv, env=env, importtime=True)
    err = "".join(line for line in done.stderr.splitlines(True) if "import time:" not in line)
    assert done.returncode == 2 and done.stdout == "", problems(done)
    assert err.count("\n") == 1 and err.startswith(f"expertd serve: error: {named}"), err
    if argv:
        assert "EXPERTD_" not in err.split(" (see ")[0], err
    assert not imported(done.stderr) & {*HEAVY, "grpc"}, "refused before the server starts"


def test_cuda_without_a_gpu_is_refused_before_listening():
    """On a machine without CUDA, --device cuda (or cuda:N, or EXPERTD_DEVICE) is one line
    and exit 2 before the server binds or prints LISTENING."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for argv, env, named in (
        (["--device", "cuda"], {}, "--device cuda"),
        (["--device", "cuda:1"], {}, "--device cuda:1"),
        ([], {"EXPERTD_DEVICE": "cuda"}, "EXPERTD_DEVICE='cuda'"),
    ):
        done = expertd_cmd(*SMALL, *argv, env=env, timeout=120)
        assert done.returncode == 2 and done.stdout == "", problems(done)  # no LISTENING
        assert done.stderr.count("\n") == 1, problems(done)
        assert done.stderr.startswith(f"expertd serve: error: {named}: "), done.stderr
        assert "CUDA" in done.stderr and "Traceback" not in done.stderr


def test_cuda_without_a_gpu_is_refused_before_any_shard_starts():
    """cluster and demo check --device cuda as serve does, once, before their children."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for command in ("cluster", "demo"):
        done = expertd_cmd(command, "--device", "cuda", timeout=120)
        assert done.returncode == 2 and done.stdout == "", problems(done)
        assert done.stderr.count("\n") == 1, problems(done)
        assert done.stderr.startswith(f"expertd {command}: error: --device cuda: "), done.stderr


def test_a_taken_tcp_data_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = expertd_cmd(
            *("serve", "--synthetic", "small", "--layers", "1", "--device", "cpu"),
            *("--listen", "127.0.0.1:0", "--tcp-data-port", str(port)),
            timeout=120,
        )
    assert done.returncode == 1, problems(done)
    assert done.stderr == (
        f"expertd serve: tcp data plane: could not bind port {port} on '127.0.0.1': "
        "[Errno 98] Address already in use\n"
    ), done.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two shards of `small` (32 experts each): one plaintext, one with TLS and a plaintext
    health port. -> (plain address, tls address, health address, certificate path)."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes"),
            *("-keyout", "server.key", "-out", "server.pem", "-days", "2"),
            *("-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        cwd=d,
        check=True,
        capture_output=True,
    )
    base = ["--synthetic", "small", "--layers", "2", "--num-shards", "2", "--torch-threads", "1"]
    health = f"127.0.0.1:{free_port()}"
    tls = ["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key")]
    plain = start_shard([*base, "--shard", "0", "--listen", "127.0.0.1:0"])
    secure = start_shard(
        [*base, "--shard", "1", "--listen", "127.0.0.1:0", *tls, "--health-listen", health]
    )
    from dataclasses import replace

    wait_serving([plain, replace(secure, address=health)], timeout=120)
    yield plain.address, secure.address, health, d / "server.pem"
    stop_shards([plain, secure], timeout=10)


def test_describe_summarizes_and_checks_coverage(servers):
    plain, secure, _, cert = servers
    done = expertd_cmd("describe", plain, secure, "--tls-ca", str(cert))
    # --tls-ca applies to every address: the plaintext one fails, in one line, exit 1
    assert done.returncode == 1 and done.stderr.count("\n") == 1, problems(done)
    assert done.stderr.startswith(f"{plain}: UNAVAILABLE"), done.stderr

    one = expertd_cmd("describe", plain)
    two = expertd_cmd("describe", secure, "--tls-ca", str(cert))
    assert one.returncode == two.returncode == 0, problems(one) + problems(two)
    assert f"{plain}: expertd {expertd.__version__}, backend reference on cpu" in one.stdout
    assert "shard 0/2: experts 0-31 (32 of 64), layers 0-1" in one.stdout
    assert "shard 1/2: experts 32-63 (32 of 64), layers 0-1" in two.stdout
    assert len(one.stdout.splitlines()) == 3, one.stdout  # a summary, not a line per expert
    assert "together" not in one.stdout

    full = expertd_cmd("describe", plain, "--full")
    assert full.returncode == 0 and full.stdout.count("\nexperts: ") == 32


def test_describe_of_several_servers_names_the_experts_they_leave_out(servers):
    plain, _, _, _ = servers
    both = expertd_cmd("describe", plain, plain)
    assert both.returncode == 0, problems(both)
    assert "together: missing layer 0: experts 32-63; layer 1: experts 32-63" in both.stdout


def test_describe_of_an_unreachable_address_is_one_line():
    done = expertd_cmd("describe", "127.0.0.1:1", "--timeout", "1")
    assert done.returncode == 1, problems(done)
    assert done.stderr.startswith("127.0.0.1:1: UNAVAILABLE") and done.stderr.count("\n") == 1


def test_health_honours_health_listen_and_tls(servers):
    _, secure, health, cert = servers
    port = secure.rsplit(":", 1)[1]
    env = {"EXPERTD_LISTEN": f"0.0.0.0:{port}", "EXPERTD_TLS_CERT": str(cert)}

    # The image's HEALTHCHECK: no address; EXPERTD_HEALTH_LISTEN wins over EXPERTD_LISTEN.
    done = expertd_cmd("health", env={**env, "EXPERTD_HEALTH_LISTEN": health}, importtime=True)
    assert done.returncode == 0, problems(done)
    assert done.stdout.strip() == f"{health}: SERVING"
    assert not imported(done.stderr) & set(HEAVY), "the probe imports no torch"

    # Plaintext to the TLS port fails, and the message says what to do.
    done = expertd_cmd("health", "--timeout", "2", env=env)
    assert done.returncode == 1 and "EXPERTD_HEALTH_LISTEN" in done.stderr, problems(done)
    assert done.stderr.count("\n") == 1

    # Or the probe speaks TLS to the main port.
    done = expertd_cmd("health", "--tls-ca", str(cert), env=env)
    assert done.returncode == 0, problems(done)
    assert done.stdout.strip() == f"127.0.0.1:{port}: SERVING"
