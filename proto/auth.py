"""Optional bearer-token auth and TLS, the same on every specd server and client.

Server side (`specd serve draft|target|orchestrator`): `--token` (or SPECD_TOKEN) turns on the
`BearerToken` interceptor (proto/interceptors.py): calls without the token end
UNAUTHENTICATED, grpc.health.v1 stays open. `--tls-cert` + `--tls-key` (PEM files) serve TLS.
Client side (the orchestrator towards the services, `specd generate --server`, specd.proto.client):
the same token is sent as `authorization: Bearer <token>` metadata on every call, and
`--tls-ca` (the PEM of the CA that signed the servers' certificates) turns TLS on.
Certificates travel as bytes, not paths, so a Ray actor on another node needs no files.
"""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from specd.proto.interceptors import BearerToken, MalformedRequests

TOKEN_ENV = "SPECD_TOKEN"


@dataclass(frozen=True)
class ServerSecurity:
    token: str | None = None  # required bearer token; None = open
    tls_cert: bytes | None = None  # PEM certificate chain; None = plaintext
    tls_key: bytes | None = None  # PEM private key of tls_cert

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Auth first (an unauthenticated call learns nothing), then bad-bytes handling."""
        return ([BearerToken(self.token)] if self.token else []) + [MalformedRequests()]

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `address` with TLS or in plaintext; returns the port (0 when binding failed)."""
        if self.tls_cert:
            credentials = grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)])
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)


@dataclass(frozen=True)
class ClientSecurity:
    token: str | None = None  # sent as `authorization: Bearer <token>`
    tls_ca: bytes | None = None  # PEM of the CA to trust; None = plaintext

    def channel(self, address: str, options=()) -> grpc.aio.Channel:
        interceptors = [_TokenOnUnary(self.token), _TokenOnStream(self.token)] if self.token else None
        if self.tls_ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.tls_ca)
            return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


class _AttachToken:
    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One class per call shape: grpc.aio files an interceptor under the first shape it subclasses.
class _TokenOnUnary(_AttachToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _TokenOnStream(_AttachToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


# -- command-line flags -----------------------------------------------------------------------


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token",
        default=None,
        help=f"require this bearer token on every call but health checks (default: ${TOKEN_ENV}, else none)",
    )
    parser.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate (needs --tls-key)"
    )
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")


def add_client_flags(parser: argparse.ArgumentParser, towards: str, token: bool = True) -> None:
    """--tls-ca, and --token unless the server flags have it (the orchestrator uses one token both ways)."""
    if token:
        parser.add_argument("--token", default=None, help=f"bearer token for {towards} (default: ${TOKEN_ENV})")
    parser.add_argument(
        "--tls-ca", default=None, metavar="PEM", help=f"connect to {towards} over TLS, trusting this CA"
    )


def server_security_from_args(args: argparse.Namespace) -> ServerSecurity:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerSecurity(token=_token(args), tls_cert=_read(args.tls_cert), tls_key=_read(args.tls_key))


def client_security_from_args(args: argparse.Namespace) -> ClientSecurity:
    return ClientSecurity(token=_token(args), tls_ca=_read(args.tls_ca))


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get(TOKEN_ENV) or None


def _read(path: str | None) -> bytes | None:
    """A PEM file's bytes; ValueError (the command line shows it) when it cannot be read."""
    try:
        return Path(path).read_bytes() if path else None
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from error
