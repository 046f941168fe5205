"""The on-disk cache (Options.cache_dir): a hit trains exactly like eager without capturing; every
change that alters the graph is a miss; entries survive concurrent writers and corruption."""
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxtrain
from fxtrain import cli, models
from fxtrain.cache.store import MAGIC, Store
from utils import current_device, long_params, to_device, train_parity, wrap_pair

ROOT = Path(__file__).resolve().parent.parent
STATE_ATOL = 3e-4  # as in test_label_sparsity: AdamW magnifies rounding noise of zero-true gradients


def _mlm(intermediate=None):
    torch.manual_seed(0)
    return models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000, intermediate=intermediate)


def _batches(n=3, shape=(4, 16), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [models.synthetic_batch("mlm", shape[0], shape[1], 1000, padding=0.4, label_density=0.2, generator=g,
                                   device=current_device())
            for _ in range(n)]


def _loss(out, _batch):
    return out.loss


def _one_step(tm, batch):
    tm(**batch).loss.backward()


def _entries(d):
    return sorted(p.name for p in Path(d).iterdir() if p.suffix == ".fxc")


def _stored(tmp_path, **options):
    """Capture once with the cache on, which writes the entry; returns the writer."""
    tm, _ = wrap_pair(_mlm(options.pop("intermediate", None)), cache_dir=str(tmp_path), **options)
    _one_step(tm, _batches(1)[0])
    assert tm.capture_info().cache_misses == 1 and len(_entries(tmp_path)) == 1, tm.capture_info().cache_log
    return tm


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_hit_trains_like_eager_without_capturing(tmp_path, caplog):
    _stored(tmp_path)
    tm, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="fxtrain"):
        train_parity(tm, ref, _batches(3), _loss, state_atol=STATE_ATOL,
                     compare_outputs=lambda o, r: torch.testing.assert_close(o.logits, r.logits, atol=1e-4, rtol=1e-4))
    info = tm.capture_info()
    assert (info.cache_hits, info.cache_misses, info.graphs) == (1, 0, 1), info.cache_log
    assert info.records[0].dynamo_graph is None and info.records[0].backward_graph is not None  # nothing traced
    assert info.optimizations["label_sparsity"].startswith("on:")  # the passes' reports come with the entry
    assert "fxtrain cache: hit" in caplog.text and "cache:" in str(info)


def test_a_new_shape_falls_back_to_capture_and_stays_exact(tmp_path):
    _stored(tmp_path, dynamic=None)  # the default: the entry holds the first batch's static sizes
    tm, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path), dynamic=None)
    batches = _batches(1) + _batches(1, shape=(3, 11), seed=2) + _batches(1, shape=(5, 20), seed=3)
    train_parity(tm, ref, batches, _loss, state_atol=STATE_ATOL)
    info = tm.capture_info()
    assert info.cache_hits == 1 and info.graphs == 2  # the entry's static sizes, then one symbolic capture


@pytest.mark.cpu_only("fresh processes build and train their own models on the CPU")
def test_hit_in_a_fresh_process_gives_eagers_losses(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys, torch, fxtrain
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_cache import _mlm, _batches
        tm = fxtrain.TrainModule(_mlm(), fxtrain.Options(cache_dir={str(tmp_path)!r}, fallback="raise"))
        opt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
        losses = []
        for b in _batches(3):
            loss = tm(**b).loss
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        info = tm.capture_info()
        print(json.dumps(dict(losses=losses, hits=info.cache_hits, misses=info.cache_misses)))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), FXTRAIN_TEST_DEVICE="cpu")   # _batches on the CPU there
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                                      text=True, timeout=600).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert (runs[0]["hits"], runs[0]["misses"]) == (0, 1) and (runs[1]["hits"], runs[1]["misses"]) == (1, 0)
    ref = _mlm()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    expected = []
    for b in _batches(3):
        loss = ref(**b).loss
        loss.backward(); opt.step(); opt.zero_grad()
        expected.append(loss.item())
    for run in runs:
        assert run["losses"] == pytest.approx(expected, abs=1e-5)


# ------------------------------------------------------------------------------------ the key
@pytest.mark.extended
def test_changed_layer_size_is_a_miss(tmp_path):
    _stored(tmp_path)
    tm, ref = wrap_pair(_mlm(intermediate=48), cache_dir=str(tmp_path))
    train_parity(tm, ref, _batches(2), _loss, state_atol=STATE_ATOL)
    assert (tm.capture_info().cache_hits, tm.capture_info().cache_misses) == (0, 1)
    assert len(_entries(tmp_path)) == 2


