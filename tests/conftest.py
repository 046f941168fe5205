"""Every test sees the defaults users get: no FXTRAIN_* variable from the environment changes what a
test means (a test that exercises one sets it itself with monkeypatch)."""
import os

import pytest

_KEEP = {"FXTRAIN_TEST_DEVICE", "FXTRAIN_LOG_LEVEL"}
# FXTRAIN_TEST_EXECUTOR=inductor runs the whole suite with that executor (FXTRAIN_EXECUTOR, which
# applies over explicit options too): the suite's second pass, the one `make test` does not run.
EXECUTOR = os.environ.get("FXTRAIN_TEST_EXECUTOR")


@pytest.fixture(autouse=True)
def _no_fxtrain_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FXTRAIN_") and name not in _KEEP:
            monkeypatch.delenv(name)
    if EXECUTOR:
        monkeypatch.setenv("FXTRAIN_EXECUTOR", EXECUTOR)


@pytest.fixture
def device():
    """The device parity tests run on (FXTRAIN_TEST_DEVICE, default cpu): see tests/utils.py."""
    from utils import DEVICE
    return DEVICE


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpu_only(reason): runs on the CPU whatever FXTRAIN_TEST_DEVICE says (gloo process groups, "
                   "fresh processes that build their own CPU models); the reason says why")
