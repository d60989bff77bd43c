"""Channels and call metadata: TLS options, the bearer token, request ids.

One grpc.aio channel per address, shared by every call in flight (HTTP/2
multiplexes them). Reconnect backoff is capped low so a restarted replica is
reachable again within a second or two, not grpc's default two minutes.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import grpc

from expertd.codec import parse_forward_response, serialize_forward_request
from expertd.v1 import expertd_pb2 as pb

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _pem(value: bytes | str | os.PathLike | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


@dataclass(frozen=True, slots=True)
class TLS:
    """TLS for the channels: each field is PEM bytes or a file path.

    root_certificates: the CA that signed the servers (None = system roots);
    private_key + certificate_chain: the client's own, for mutual TLS;
    server_name: the name to check the server certificate against, when it
    differs from the host in the address (e.g. connecting by IP)."""

    root_certificates: bytes | str | os.PathLike | None = None
    private_key: bytes | str | os.PathLike | None = None
    certificate_chain: bytes | str | os.PathLike | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("TLS: private_key and certificate_chain go together (mutual TLS)")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            _pem(self.root_certificates), _pem(self.private_key), _pem(self.certificate_chain)
        )


def open_channel(address: str, tls: TLS | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = list(CHANNEL_OPTIONS)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


class ExpertStub:
    """expertd.v1.ExpertService on a channel, like the generated stub, except that
    Forward answers are read off the received bytes without a copy (expertd/codec.py)."""

    def __init__(self, channel: grpc.aio.Channel, telemetry=None) -> None:
        service = "/expertd.v1.ExpertService/"
        request = serialize_forward_request  # ForwardRequestOut or a message
        response = parse_forward_response
        if telemetry is not None:  # client/telemetry.py: the encode and decode stages
            request = telemetry.timed("encode", request)
            response = telemetry.timed("decode", response)
        self.Forward = channel.unary_unary(
            service + "Forward",
            request_serializer=request,
            response_deserializer=response,
        )
        self.ForwardStream = channel.stream_stream(
            service + "ForwardStream",
            request_serializer=request,
            response_deserializer=response,
        )
        self.Describe = channel.unary_unary(
            service + "Describe",
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.DescribeResponse.FromString,
        )
        self.RegisterSlots = channel.unary_unary(
            service + "RegisterSlots",
            request_serializer=pb.RegisterSlotsRequest.SerializeToString,
            response_deserializer=pb.RegisterSlotsResponse.FromString,
        )
        self.RegisterRemoteSlots = channel.unary_stream(
            service + "RegisterRemoteSlots",
            request_serializer=pb.RegisterSlotsRequest.SerializeToString,
            response_deserializer=pb.RegisterSlotsResponse.FromString,
        )


def metadata_tuples(metadata) -> list[tuple[str, str]]:
    """A dict or (key, value) pairs -> gRPC metadata (keys lower case, as gRPC wants)."""
    if not metadata:
        return []
    items = metadata.items() if isinstance(metadata, dict) else metadata
    return [(str(k).lower(), str(v)) for k, v in items]


# Made-up request ids: this process's random prefix and a counter, 16 hex digits as a
# uuid4's first 16 were (2 us a call for uuid4 here, 0.2 for this), unique across
# processes but for a 1 in 2^32 clash of prefixes.
_ID_PREFIX = os.urandom(4).hex()
_id_counter = itertools.count()


def _new_id_prefix() -> None:  # a forked child makes ids of its own
    global _ID_PREFIX
    _ID_PREFIX = os.urandom(4).hex()


os.register_at_fork(after_in_child=_new_id_prefix)


def call_metadata(
    base: list[tuple[str, str]], token: str | None, request_id: str | None, extra
) -> tuple[tuple[str, str], ...]:
    """Client-wide metadata, the bearer token, `x-request-id` (one made up when
    not given, so server logs of one call can be found), then per-call metadata."""
    md = list(base)
    if token:
        md.append(("authorization", f"Bearer {token}"))
    md.append(("x-request-id", request_id or f"{_ID_PREFIX}{next(_id_counter) & 0xFFFFFFFF:08x}"))
    md.extend(metadata_tuples(extra))
    return tuple(md)
