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


# FXTRAIN_TEST_LAUNCH_RATES=accelerator gives every capture the launch model's accelerator rates
# (cost/launches.py), whatever the test device: the CPU then makes the sparsity decisions a GPU makes
# (the tiny test models' passes are off there, host launches costing more than the FLOPs they skip),
# so that a session without a GPU can run the suite as a GPU would decide.
if os.environ.get("FXTRAIN_TEST_LAUNCH_RATES") == "accelerator":
    from fxtrain.capture import pipeline
    from fxtrain.cost.launches import ACCELERATOR
    pipeline.rates_for = lambda device_type: ACCELERATOR
elif os.environ.get("FXTRAIN_TEST_LAUNCH_RATES"):
    raise pytest.UsageError("FXTRAIN_TEST_LAUNCH_RATES takes 'accelerator' or nothing")


@pytest.fixture(autouse=True, scope="module")
def _older_objects_frozen():
    """What earlier test files left alive (torch's process-wide compile caches keep millions of
    objects) is moved out of the collector's sight for this file, and back after it: a full
    ``gc.collect()`` (tests that check what is freed call it) then costs this file's objects, not
    the whole process's (measured: 5.7M objects, 1-15 s per collection late in the suite). Nothing
    is lost: frozen objects are unfrozen, and collectable again, when the file ends.

    The file's own garbage is collected before that (cheap: the older objects are still frozen), so
    that the next file does not freeze it for its whole run: a reference cycle through a test's
    exception (a traceback holding a PythonOp's pending call) otherwise kept that call's POOL entry
    alive through test_pythonop.py, whose tests check the pool empties, whenever pytest-xdist ran
    that file after test_pythonop_eager_semantics.py's raising Function on the same worker."""
    gc.freeze()
    yield
    gc.collect()
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _no_fxtrain_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FXTRAIN_") and name not in _KEEP:
            monkeypatch.delenv(name)


@pytest.fixture
def passes_whatever_they_cost(monkeypatch):
    """For tests of what the sparsity passes compute: the passes stay on whatever their kernel
    launches would cost on the test device. The launch model (cost/launches.py) turns off an
    ``"auto"`` pass whose added host work costs more than the FLOPs it skips, which it does for
    models as small as the suite's, on an accelerator and on the CPU; these tests check the
    rewrites' exactness on the test device, which needs them on. The launch model's own decisions are tested without this
    (tests/test_passes_unit.py, test_padding_elimination.py), and ``"on"`` would change the reports
    these tests read. The runtime's mode is then chosen by the CPU's rule too (cost/launches.py:
    ``replay_pays``), whose exchange rate a test may set (``BYTES_PER_BACKWARD_OP``)."""
    from fxtrain.capture import pipeline
    monkeypatch.setattr(pipeline, "rates_for", lambda device_type: None)


@pytest.fixture
def device():
    """The device this test runs on: FXTRAIN_TEST_DEVICE (default cpu), the CPU if marked cpu_only."""
    import utils
    return utils.current_device()


# ------------------------------------------------------------------------------- the test device
# FXTRAIN_TEST_DEVICE=cuda runs every test on that device, except those marked
# ``@pytest.mark.cpu_only(reason="...")`` (on a test, a class, a module's ``pytestmark`` or a
# ``pytest.param``): before each test's fixtures, ``utils.current_device()`` is set to the CPU for
# those and to the requested device for the others, and the terminal summary lists the reasons.
# ``--device-audit`` checks, on a machine without that device, that every other test uses it.


def _cpu_only_reason(item):
    """The reason of ``item``'s cpu_only marker, None when it has none; a marker without a reason
    is an error (the reason is what the summary shows)."""
    marker = item.get_closest_marker("cpu_only")
    if marker is None:
        return None
    reason = marker.kwargs.get("reason", marker.args[0] if marker.args else "")
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(f"{item.nodeid}: cpu_only needs a reason: @pytest.mark.cpu_only(reason=\"...\")")
    return reason


def pytest_addoption(parser):
    parser.addoption(
        "--device-audit", action="store_true",
        help="on a machine without FXTRAIN_TEST_DEVICE's device (default cuda when unset): fail every test not "
             "marked cpu_only that passes (it never put its model or batches on the test device), pass those that "
             "fail for the missing device, skip the cpu_only ones (docs/architecture.md, the suite)")
    parser.addoption(
        "--failure-log", metavar="PATH",
        help="append each failure's traceback to PATH as the test ends: a run that a timeout kills before "
             "pytest's summary (bench/gpu_report.sh on a lent GPU) still says why each test failed")


