"""Stalled uploads against a real `expertd serve` process: 40 clients, each on its
own connection, start a ~29 MiB request, send most of it, and stall (answering
pings, as a live client would). The server must cut each call after its receive
timeout, give the memory of the partial messages back, and keep answering health
checks meanwhile.

The clients speak HTTP/2 by hand (below): gRPC's own client only ever sends whole
messages.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertd.launcher import start_shard, stop_shards, wait_serving

CLIENTS = 40
DECLARED = 29 << 20  # the request size announced in the gRPC message prefix
SENT = 28 << 20  # what each client sends of it before stalling
RECEIVE_TIMEOUT_S = 3.0
FORWARD = b"/expertd.v1.ExpertService/Forward"

# -- a minimal HTTP/2 client --------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INITIAL_WINDOW = 65535


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return head + payload


def header(name: bytes, value: bytes) -> bytes:
    """HPACK: a literal field, new name, not indexed, no Huffman (names, values < 127 B)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class StalledUpload(threading.Thread):
    """One connection, one call to `path`: a message prefix announcing `declared`
    bytes, `sent` of them sent as flow control allows, then nothing more. Pings are
    answered and windows tracked until the server ends the call or `stop` is set."""

    def __init__(self, address: str, path: bytes, declared: int, sent: int) -> None:
        super().__init__(daemon=True)
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.authority = address.encode()
        self.path, self.declared, self.sent_goal = path, declared, sent
        self.sent = 0
        self.stop = threading.Event()
        self.done_sending = threading.Event()
        self.ended_at: float | None = None  # when the server ended the call
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with socket.create_connection(self.target, timeout=30) as sock:
                self._talk(sock)
        except Exception as e:  # a reset counts as an end too
            self.error = e
            self.ended_at = self.ended_at or time.monotonic()
        finally:
            self.done_sending.set()

    def _talk(self, sock: socket.socket) -> None:
        fields = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", self.path),
            (b":authority", self.authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        block = b"".join(header(n, v) for n, v in fields)
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block))
        pending = b"\x00" + struct.pack(">I", self.declared)  # uncompressed, this long
        conn_window = stream_window = INITIAL_WINDOW
        initial = INITIAL_WINDOW
        chunk = bytes(16384)
        buf = b""
        sock.settimeout(None)
        while not self.stop.is_set() and self.ended_at is None:
            while self.sent < self.sent_goal and min(conn_window, stream_window) > 0:
                n = min(conn_window, stream_window, 16384, self.sent_goal - self.sent)
                body = (pending + chunk)[:n]
                pending = pending[len(body) :] if pending else b""
                sock.sendall(frame(DATA, 0, 1, body))
                self.sent += n
                conn_window -= n
                stream_window -= n
            if self.sent >= self.sent_goal:
                self.done_sending.set()
            if not select.select([sock], [], [], 0.05)[0]:
                continue
            data = sock.recv(1 << 16)
            if not data:
                self.ended_at = time.monotonic()
                return
            buf += data
            while len(buf) >= 9:
                size = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + size:
                    break
                kind, flags = buf[3], buf[4]
                stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9 : 9 + size], buf[9 + size :]
                if kind == SETTINGS and not flags & ACK:
                    for i in range(0, len(payload), 6):
                        key, value = struct.unpack(">HI", payload[i : i + 6])
                        if key == 4:  # SETTINGS_INITIAL_WINDOW_SIZE
                            stream_window += value - initial
                            initial = value
                    sock.sendall(frame(SETTINGS, ACK, 0))
                elif kind == WINDOW_UPDATE:
                    increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                    if stream == 0:
                        conn_window += increment
                    else:
                        stream_window += increment
                elif kind == PING and not flags & ACK:
                    sock.sendall(frame(PING, ACK, 0, payload))
                elif (
                    (kind == HEADERS and flags & END_STREAM)
                    or (kind == RST_STREAM and stream == 1)
                    or kind == GOAWAY
                ):
                    self.ended_at = time.monotonic()
        while not self.stop.is_set():  # the call is over; the connection stays, idle
            time.sleep(0.05)


# -- the test -----------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def health_latency(channel) -> float:
    t0 = time.monotonic()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - t0


def test_stalled_uploads_are_cut_and_their_memory_returned():
    args = ["--synthetic", "small", "--layers", "1", "--num-shards", "8", "--torch-threads", "1"]
    shard = start_shard(args, env={"EXPERTD_RECEIVE_TIMEOUT_S": str(RECEIVE_TIMEOUT_S)})
    uploads: list[StalledUpload] = []
    try:
        wait_serving([shard], timeout=120)
        pid = shard.process.pid
        with grpc.insecure_channel(shard.address) as channel:
            health_latency(channel)
            before = rss_mib(pid)
            t0 = time.monotonic()
            uploads = [
                StalledUpload(shard.address, FORWARD, DECLARED, SENT) for _ in range(CLIENTS)
            ]
            for u in uploads:
                u.start()
            latencies, during = [], before
            while not all(u.done_sending.is_set() or u.ended_at for u in uploads):
                during = max(during, rss_mib(pid))
                latencies.append(health_latency(channel))
                assert time.monotonic() - t0 < 120, "the uploads did not get through"
                time.sleep(0.1)
            held_mib = sum(u.sent for u in uploads) / 2**20
            deadline = time.monotonic() + RECEIVE_TIMEOUT_S + 30
            while not all(u.ended_at for u in uploads) and time.monotonic() < deadline:
                during = max(during, rss_mib(pid))
                latencies.append(health_latency(channel))
                time.sleep(0.1)
            ended = [u.ended_at - t0 for u in uploads if u.ended_at]
            assert len(ended) == CLIENTS, f"{CLIENTS - len(ended)} stalled calls still open"
            time.sleep(2.0)  # the server's periodic return of freed memory
            after = rss_mib(pid)
            latencies.append(health_latency(channel))
        print(
            f"RSS {before:.0f} MiB before, {during:.0f} during ({held_mib:.0f} MiB sent by "
            f"{CLIENTS} stalled clients), {after:.0f} after; calls cut after "
            f"{min(ended):.1f}-{max(ended):.1f} s; worst health latency {max(latencies):.2f} s"
        )
        assert max(ended) < RECEIVE_TIMEOUT_S + 20
        assert after - before < 256, f"{after - before:.0f} MiB still held after the calls ended"
        assert max(latencies) < 2.0
        assert shard.alive()
    finally:
        for u in uploads:
            u.stop.set()
        stop_shards([shard], timeout=30)
