"""Auth end to end: the real client against real `expertd serve` processes
configured by their flags (--auth-token-file, --tls-*, --health-listen).

No token, a wrong token, an expired or untrusted certificate on either side, a
certificate for another name, plaintext to a TLS port: each is refused with the
right status, promptly (never retried until the deadline), and health keeps
answering; the right credentials get correct results.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import replace

import grpc
import pytest
import torch
from conftest import SEED, hidden
from grpc_health.v1 import health_pb2

from expertd.client import TLS, CoverageError, ExpertClient, ShardCallError
from expertd.kernels import reference_forward, relative_error
from expertd.launcher import health_status, start_shard, stop_shards, wait_serving

TOKEN = "reliability-token"
QUICK_S = 3.0  # a refusal must come this fast: it is not worth retrying


def openssl(d, *args) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)


def cert(d, name: str, ca: str | None, days: int = 2, san: bool = False) -> None:
    """name.key + name.pem signed by `ca` (self-signed when None); days=-1: already expired."""
    key = ["-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", f"/CN={name}"]
    if ca is None:
        openssl(d, "req", "-x509", *key, "-out", f"{name}.pem", "-days", str(days))
        return
    openssl(d, "req", *key, "-out", f"{name}.csr")
    ext = ["-extfile", "san.ext"] if san else []
    sign = ["-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial"]
    openssl(
        d,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        *sign,
        "-out",
        f"{name}.pem",
        "-days",
        str(days),
        *ext,
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, ca, days, san in (
        ("ca", None, 2, False),
        ("other-ca", None, 2, False),
        ("server", "ca", 2, True),
        ("server-expired", "ca", -1, True),
        ("client", "ca", 2, False),
        ("client-expired", "ca", -1, False),
        ("stranger", "other-ca", 2, False),
    ):
        cert(d, name, ca, days, san)
    expired = subprocess.run(
        ["openssl", "x509", "-checkend", "0", "-in", "server-expired.pem"], cwd=d
    )
    assert expired.returncode != 0  # the certificate really has expired
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers(pki, tmp_path_factory):
    """name -> (address, plaintext health address or None), three processes started at once."""
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    base = ["--synthetic", "small", "--layers", "1", "--seed", str(SEED), "--num-shards", "8"]
    base += ["--torch-threads", "1"]
    tls = lambda c: ["--tls-cert", str(pki / f"{c}.pem"), "--tls-key", str(pki / f"{c}.key")]  # noqa: E731
    health = {n: f"127.0.0.1:{free_port()}" for n in ("expired", "mtls")}
    flags = {
        "token": ["--auth-token-file", str(token_file)],
        "expired": [*tls("server-expired"), "--health-listen", health["expired"]],
        "mtls": [
            *tls("server"),
            *("--tls-client-ca", str(pki / "ca.pem"), "--health-listen", health["mtls"]),
        ],
    }
    procs = {n: start_shard([*base, *f]) for n, f in flags.items()}
    # A TLS port's health is asked on its plaintext twin (what a probe does too).
    probes = [replace(p, address=health.get(n, p.address)) for n, p in procs.items()]
    wait_serving(probes, timeout=120)
    yield {n: (p.address, health.get(n)) for n, p in procs.items()}
    stop_shards(list(procs.values()), timeout=10)


def call_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 8, (4, 2), generator=gen, dtype=torch.int32)  # shard 0's experts
    return 0, hidden(4, gen), ids, torch.rand((4, 2), generator=gen)


def assert_correct(client, full_layers) -> None:
    layer, x, ids, w = call_inputs()
    out = client.forward(layer, x, ids, w)
    assert relative_error(out, reference_forward(full_layers[layer], x, ids, w)) <= 1e-2


def refused_at_discovery(address: str, why: str, **options) -> None:
    t0 = time.monotonic()
    with pytest.raises(CoverageError) as info:
        ExpertClient([address], discover_timeout=QUICK_S, **options)
    assert time.monotonic() - t0 <= QUICK_S + 1.0
    assert address in str(info.value) and why in str(info.value), str(info.value)


def test_token(servers, full_layers):
    address, _ = servers["token"]
    refused_at_discovery(address, "UNAUTHENTICATED")  # no token
    refused_at_discovery(address, "UNAUTHENTICATED", token="wrong")
    with ExpertClient([address], token=TOKEN, timeout=10) as client:
        assert_correct(client, full_layers)
        t0 = time.monotonic()  # a wrong token on one call: refused, not retried
        with pytest.raises(ShardCallError) as info:
            client.forward(*call_inputs(), token="wrong")
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert time.monotonic() - t0 <= QUICK_S
        assert_correct(client, full_layers)  # and the client still works
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING  # no token needed


def test_expired_server_certificate(servers, pki):
    address, health = servers["expired"]
    refused_at_discovery(address, "UNAVAILABLE", tls=TLS(pki / "ca.pem"))
    assert health_status(health) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    "case",
    [
        "no client certificate",
        "expired client",
        "client of another CA",
        "wrong server name",
        "untrusted server",
        "plaintext",
    ],
)
def test_mutual_tls_refusals(servers, pki, case):
    address, health = servers["mtls"]
    ca, pair = pki / "ca.pem", (pki / "client.key", pki / "client.pem")
    tls = {
        "no client certificate": TLS(ca),
        "expired client": TLS(ca, pki / "client-expired.key", pki / "client-expired.pem"),
        "client of another CA": TLS(ca, pki / "stranger.key", pki / "stranger.pem"),
        "wrong server name": TLS(ca, *pair, server_name="not-this-server.example"),
        "untrusted server": TLS(pki / "other-ca.pem", *pair),
        "plaintext": None,
    }[case]
    refused_at_discovery(address, "UNAVAILABLE", tls=tls)
    assert health_status(health) == health_pb2.HealthCheckResponse.SERVING


def test_mutual_tls_accepted(servers, pki, full_layers):
    address, _ = servers["mtls"]
    tls = TLS(pki / "ca.pem", pki / "client.key", pki / "client.pem")
    with ExpertClient([address], tls=tls, timeout=10) as client:
        assert_correct(client, full_layers)


def test_tls_client_to_plaintext_port(servers, pki):
    refused_at_discovery(servers["token"][0], "UNAVAILABLE", tls=TLS(pki / "ca.pem"))
