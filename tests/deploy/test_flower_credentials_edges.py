"""Flower credentials (:func:`fedproto.deploy.local_federation.make_credentials`) on unusual folders and renewals: the
current folder, a CA key that is not the CA's, a CA past its end date."""

from __future__ import annotations

import datetime
import os

import pytest

pytest.importorskip("flwr")
pytest.importorskip("cryptography")
pytestmark = pytest.mark.flower

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from fedproto.deploy.local_federation import make_credentials  # noqa: E402
from fedproto.errors import ConfigError  # noqa: E402


def test_the_current_folder_keeps_its_ca_key_beside_it(tmp_path, monkeypatch):
    (tmp_path / "creds").mkdir()
    monkeypatch.chdir(tmp_path / "creds")
    out = make_credentials(".", nodes=1)
    assert out.ca_cert.resolve() == tmp_path / "creds" / "ca.crt"
    key = tmp_path / "creds-ca" / "ca.key"
    assert key.is_file() and oct(key.stat().st_mode & 0o777) == "0o600"
    ca = x509.load_pem_x509_certificate(out.ca_cert.read_bytes())
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    assert ca.public_key() == private.public_key()


def test_renewal_with_another_cas_key_is_refused(tmp_path):
    make_credentials(tmp_path / "a", nodes=1)
    make_credentials(tmp_path / "b", nodes=1)
    before = (tmp_path / "a" / "server.pem").read_bytes()
    with pytest.raises(ConfigError, match=r"is not the key of .*ca\.crt.*give the CA's own key"):
        make_credentials(tmp_path / "a", nodes=1, ca_key=tmp_path / "b-ca" / "ca.key")
    assert (tmp_path / "a" / "server.pem").read_bytes() == before


def test_renewal_under_an_expired_ca_is_refused(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    (tmp_path / "c-ca").mkdir()
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(days=10))
          .not_valid_after(now - datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "c-ca" / "ca.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.chmod(tmp_path / "c-ca" / "ca.key", 0o600)
    with pytest.raises(ConfigError, match=r"ca\.crt.* expired on .*; make a new CA in a new folder"):
        make_credentials(folder, nodes=1)
    assert sorted(p.name for p in folder.iterdir()) == ["ca.crt"]
