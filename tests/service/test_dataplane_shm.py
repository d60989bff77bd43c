"""The same-host data plane (docs/dataplane.md) end to end: real servers, the real
client, real shared memory. Results are bit for bit those of the gRPC path; the
transport is picked per replica; bad slot calls get Forward's errors; leases need
credentials and follow restarts."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import hidden, routing, shard_config

from expertd import dataplane as dp
from expertd import nixl
from expertd.client import AsyncExpertClient, ExpertClient, ShardCallError
from expertd.client.channels import ExpertStub
from expertd.client.shm import ShmChannel
from expertd.kernels import reference_forward, relative_error
from expertd.server.app import BackgroundServer
from expertd.server.bank import ExpertBank
from expertd.v1 import expertd_pb2 as pb

pytestmark = pytest.mark.skipif(not dp.available(), reason="needs Linux memfd, futex, fd passing")

ALL = dict(num_shards=1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.fixture(scope="module")
def bank_all():
    return ExpertBank.load(shard_config(0, **ALL), progress=lambda _m: None)


def test_shm_matches_grpc_bit_for_bit_on_8_shards(addresses, full_layers):
    gen = torch.Generator().manual_seed(11)
    with (
        ExpertClient(addresses, transport="shm") as shm,
        ExpertClient(addresses, transport="grpc") as rpc,
    ):
        assert {s["transport"] for s in shm.stats().values()} == {"shm"}
        assert {s["transport"] for s in rpc.stats().values()} == {"grpc"}
        for m in (0, 1, 7, 300, 1000):
            x = hidden(m, gen)
            ids, w = routing(m, gen)
            if m > 2:  # some rows with a padded route
                ids[::2, -1] = -1
                w[::2, -1] = 0.0
            a, b = shm.forward(1, x, ids, w), rpc.forward(1, x, ids, w)
            assert a.shape == (m, 512) and a.dtype == torch.bfloat16
            assert torch.equal(bits(a), bits(b)), m
            if m in (1, 7):
                assert relative_error(a, reference_forward(full_layers[1], x, ids, w)) <= 1e-2
            sub = shm.submit(1, x, ids, w).result()  # the event loop's path, same bits
            assert torch.equal(bits(sub), bits(b))
        assert all(s["calls"] > 0 for s in shm.stats().values())
        timing = next(iter(shm.stats().values()))["last_timing"]
        assert timing["batch_requests"] >= 1 and timing["compute_us"] > 0


def test_auto_picks_shm_for_local_shards_and_grpc_when_forced(addresses, cluster):
    with ExpertClient(addresses) as auto, ExpertClient(addresses, transport="grpc") as forced:
        assert {s["transport"] for s in auto.stats().values()} == {"shm"}
        assert all(s["slots"] >= 1 for s in auto.stats().values())
        assert {s["transport"] for s in forced.stats().values()} == {"grpc"}
        registry = cluster[0].servicer.slots
        before = len(registry.stats())
        gen = torch.Generator().manual_seed(2)
        x = hidden(3, gen)
        ids, w = routing(3, gen)
        assert torch.equal(bits(auto.forward(0, x, ids, w)), bits(forced.forward(0, x, ids, w)))
        assert before >= 1  # the auto client's lease
        metrics = cluster[0].servicer.metrics.registry
        assert metrics.get_sample_value("expertd_dataplane_leases", {"transport": "shm"}) >= 1
        assert metrics.get_sample_value("expertd_requests_total", {"method": "Slot", "code": "OK"})
    deadline = time.monotonic() + 10  # closing the client ends its lease
    while len(registry.stats()) != before - 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_describe_names_the_dataplanes(cluster):
    async def describe():
        async with grpc.aio.insecure_channel(cluster[0].address) as ch:
            return await ExpertStub(ch).Describe(pb.DescribeRequest(), timeout=10)

    offered = ["shm", "tcp"] + (["nixl"] if nixl.installed() else [])
    assert list(asyncio.run(describe()).dataplanes) == offered


def test_async_client_many_calls_at_once_over_slots(addresses):
    """More calls in flight than slots: slots are leased up to the cap, the rest go
    over gRPC; every answer is the gRPC path's (up to rounding: the shards merge
    concurrent calls into batches, and a batch's composition differs run to run)."""
    gen = torch.Generator().manual_seed(3)
    work = []
    for m in (1, 2, 5, 9, 16, 33) * 4:
        x = hidden(m, gen)
        ids, w = routing(m, gen)
        work.append((x, ids, w))

    async def run(transport):
        client = await AsyncExpertClient.connect(addresses, transport=transport)
        try:
            outs = await asyncio.gather(*(client.forward(0, *c) for c in work))
            return outs, client.stats()
        finally:
            await client.close()

    shm_out, stats = asyncio.run(run("shm"))
    rpc_out, _ = asyncio.run(run("grpc"))
    for a, b in zip(shm_out, rpc_out, strict=True):
        assert relative_error(a, b) <= 1e-2
    assert all(s["slots"] >= 2 for s in stats.values())