def test_key_of_a_model_does_not_change_once_dynamo_traced_its_code():
    """A key must mean the same in every process: tracing holds references to the code's constants,
    which changed marshal's bytes of it (and so the key) in a process that had captured before."""
    from fxtrain.cache import key
    before = key.module_digest(_mlm())
    fxtrain.TrainModule(to_device(_mlm()), fxtrain.Options(fallback="raise"))(**_batches(1)[0]).loss.backward()
    key._class_digest.cache_clear(), key._code_digest.cache_clear()  # as a new process would compute it
    assert key.module_digest(_mlm()) == before


def test_changed_option_is_a_miss(tmp_path):
    _stored(tmp_path)
    tm, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path), label_sparsity="off")
    train_parity(tm, ref, _batches(2), _loss, state_atol=STATE_ATOL)
    info = tm.capture_info()
    assert (info.cache_hits, info.cache_misses) == (0, 1) and info.optimizations["label_sparsity"].startswith("off")


NET = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return (self.lin(x) {op}).pow(2).mean()
"""


def _net_from(path, op, name):
    path.write_text(NET.format(op=op))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.Net()


@pytest.mark.parametrize("same", [True, False])
def test_changed_forward_body_is_a_miss(tmp_path, same):
    cache, source = tmp_path / "cache", tmp_path / "netmod.py"
    cache.mkdir()
    x = to_device(torch.randn(4, 8))
    first = fxtrain.TrainModule(to_device(_net_from(source, "* 2.0", "netmod")), fxtrain.Options(cache_dir=str(cache)))
    first(x).backward()
    first.capture_info()   # waits for the partition: the entry is stored with the whole step
    # The same file edited: the class has the same name, module and file, only its forward differs.
    model = to_device(_net_from(source, "* 2.0" if same else "* 3.0 + 1.0", "netmod"))
    ref = to_device(_net_from(source, "* 2.0" if same else "* 3.0 + 1.0", "netmod"))
    tm = fxtrain.TrainModule(model, fxtrain.Options(cache_dir=str(cache), fallback="raise"))
    loss = tm(x)
    torch.testing.assert_close(loss, ref(x))
    loss.backward()
    ref(x).backward()
    torch.testing.assert_close(tm.module.lin.weight.grad, ref.lin.weight.grad)
    info = tm.capture_info()
    assert (info.cache_hits, info.cache_misses) == ((1, 0) if same else (0, 1)), info.cache_log


def test_edited_source_file_of_traced_code_is_a_miss(tmp_path):
    """A helper the forward calls lives in another file: its edit is caught by the entry's file hashes."""
    cache = tmp_path / "cache"
    cache.mkdir()
    helper = tmp_path / "helper_mod.py"
    helper.write_text("def scale(x):\n    return x * 2.0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import helper_mod

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x):
                return helper_mod.scale(self.lin(x)).pow(2).mean()

        x = to_device(torch.randn(4, 8))
        torch.manual_seed(0)
        first = fxtrain.TrainModule(to_device(Net()), fxtrain.Options(cache_dir=str(cache)))
        first(x).backward()
        first.capture_info()   # waits for the partition: the entry is stored with the whole step
        helper.write_text("def scale(x):\n    return x * 5.0\n")
        importlib.reload(helper_mod)
        torch.manual_seed(0)
        model = to_device(Net())
        tm = fxtrain.TrainModule(model, fxtrain.Options(cache_dir=str(cache), fallback="raise"))
        torch.testing.assert_close(tm(x), model(x))
        assert tm.capture_info().cache_misses == 1
        assert "source changed" in " ".join(tm.capture_info().cache_log)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper_mod", None)


