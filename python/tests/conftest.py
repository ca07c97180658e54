"""Fixtures: a synthetic dataset in a folder and real `stoker worker` processes serving it."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def stoker_bin() -> str:
    path = os.environ.get("STOKER_BIN", str(REPO / "target" / "release" / "stoker"))
    if not os.path.exists(path):
        pytest.skip(f"no stoker binary at {path} (cargo build --release, or set STOKER_BIN)")
    return path


def lab_bin() -> str:
    """The lab binary (synthetic datasets), built beside the product."""
    path = os.environ.get("STOKER_LAB", str(pathlib.Path(stoker_bin()).with_name("stoker-lab")))
    if not os.path.exists(path):
        pytest.skip(f"no stoker-lab binary at {path} (cargo build --release, or set STOKER_LAB)")
    return path


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    subprocess.run(
        [lab_bin(), "synth", "--out", str(out), "--samples", "40",
         "--samples-per-shard", "10", "--min-side", "64", "--max-side", "240"],
        check=True, capture_output=True,
    )
    return out


class Worker:
    def __init__(self, data: pathlib.Path, *args: str, token: str = "") -> None:
        auth = ["--no-auth"]
        if token:
            tok = data.parent / "token"
            tok.write_text(token)
            auth = ["--token-file", str(tok)]
        self.proc = subprocess.Popen(
            [stoker_bin(), "worker", "--data", str(data), "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--global-batch-size", "8",
             "--cpu-threads", "1", *auth, *args],
            stdout=subprocess.PIPE, text=True,
        )
        self.addr = ""
        for line in self.proc.stdout:
            if line.startswith("listening "):
                self.addr = line.split()[1]
                break
        assert self.addr, "worker exited before listening"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def worker(dataset):
    started = []

    def start(*args: str, token: str = "") -> Worker:
        w = Worker(dataset, *args, token=token)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def packed_worker(worker, dataset, max_tokens=2048):
    """A worker packing up to ``max_tokens`` (the dataset's sample lengths written first)."""
    subprocess.run([stoker_bin(), "dataset", "index", str(dataset), "--write-lengths"],
                   check=True, capture_output=True)
    return worker("--pack-max-tokens", str(max_tokens))


def launch(tmp_path, name, processes, script, **cfg):
    """``processes`` ranks of ``script`` on gloo; what each got, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"{name}-{{rank}}.json"
    cfg = {**cfg, "out": str(out)}
    procs = [
        subprocess.Popen([sys.executable, str(script), json.dumps(cfg)],
                         env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(processes),
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for r in range(processes)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * processes
    return [json.loads(pathlib.Path(str(out).format(rank=r)).read_text()) for r in range(processes)]
