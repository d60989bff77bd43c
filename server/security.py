"""Bearer-token auth and TLS for the shard server.

Every service but grpc.health.v1 needs `authorization: Bearer <token>` (one such
header, no more) when the server has a token; the comparison takes constant time,
and a refused call learns nothing but UNAUTHENTICATED. The refusal is decided on the
call's headers alone: its request body is never received nor parsed.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSAL = "missing or invalid credentials"


def load_token(token_file: str | None, environ=os.environ) -> str | None:
    """The token from --auth-token-file, else EXPERTD_AUTH_TOKEN, else None (auth off).

    Surrounding whitespace is dropped (a file written by `echo` ends in a newline);
    a blank token, or one with characters a gRPC header cannot carry, is an error:
    a server meant to have auth never starts without it."""
    if token_file:
        where, raw = f"auth token file {token_file}", Path(token_file).read_text()
    elif "EXPERTD_AUTH_TOKEN" in environ:
        where, raw = "EXPERTD_AUTH_TOKEN", environ["EXPERTD_AUTH_TOKEN"]
    else:
        return None
    token = raw.strip()
    if not token:
        raise ValueError(f"{where} is empty: give a token, or unset it to serve without auth")
    if not all(" " <= c <= "~" for c in token):
        raise ValueError(f"{where}: the token must be printable ASCII (it travels in a header)")
    return token


async def _refuse(_requests, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


# Request-streaming handlers that never read: grpc receives no request message for
# a refused call (its body stays in the client's flow-control window), let alone
# parses one. Keyed by whether the method streams its responses.
_REFUSALS = {
    False: grpc.stream_unary_rpc_method_handler(_refuse),
    True: grpc.stream_stream_rpc_method_handler(_refuse),
}


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def allowed(self, metadata) -> bool:
        given = [
            value.encode() if isinstance(value, str) else value
            for key, value in metadata or ()
            if key == "authorization"
        ]
        # Exactly one header: with two, proxies and servers disagree on which counts.
        ok = hmac.compare_digest(given[0] if given else b"", self._expected)
        return ok and len(given) == 1

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None or self.allowed(handler_call_details.invocation_metadata):
            return handler
        return _REFUSALS[handler.response_streaming]


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None
) -> grpc.ServerCredentials | None:
    """TLS from PEM files (mutual TLS when a client CA is given); None = plaintext."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    pair = (Path(key).read_bytes(), Path(cert).read_bytes())
    ca = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )
