"""fxtrain installs and runs beside the torch a user already has (issue 16).

- torch's version is read in one place (torch_private: ``parse_version``, ``torch_at_least``,
  ``check_supported``), and no other module branches on it;
- outside the tested window: older raises ``fxtrain.Error`` at TrainModule construction, newer warns
  once and runs, and ``import fxtrain`` works either way;
- the package declares ranges, transformers and matplotlib are extras, and a TrainModule over a
  plain module trains without them;
- installing fxtrain into an environment that holds a torch of the window keeps that torch.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib
import warnings

import pytest
import torch

import fxtrain
from fxtrain import torch_private as tp

ROOT = pathlib.Path(fxtrain.__file__).resolve().parent.parent

pytestmark = pytest.mark.cpu_only(reason="torch version checks, package metadata and fresh processes that build their own CPU models")


@pytest.mark.parametrize("text, expected", [
    ("2.11.0", (2, 11, 0)), ("2.11.0a0+git1234abc", (2, 11, 0)), ("2.14.1+cu130", (2, 14, 1)),
    ("2.13.0+cpu", (2, 13, 0)), ("2.15.0.dev20261101+cu130", (2, 15, 0)), ("2.12", (2, 12, 0)),
    ("2.10.0rc1", (2, 10, 0)),
])
def test_version_strings(text, expected):
    assert tp.parse_version(text) == expected


def test_unreadable_version_is_an_error():
    with pytest.raises(fxtrain.Error, match="cannot read"):
        tp.parse_version("nightly")


def test_running_torch_is_in_the_window():
    """The suite runs on releases of the window only (constraints/): nothing warns or raises here."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.check_supported()
    assert tp.TORCH_VERSION == tp.parse_version(torch.__version__)
    assert tp.torch_at_least(*tp.WINDOW[0]) and not tp.torch_at_least(tp.WINDOW[1][0], tp.WINDOW[1][1] + 1)


@pytest.mark.parametrize("text", ["2.10.2+cu128", "2.9.1", "1.13.0"])
def test_older_torch_raises_naming_the_window(text):
    with pytest.raises(fxtrain.Error, match=r"torch 2\.11 or newer \(tested on 2\.11\.0 to 2\.14\.1\)"):
        tp.check_supported(text)


def test_source_build_of_the_oldest_release_counts_as_it():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.check_supported("2.11.0a0+gitdeadbee")
        tp.check_supported("2.14.1+cu130")


