"""The `tcp` data plane's wire: tensors framed raw on a TCP connection of their own.

gRPC stays the control plane: RegisterSlots (authenticated) books a lease and
answers with a one-time token and the shard's data port (on the host of its gRPC
address). The client opens one connection per slot and presents HELLO (magic,
token, slot index); the shard answers one byte, READY, or REFUSED with why, and
closes. From then on each connection carries one call at a time, each way a fixed
little-endian header then the tensors' bytes, straight from and into the slots'
buffers (a `dataplane.Layout`, as the shared-memory slots use):

    call:    CALL   | x bf16 [m, H] | ids int32 [m, k] | weights fp32 [m, k]
    answer:  ANSWER | the partial bf16 [rows, H]   (or error_len bytes of UTF-8 text)

Nothing goes through protobuf or an HTTP/2 frame: the bytes are copied once by
the kernel on each side (socket -> slot buffer, slot buffer -> socket). The
connections are the lease: one of them ending (the client closed it, its process
died, the shard stopped) ends them all, and the calls in flight fail with
UNAVAILABLE, as on the other slot transports. docs/dataplane.md, "Across hosts:
raw TCP", has the design and the figures.

The tensors travel in the clear: a shard with TLS on offers no tcp data plane.
"""

from __future__ import annotations

import socket
import struct

TCP = "tcp"

MAGIC = b"EXD2"  # EXD1's call header had no trace context
TOKEN_BYTES = 24
HELLO = struct.Struct("<4s24sI")  # magic, token, slot index
READY = b"R"
REFUSED = b"X"  # + why (UTF-8, at most 200 bytes), then the connection closes
# seq, layer, m, k, timeout_us (0: no limit), request_id, then the caller's span:
# trace_hi, trace_lo, span_id (0: none), trace_flags (expertd.tracing.context_fields)
CALL = struct.Struct("<IIIIQQQQQI4x")
# seq, status (a grpc.StatusCode value, 0: OK), rows, error_len, then the timing of
# expertd.v1.Timing: queue_us, compute_us, total_us, stage_us, device_us,
# batch_requests, batch_tokens (dataplane.TIMING_FIELDS' order)
ANSWER = struct.Struct("<IiIIQQQQQII")
MAX_ERROR_BYTES = 1024


class PeerGone(ConnectionError):
    """The other end closed the connection (EOF)."""


def tune(sock: socket.socket) -> None:
    """Small frames leave at once (no Nagle delay); a dead peer is found by keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (PeerGone at EOF; socket.timeout per the socket's)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerGone("connection closed by the peer")
        got += k


def send_all(sock: socket.socket, buffers: list) -> None:
    """Send every buffer, in order, with as few syscalls as the socket allows."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def send_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking socket's sends give up after `seconds` (SO_SNDTIMEO; 0: never)."""
    seconds = max(seconds, 1e-3)
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def pack_hello(token: bytes, index: int) -> bytes:
    return HELLO.pack(MAGIC, token, index)


def unpack_hello(data: bytes) -> tuple[bytes, int]:
    """-> (token, slot index); ValueError when it is not a HELLO."""
    if len(data) != HELLO.size:
        raise ValueError("short hello")
    magic, token, index = HELLO.unpack(data)
    if magic != MAGIC:
        if magic[:3] == MAGIC[:3]:  # another version of this wire
            theirs, ours = magic.decode("ascii", "replace"), MAGIC.decode()
            raise ValueError(f"tcp data plane {theirs} from the client, this shard speaks {ours}")
        raise ValueError("not an expertd tcp data plane hello")
    return token, index


def host_of(address: str) -> str:
    """The host part of a gRPC target 'HOST:PORT' or '[v6]:PORT' (dns:/// allowed)."""
    target = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host = target.rpartition(":")[0] if ":" in target else target
    return host.strip("[]")
