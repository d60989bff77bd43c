"""Bearer-token auth and TLS for the shard server.

Every service but grpc.health.v1 needs `authorization: Bearer <token>` when the
server has a token; the comparison takes constant time, and a refused call
learns nothing but UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

from expertd.server.malformed import HANDLER_MAKERS

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSAL = "missing or invalid credentials"


def load_token(token_file: str | None) -> str | None:
    """The token from --auth-token-file, else EXPERTD_AUTH_TOKEN, else None (auth off)."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"auth token file {token_file} is empty")
        return token
    return os.environ.get("EXPERTD_AUTH_TOKEN") or None


def _refuse_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    return HANDLER_MAKERS[(handler.request_streaming, handler.response_streaming)](
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def allowed(self, metadata) -> bool:
        given = b""
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                break
        return hmac.compare_digest(given, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if self.allowed(handler_call_details.invocation_metadata):
            return handler
        return _refuse_handler(handler)


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
