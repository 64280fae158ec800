"""TLS certificates and SuperNode keys for a Flower federation (:func:`make_credentials`, with the
``cryptography`` package Flower itself depends on): a CA, a SuperLink certificate signed by it, and
one EC (P-384) key pair per SuperNode in OpenSSH format, as Flower's SuperNode authentication
expects. Used by :class:`fedproto.deploy.local_federation.LocalFederation`, and importable from
:mod:`fedproto.deploy.local_federation` too."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from fedproto.errors import ConfigError


@dataclass
class Credentials:
    """Paths of the files :func:`make_credentials` writes (PEM certificates and keys; node keys in
    OpenSSH format: ``node_keys[i]`` is (private key, public key) of SuperNode i)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: list[tuple[Path, Path]] = field(default_factory=list)


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only (mode 0600 from its creation, not after)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_credentials(folder: str | Path, nodes: int, days: int = 365,
                     addresses: tuple[str, ...] = ("127.0.0.1", "localhost"),
                     ca_key: str | Path | None = None) -> Credentials:
    """Write into ``folder`` a CA (``ca.crt``), a SuperLink TLS certificate signed by it
    (``server.pem``, key ``server.key``) valid for ``addresses`` (IP addresses and host names: the
    address the SuperNodes and ``flwr`` connect to), and ``nodes`` SuperNode key pairs (``node<i>``,
    ``node<i>.pub``: EC P-384, OpenSSH format). Private keys are written with mode 0600.

    The CA's private key is kept apart from ``folder`` (whose files are copied to the machines): in
    ``ca_key`` (default ``<folder>-ca/ca.key``, its folder mode 0700). Renewal: call again with the same
    ``folder`` and ``ca_key`` before ``days`` run out: the CA is kept (the SuperNodes' ``ca.crt`` stays
    valid), the SuperLink certificate and key are issued anew, and node key pairs that exist are kept (the
    SuperLink's list of authorized keys stays valid); only missing ones are made.

    Args:
        folder: where the certificates and the keys the machines need go (created).
        nodes: how many SuperNode key pairs ``node0`` .. ``node<nodes-1>`` the folder holds.
        days: validity of the certificates, in days (a new CA only; a kept CA keeps its own).
        addresses: the SuperLink's IP addresses and host names.
        ca_key: file of the CA's private key (PEM, PKCS#8).

    Raises:
        ConfigError: ``nodes`` < 0, ``days`` < 1, no ``addresses``, or a ``ca.crt`` in ``folder`` without its
            key at ``ca_key`` (or the reverse): a CA cannot be renewed from half of it; a ``ca_key`` that is
            not the key of ``ca.crt``; a kept CA past its end date.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if nodes < 0:
        raise ConfigError(f"nodes={nodes}: give the number of SuperNode key pairs, >= 0")
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ConfigError(f"days={days!r}: give the certificates' lifetime as a whole number of days, >= 1")
    if isinstance(addresses, str) or not addresses:
        raise ConfigError(f"addresses={addresses!r}: give a tuple of the SuperLink's IP addresses and host names, "
                          "e.g. ('10.0.0.1', 'superlink.example.org')")

    def name(a: str):
        try:
            return x509.IPAddress(ipaddress.ip_address(a))
        except ValueError:
            return x509.DNSName(a)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    named = Path(os.path.abspath(folder))  # "." or "creds/..": the folder's own name, for <folder>-ca
    ca_key_path = Path(ca_key) if ca_key is not None else named.with_name(named.name + "-ca") / "ca.key"
    now = datetime.datetime.now(datetime.timezone.utc)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    out = Credentials(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    if out.ca_cert.is_file() != ca_key_path.is_file():
        have, lack = (out.ca_cert, ca_key_path) if out.ca_cert.is_file() else (ca_key_path, out.ca_cert)
        raise ConfigError(f"{str(have)!r} exists but {str(lack)!r} does not: a CA is renewed from its certificate "
                          "and its key together; give the key's path as ca_key, or a new folder for a new CA")
    if out.ca_cert.is_file():  # renewal: keep the CA
        ca = x509.load_pem_x509_certificate(out.ca_cert.read_bytes())
        ca_private = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        ca_name = ca.subject
        if ca.public_key() != ca_private.public_key():
            raise ConfigError(f"{str(ca_key_path)!r} is not the key of {str(out.ca_cert)!r} (another CA's); give the "
                              "CA's own key as ca_key, or a new folder for a new CA")
        if ca.not_valid_after_utc <= now:
            raise ConfigError(f"the CA {str(out.ca_cert)!r} expired on {ca.not_valid_after_utc:%Y-%m-%d}; make a new "
                              "CA in a new folder (and give the SuperNodes its ca.crt)")
    else:
        ca_private = ec.generate_private_key(ec.SECP384R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedproto local CA")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
              .public_key(ca_private.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now)
              .not_valid_after(now + datetime.timedelta(days=days))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .sign(ca_private, hashes.SHA256()))
        ca_key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(ca_key_path, pem_key(ca_private))
        out.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    until = min(now + datetime.timedelta(days=days), ca.not_valid_after_utc)
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(addresses[0]))]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(x509.SubjectAlternativeName([name(str(a)) for a in addresses]), critical=False)
            .sign(ca_private, hashes.SHA256()))
    out.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out.server_key, pem_key(key))
    for i in range(nodes):
        priv, pub = folder / f"node{i}", folder / f"node{i}.pub"
        if not (priv.is_file() and pub.is_file()):
            k = ec.generate_private_key(ec.SECP384R1())
            _write_private(priv, k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                 serialization.NoEncryption()))
            pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                        serialization.PublicFormat.OpenSSH))
        out.node_keys.append((priv, pub))
    return out


__all__ = ["Credentials", "make_credentials"]
