"""Certificates for one lab run, made afresh with the ``openssl`` command: a
CA, one certificate per node for its address (the agent serves HTTPS with it
and presents it to its peers), and one for the lab's own requests (health
checks, dump requests, queries from tests).  The agents ask every client for
a certificate of the CA (mutual TLS), so a run exercises the path a cluster
runs.  Keys are EC P-256 and live in the run's folder only.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from stallwatch.dumpers.errors import LabError
from stallwatch.query.tls import ClientTls, ServerTls

_DAYS = "2"
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True, slots=True)
class LabCerts:
    folder: Path
    ca: Path
    client_cert: Path
    client_key: Path

    def node_cert(self, index: int) -> tuple[Path, Path]:
        return self.folder / f"node{index}.pem", self.folder / f"node{index}.key"

    def server(self, index: int) -> ServerTls:
        cert, key = self.node_cert(index)
        return ServerTls(cert, key, self.ca)

    def client(self) -> ClientTls:
        """What the lab (and a test) uses to reach the agents."""
        return ClientTls(self.ca, self.client_cert, self.client_key)

    def agent_args(self, index: int) -> list[str]:
        cert, key = self.node_cert(index)
        return [
            "--tls-cert", str(cert), "--tls-key", str(key),
            "--tls-client-ca", str(self.ca), "--tls-ca", str(self.ca),
        ]  # fmt: skip


def _openssl(*args: str) -> None:
    try:
        subprocess.run(["openssl", *args], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise LabError("the lab needs the openssl command for its certificates") from None
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr or "").strip().splitlines()[-1:] or ["?"]
        raise LabError(f"openssl {args[0]} failed: {last[0]}") from None


def _issue(folder: Path, name: str, subject_alt: str, ca: Path, ca_key: Path) -> None:
    key, csr, cert = (folder / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
    ext = folder / f"{name}.ext"
    ext.write_text(
        f"subjectAltName={subject_alt}\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    _openssl("req", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", _DAYS, "-out", str(cert), "-extfile", str(ext),
    )  # fmt: skip
    csr.unlink()
    ext.unlink()
    key.chmod(0o600)


def make_certs(folder: Path, node_ips: dict[int, str]) -> LabCerts:
    """A CA, a certificate per node (for its IP address) and a client's."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    _openssl(
        "req", "-x509", *_EC, "-keyout", str(ca_key), "-out", str(ca), "-days", _DAYS,
        "-subj", "/CN=stallwatch lab CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    for index, ip in node_ips.items():
        _issue(folder, f"node{index}", f"IP:{ip}", ca, ca_key)
    _issue(folder, "client", "DNS:stallwatch-lab-client", ca, ca_key)
    ca_key.unlink()  # nothing more to sign
    return LabCerts(folder, ca, folder / "client.pem", folder / "client.key")
