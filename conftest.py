"""Fixtures shared by every Python test folder (pytest loads this file for all of them)."""

import os

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
