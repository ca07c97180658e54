"""HTTPS from the `stoker` binary: both rustls users (kube's client, the AWS SDK's S3 client)
run with the one crypto provider the binary installs. The operator against the HTTPS API
server is the rest of this folder; here the worker's S3 client meets an HTTPS endpoint with a
self-signed certificate and must fail with a certificate error that names the store, never
a panic."""

import os
import ssl
import subprocess
import threading

import pytest

from conftest import free_port, stoker_bin


@pytest.fixture
def https_endpoint(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    import socket
    port = free_port()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    handshakes = []
    reached = threading.Event()

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                with ctx.wrap_socket(conn, server_side=True):
                    handshakes.append("ok")
            except (ssl.SSLError, OSError) as e:
                handshakes.append(str(e))
            reached.set()

    threading.Thread(target=serve, daemon=True).start()
    yield f"https://127.0.0.1:{port}", handshakes, reached
    sock.close()


def test_the_s3_client_speaks_tls_and_names_the_failure(https_endpoint):
    url, handshakes, reached = https_endpoint
    r = subprocess.run(
        [stoker_bin(), "dataset", "index", "s3://bucket/data", "--s3-endpoint", url,
         "--s3-path-style", "--s3-region", "us-east-1"],
        capture_output=True, text=True, timeout=120,
        # Static credentials and no instance metadata: nothing but the loopback endpoint.
        env=dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y",
                 AWS_EC2_METADATA_DISABLED="true", AWS_MAX_ATTEMPTS="1"))
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "panicked" not in out and "CryptoProvider" not in out, out
    assert "s3://bucket/data" in out, out
    # The client reached the TLS handshake (and refused the untrusted certificate). The server
    # thread records it once its side of the handshake ends, which can be after the client
    # has exited: wait for that (a liveness bound, not a timing check).
    reached.wait(timeout=30)
    assert handshakes, "no TLS handshake reached the server"