def pytest_runtest_logreport(report):
    """``--failure-log``: written by the controller (the process that prints the summary), not by
    pytest-xdist's workers, so each failure is there once, in the order the results came in."""
    if _FAILURE_LOG is None or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    text = report.longreprtext
    if len(text) > 8000:   # the end of a traceback says what failed; its start, where
        text = text[:2000] + "\n[...]\n" + text[-6000:]
    with open(_FAILURE_LOG, "a") as log:
        log.write(f"===== {report.nodeid} ({report.when})\n{text}\n\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    import torch
    import utils
    reason = _cpu_only_reason(item)
    utils._current = torch.device("cpu") if reason is not None else utils.REQUESTED_DEVICE
    if reason is not None:
        item.user_properties.append(("cpu_only", reason))  # reaches the xdist controller's summary


def pytest_terminal_summary(terminalreporter, config):
    import utils
    requested = str(utils.REQUESTED_DEVICE)
    if requested == "cpu":
        return
    by_reason = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, value in getattr(report, "user_properties", ()):
                if name == "cpu_only":
                    by_reason.setdefault(value, set()).add(report.nodeid)
    if not by_reason:
        return
    total = len(set().union(*by_reason.values()))
    ran = "were skipped by --device-audit" if _AUDIT_SIGNATURE is not None else "ran on the CPU"
    terminalreporter.write_sep("=", f"cpu_only: {total} tests {ran}, not on {requested}")
    for reason, nodeids in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        files = sorted({n.split("::")[0] for n in nodeids})
        terminalreporter.write_line(f"{len(nodeids):4d}  {reason}  [{', '.join(files)}]")
        if config.getoption("verbose") > 0:
            for nodeid in sorted(nodeids):
                terminalreporter.write_line(f"        {nodeid}")


# ------------------------------------------------------------------------------- --device-audit
_AUDIT_SIGNATURE = None   # the message torch raises when a tensor goes to the missing device
_AUDITED = None           # the device the audit checks for (tests may clear the variable)


def _start_device_audit():
    global _AUDIT_SIGNATURE, _AUDITED
    os.environ.setdefault("FXTRAIN_TEST_DEVICE", "cuda")
    import torch
    requested = _AUDITED = os.environ["FXTRAIN_TEST_DEVICE"]
    try:
        torch.empty(1).to(requested)
    except Exception as error:   # torch without CUDA: "Torch not compiled with CUDA enabled"
        _AUDIT_SIGNATURE = str(error).strip().splitlines()[0]
    else:
        raise pytest.UsageError(f"--device-audit needs a machine without {requested}: here tensors reach it, so "
                                f"run FXTRAIN_TEST_DEVICE={requested} without --device-audit")


def pytest_collection_modifyitems(config, items):
    # Stable sort: long tests first, the rest in collection order. With `-n 2` the wall time is at
    # least the longest test; started last, it would also add to the time the other worker waits.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    if config.getoption("--device-audit"):
        for item in items:
            if _cpu_only_reason(item) is not None:   # the plain CPU run covers these
                item.add_marker(pytest.mark.skip(reason="device audit: cpu_only"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _AUDIT_SIGNATURE is None or call.when == "teardown" or _cpu_only_reason(item) is not None:
        return
    report = outcome.get_result()
    touched = report.failed and _AUDIT_SIGNATURE in report.longreprtext
    if touched and call.when == "setup":      # a fixture reached the device: do not run the test
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, "device audit: reached the device in setup")
    elif touched:
        report.outcome, report.longrepr = "passed", None
    elif report.passed and call.when == "call":
        report.outcome = "failed"
        report.longrepr = (f"device audit: passed without FXTRAIN_TEST_DEVICE={_AUDITED}, "
                           "which this machine lacks: nothing of it went to the test device. Move its model and "
                           "batches with tests/utils.py's to_device/wrap_pair/current_device(), or mark it "
                           "@pytest.mark.cpu_only(reason=...).")


_FAILURE_LOG = None   # --failure-log


def pytest_configure(config):
    global _FAILURE_LOG
    _FAILURE_LOG = config.getoption("--failure-log")
    if config.getoption("--device-audit"):
        _start_device_audit()
    config.addinivalue_line(
        "markers", "cpu_only(reason): runs on the CPU whatever FXTRAIN_TEST_DEVICE says (gloo process groups, "
                   "fresh processes that build their own CPU models, source scans, CPU kernel routes); the "
                   "reason is listed in the terminal summary when the test device is not the CPU")
    config.addinivalue_line(
        "markers", "extended: runs in `make test-long`, not in `make test` (more models, sides or seeds of a "
                   "code path `make test` covers once; the suite's 15-minute budget on 2 cores)")
    config.addinivalue_line(
        "markers", "long: one of the suite's longest tests (minutes on 2 cores); started first, so that the "
                   "pytest-xdist workers do not end on it while the other worker idles")

