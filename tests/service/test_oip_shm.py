"""The OIP system and CUDA shared-memory extensions, driven by the stock Triton
client (tests/service/oip_shm_client.py, its own process) against a real server on a real
socket, with real POSIX shared memory made by tritonclient.utils.shared_memory."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from conftest import hidden, routing, shard_config

from expertd import wire
from expertd.server.app import BackgroundServer
from expertd.server.oip_shm import INLINE_BYTES, SharedMemoryRegistry, TensorRef
from expertd.server.validate import RequestError
from expertd.v1 import expertd_pb2 as pb
from expertd.v1 import expertd_pb2_grpc as pb_grpc
from expertd.v1 import inference_pb2 as oip
from expertd.v1 import inference_pb2_grpc as oip_grpc

pytest.importorskip("tritonclient")

TOKEN = "oip-shm-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
SCRIPT = Path(__file__).with_name("oip_shm_client.py")
H = 512  # the small preset's hidden size
DATATYPES = {torch.bfloat16: "BF16", torch.float32: "FP32", torch.int32: "INT32"}


def key(name: str) -> str:
    """A shm_open key no other test run on this host uses."""
    return f"/expertd-test-{os.getpid()}-{name}"


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def spec(name: str, t: torch.Tensor) -> dict:
    """An input sent in raw_input_contents."""
    data = base64.b64encode(raw_bytes(t)).decode()
    return {"name": name, "datatype": DATATYPES[t.dtype], "shape": list(t.shape), "data": data}


def in_shm(name: str, t: torch.Tensor, region: str, offset: int, byte_size=None) -> dict:
    """An input read from a shared-memory region."""
    size = len(raw_bytes(t)) if byte_size is None else byte_size
    return {
        "name": name,
        "datatype": DATATYPES[t.dtype],
        "shape": list(t.shape),
        "region": region,
        "offset": offset,
        "byte_size": size,
    }


def case(seed: int, m: int):
    gen = torch.Generator().manual_seed(seed)
    x = hidden(m, gen)
    ids, w = routing(m, gen)
    ids[ids >= 8] = -1  # shard 0 of 8 owns experts 0-7
    return x, ids, w


def shm_fds(path: str) -> int:
    """How many of this process's descriptors (the server's: it runs in-process) are open
    on the shared-memory object `path`."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}") == path
    return count


class TritonClient:
    """tests/service/oip_shm_client.py in its own process: call(op, **args) -> its answer."""

    def __init__(self, address: str, token: str | None = TOKEN) -> None:
        args = [sys.executable, str(SCRIPT), address] + ([token] if token else [])
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def __call__(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"client process died: {self.proc.stderr.read()}")
        return json.loads(line)

    def ok(self, op: str, **args) -> dict:
        answer = self(op, **args)
        assert "status" not in answer and "client_error" not in answer, answer
        return answer

    def refused(self, op: str, code: str, *words: str, **args) -> str:
        answer = self(op, **args)
        assert "status" in answer, f"{op} {args} was accepted"
        assert code in answer["status"], answer
        for word in words:
            assert word in answer["message"], answer
        return answer["message"]

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read()


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(shard_config(0, allow_client_shm=True, auth_token=TOKEN)) as s:
        yield s


@pytest.fixture
def client(server):
    c = TritonClient(server.address)
    yield c
    c.ok("unregister")  # leave the next test no region
    c.ok("unregister_cuda")
    c.close()


def forward(address: str, x, ids, w, layer: int = 0) -> bytes:
    """Our own Forward RPC's output bytes, for the same inputs."""
    request = pb.ForwardRequest(
        layer=layer,
        hidden_states=wire.encode(x),
        topk_ids=wire.encode(ids),
        topk_weights=wire.encode(w),
    )
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.ExpertServiceStub(channel).Forward(request, metadata=AUTH, timeout=60)
    return reply.output.data


def test_metadata_lists_the_extensions(server, client):
    meta = client.ok("metadata")
    assert meta["name"] == "expertd" and "system_shared_memory" in meta["extensions"]
    assert ("cuda_shared_memory" in meta["extensions"]) == torch.cuda.is_available()