def test_a_cache_dir_does_not_partition_at_capture(tmp_path):
    """An empty cache_dir's first process captures as without one (issue 19: partitioning at capture
    to store the entry cost its first step 3.3 s): the partition worker partitions the capture
    while it runs in the autograd mode, and the whole step is stored when the answer is back; the
    next module hits it and trains as eager."""
    tm, _ = wrap_pair(_mlm(), cache_dir=str(tmp_path), executor="auto", dynamic=None)   # the defaults
    batches = _batches(3)
    _one_step(tm, batches[0])
    early = tm.capture_info(wait=False)
    assert early.records[0].pending is not None and early.records[0].runtime.startswith("autograd"), early
    assert _entries(tmp_path) == [], _entries(tmp_path)   # the request has not even gone (runtime/pending.py)
    info = tm.capture_info()                               # waits for the partition: then it is stored
    assert len(_entries(tmp_path)) == 1 and info.cache_log[-1].startswith("stored "), info.cache_log
    hit, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path), executor="auto", dynamic=None)
    train_parity(hit, ref, batches, _loss, state_atol=STATE_ATOL)
    assert hit.capture_info().cache_hits == 1, hit.capture_info().cache_log


KILLED = textwrap.dedent("""
    import os, sys, time, torch, fxtrain
    sys.path.insert(0, sys.argv[3])
    from test_cache import _mlm, _batches
    from fxtrain.runtime import tiered
    when = sys.argv[2]
    tm = fxtrain.TrainModule(_mlm(), fxtrain.Options(cache_dir=sys.argv[1], executor="auto", compile_after=0.0))
    batches = _batches(2)
    for step in range(2):   # the second call sends the partition request
        tm(**batches[step % 2]).loss.backward()
    if when == "compile":
        tm.capture_info()   # the entry is stored; the next call starts the tier's compile
        tm(**batches[0]).loss.backward()
        while not tiered._workers:
            time.sleep(0.05)
        worker = next(iter(tiered._workers))
        print("worker", worker.pid, os.path.dirname(worker.args[3]), flush=True)
    print("kill me", flush=True)
    time.sleep(600)
""")


@pytest.mark.cpu_only("fresh processes build and train their own models on the CPU")
@pytest.mark.parametrize("when", ["partition", pytest.param("compile", marks=pytest.mark.extended)])  # 34 s
def test_a_process_killed_mid_partition_or_compile_leaves_a_usable_cache(tmp_path, when):
    """SIGKILL while the partition worker or the tier's compile runs: no atexit, no cleanup. The next
    process hits what was stored (the entry, stored once the partition was back) or misses cleanly
    (nothing was), and trains as eager; the killed process's compile worker does not outlive it, and
    removes the directory of graphs its parent wrote for it."""
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=str(ROOT), FXTRAIN_TEST_DEVICE="cpu")
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path), when, str(ROOT / "tests")], env=env,
                            stdout=subprocess.PIPE, text=True)
    lines = []
    while not lines or lines[-1] != "kill me":
        line = proc.stdout.readline().strip()
        assert line or proc.poll() is None, f"the child ended first: {lines}"
        lines.append(line)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    if when == "compile":
        worker = int(lines[0].split()[1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(worker):
            time.sleep(0.2)
        assert not _running(worker), "the compile worker outlived its killed parent"
        assert not Path(lines[0].split()[2]).exists(), "the killed process's graphs for its worker are left behind"
    assert len(_entries(tmp_path)) == (1 if when == "compile" else 0), _entries(tmp_path)
    tm, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path), executor="auto", dynamic=None)   # the child's
    train_parity(tm, ref, _batches(3), _loss, state_atol=STATE_ATOL)
    info = tm.capture_info()
    assert (info.cache_hits, info.cache_misses) == ((1, 0) if when == "compile" else (0, 1)), info.cache_log
    assert "corrupt" not in " ".join(info.cache_log), info.cache_log


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


# ------------------------------------------------------------------------ writes and damage
WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from fxtrain.cache.store import Store
    store, start = Store(Path(sys.argv[1])), float(sys.argv[3])
    while time.time() < start:
        pass
    for i in range(int(sys.argv[2])):
        size = 1000 + (i * 7919) % 200000
        store.write("samekey", {"writer": sys.argv[4], "i": i}, bytes([i % 251]) * size)
