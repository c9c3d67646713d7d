"""`GatewaySettings.tls_problem`: why the gateway cannot serve HTTPS with the files it was given
(the gateway then refuses to start; tests/e2e/test_tls.py runs it)."""

from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from services.gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def leaf() -> trustme.LeafCert:
    return trustme.CA().issue_cert("127.0.0.1")


def settings(cert: str | Path | None, key: str | Path | None) -> GatewaySettings:
    return GatewaySettings(
        tls_certfile=None if cert is None else str(cert), tls_keyfile=None if key is None else str(key)
    )


def test_no_files_or_empty_variables_mean_plain_http() -> None:
    assert settings(None, None).tls_problem() is None
    assert settings("", "").tls_problem() is None


def test_a_certificate_and_its_key_are_accepted(leaf: trustme.LeafCert, tmp_path: Path) -> None:
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    assert settings(tmp_path / "cert.pem", tmp_path / "key.pem").tls_problem() is None


def test_one_without_the_other_is_named(tmp_path: Path) -> None:
    assert settings(tmp_path / "c.pem", "").tls_problem() == (
        "AXON_TLS_KEYFILE is not set; HTTPS needs both AXON_TLS_CERTFILE and AXON_TLS_KEYFILE"
    )
    problem = settings(None, tmp_path / "k.pem").tls_problem()
    assert problem is not None and problem.startswith("AXON_TLS_CERTFILE is not set")


def test_an_unreadable_file_is_named(leaf: trustme.LeafCert, tmp_path: Path) -> None:
    leaf.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    assert settings(tmp_path, tmp_path / "key.pem").tls_problem() == (
        f"AXON_TLS_CERTFILE ({tmp_path}) cannot be read: Is a directory"
    )


def test_an_encrypted_key_is_refused_without_asking_for_a_password(leaf: trustme.LeafCert, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), password=None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    (tmp_path / "key.pem").write_bytes(encrypted)
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    problem = settings(tmp_path / "cert.pem", tmp_path / "key.pem").tls_problem()
    assert problem is not None and "are not a PEM certificate and its unencrypted private key" in problem
