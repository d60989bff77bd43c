"""Production behaviour of one shard server: batching, limits, auth, TLS,
metrics, unix sockets, draining. Real servers on loopback, real status codes."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from conftest import hidden, shard_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loadgen import outcomes

from expertd import wire
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


def open_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])


@pytest.fixture(scope="module")
def bank0():
    return ExpertBank.load(shard_config(0), progress=lambda _m: None)


def make_request(m: int, seed: int, k: int = 2, layer: int = 0) -> tuple[pb.ForwardRequest, tuple]:
    gen = torch.Generator().manual_seed(seed)
    x = hidden(m, gen)
    ids = torch.randint(0, 8, (m, k), generator=gen, dtype=torch.int32)  # shard 0's experts
    w = torch.rand((m, k), generator=gen)
    req = pb.ForwardRequest(
        layer=layer,
        request_id=seed,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )
    return req, (x, ids, w)


def sample(server: BackgroundServer, name: str, labels: dict | None = None) -> float:
    value = server.servicer.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_concurrent_requests_are_merged_and_split_back(bank0, full_layers):
    with BackgroundServer(shard_config(0, batch_window_us=200_000), bank=bank0) as server:
        cases = [
            make_request(m, seed, k)
            for seed, (m, k) in enumerate([(3, 2), (40, 1), (1, 2), (17, 3)] * 2)
        ]
        with open_channel(server.address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            futures = [stub.Forward.future(req, timeout=30) for req, _ in cases]
            replies = [f.result() for f in futures]
        for (req, (x, ids, w)), reply in zip(cases, replies, strict=True):
            assert reply.request_id == req.request_id
            out = wire.decode(reply.output, "output")
            assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2
        batches = sample(server, "expertd_batch_requests_count")
        assert sample(server, "expertd_batch_requests_sum") == len(cases)
        assert batches < len(cases)  # merged: fewer forwards than requests
        assert sample(server, "expertd_tokens_total") == sum(
            r.hidden_states.shape[0] for r, _ in cases
        )


def test_nan_in_one_merged_request_spares_the_others(bank0, full_layers):
    with BackgroundServer(shard_config(0, batch_window_us=200_000), bank=bank0) as server:
        good = [make_request(5, s) for s in (1, 2)]
        bad_req, (x, _ids, _w) = make_request(4, 3)
        x = x.clone()
        x[3, 100] = float("inf")
        bad_req.hidden_states.CopyFrom(wire.encode(x))
        with open_channel(server.address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            futures = [
                stub.Forward.future(r, timeout=30) for r in (good[0][0], bad_req, good[1][0])
            ]
            with pytest.raises(grpc.RpcError) as info:
                futures[1].result()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "hidden_states[3, 100] is inf" in info.value.details()
            for (_, (gx, gi, gw)), f in ((good[0], futures[0]), (good[1], futures[2])):
                out = wire.decode(f.result().output, "output")
                assert relative_error(out, reference_forward(full_layers[0], gx, gi, gw)) <= 1e-2
        assert (
            sample(
                server, "expertd_requests_total", {"method": "Forward", "code": "INVALID_ARGUMENT"}
            )
            == 1
        )


def test_queue_full_is_resource_exhausted_and_nothing_lost(bank0, full_layers):
    config = shard_config(0, max_queue_requests=1, max_tokens=1024, max_queue_tokens=1024)
    with BackgroundServer(config, bank=bank0) as server:
        cases = [make_request(1024, s, k=4) for s in range(6)]
        with open_channel(server.address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            results = outcomes([stub.Forward.future(r, timeout=60) for r, _ in cases])
        refused = [o for o in results if isinstance(o, grpc.RpcError)]
        assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert "queue full" in refused[0].details()
        for (_, (x, ids, w)), o in zip(cases, results, strict=True):  # the accepted ones are right
            if not isinstance(o, grpc.RpcError):
                ref = reference_forward(full_layers[0], x, ids, w)
                assert relative_error(wire.decode(o.output, "output"), ref) <= 1e-2


def test_expired_request_is_not_computed(bank0):
    with BackgroundServer(shard_config(0), bank=bank0) as server:
        big, _ = make_request(2048, 1, k=8)
        small, _ = make_request(2, 2)
        with open_channel(server.address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            slow = stub.Forward.future(big, timeout=60)
            while not server.servicer.batcher.computing:  # the big one holds the device
                time.sleep(0.001)
            with pytest.raises(grpc.RpcError) as info:
                stub.Forward(small, timeout=0.01)  # queued behind the big one, expires
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            slow.result()
        assert sample(server, "expertd_tokens_total") == 2048  # the small one never ran


def test_expired_stream_request_is_not_computed(bank0):
    """On a stream the caller's wait travels in timeout_us; past it, no compute."""
    with BackgroundServer(shard_config(0), bank=bank0) as server:
        big, _ = make_request(2048, 1, k=8)
        small, _ = make_request(2, 2)
        small.timeout_us = 10_000
        small.request_id = 7
        with open_channel(server.address) as ch:
            stub = pb_grpc.ExpertServiceStub(ch)
            slow = stub.Forward.future(big, timeout=60)
            while not server.servicer.batcher.computing:  # the big one holds the device
                time.sleep(0.001)
            (reply,) = list(stub.ForwardStream(iter([small]), timeout=60))
            slow.result()
        assert reply.request_id == 7
        assert reply.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert sample(server, "expertd_tokens_total") == 2048  # the small one never ran


