"""TLS for the agents' HTTP surface: the server's context (certificate, key,
and a CA for client certificates: mutual TLS) and the clients' (a CA that
must have signed the agent's certificate, and a certificate of their own
for agents that ask for one).

Every file is checked when the context is made, and a bad one is named in a
one-line ``UsageError`` (missing, not PEM, a key that does not match its
certificate), never an ``ssl`` traceback.  Clients check the agent's name
against its certificate: address agents by a name or IP address that the
certificate lists.  (The command-line options are
``stallwatch.commands.options``.)
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import UsageError


@dataclass(frozen=True, slots=True)
class ServerTls:
    cert: Path
    key: Path
    client_ca: Path | None = None  # client certificates must chain to it

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(ctx, self.cert, self.key, "--tls-cert", "--tls-key")
        if self.client_ca is not None:
            _load_ca(ctx, self.client_ca, "--tls-client-ca")
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True, slots=True)
class ClientTls:
    ca: Path | None  # None: the system's trusted CAs
    cert: Path | None = None  # a client certificate, for mutual TLS
    key: Path | None = None
    ca_flag: str = "--tls-ca"

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            _load_ca(ctx, self.ca, self.ca_flag)
        if (self.cert is None) != (self.key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        if self.cert is not None and self.key is not None:
            _load_chain(ctx, self.cert, self.key, "--tls-cert", "--tls-key")
        return ctx


def server_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> ServerTls | None:
    """The server's TLS files from the command line, or None for plain HTTP."""
    if cert is None and key is None:
        if client_ca is not None:
            raise UsageError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise UsageError("--tls-cert and --tls-key go together")
    return ServerTls(cert, key, client_ca)


def _readable(path: Path, flag: str) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None


def _load_ca(ctx: ssl.SSLContext, path: Path, flag: str) -> None:
    _readable(path, flag)
    try:
        ctx.load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise UsageError(f"{flag} {path}: not a PEM CA certificate ({_why(exc)})") from None


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path, cert_flag: str, key_flag: str) -> None:
    _readable(cert, cert_flag)
    _readable(key, key_flag)
    try:  # the certificate alone first, so that a bad one is named as such
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(cert))
    except ssl.SSLError as exc:
        raise UsageError(f"{cert_flag} {cert}: not a PEM certificate ({_why(exc)})") from None
    try:
        ctx.load_cert_chain(str(cert), str(key), password=_no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise UsageError(f"{key_flag} {key}: does not match {cert_flag} {cert}") from None
        raise UsageError(
            f"{key_flag} {key}: not an unencrypted PEM private key ({_why(exc)})"
        ) from None


def _no_password() -> str:
    raise ssl.SSLError("the key is encrypted: the agent cannot ask for its password")


def _why(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.strerror or exc).lower().replace("_", " ")


def describe_failure(exc: BaseException, ca: Path | None, client_cert: bool = True) -> str:
    """One line for a failed TLS connection, naming the CA file that did not
    trust the agent."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        trusted = f"--tls-ca {ca}" if ca is not None else "the system's CAs"
        return f"TLS: the agent's certificate is not trusted by {trusted}: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        # Refusing a client without a certificate, a TLS 1.3 server closes
        # after the handshake: the client sees an alert or just the close.
        hint = "" if client_cert else " (does it ask for a client certificate: --tls-cert?)"
        return f"TLS: {_why(exc)}{hint}"
    return str(exc)
