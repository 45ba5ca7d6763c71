"""Throw-away PKI for one test control plane, made with the ``openssl`` command line.

Invariants:
  * everything lives in one directory owned by the cluster and dies with it; keys are
    mode 0600 and never leave it;
  * one self-signed CA signs the apiserver serving cert (SANs: localhost, 127.0.0.1, the
    first service IP and the in-cluster ``kubernetes.default...`` names) and the admin
    client cert (O=system:masters, so it bypasses RBAC; everyone else goes through it);
  * the service-account signing key pair is separate from the CA;
  * no Python crypto dependency: only ``openssl`` (present on every Debian image).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_DAYS = "3650"


class PKIError(RuntimeError):
    """openssl is missing or one of its commands failed."""


@dataclass(frozen=True)
class PKI:
    """Paths of the files the components and kubeconfigs need."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise PKIError("openssl is not installed (apt-get install openssl)")
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PKIError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def _key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
             str(path), cwd=path.parent)  # fmt: skip
    os.chmod(path, 0o600)


def _signed_cert(
    directory: Path, name: str, subject: str, extensions: list[str], ca: tuple[Path, Path]
) -> tuple[Path, Path]:
    key, csr, cert = (directory / f"{name}{suffix}" for suffix in (".key", ".csr", ".crt"))
    ext = directory / f"{name}.ext"
    _key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr), cwd=directory)
    ext.write_text("\n".join(extensions) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-days", _DAYS, "-sha256", "-extfile", str(ext), "-out", str(cert),
             cwd=directory)  # fmt: skip
    csr.unlink()
    ext.unlink()
    return cert, key


def make_pki(directory: Path, service_ip: str) -> PKI:
    """Create the CA, serving cert, admin client cert and SA key pair under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = directory / "ca.key", directory / "ca.crt"
    _key(ca_key)
    _openssl("req", "-x509", "-new", "-key", str(ca_key), "-subj", "/CN=mmis-test-ca",
             "-days", _DAYS, "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", str(ca_cert),
             cwd=directory)  # fmt: skip
    ca = (ca_cert, ca_key)
    sans = ",".join(
        [
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
            "IP:127.0.0.1",
            f"IP:{service_ip}",
        ]
    )
    serving = _signed_cert(
        directory,
        "apiserver",
        "/CN=kube-apiserver",
        [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=serverAuth",
            f"subjectAltName={sans}",
        ],
        ca,
    )
    admin = _signed_cert(
        directory,
        "admin",
        "/O=system:masters/CN=mmis-admin",
        [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=clientAuth",
        ],
        ca,
    )
    sa_key, sa_pub = directory / "sa.key", directory / "sa.pub"
    _key(sa_key)
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub), cwd=directory)
    return PKI(ca_cert, ca_key, serving[0], serving[1], admin[0], admin[1], sa_key, sa_pub)