# -- slot misuse: a client writing the control block by hand ------------------------------


async def _lease(address: str, token: str | None = None) -> tuple[ShmChannel, grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(address)
    stub = ExpertStub(ch)
    md = (("authorization", f"Bearer {token}"),) if token else ()
    info = await stub.Describe(pb.DescribeRequest(), timeout=10, metadata=md)
    plane = ShmChannel(address, info.instance_id)
    await plane.grow(stub, md, 1, 10)
    return plane, ch


def _ring(slot, layer: int, m: int, k: int) -> tuple[int, str]:
    ctl = slot.ctl
    ctl.layer, ctl.m, ctl.k, ctl.flags, ctl.timeout_us = layer, m, k, 0, 10_000_000
    slot.rows = m
    slot.seq = (ctl.req_seq + 1) & 0xFFFFFFFF
    ctl.req_seq = slot.seq
    dp.futex_wake(slot.req_addr)
    assert slot.wait(time.monotonic() + 30)
    if ctl.status:
        n = ctl.error_len
        return ctl.status, bytes(slot.mm[dp.ERROR_OFFSET : dp.ERROR_OFFSET + n]).decode()
    return 0, ""


def test_region_misuse_gets_invalid_argument_and_the_server_keeps_serving(bank_all):
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:

        async def misuse():
            plane, ch = await _lease(server.address)
            try:
                slot = plane.acquire()
                lay = slot.layout
                h, k = lay.hidden, 8
                gen = torch.Generator().manual_seed(4)
                x = hidden(2, gen)
                ids, w = routing(2, gen)
                slot.x[: 2 * h] = x.view(torch.int16).numpy().view(np.uint16).reshape(-1)
                slot.ids[: 2 * k] = ids.numpy().reshape(-1)
                slot.w[: 2 * k] = w.numpy().reshape(-1)
                results = {
                    "rows": _ring(slot, 0, lay.max_tokens + 1, k),
                    "k0": _ring(slot, 0, 2, 0),
                    "kbig": _ring(slot, 0, 2, lay.top_k + 1),
                    "layer": _ring(slot, 99, 2, k),
                }
                slot.ids[3] = 64  # an expert id outside [-1, 64)
                results["id"] = _ring(slot, 0, 2, k)
                slot.ids[3] = ids[0, 3]
                results["ok"] = _ring(slot, 0, 2, k)
                out = torch.from_numpy(slot.out[: 2 * h].copy().view(np.int16)).view(2, h)
                return results, out.view(torch.bfloat16), (x, ids, w)
            finally:
                plane.close()
                await ch.close()

        results, out, (x, ids, w) = asyncio.run(misuse())
        invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert results["rows"][0] == invalid and "exceed the slot" in results["rows"][1]
        assert results["k0"][0] == invalid and "top_k 0" in results["k0"][1]
        assert results["kbig"][0] == invalid and "top_k" in results["kbig"][1]
        assert results["layer"][0] == grpc.StatusCode.NOT_FOUND.value[0]
        assert "layer 99 is not served" in results["layer"][1]
        assert results["id"][0] == invalid and "topk_ids[0, 3] = 64" in results["id"][1]
        assert results["ok"] == (0, "")
        with ExpertClient([server.address], transport="grpc") as client:
            assert torch.equal(bits(out), bits(client.forward(0, x, ids, w)))
        for text in (r[1] for r in results.values()):
            assert "Error" not in text and "Exception" not in text


def test_registration_needs_credentials_and_the_one_time_token(bank_all):
    config = shard_config(0, auth_token="s3cret", **ALL)
    with BackgroundServer(config, bank=bank_all) as server:

        async def attempts():
            ch = grpc.aio.insecure_channel(server.address)
            stub = ExpertStub(ch)
            try:
                with pytest.raises(grpc.RpcError) as refused:
                    await stub.RegisterSlots(pb.RegisterSlotsRequest(transport="shm"), timeout=10)
                md = (("authorization", "Bearer s3cret"),)
                reply = await stub.RegisterSlots(
                    pb.RegisterSlotsRequest(transport="shm"), timeout=10, metadata=md
                )
                bad = await stub.RegisterSlots(
                    pb.RegisterSlotsRequest(transport="nvlink"), timeout=10, metadata=md
                )
            except grpc.RpcError as e:
                bad = e
            finally:
                await ch.close()
            return refused.value, reply, bad

        refused, reply, bad = asyncio.run(attempts())
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "nvlink" in bad.details()
        # A wrong token on the socket is refused; the right one works once.
        for token, ok in ((b"forged" * 4, False), (reply.token, True), (reply.token, False)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(10)
            s.connect(dp.abstract_address(reply.socket_name))
            s.send(dp.HELLO + token)
            msg, fds, _, _ = socket.recv_fds(s, 256, 4)
            for fd in fds:
                os.close(fd)
            assert (msg[:1] == dp.FDS) == ok, msg
            s.close()
        with ExpertClient([server.address], token="s3cret") as client:
            assert {s["transport"] for s in client.stats().values()} == {"shm"}
            gen = torch.Generator().manual_seed(6)
            x = hidden(2, gen)
            ids, w = routing(2, gen)
            assert client.forward(0, x, ids, w).shape == (2, 512)


def test_slot_memory_is_sealed(bank_all):
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:

        async def check():
            plane, ch = await _lease(server.address)
            try:
                slot = plane.acquire()
                return slot.layout.byte_size, slot.mm.size()
            finally:
                plane.close()
                await ch.close()

        size, mapped = asyncio.run(check())
        assert mapped == size
        fd = dp.sealed_memfd("probe", dp.PAGE)
        try:
            assert dp.is_sealed(fd)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)


def test_restarted_shard_is_leased_again(bank_all, full_layers):
    server = BackgroundServer(shard_config(0, **ALL), bank=bank_all)
    address = server.address
    gen = torch.Generator().manual_seed(8)
    x = hidden(4, gen)
    ids, w = routing(4, gen)
    want = reference_forward(full_layers[0], x, ids, w)
    try:
        with ExpertClient([address], timeout=20, refresh_s=0.2) as client:
            assert client.stats()[address]["transport"] == "shm"
            assert relative_error(client.forward(0, x, ids, w), want) <= 1e-2
            old = client.stats()[address]["instance_id"]
            server.stop()
            server = BackgroundServer(shard_config(0, listen=address, **ALL), bank=bank_all)
            deadline = time.monotonic() + 20
            while client.stats()[address]["instance_id"] == old:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert relative_error(client.forward(0, x, ids, w), want) <= 1e-2
            stats = client.stats()[address]
            assert stats["transport"] == "shm" and stats["instance_id"] != old
            assert len(server.servicer.slots.stats()) == 1
    finally:
        server.stop()


def test_a_deadline_passes_while_the_shard_computes(bank_all):
    """A call whose deadline passes is DEADLINE_EXCEEDED; its slot is not reused
    until the shard has answered, and the next calls are right."""
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:
        runner = server.servicer.batcher.runner
        inner = runner.launch

        def slow_launch(*a, **k):
            time.sleep(0.5)
            return inner(*a, **k)

        with ExpertClient([server.address], transport="shm") as client:
            gen = torch.Generator().manual_seed(9)
            x = hidden(3, gen)
            ids, w = routing(3, gen)
            want = client.forward(0, x, ids, w)
            runner.launch = slow_launch
            with pytest.raises(ShardCallError, match="DEADLINE_EXCEEDED"):
                client.forward(0, x, ids, w, timeout=0.1)
            runner.launch = inner
            for _ in range(3):
                assert torch.equal(bits(client.forward(0, x, ids, w)), bits(want))


def test_futex_word_address_is_in_the_mapping():
    fd = dp.sealed_memfd("probe", dp.PAGE)
    mm = mmap.mmap(fd, dp.PAGE)
    ctl = dp.Control.from_buffer(mm)
    addr = ctypes.addressof(ctl) + dp.Control.resp_seq.offset
    t0 = time.monotonic()
    dp.futex_wait(addr, 1, 1.0)  # the word is 0, not 1: returns at once
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    dp.futex_wait(addr, 0, 0.05)  # the word is 0: sleeps until the timeout
    assert time.monotonic() - t0 >= 0.04
    del ctl
    mm.close()
    os.close(fd)


def test_slot_semaphore_wakes_a_waiter_from_another_process():
    """cuda-ipc slots' wake-up: a process-shared semaphore in the control block, posted
    after the doorbell word is stored (here by a second process, as a CUDA stream's
    host function would); without a post the waiter sleeps until its deadline."""
    fd = dp.sealed_memfd("sem-probe", dp.PAGE)
    mm = mmap.mmap(fd, dp.PAGE)
    ctl = dp.Control.from_buffer(mm)
    base = ctypes.addressof(ctl)
    sem = base + dp.SEM_OFFSET
    dp.sem_init(sem)
    req = base + dp.Control.req_seq.offset
    t0 = time.monotonic()
    assert not dp.wait_word(ctl, "req_seq", req, 0, t0 + 0.05, 0.0, sem)
    assert time.monotonic() - t0 >= 0.04
    child = (
        "import ctypes, mmap, sys, time\n"
        "from expertd import dataplane as dp\n"
        "fd = int(sys.argv[1])\n"
        "mm = mmap.mmap(fd, dp.PAGE)\n"
        "ctl = dp.Control.from_buffer(mm)\n"
        "time.sleep(0.2)\n"
        "ctl.req_seq = 1\n"
        "dp.sem_post(ctypes.addressof(ctl) + dp.SEM_OFFSET)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(fd)], pass_fds=[fd])
    try:
        t0 = time.monotonic()
        assert dp.wait_word(ctl, "req_seq", req, 0, t0 + 30.0, 0.0, sem)
        assert ctl.req_seq == 1 and time.monotonic() - t0 < 20.0
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == 0
    del ctl
    mm.close()
    os.close(fd)


def test_cuda_ipc_layout_keeps_tensors_off_the_host_slot():
    host, dev = dp.Layout(256, 8, 512), dp.Layout(256, 8, 512, device=True)
    assert dev.ids_offset == dev.x_offset == dp.CONTROL_BYTES  # no x region on the host
    assert dev.byte_size == dev.out_offset  # nor an out region
    assert dev.byte_size == host.byte_size - 2 * 256 * 512 * 2
    assert dev.device_out_offset >= 2 * 256 * 512 and dev.device_bytes >= 4 * 256 * 512
    assert host.device_bytes == 0
    assert dp.Layout.from_proto(dev.to_proto(pb), device=True) == dev
    with pytest.raises(ValueError, match="layout differs"):
        dp.Layout.from_proto(dev.to_proto(pb))  # read as a host slot: refused, not misread


def test_cuda_ipc_is_refused_by_a_cpu_shard_with_reasons(bank_all):
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:

        async def register():
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = ExpertStub(ch)
                info = await stub.Describe(pb.DescribeRequest(), timeout=10)
                try:
                    await stub.RegisterSlots(
                        pb.RegisterSlotsRequest(transport=dp.CUDA_IPC), timeout=10
                    )
                except grpc.RpcError as e:
                    return info, e
            raise AssertionError("a CPU shard leased cuda-ipc slots")

        info, refused = asyncio.run(register())
        assert dp.CUDA_IPC not in info.dataplanes
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'cuda-ipc' is not offered here (offered: shm)" in refused.details()
        gen = torch.Generator().manual_seed(8)
        x = hidden(2, gen)
        ids, w = routing(2, gen)
        with ExpertClient([server.address], transport="cuda-ipc") as forced:
            with pytest.raises(ShardCallError) as info:
                forced.forward(0, x, ids, w)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "cuda-ipc" in str(info.value) and "offers no cuda-ipc" in str(info.value)
        with ExpertClient([server.address]) as auto:  # auto: shm, saying why not cuda-ipc
            assert auto.forward(0, x, ids, w).shape == (2, 512)
            (stats,) = auto.stats().values()
            assert stats["transport"] == "shm"


def test_paced_waiters_answer_every_call_whatever_the_gaps(bank_all, monkeypatch):
    """With spare CPUs, a shard's waiter sleeps until shortly before the next call is due
    and the caller spins through its answers' jitter (dp.spare_cpus): forced on here (the
    CI machine has 2 cores), calls at a steady pace, then after pauses longer than the
    learned one and shorter ones, are all answered with the gRPC path's bits."""
    monkeypatch.setattr(dp, "_SPARE", True)
    gen = torch.Generator().manual_seed(21)
    with BackgroundServer(shard_config(0, **ALL), bank=bank_all) as server:
        assert server.servicer.slots.pace_max_s == dp.NEXT_MAX_S
        with (
            ExpertClient([server.address], transport="shm") as shm,
            ExpertClient([server.address], transport="grpc") as rpc,
        ):
            calls = [(hidden(m, gen), *routing(m, gen)) for m in (1, 4, 33)]
            want = [rpc.forward(0, *c) for c in calls]
            for gap in [0.0] * 40 + [0.05, 0.0, 0.0, 0.6, 0.0, 0.002, 0.0, 0.0003, 0.0]:
                time.sleep(gap)
                for c, b in zip(calls, want, strict=True):
                    assert torch.equal(bits(shm.forward(0, *c, timeout=10)), bits(b))
            assert next(iter(shm.stats().values()))["transport"] == "shm"


def test_recent_durations_keep_the_extremes_of_the_last_eight():
    recent = dp.Recent()
    assert (recent.low(), recent.high()) == (0.0, 0.0)
    for v in (5.0, 3.0, 9.0):
        recent.add(v)
    assert (recent.low(), recent.high()) == (3.0, 9.0)
    for v in range(10, 18):  # eight newer ones push the first three out
        recent.add(float(v))
    assert (recent.low(), recent.high()) == (10.0, 17.0)


def test_shm_calls_time_both_wake_ups(bank_all):
    """The shard stamps when its waiter saw the doorbell and when it answered (one
    clock for every process of a host): the caller's timings split the transfer into
    the doorbell and the wake-up, on its own thread and on the event loop alike."""
    gen = torch.Generator().manual_seed(31)
    server = BackgroundServer(shard_config(0, **ALL), bank=bank_all)
    with server, ExpertClient([server.address], transport="shm") as client:
        x = hidden(3, gen)
        ids, w = routing(3, gen)
        for _ in range(5):
            client.forward(0, x, ids, w)  # the caller's thread
            client.submit(0, x, ids, w).result()  # the event loop
        t = client.timings()
        last = next(iter(client.stats().values()))["last_timing"]
    for stage in ("doorbell", "wake"):
        assert t[stage]["count"] == 10, t
        assert 0 < t[stage]["mean_us"] < t["transfer"]["mean_us"], t
    assert last["doorbell_us"] > 0
    assert 0 < last["wake_us"] < 1e6


def test_a_containers_cpu_quota_caps_the_cpus_waiters_count_on(tmp_path):
    """Waiters spin longer only with spare CPUs; a container's limit is a CFS quota
    (its affinity still lists every core of the host), read from cgroup v2 or v1."""
    v2 = tmp_path / "cpu.max"
    v1 = tmp_path / "v1"
    v1.mkdir()
    none = str(tmp_path / "absent")
    v2.write_text("max 100000\n")
    assert dp.cpu_quota(str(v2), none) is None
    v2.write_text("250000 100000\n")
    assert dp.cpu_quota(str(v2), none) == 2.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert dp.cpu_quota(none, str(v1)) is None
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    assert dp.cpu_quota(none, str(v1)) == 3.0
    assert dp.cpu_quota(none, none) is None
    v2.write_text("garbage\n")
    assert dp.cpu_quota(str(v2), none) is None


def test_pinned_rows_lock_by_doubling_and_stop_asking_once_refused(monkeypatch):
    """A GPU shard's host slot locks its x and out rows on demand (the driver's
    registration stood in for here: no GPU on this machine): whole pages, by doubling
    from PIN_MIN_ROWS, each size once; a refusal unlocks everything and is final."""
    from expertd import cudamem
    from expertd.server import slots

    calls, refuse = [], []

    class FakeHost:
        def __init__(self, addr, nbytes, device):
            if refuse:
                raise cudamem.CudaIpcError("cudaHostRegister: refused")
            self.span = (addr, nbytes)
            calls.append(("lock", self.span))

        def release(self):
            calls.append(("unlock", self.span))

    monkeypatch.setattr(cudamem, "PinnedHost", FakeHost)
    lay = dp.Layout(max_tokens=2048, top_k=8, hidden=512)
    out = torch.zeros(2048 * 512, dtype=torch.bfloat16)
    rows = slots.PinnedRows(1 << 20, lay, "cuda:0", out)
    view = rows.out_rows(100)
    assert view.shape == (100, 512) and view.data_ptr() == out.data_ptr()
    assert rows.rows == slots.PIN_MIN_ROWS
    span = dp.round_pages(2 * slots.PIN_MIN_ROWS * 512)
    assert calls == [
        ("lock", ((1 << 20) + lay.x_offset, span)),
        ("lock", ((1 << 20) + lay.out_offset, span)),
    ]
    calls.clear()
    assert rows.out_rows(slots.PIN_MIN_ROWS).shape[0] == slots.PIN_MIN_ROWS and not calls
    assert rows.out_rows(600).shape[0] == 600 and rows.rows == 4 * slots.PIN_MIN_ROWS
    assert [c[0] for c in calls] == ["unlock", "unlock", "lock", "lock"]
    calls.clear()
    refuse.append(True)
    assert rows.out_rows(2000) is None and rows.refused and rows.rows == 0
    assert [c[0] for c in calls] == ["unlock", "unlock"]
    refuse.clear()
    calls.clear()
    assert rows.out_rows(10) is None and not calls  # not asked again


@pytest.mark.parametrize("transport", ["shm", "tcp", *(["nixl"] if nixl.available() else [])])
def test_slot_tokens_bounds_the_slots_and_larger_parts_go_over_grpc(bank_all, transport):
    """ExpertClient(slot_tokens=N): slots of N rows (their memory is the client's
    budget); a shard's part with more rows goes over gRPC, with the same bits."""
    server = BackgroundServer(shard_config(0, **ALL), bank=bank_all)
    metrics = server.servicer.metrics.registry

    def slot_calls() -> float:
        return (
            metrics.get_sample_value("expertd_requests_total", {"method": "Slot", "code": "OK"})
            or 0.0
        )

    try:
        with (
            ExpertClient([server.address], transport=transport, slot_tokens=8) as client,
            ExpertClient([server.address], transport="grpc") as ref,
        ):
            for m, through_slot in ((8, True), (9, False), (3, True), (300, False)):
                gen = torch.Generator().manual_seed(m)
                x = hidden(m, gen)
                ids, w = routing(m, gen)
                before = slot_calls()
                got = client.forward(0, x, ids, w)
                assert torch.equal(bits(got), bits(ref.forward(0, x, ids, w))), m
                assert (slot_calls() == before + 1) == through_slot, m
            stats = client.stats()[server.address]
            assert stats["transport"] == transport and stats["slot_rows"] == 8, stats
    finally:
        server.stop()
    with pytest.raises(ValueError, match="slot_tokens"):
        ExpertClient(["127.0.0.1:1"], slot_tokens=-1)