def test_infer_through_system_shared_memory(server, client):
    x, ids, w = case(1, 13)
    sizes = [len(raw_bytes(t)) for t in (x, ids, w)]
    out_bytes = 13 * H * 2
    # One object: a 100-byte header the region skips, then x, ids, w back to back (not
    # page-aligned), then room for the output.
    total = 100 + sum(sizes) + out_bytes
    client.ok("create", name="io", key=key("io"), byte_size=total)
    client.ok("register", name="io", key=key("io"), byte_size=total - 100, offset=100)
    offsets = [0, sizes[0], sizes[0] + sizes[1]]
    for t, offset in zip((x, ids, w), offsets, strict=True):
        client.ok("put", name="io", tensor=spec("t", t), offset=100 + offset)
    names = ("hidden_states", "topk_ids", "topk_weights")
    inputs = [
        in_shm(n, t, "io", off) for n, t, off in zip(names, (x, ids, w), offsets, strict=True)
    ]
    out_at = sum(sizes)
    answer = client.ok(
        "infer", inputs=inputs, output={"region": "io", "offset": out_at, "byte_size": out_bytes}
    )
    assert answer["shape"] == [13, H] and answer["raw_lengths"] == [0]  # no raw contents
    got = client.ok("get", name="io", datatype="BF16", shape=[13, H], offset=100 + out_at)
    from_shm = base64.b64decode(got["data"])

    raw = client.ok("infer", inputs=[spec(n, t) for n, t in zip(names, (x, ids, w), strict=True)])
    assert base64.b64decode(raw["data"]) == from_shm
    assert forward(server.address, x, ids, w) == from_shm
    # Inputs mixed: hidden_states from shared memory, the routing raw; output raw.
    mixed = client.ok("infer", inputs=[inputs[0], spec(names[1], ids), spec(names[2], w)])
    assert base64.b64decode(mixed["data"]) == from_shm
    assert mixed["raw_lengths"] == [out_bytes]


def test_large_tensors_through_system_shared_memory(server, client):
    """Inputs and outputs over a MiB are copied off the event loop: same bytes."""
    m = 1100
    x, ids, w = case(6, m)
    names = ("hidden_states", "topk_ids", "topk_weights")
    sizes = [len(raw_bytes(t)) for t in (x, ids, w)]
    assert sizes[0] > 1 << 20 and m * H * 2 > 1 << 20
    client.ok("create", name="in", key=key("in"), byte_size=sum(sizes))
    client.ok("create", name="out", key=key("out"), byte_size=m * H * 2)
    client.ok("register", name="in", key=key("in"), byte_size=sum(sizes))
    client.ok("register", name="out", key=key("out"), byte_size=m * H * 2)
    offsets = [0, sizes[0], sizes[0] + sizes[1]]
    inputs = []
    for n, t, offset in zip(names, (x, ids, w), offsets, strict=True):
        client.ok("put", name="in", tensor=spec(n, t), offset=offset)
        inputs.append(in_shm(n, t, "in", offset))
    output = {"region": "out", "offset": 0, "byte_size": m * H * 2}
    assert client.ok("infer", inputs=inputs, output=output)["raw_lengths"] == [0]
    got = client.ok("get", name="out", datatype="BF16", shape=[m, H])
    raw = client.ok("infer", inputs=[spec(n, t) for n, t in zip(names, (x, ids, w), strict=True)])
    assert base64.b64decode(got["data"]) == base64.b64decode(raw["data"])


def test_status_and_unregister(server, client):
    client.ok("create", name="a", key=key("a"), byte_size=8192)
    client.ok("create", name="b", key=key("b"), byte_size=4096)
    client.ok("register", name="a", key=key("a"), byte_size=4096, offset=4096)
    client.ok("register", name="b", key=key("b"), byte_size=4096)
    regions = client.ok("status")["regions"]
    assert regions == {
        "a": {"name": "a", "key": key("a"), "offset": 4096, "byte_size": 4096},
        "b": {"name": "b", "key": key("b"), "offset": 0, "byte_size": 4096},
    }
    assert list(client.ok("status", name="b")["regions"]) == ["b"]
    client.refused("status", "NOT_FOUND", "'zzz'", name="zzz")
    assert client.ok("status_cuda")["regions"] == {}
    client.refused("status_cuda", "NOT_FOUND", "system", name="a")  # not a CUDA region
    path = "/dev/shm" + key("a")
    assert shm_fds(path) == 1
    client.ok("unregister", name="a")
    assert shm_fds(path) == 0  # closed by unregistering
    assert list(client.ok("status")["regions"]) == ["b"]
    client.ok("unregister", name="a")  # twice: harmless, as in Triton
    client.ok("unregister_cuda", name="b")  # a system region: CUDA unregister leaves it
    assert list(client.ok("status")["regions"]) == ["b"]
    client.ok("register", name="a", key=key("a"), byte_size=4096)  # the name is free again
    client.ok("unregister")  # every system region
    assert client.ok("status")["regions"] == {}
    assert shm_fds(path) == 0 and shm_fds("/dev/shm" + key("b")) == 0


