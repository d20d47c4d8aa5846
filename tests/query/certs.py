"""Certificates for the TLS tests, made by trustme: a CA, a certificate for
the loopback listeners (127.0.0.1, ::1, localhost), a client certificate of
the same CA, and a second CA that trusts none of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme

from stallwatch.query.tls import ClientTls, ServerTls


@dataclass(frozen=True, slots=True)
class Certs:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # trusts none of the above

    def server(self, mutual: bool = False) -> ServerTls:
        return ServerTls(self.cert, self.key, self.ca if mutual else None)

    def client(self, with_cert: bool = False, ca: Path | None = None) -> ClientTls:
        if with_cert:
            return ClientTls(ca or self.ca, self.client_cert, self.client_key)
        return ClientTls(ca or self.ca)


def make_certs(folder: Path, *names: str) -> Certs:
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert(*(names or ("127.0.0.1", "::1", "localhost")))
    client = ca.issue_cert("stallwatch-client")
    paths = {n: folder / f"{n}.pem" for n in ("ca", "cert", "key", "ccert", "ckey", "other")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    other.cert_pem.write_to_path(str(paths["other"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["ccert"]))
    client.private_key_pem.write_to_path(str(paths["ckey"]))
    return Certs(
        paths["ca"], paths["cert"], paths["key"], paths["ccert"], paths["ckey"], paths["other"]
    )
