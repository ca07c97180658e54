"""The image scripts/build-image.sh builds: started with podman (runc, cgroupfs, read-only
root, non-root user), `stoker worker` inside it serves a real client outside it over TLS."""

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path(os.environ.get("STOKER_CACHE") or pathlib.Path.home() / ".cache" / "stoker")
ARCHIVE = CACHE / "image" / "stoker.oci.tar"


def podman_env() -> dict:
    return dict(os.environ, CONTAINERS_CONF=str(CACHE / "podman" / "containers.conf"),
                CONTAINERS_STORAGE_CONF=str(CACHE / "podman" / "storage.conf"))


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True,
                       timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {r.stderr}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None or not ARCHIVE.exists():
        msg = f"no podman or no {ARCHIVE}: run scripts/build-image.sh"
        if os.environ.get("STOKER_REQUIRE_IMAGE"):
            pytest.fail(msg)
        pytest.skip(msg)
    out = podman("load", "-q", "-i", str(ARCHIVE)).stdout
    return out.strip().split()[-1]


@pytest.fixture(scope="module")
def shared_dirs():
    """A dataset, the tokenizer and TLS certificates, readable by the image's non-root user."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="stoker-image-"))
    stoker = os.environ.get("STOKER_BIN", str(REPO / "target" / "release" / "stoker"))
    data = root / "data"
    lab = os.environ.get("STOKER_LAB", str(pathlib.Path(stoker).with_name("stoker-lab")))
    subprocess.run([lab, "synth", "--out", str(data), "--samples", "16",
                    "--samples-per-shard", "8", "--min-side", "64", "--max-side", "200"],
                   check=True, capture_output=True)
    tok = root / "tokenizer"
    shutil.copytree(os.environ.get("STOKER_TOKENIZER", CACHE / "qwen-tokenizer"), tok)
    tls = root / "tls"
    subprocess.run([stoker, "certs", "--name", "127.0.0.1", "--out", str(tls)], check=True,
                   capture_output=True)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    yield data, tok, tls
    shutil.rmtree(root, ignore_errors=True)


def test_a_worker_in_the_image_serves_a_client_outside_it(image, shared_dirs):
    import stoker

    data, tok, tls = shared_dirs
    port, metrics = free_port(), free_port()
    name = f"stoker-image-test-{os.getpid()}"
    podman("run", "-d", "--name", name, "--network", "host", "--read-only",
           "--tmpfs", "/tmp", "-v", f"{data}:/data:ro", "-v", f"{tok}:/tokenizer:ro",
           "-v", f"{tls}:/tls:ro", "-e", "STOKER_TLS_CERT=/tls/tls.crt", "-e", "STOKER_TLS_KEY=/tls/tls.key",
           "-e", "STOKER_TOKEN=image-test", image,
           "worker", "--data", "/data", "--tokenizer", "/tokenizer",
           "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}",
           "--global-batch-size", "8", "--cpu-threads", "1")
    try:
        inspect = podman("inspect", "--format", "{{.Config.User}}", name).stdout.strip()
        assert inspect == "65532:65532", inspect
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = podman("logs", name, check=False)
                pytest.fail(f"worker in the image never ready: {logs.stdout}{logs.stderr}")
            time.sleep(0.5)
        loader = stoker.Loader(f"127.0.0.1:{port}", rank=0, world_size=1, token="image-test",
                               tls_ca=str(tls / "ca.crt"))
        batch = next(iter(loader))
        assert len(batch.sample_ids) == 8
        assert batch.tensors["pixel_values"].shape[0] > 0
        assert batch.tensors["input_ids"].shape[0] == 8
    finally:
        podman("rm", "-f", name, check=False)