def test_registration_mistakes(server, client):
    client.ok("create", name="r", key=key("r"), byte_size=4096)
    client.ok("register", name="r", key=key("r"), byte_size=4096)
    client.refused(
        "register",
        "ALREADY_EXISTS",
        "'r'",
        "already registered",
        name="r",
        key=key("r"),
        byte_size=16,
    )
    client.refused(
        "register", "NOT_FOUND", key("nothing"), name="n", key=key("nothing"), byte_size=16
    )
    for bad in ("/", "a/b", "/../etc/passwd", "/.."):
        client.refused(
            "register", "INVALID_ARGUMENT", "not a valid", name="k", key=bad, byte_size=8
        )
    client.refused(
        "register",
        "INVALID_ARGUMENT",
        "past the end",
        "4096 bytes",
        name="big",
        key=key("r"),
        byte_size=4000,
        offset=100,
    )
    client.refused(
        "register", "INVALID_ARGUMENT", "byte_size is 0", name="z", key=key("r"), byte_size=0
    )
    # A link planted in /dev/shm is not followed to what it points at.
    link = Path("/dev/shm" + key("link"))
    target = Path("/dev/shm" + key("target"))
    target.write_bytes(b"\0" * 64)
    link.symlink_to(target)
    try:
        client.refused(
            "register", "INVALID_ARGUMENT", "cannot open", name="l", key=key("link"), byte_size=8
        )
    finally:
        link.unlink()
        target.unlink()
    if not torch.cuda.is_available():
        client.refused(
            "register_cuda",
            "INVALID_ARGUMENT",
            "no CUDA device",
            name="c",
            byte_size=64,
            raw_handle=base64.b64encode(b"\0" * 64).decode(),
        )
    assert list(client.ok("status")["regions"]) == ["r"]


def test_infer_mistakes(server, client):
    x, ids, w = case(2, 4)
    size = len(raw_bytes(x))
    client.ok("create", name="m", key=key("m"), byte_size=size + 64)
    client.ok("register", name="m", key=key("m"), byte_size=size)
    client.ok("put", name="m", tensor=spec("x", x))
    rest = [spec("topk_ids", ids), spec("topk_weights", w)]

    def refused(code, *words, inp=None, output=None):
        inputs = [inp or in_shm("hidden_states", x, "m", 0), *rest]
        client.refused("infer", code, *words, inputs=inputs, output=output)

    refused("NOT_FOUND", "'nope'", inp=in_shm("hidden_states", x, "nope", 0))
    refused("INVALID_ARGUMENT", "offset", "outside", inp=in_shm("hidden_states", x, "m", size))
    refused("INVALID_ARGUMENT", "past the end", inp=in_shm("hidden_states", x, "m", 2))
    refused(
        "INVALID_ARGUMENT",
        "does not match",
        f"{size} bytes",
        inp=in_shm("hidden_states", x, "m", 0, byte_size=size - 2),
    )
    refused(
        "INVALID_ARGUMENT", "cannot hold", output={"region": "m", "offset": 0, "byte_size": 100}
    )
    refused("NOT_FOUND", "'gone'", output={"region": "gone", "offset": 0, "byte_size": size})
    # The same request, right, still works.
    good = client.ok("infer", inputs=[in_shm("hidden_states", x, "m", 0), *rest])
    assert base64.b64decode(good["data"]) == forward(server.address, x, ids, w)