@pytest.fixture(scope="module")
def authed(bank0):
    with BackgroundServer(shard_config(0, auth_token=TOKEN), bank=bank0) as server:
        yield server


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        [("authorization", "Bearer wrong")],
        [("authorization", TOKEN)],
        [("authorization", "Bearer s3cret-toke")],
    ],
)
def test_missing_or_wrong_token_is_unauthenticated(authed, metadata):
    with open_channel(authed.address) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        for call in (
            lambda: stub.Describe(pb.DescribeRequest(), metadata=metadata, timeout=5),
            lambda: stub.Forward(make_request(2, 1)[0], metadata=metadata, timeout=5),
            lambda: list(
                stub.ForwardStream(iter([make_request(2, 1)[0]]), metadata=metadata, timeout=5)
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert info.value.details() == "missing or invalid credentials"


def test_right_token_passes_and_health_stays_open(authed, full_layers):
    good = [("authorization", f"Bearer {TOKEN}")]
    with open_channel(authed.address) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        assert stub.Describe(pb.DescribeRequest(), metadata=good, timeout=5).num_experts == 64
        req, (x, ids, w) = make_request(3, 4)
        out = wire.decode(stub.Forward(req, metadata=good, timeout=10).output, "output")
        assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost/127.0.0.1, a client certificate, and a stranger CA."""
    d = tmp_path_factory.mktemp("pki")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            "-subj",
            f"/CN={ca}",
            "-days",
            "2",
            cwd=d,
        )
    for name, ca, ext in (
        ("server", "ca", ["-extfile", "san.ext"]),
        ("client", "ca", []),
        ("stranger", "other-ca", []),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            f"{ca}.pem",
            "-CAkey",
            f"{ca}.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            *ext,
            cwd=d,
        )
    return d


def _secure(address, pki, cert=None, ca="ca"):
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / f"{ca}.pem").read_bytes(),
        private_key=(pki / f"{cert}.key").read_bytes() if cert else None,
        certificate_chain=(pki / f"{cert}.pem").read_bytes() if cert else None,
    )
    return grpc.secure_channel(address, creds)


def test_tls_and_mutual_tls(bank0, pki):
    files = {"tls_cert": str(pki / "server.pem"), "tls_key": str(pki / "server.key")}
    with BackgroundServer(shard_config(0, **files), bank=bank0) as server:
        # the raw TCP data plane carries tensors in the clear: never beside TLS
        assert server._running.tcp_port is None and "tcp" not in server.servicer.dataplanes()
        with _secure(server.address, pki) as ch:
            assert (
                pb_grpc.ExpertServiceStub(ch).Describe(pb.DescribeRequest(), timeout=5).num_experts
                == 64
            )
        with _secure(server.address, pki, ca="other-ca") as ch:  # server cert not trusted
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.ExpertServiceStub(ch).Describe(pb.DescribeRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with open_channel(server.address) as ch:  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.ExpertServiceStub(ch).Describe(pb.DescribeRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    files["tls_client_ca"] = str(pki / "ca.pem")
    files["health_listen"] = "127.0.0.1:0"
    with BackgroundServer(shard_config(0, **files), bank=bank0) as server:
        with _secure(server.address, pki, cert="client") as ch:
            assert (
                pb_grpc.ExpertServiceStub(ch).Describe(pb.DescribeRequest(), timeout=5).num_experts
                == 64
            )
        plain = f"127.0.0.1:{server._running.health_port}"  # probes without certificates
        with grpc.insecure_channel(plain) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:  # health only: nothing else there
                pb_grpc.ExpertServiceStub(ch).Describe(pb.DescribeRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        for cert in (None, "stranger"):  # no client certificate, or one from another CA
            with _secure(server.address, pki, cert=cert) as ch:
                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.ExpertServiceStub(ch).Describe(pb.DescribeRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_metrics_endpoint(bank0):
    with BackgroundServer(shard_config(0, metrics_port=0), bank=bank0) as server:
        port = server._running.metrics_port
        with open_channel(server.address) as ch:
            pb_grpc.ExpertServiceStub(ch).Forward(make_request(7, 1)[0], timeout=10)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'expertd_requests_total{code="OK",method="Forward"} 1.0' in text
    assert "expertd_tokens_total 7.0" in text
    assert "expertd_gpu_mps 0.0" in text  # a CPU shard: no GPU to share
    for name in (
        "expertd_batch_tokens_bucket",
        "expertd_queue_seconds_bucket",
        "expertd_compute_seconds_bucket",
        "expertd_resident_weight_bytes",
        "expertd_device_memory_bytes",
    ):
        assert name in text


def test_unix_socket(bank0, tmp_path, full_layers):
    address = f"unix:{tmp_path}/shard.sock"
    with BackgroundServer(shard_config(0, listen=address), bank=bank0) as server:
        assert server.address == address
        with open_channel(address) as ch:
            req, (x, ids, w) = make_request(9, 5)
            out = wire.decode(
                pb_grpc.ExpertServiceStub(ch).Forward(req, timeout=10).output, "output"
            )
    assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2


def test_draining_refuses_new_calls(bank0):
    with BackgroundServer(shard_config(0), bank=bank0) as server:
        server.servicer.draining = True
        with open_channel(server.address) as ch, pytest.raises(grpc.RpcError) as info:
            pb_grpc.ExpertServiceStub(ch).Forward(make_request(2, 1)[0], timeout=5)
        assert (
            info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
        )


def test_draining_answers_a_streams_requests_already_read_and_ends_it(bank0, full_layers):
    """A stream that stays open while the server drains: the requests it had sent (read
    while the first one computed) are all answered, and the stream then ends, OK."""
    import threading

    cases = [make_request(256, seed) for seed in range(1, 7)]
    release = threading.Event()

    def requests():
        for req, _ in cases:
            yield req
        release.wait(30)  # the client never half-closes: only the drain ends the stream

    server = BackgroundServer(shard_config(0), bank=bank0)
    with server, open_channel(server.address) as ch:
        try:
            stream = pb_grpc.ExpertServiceStub(ch).ForwardStream(requests(), timeout=30)
            replies = [next(stream)]  # the server is computing: every request is read
            start = time.monotonic()
            server.servicer.draining = True
            replies += list(stream)  # ends without the client closing its side
            ended = time.monotonic() - start
            code = stream.code()
        finally:
            release.set()
    assert code == grpc.StatusCode.OK and ended < 10
    assert sorted(r.request_id for r in replies) == [req.request_id for req, _ in cases]
    by_id = {req.request_id: args for req, args in cases}
    for reply in replies:
        assert not reply.HasField("error"), reply.error
        x, ids, w = by_id[reply.request_id]
        out = wire.decode(reply.output, "output")
        assert relative_error(out, reference_forward(full_layers[0], x, ids, w)) <= 1e-2


def test_too_many_inflight(bank0):
    config = shard_config(0, max_inflight=1)
    with BackgroundServer(config, bank=bank0) as server, open_channel(server.address) as ch:
        stub = pb_grpc.ExpertServiceStub(ch)
        with ThreadPoolExecutor(4) as pool:
            calls = [
                pool.submit(stub.Forward, make_request(1024, s, k=4)[0], timeout=60)
                for s in range(4)
            ]
        codes = []
        for c in calls:
            try:
                c.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
