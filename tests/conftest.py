"""Every test sees the defaults users get: no FXTRAIN_* variable from the environment changes what a
test means (a test that exercises one sets it itself with monkeypatch)."""
import gc
import os

import pytest

_KEEP = {"FXTRAIN_TEST_DEVICE", "FXTRAIN_LOG_LEVEL"}

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one intra-op thread each keeps them from fighting
    # over the cores (both the fxtrain model and its eager oracle run in the same worker, alike).
    import torch
    torch.set_num_threads(1)
# FXTRAIN_TEST_EXECUTOR=inductor runs the whole suite with that executor as the default of
# fxtrain.Options (a test that names an executor keeps it: those test one executor's features):
# the suite's second pass, the one `make test` does not run. Fresh processes a test starts (the
# CLI, cache and pipeline workers) keep the library's default.
EXECUTOR = os.environ.get("FXTRAIN_TEST_EXECUTOR")


# Inductor fuses kernels and so reorders float reductions, as torch.compile does (fxtrain's
# inductor executor gives torch.compile's numbers bit for bit on the models checked): its pass
# compares against eager at ten times the tolerances the eager executor's pass holds to.
INDUCTOR_TOLERANCE = 10.0


def _scaled_assert_close(assert_close):
    def check(actual, expected, *args, rtol=None, atol=None, **kwargs):
        if rtol is None and atol is None:
            rtol, atol = 1.3e-6, 1e-5   # torch's float32 defaults
        rtol, atol = (rtol or 0.0) * INDUCTOR_TOLERANCE, (atol or 0.0) * INDUCTOR_TOLERANCE
        return assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)
    return check


def _default_executor(init):
    def with_default(self, *args, **kwargs):
        kwargs.setdefault("executor", EXECUTOR)
        init(self, *args, **kwargs)
    return with_default


if EXECUTOR:
    import fxtrain
    fxtrain.Options.__init__ = _default_executor(fxtrain.Options.__init__)
if EXECUTOR == "inductor":
    import torch.testing
    torch.testing.assert_close = _scaled_assert_close(torch.testing.assert_close)


@pytest.fixture(autouse=True, scope="module")
def _older_objects_frozen():
    """What earlier test files left alive (torch's process-wide compile caches keep millions of
    objects) is moved out of the collector's sight for this file, and back after it: a full
    ``gc.collect()`` (tests that check what is freed call it) then costs this file's objects, not
    the whole process's (measured: 5.7M objects, 1-15 s per collection late in the suite). Nothing
    is lost: frozen objects are unfrozen, and collectable again, when the file ends."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _no_fxtrain_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FXTRAIN_") and name not in _KEEP:
            monkeypatch.delenv(name)


@pytest.fixture
def device():
    """The device parity tests run on (FXTRAIN_TEST_DEVICE, default cpu): see tests/utils.py."""
    from utils import DEVICE
    return DEVICE


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpu_only(reason): runs on the CPU whatever FXTRAIN_TEST_DEVICE says (gloo process groups, "
                   "fresh processes that build their own CPU models); the reason says why")
    config.addinivalue_line(
        "markers", "extended: runs in `make test-long`, not in `make test` (more models, sides or seeds of a "
                   "code path `make test` covers once; the suite's 15-minute budget on 2 cores)")
    config.addinivalue_line(
        "markers", "long: one of the suite's longest tests (minutes on 2 cores); started first, so that the "
                   "pytest-xdist workers do not end on it while the other worker idles")


def pytest_collection_modifyitems(config, items):
    # Stable sort: long tests first, the rest in collection order. With `-n 2` the wall time is at
    # least the longest test; started last, it would also add to the time the other worker waits.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