def test_malformed_parameters(server):
    """What tritonclient never sends but another client could."""
    shm = server._running.inference.shm
    with grpc.insecure_channel(server.address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)

        def infer(**params) -> grpc.RpcError:
            request = oip.ModelInferRequest(model_name="moe")
            inp = request.inputs.add(name="hidden_states", datatype="BF16", shape=[1, H])
            for name, value in params.items():
                setattr(inp.parameters[name], *value)
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(request, metadata=AUTH, timeout=30)
            return e.value

        e = infer(shared_memory_offset=("int64_param", 0))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "without" in e.details()
        e = infer(
            shared_memory_region=("int64_param", 3), shared_memory_byte_size=("int64_param", 8)
        )
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "string" in e.details()
        e = infer(shared_memory_region=("string_param", "x"))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "byte_size" in e.details()
        e = infer(
            shared_memory_region=("string_param", "x"), shared_memory_byte_size=("int64_param", -8)
        )
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "negative" in e.details()
        e = infer(
            shared_memory_region=("string_param", "x"),
            shared_memory_byte_size=("string_param", "8"),
        )
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "integer" in e.details()
        # Registration needs the token like every other call.
        with pytest.raises(grpc.RpcError) as e:
            stub.SystemSharedMemoryRegister(
                oip.SystemSharedMemoryRegisterRequest(name="t", key=key("t"), byte_size=8),
                timeout=30,
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.SystemSharedMemoryStatus(oip.SystemSharedMemoryStatusRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert shm.regions == {}


def test_truncated_object_fails_the_request_not_the_server(server, client):
    x, ids, w = case(3, 8)
    size = len(raw_bytes(x))
    client.ok("create", name="t", key=key("t"), byte_size=2 * size)
    client.ok("register", name="t", key=key("t"), byte_size=2 * size)
    client.ok("put", name="t", tensor=spec("x", x))
    inputs = [in_shm("hidden_states", x, "t", size), spec("topk_ids", ids), spec("topk_weights", w)]
    client.ok("infer", inputs=inputs)
    os.truncate("/dev/shm" + key("t"), size)  # the client shrinks its object under the server
    client.refused("infer", "INVALID_ARGUMENT", "truncated", inputs=inputs)
    output = {"region": "t", "offset": size, "byte_size": size}
    inputs[0] = in_shm("hidden_states", x, "t", 0)
    client.refused("infer", "INVALID_ARGUMENT", "truncated", inputs=inputs, output=output)
    assert os.stat("/dev/shm" + key("t")).st_size == size  # not grown back by the server
    good = client.ok("infer", inputs=inputs)  # the intact part still serves
    assert base64.b64decode(good["data"]) == forward(server.address, x, ids, w)


def test_other_clients_keep_being_served(server, client):
    x, ids, w = case(4, 6)
    expected = forward(server.address, x, ids, w)
    done, failures = threading.Event(), []

    def steady() -> None:  # a second client's plain inference, all along
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ExpertServiceStub(channel)
            request = pb.ForwardRequest(
                hidden_states=wire.encode(x), topk_ids=wire.encode(ids), topk_weights=wire.encode(w)
            )
            while not done.is_set():
                try:
                    reply = stub.Forward(request, metadata=AUTH, timeout=60)
                    if reply.output.data != expected:
                        failures.append("different output")
                except grpc.RpcError as e:
                    failures.append(e.details())

    thread = threading.Thread(target=steady)
    thread.start()
    try:
        client.ok("create", name="bad", key=key("bad"), byte_size=4096)
        rest = [spec("topk_ids", ids), spec("topk_weights", w)]
        for _ in range(5):
            client.refused("register", "NOT_FOUND", name="n", key=key("none"), byte_size=8)
            client.ok("register", name="bad", key=key("bad"), byte_size=4096)
            client.refused("register", "ALREADY_EXISTS", name="bad", key=key("bad"), byte_size=8)
            client.refused(
                "infer", "INVALID_ARGUMENT", inputs=[in_shm("hidden_states", x, "bad", 4000), *rest]
            )
            client.ok("unregister", name="bad")
    finally:
        done.set()
        thread.join(60)
    assert failures == []


def test_region_in_use_stays_open_until_the_request_ends():
    """Unregistering during a request defers the close to that request's end."""
    path = Path("/dev/shm" + key("lease"))
    path.write_bytes(bytes(range(256)) * 16)
    try:
        registry = SharedMemoryRegistry(allowed=True)
        registry.register_system("r", key("lease"), 0, 4096)
        lease = registry.lease(max_read_bytes=1 << 20)
        assert bytes(lease.read("x", TensorRef("r", 256, 4))) == bytes([0, 1, 2, 3])
        registry.unregister("system", "r")
        assert shm_fds(str(path)) == 1 and "r" not in registry.regions
        region = lease.regions[0]
        region.write(0, memoryview(b"\xff\xfe"))  # the request's output still lands
        lease.release()
        assert shm_fds(str(path)) == 0
        assert path.read_bytes()[:2] == b"\xff\xfe"
        with pytest.raises(RequestError, match="larger than any request"):
            registry.lease(max_read_bytes=3).read("x", TensorRef("r", 0, 4))
    finally:
        path.unlink()


def test_large_reads_wait_for_fill():
    """A read over INLINE_BYTES is copied by fill(), which the request runs off the loop."""
    path = Path("/dev/shm" + key("fill"))
    content = os.urandom(INLINE_BYTES + 4096)
    path.write_bytes(content)
    try:
        registry = SharedMemoryRegistry(allowed=True)
        registry.register_system("r", key("fill"), 0, len(content))
        lease = registry.lease(max_read_bytes=1 << 30)
        small = lease.read("a", TensorRef("r", 0, 16))
        big = lease.read("b", TensorRef("r", 4095, INLINE_BYTES + 1))
        assert bytes(small) == content[:16] and len(lease.pending) == 1
        lease.fill()
        assert bytes(big) == content[4095:] and not lease.pending
        lease.release()
        registry.close()
        assert shm_fds(str(path)) == 0
    finally:
        path.unlink()


def test_shutdown_closes_regions_and_off_by_default():
    path = Path("/dev/shm" + key("shutdown"))
    path.write_bytes(b"\0" * 4096)
    try:
        plain = BackgroundServer(shard_config(0))  # client shared memory not allowed
        try:
            c = TritonClient(plain.address, token=None)
            try:
                c.refused(
                    "register",
                    "UNIMPLEMENTED",
                    "--allow-client-shm",
                    name="s",
                    key=key("shutdown"),
                    byte_size=8,
                )
                assert "system_shared_memory" not in c.ok("metadata")["extensions"]
                assert c.ok("status")["regions"] == {}
            finally:
                c.close()
        finally:
            plain.stop()
        s = BackgroundServer(shard_config(0, allow_client_shm=True))
        try:
            c = TritonClient(s.address, token=None)
            c.ok("register", name="s", key=key("shutdown"), byte_size=4096)
            c.close()
            assert shm_fds(str(path)) == 1
        finally:
            s.stop()
        assert shm_fds(str(path)) == 0
    finally:
        path.unlink()


# -- CUDA shared memory (an NVIDIA GPU and the cuda-bindings package) ----------------------


@pytest.mark.cuda
def test_infer_through_cuda_shared_memory(server, client):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cuda.bindings.runtime")
    x, ids, w = case(5, 9)
    names = ("hidden_states", "topk_ids", "topk_weights")
    made = client("create_cuda", name="probe", byte_size=64)
    if "client_error" in made:  # the client's side, before any server call
        pytest.skip(f"this host cannot make CUDA shared memory: {made['client_error']}")
    client.ok("destroy", name="probe")
    for name, t in zip(("cx", "cids", "cw"), (x, ids, w), strict=True):
        size = len(raw_bytes(t))
        client.ok("create_cuda", name=name, byte_size=size)
        client.ok("register_cuda", name=name, byte_size=size)
        client.ok("put", name=name, tensor=spec(name, t))
    client.ok("create_cuda", name="cout", byte_size=9 * H * 2)
    client.ok("register_cuda", name="cout", byte_size=9 * H * 2)
    status = client.ok("status_cuda")["regions"]
    assert set(status) == {"cx", "cids", "cw", "cout"} and status["cout"]["byte_size"] == 9 * H * 2
    assert status["cx"]["device_id"] == 0
    inputs = [
        in_shm(n, t, r, 0) for n, t, r in zip(names, (x, ids, w), ("cx", "cids", "cw"), strict=True)
    ]
    answer = client.ok(
        "infer", inputs=inputs, output={"region": "cout", "offset": 0, "byte_size": 9 * H * 2}
    )
    assert answer["raw_lengths"] == [0]
    got = base64.b64decode(client.ok("get", name="cout", datatype="BF16", shape=[9, H])["data"])
    assert got == forward(server.address, x, ids, w)
    client.refused(
        "register_cuda",
        "ALREADY_EXISTS",
        name="cx",
        byte_size=8,
        raw_handle=base64.b64encode(b"\0" * 64).decode(),
    )
    client.refused(
        "register_cuda",
        "INVALID_ARGUMENT",
        "64",
        name="short",
        byte_size=8,
        raw_handle=base64.b64encode(b"\1" * 10).decode(),
    )
    client.refused(
        "register_cuda",
        "INVALID_ARGUMENT",
        "IPC handle",
        name="junk",
        byte_size=8,
        raw_handle=base64.b64encode(b"\1" * 64).decode(),
    )
    client.refused(
        "register_cuda",
        "INVALID_ARGUMENT",
        "device 999",
        name="dev",
        byte_size=8,
        device_id=999,
        raw_handle=base64.b64encode(b"\0" * 64).decode(),
    )
    client.refused("status", "NOT_FOUND", "CUDA", name="cx")
    client.ok("create_cuda", name="small", byte_size=256)
    client.refused(
        "register_cuda",
        "INVALID_ARGUMENT",
        "larger than the exported allocation",
        name="small",
        byte_size=1 << 24,
    )
    client.ok("unregister_cuda", name="cx")
    assert set(client.ok("status_cuda")["regions"]) == {"cids", "cw", "cout"}
    client.ok("unregister_cuda")
    assert client.ok("status_cuda")["regions"] == {}