def test_newer_torch_warns_once_and_runs():
    text = "2.15.0.dev20261120+cu130"
    tp._warned.discard(text)
    with pytest.warns(fxtrain.FxtrainWarning, match=r"tested on torch 2\.11\.0 to 2\.14\.1; this is torch 2\.15"):
        tp.check_supported(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.check_supported(text)   # once per version


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FXTRAIN_")}
    full.update(env, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=full, capture_output=True,
                          text=True, timeout=600)


def test_outside_the_window_import_works_and_construction_says_why():
    """A fresh process whose torch says it is 2.10: importing fxtrain works; a TrainModule raises;
    one that says 2.15 warns once and trains."""
    done = _run("""
        import warnings, torch
        torch.__version__ = "2.10.0+cu128"
        import fxtrain
        try:
            fxtrain.TrainModule(torch.nn.Linear(2, 2))
        except fxtrain.Error as e:
            print("ERROR", e)
    """)
    assert done.returncode == 0, done.stderr
    assert "ERROR fxtrain needs torch 2.11 or newer" in done.stdout and "this is torch 2.10.0+cu128" in done.stdout
    done = _run("""
        import warnings, torch
        torch.__version__ = "2.15.0"
        import fxtrain
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tm = fxtrain.TrainModule(torch.nn.Linear(2, 2), fxtrain.Options(fallback="raise"))
            fxtrain.TrainModule(torch.nn.Linear(2, 2))
        tm(torch.randn(3, 2)).sum().backward()
        print("WARNINGS", sum(issubclass(w.category, fxtrain.FxtrainWarning) and "2.15.0" in str(w.message) for w in seen))
    """)
    assert done.returncode == 0, done.stderr
    assert "WARNINGS 1" in done.stdout, done.stdout


def test_trains_without_the_extras():
    """transformers and matplotlib made unimportable: fxtrain imports, a TrainModule over a plain
    module trains a step as eager does, and what needs an extra names it."""
    done = _run("""
        import copy, sys
        sys.modules["transformers"] = None
        sys.modules["matplotlib"] = None
        import torch, fxtrain
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        ref = copy.deepcopy(model)
        tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise"))
        x = torch.randn(4, 8)
        loss, ref_loss = tm(x).square().mean(), ref(x).square().mean()
        loss.backward(); ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert tm.capture_info().graphs == 1 and tm.capture_info().fallback_reason is None
        from fxtrain import models
        try:
            models.bert_mlm()
        except fxtrain.Error as e:
            print("HF", e)
        report = fxtrain.profile(torch.nn.Linear(4, 4), torch.randn(2, 4))
        try:
            report.plot("/dev/null")
        except fxtrain.Error as e:
            print("PLOT", e)
        print("OK")
    """)
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout, done.stdout
    assert "HF fxtrain's built-in models needs transformers" in done.stdout and "fxtrain[hf]" in done.stdout
    assert "PLOT" in done.stdout and "fxtrain[plot]" in done.stdout


def test_cli_names_the_missing_extra():
    done = _run("""
        import sys
        sys.modules["transformers"] = None
        from fxtrain.cli import main
        sys.exit(main(["split", "bert-tiny", "--stages", "2"]))
    """)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "pip install 'fxtrain[hf]'" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_declared_requirements_are_ranges():
    """Every runtime requirement is a range (installs beside the user's packages); only the
    constraints files, which `make` uses, pin exact versions, one per tested torch."""
    text = (ROOT / "pyproject.toml").read_text()
    project = tomllib.loads(text)["project"]
    requirements = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert "torch>=2.11" in project["dependencies"]
    assert not [r for r in requirements if "==" in r or "<" in r], requirements
    assert set(project["optional-dependencies"]) >= {"hf", "plot", "test"}
    assert not [r for r in project["dependencies"] if r.startswith(("transformers", "matplotlib"))]
    pinned = sorted(p.name for p in (ROOT / "constraints").glob("torch-*.txt"))
    assert {f"torch-{v}.txt" for v in tp.TESTED} <= set(pinned), pinned
    for name in pinned:
        version = name[len("torch-"):-len(".txt")]
        lines = [l for l in (ROOT / "constraints" / name).read_text().splitlines() if l and not l.startswith("#")]
        assert f"torch=={version}" in lines and all("==" in l for l in lines), name


# Files that may read torch's version string without branching on it: they record it.
_VERSION_READERS = {"torch_private.py"}


def test_no_module_but_torch_private_branches_on_the_torch_version():
    """Version differences live in torch_private.py: no other module reads ``torch.__version__``,
    ``torch.version`` (its build facts ``.hip`` and ``.cuda`` aside), the version helpers, or
    compares versions."""
    package = ROOT / "fxtrain"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(package))
        if rel in _VERSION_READERS:
            continue
        tree = ast.parse(path.read_text())
        # torch.version.hip and .cuda say which build runs (ROCm, CUDA), not which release: allowed.
        build_facts = {id(n.value) for n in ast.walk(tree)
                       if isinstance(n, ast.Attribute) and n.attr in ("hip", "cuda")}
        for node in ast.walk(tree):
            name = None
            if id(node) in build_facts:
                continue
            if isinstance(node, ast.Attribute) and node.attr in ("__version__", "version", "torch_at_least",
                                                                  "TORCH_VERSION", "parse_version"):
                base = node.value
                name = f"{getattr(base, 'id', getattr(base, 'attr', '?'))}.{node.attr}"
                if name in ("torch.__version__", "torch.version") or node.attr in ("torch_at_least", "TORCH_VERSION",
                                                                                   "parse_version"):
                    found.append(f"{rel}:{node.lineno}: {name}")
            elif isinstance(node, ast.ImportFrom) and any(a.name in ("torch_at_least", "TORCH_VERSION", "parse_version")
                                                          for a in node.names):
                found.append(f"{rel}:{node.lineno}: imports a version helper")
            elif isinstance(node, ast.ImportFrom) and node.module in ("packaging.version", "torch.torch_version"):
                found.append(f"{rel}:{node.lineno}: from {node.module}")
    assert not found, "version branches outside torch_private.py:\n" + "\n".join(found)


def test_install_keeps_the_users_torch(tmp_path):
    """``pip install`` of fxtrain into this environment (a torch of the window) installs nothing
    that replaces torch: a dry run's report lists no torch. Without a package index (the lent GPU
    machine's image) the dry run resolves against the installed packages alone (``--no-index``,
    the installed setuptools building the metadata): it fails unless this environment's torch and
    other packages already satisfy fxtrain's requirements."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
               "--no-cache-dir", str(ROOT)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "No matching distribution found for setuptools" in done.stderr:
        done = subprocess.run(command + ["--no-index", "--no-build-isolation"], capture_output=True, text=True,
                              timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    installs = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert "fxtrain" in installs
    assert not {name for name in installs if name == "torch" or name.startswith("nvidia-")}, installs


def test_python_call_reaches_torchs_apply_on_this_release():
    """pythonop/python_call.py binds torch's own ``Function.apply`` as a descriptor (a classmethod up
    to 2.13, a C classmethod_descriptor from 2.14): its fall-through call runs the Function as
    ``Fn.apply`` does, forward and backward, on whichever release the suite runs on."""
    from fxtrain.pythonop import python_call

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.k, None

    x = torch.randn(3, requires_grad=True)
    out = python_call.apply(Twice, x, 2.5)
    assert type(out.grad_fn).__name__ == "TwiceBackward"
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.5))