""")


@pytest.mark.cpu_only("fresh processes build and train their own models on the CPU")
def test_two_processes_writing_one_key_always_leave_a_valid_entry(tmp_path):
    import time
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = str(time.time() + 3.0)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "150", start, name], env=env)
             for name in ("a", "b")]
    store, reads = Store(tmp_path), 0
    while any(p.poll() is None for p in procs):
        found = store.read("samekey")  # raises CorruptEntry on a torn or partial file
        if found is not None:
            header, payload = found
            assert payload == bytes([header["i"] % 251]) * len(payload)
            reads += 1
    assert all(p.returncode == 0 for p in procs)
    assert reads > 0 and store.read("samekey") is not None
    assert [p.name for p in tmp_path.iterdir()] == ["samekey.fxc"]  # no temporary file left behind


# make test-long (49 s): the race of two writers of one key is make test's
# test_two_processes_writing_one_key_always_leave_a_valid_entry (the store, 150 writes each), and a
# hit on another process's entry is test_hit_in_a_fresh_process_gives_eagers_losses.
@pytest.mark.extended
@pytest.mark.cpu_only("fresh processes build and train their own models on the CPU")
def test_two_processes_capturing_the_same_model_at_once(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch, fxtrain
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_cache import _mlm, _batches
        tm = fxtrain.TrainModule(_mlm(), fxtrain.Options(cache_dir={str(tmp_path)!r}, fallback="raise",
                                                         executor={fxtrain.Options().executor!r}))
        tm(**_batches(1)[0]).loss.backward()
        assert tm.capture_info().cache_misses == 1
    """)   # the writers use this process's default executor (the suite's inductor pass changes it)
    env = dict(os.environ, PYTHONPATH=str(ROOT), FXTRAIN_TEST_DEVICE="cpu")   # _batches on the CPU there
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env) for _ in range(2)]
    assert all(p.wait(timeout=600) == 0 for p in procs)
    assert len(_entries(tmp_path)) == 1 and not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    tm, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path), dynamic=None)  # the writers' options
    train_parity(tm, ref, _batches(2), _loss, state_atol=STATE_ATOL)
    assert tm.capture_info().cache_hits == 1


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbled":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:])
    elif how == "not an entry":
        path.write_bytes(b"PK\x03\x04 this is some other file format")
    elif how == "unloadable":  # intact checksum, but the payload is not an fxtrain entry
        store = Store(path.parent)
        store.write(path.stem, {"model": "x"}, b"\x80\x04K\x01.")


@pytest.mark.parametrize("how", long_params(["truncated", "garbled", "not an entry", "unloadable"],
                                             keep=["truncated"]))
def test_corrupt_entry_is_logged_once_ignored_and_rewritten(tmp_path, caplog, how):
    _stored(tmp_path)
    path = tmp_path / _entries(tmp_path)[0]
    _damage(path, how)
    damaged = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        for _ in range(2):  # two modules in one process: one warning
            tm, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path))
            train_parity(tm, ref, _batches(1), _loss)
            _damage(path, how) if _ == 0 else None
    assert caplog.text.count("corrupt cache entry") == 1
    info = tm.capture_info()
    assert info.cache_misses == 1 and "corrupt" in " ".join(info.cache_log)
    assert path.read_bytes() != damaged and Store(tmp_path).read(path.stem) is not None  # rewritten
    hit, ref = wrap_pair(_mlm(), cache_dir=str(tmp_path))
    train_parity(hit, ref, _batches(1), _loss)
    assert hit.capture_info().cache_hits == 1


def test_missing_directory_warns_once_and_runs_without_cache(tmp_path, caplog):
    missing = tmp_path / "nope"
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        for _ in range(2):
            tm, ref = wrap_pair(_mlm(), cache_dir=str(missing))
            train_parity(tm, ref, _batches(1), _loss)
    assert caplog.text.count("does not exist") == 1 and not missing.exists()
    assert tm.capture_info().cache_hits == tm.capture_info().cache_misses == 0


def test_read_only_directory_warns_once_and_runs_without_cache(tmp_path, caplog):
    if os.geteuid() != 0:
        directory = tmp_path / "ro"
        directory.mkdir()
        directory.chmod(0o555)
    else:  # root writes through permission bits; sysfs refuses new files even to root
        directory = Path("/sys")
    assert directory.is_dir()
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        for _ in range(2):
            tm, ref = wrap_pair(_mlm(), cache_dir=str(directory))
            train_parity(tm, ref, _batches(1), _loss)
    assert caplog.text.count("not writable") == 1
    assert "cache off" in " ".join(tm.capture_info().cache_log)


