"""Fixtures shared by every Python test folder (pytest loads this file for all of them)."""

import os
import pathlib
import subprocess

import pytest


@pytest.fixture(scope="session")
def torch():
    """The torch module, for the checks against the model itself. Where torch is not
    installed those tests skip; scripts/test.sh installs it and sets STOKER_REQUIRE_TORCH=1,
    so in CI a missing torch fails them instead of passing them by skipping."""
    try:
        import torch
    except ImportError as e:
        if os.environ.get("STOKER_REQUIRE_TORCH"):
            pytest.fail(f"torch is required (STOKER_REQUIRE_TORCH=1): {e}")
        pytest.skip(f"torch is not installed: {e}")
    return torch


@pytest.fixture(scope="session", autouse=True)
def tls_certs(tmp_path_factory):
    """Every worker the tests start serves TLS and every loader checks it, as in production: a
    CA and a certificate for 127.0.0.1 made once by `stoker certs`, handed over through the
    variables workers (STOKER_TLS_CERT, STOKER_TLS_KEY) and loaders (STOKER_TLS_CA) read. The
    folder, or None where there is no stoker binary (stages that start no worker)."""
    repo = pathlib.Path(__file__).resolve().parent
    stoker = os.environ.get("STOKER_BIN", str(repo / "target" / "release" / "stoker"))
    if not os.path.exists(stoker):
        yield None
        return
    out = tmp_path_factory.mktemp("tls")
    subprocess.run([stoker, "certs", "--name", "127.0.0.1", "--name", "localhost", "--out", str(out)],
                   check=True, capture_output=True)
    env = {"STOKER_TLS_CERT": out / "tls.crt", "STOKER_TLS_KEY": out / "tls.key", "STOKER_TLS_CA": out / "ca.crt"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    yield out
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
