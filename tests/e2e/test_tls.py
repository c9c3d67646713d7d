"""HTTPS without a load balancer: a gateway given `AXON_TLS_CERTFILE` and `AXON_TLS_KEYFILE` serves
TLS itself, with a certificate made here by a throwaway CA, in front of the shared sim stack.

The official `openai` client completes and streams over it; plain HTTP and clients that do not
trust the CA get nothing; the connection limits of `shared/guarded_http.py` still hold inside TLS;
and a gateway given half a TLS setup or an unusable file refuses to start (exit 2)."""

import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trustme
from openai import OpenAI

from services.cli import launcher
from services.cli.launcher import Service
from tests.e2e.conftest import SIM_MODEL
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e

HEAD_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path

    def trusting(self) -> ssl.SSLContext:
        """A client context that trusts the test's CA (and nothing else)."""
        return ssl.create_default_context(cafile=str(self.ca))


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = TlsFiles(ca=directory / "ca.pem", cert=directory / "cert.pem", key=directory / "key.pem")
    ca.cert_pem.write_to_path(str(files.ca))
    leaf.private_key_pem.write_to_path(str(files.key))
    for blob in leaf.cert_chain_pems:
        blob.write_to_path(str(files.cert), append=True)
    return files


def start_gateway(stack: Stack, sessions: Service, env: dict[str, str]) -> Service:
    port = launcher.free_port()
    return launcher.start_service(
        "gateway",
        env=stack.env({"AXON_SESSIONS_URL": sessions.url, **env}),
        port=port,
        name="gateway-tls",
        log_path=stack.log_dir / f"gateway-tls-{port}.log",
    )


@pytest.fixture(scope="module")
def tls_gateway(stack: Stack, sessions: Service, tls_files: TlsFiles) -> Iterator[Service]:
    gateway = start_gateway(
        stack,
        sessions,
        {
            "AXON_TLS_CERTFILE": str(tls_files.cert),
            "AXON_TLS_KEYFILE": str(tls_files.key),
            "AXON_REQUEST_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        },
    )
    try:
        # As `axon up` starts it: the launcher knows a gateway with a certificate speaks HTTPS.
        assert gateway.url == f"https://127.0.0.1:{gateway.port}"
        launcher.wait_ready([gateway], timeout_s=60)
        yield gateway
    finally:
        gateway.stop(timeout_s=15)


def test_the_openai_client_completes_and_streams_over_https(
    tls_gateway: Service, tls_files: TlsFiles, api_key: str
) -> None:
    with httpx.Client(verify=tls_files.trusting()) as http_client:
        client = OpenAI(
            base_url=f"https://127.0.0.1:{tls_gateway.port}/v1",
            api_key=api_key,
            http_client=http_client,
            max_retries=0,
            timeout=30,
        )
        messages = [{"role": "user", "content": "Hello over TLS"}]
        completion = client.chat.completions.create(model=SIM_MODEL, messages=messages, max_tokens=8)
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        assert len((completion.choices[0].message.content or "").split()) == 8

        stream = client.chat.completions.create(model=SIM_MODEL, messages=messages, max_tokens=40, stream=True)
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        # Streamed in pieces: one a token, or fewer where the worker, slowed by a busy machine,
        # put tokens that came while it was publishing into one chunk (its `Coalescer`).
        assert 1 < len([p for p in pieces if p]) <= 40
        assert len("".join(pieces).split()) == 40


def test_plain_http_and_untrusting_clients_get_nothing(tls_gateway: Service) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{tls_gateway.port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{tls_gateway.port}/health", timeout=5)


def tls_socket(port: int, files: TlsFiles) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock = files.trusting().wrap_socket(raw, server_hostname="127.0.0.1")
    sock.settimeout(HEAD_TIMEOUT_S + 5)
    return sock


def read_all(sock: ssl.SSLSocket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_the_connection_limits_hold_inside_tls(tls_gateway: Service, tls_files: TlsFiles) -> None:
    # Half a request head, then silence: answered 408 and closed after AXON_REQUEST_HEAD_TIMEOUT_S.
    with tls_socket(tls_gateway.port, tls_files) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        answer = read_all(sock)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"code":"request_timeout"' in answer
    assert HEAD_TIMEOUT_S - 0.2 <= waited < HEAD_TIMEOUT_S + 3
    # A head above AXON_MAX_HEADER_BYTES (32 KiB): 431 at once.
    with tls_socket(tls_gateway.port, tls_files) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx-big: " + b"a" * 40_000 + b"\r\n\r\n")
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    # A whole request on a kept-alive TLS connection is answered.
    with tls_socket(tls_gateway.port, tls_files) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("only the certificate", "AXON_TLS_KEYFILE is not set"),
        ("a missing key file", "AXON_TLS_KEYFILE ("),
        ("a key that is not the certificate's", "are not a PEM certificate and its unencrypted private key"),
    ],
)
def test_a_gateway_with_unusable_tls_settings_refuses_to_start(
    stack: Stack, sessions: Service, tls_files: TlsFiles, tmp_path: Path, case: str, expected: str
) -> None:
    other_key = tmp_path / "other-key.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    env = {
        "only the certificate": {"AXON_TLS_CERTFILE": str(tls_files.cert)},
        "a missing key file": {"AXON_TLS_CERTFILE": str(tls_files.cert), "AXON_TLS_KEYFILE": str(tmp_path / "none")},
        "a key that is not the certificate's": {
            "AXON_TLS_CERTFILE": str(tls_files.cert),
            "AXON_TLS_KEYFILE": str(other_key),
        },
    }[case]
    gateway = start_gateway(stack, sessions, env)
    assert gateway.process.wait(timeout=60) == 2, gateway.log_tail()
    log = gateway.log_text()
    assert "refusing_to_start" in log and "Refusing to start HTTPS" in log and expected in log, log