# ------------------------------------------------------------------------------- the command
def test_cache_ls_and_clear(tmp_path, capsys):
    _stored(tmp_path)
    assert cli.main(["cache", "ls", "--dir", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    size = (tmp_path / _entries(tmp_path)[0]).stat().st_size
    assert "1 entry" in listed and "BertForMaskedLM" in listed and "train" in listed
    assert f"{size / 1000:.1f} KB" in listed
    assert cli.main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 file(s)" in capsys.readouterr().out and _entries(tmp_path) == []
    assert cli.main(["cache", "ls", "--dir", str(tmp_path / "nope")]) == 2


def test_entry_file_starts_with_a_readable_header(tmp_path):
    _stored(tmp_path)
    data = (tmp_path / _entries(tmp_path)[0]).read_bytes()
    assert data.startswith(MAGIC)
    header = Store(tmp_path).entries()[0].header
    assert header["torch"] == torch.__version__ and header["fxtrain"] == fxtrain.__version__
    assert header["model"] == "BertForMaskedLM" and header["nodes"] > 0


class _ReturnsAView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x).relu()
        return h.view(-1, 2), h.pow(2).mean()


def test_output_viewing_an_intermediate_is_cached_and_exact(tmp_path):
    """AOTAutograd hands such an output out as a plain tensor (_unsafe_view); a hit does the same."""
    x = to_device(torch.randn(4, 8))
    for expected in ((0, 1), (1, 0)):
        torch.manual_seed(0)
        tm, ref = wrap_pair(_ReturnsAView(), cache_dir=str(tmp_path))
        (view, loss), (ref_view, ref_loss) = tm(x), ref(x)
        torch.testing.assert_close(view, ref_view)
        (view.sum() + loss).backward()
        (ref_view.sum() + ref_loss).backward()
        torch.testing.assert_close(tm.module.lin.weight.grad, ref.lin.weight.grad)
        info = tm.capture_info()
        # The autograd runtime (live capture and hit alike) returns a view, as eager does; the
        # aten-graph runtime (the inductor executor's) a plain tensor, as AOTAutograd does.
        assert ref_view._is_view() and view._is_view() == info.records[0].runtime.startswith("autograd"), \
            info.records[0].runtime
        assert (info.cache_hits, info.cache_misses) == expected, info.cache_log


def test_causal_lm_returning_its_dynamic_cache_is_stored_and_rebuilt(tmp_path):
    """HF causal LMs return their key/value cache (a transformers DynamicCache) with the default
    use_cache=True: the entry rebuilds that object from the graph's outputs on a hit, each layer's
    keys and values equal to eager's, and the step trains as eager does."""
    def gpt2():
        torch.manual_seed(0)
        return models.gpt2_lm(hidden=32, layers=2, heads=2, vocab=500, positions=32)

    g = torch.Generator().manual_seed(0)
    batches = [models.synthetic_batch("clm", 3, 12, 500, padding=0.0, generator=g, device=current_device()) for _ in range(3)]
    writer, _ = wrap_pair(gpt2(), cache_dir=str(tmp_path))
    assert type(writer(**batches[0]).past_key_values).__name__ == "DynamicCache"
    assert any(line.startswith("stored") for line in writer.capture_info().cache_log), writer.capture_info().cache_log
    tm, ref = wrap_pair(gpt2(), cache_dir=str(tmp_path))

    def same_cache(out, ref_out):
        mine, theirs = out.past_key_values, ref_out.past_key_values
        assert type(mine) is type(theirs) and len(mine.layers) == len(theirs.layers) == 2
        for a, b in zip(mine.layers, theirs.layers):
            assert type(a) is type(b) and a.is_initialized and a.get_seq_length() == b.get_seq_length()
            torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(a.values, b.values)
        torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-5)
    train_parity(tm, ref, batches, _loss, compare_outputs=same_cache)
    assert (tm.capture_info().cache_hits, tm.capture_info().graphs) == (1, 1), tm.capture_info().cache_log


def test_an_object_holding_no_result_of_the_call_is_not_stored(tmp_path):
    """A returned object without this call's tensors (here the model's own config) would come back
    from an entry as a copy where eager returns the very object: not stored, said why, and the
    live capture returns the object itself."""
    class WithConfig(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.settings = torch.nn.Linear(4, 4), _Settings()

        def forward(self, x):
            return self.lin(x).sum(), self.settings

    tm, ref = wrap_pair(WithConfig(), cache_dir=str(tmp_path))
    loss, settings = tm(to_device(torch.randn(2, 4)))
    loss.backward()
    assert settings is tm.module.settings
    assert any("returns a _Settings, which fxtrain cannot rebuild" in line for line in tm.capture_info().cache_log), \
        tm.capture_info().cache_log
    assert _entries(tmp_path) == []


class _Settings:
    def __init__(self):
        self.scale, self.name = 2.0, "settings"
