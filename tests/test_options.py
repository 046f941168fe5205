"""Options: defaults, FXTRAIN_* environment overrides (highest priority), parsing and logging."""
import dataclasses
import logging

import pytest
import torch

import fxtrain
from fxtrain.options import Options, options_table, resolve

pytestmark = pytest.mark.cpu_only(reason="option parsing: no tensors")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os
    for k in list(os.environ):
        if k.startswith("FXTRAIN_"):
            monkeypatch.delenv(k)


def test_defaults():
    # The dataclass's own defaults: the suite's inductor pass (tests/conftest.py) changes what
    # Options() gives, not what a user gets.
    defaults = {f.name: f.default for f in dataclasses.fields(Options)}
    assert (defaults["executor"], defaults["fallback"], defaults["dynamic"], defaults["fullgraph"]) == \
        ("auto", "eager", None, False)
    assert defaults["compile_after"] == 10.0
    o = Options()
    assert (o.fallback, o.dynamic, o.fullgraph) == ("eager", None, False)


def test_env_overrides_code(monkeypatch):
    monkeypatch.setenv("FXTRAIN_FALLBACK", "raise")
    monkeypatch.setenv("FXTRAIN_DYNAMIC", "off")
    monkeypatch.setenv("FXTRAIN_RECOMPILE_LIMIT", "5")
    eff = resolve(Options(fallback="eager", dynamic=True, recompile_limit=64))
    assert eff.fallback == "raise" and eff.dynamic is False and eff.recompile_limit == 5
    assert isinstance(eff.recompile_limit, int)


def test_code_value_kept_without_env():
    assert resolve(Options(executor="inductor")).executor == "inductor"


@pytest.mark.parametrize("raw,value", [("1", True), ("true", True), ("YES", True), ("on", True),
                                       ("0", False), ("false", False), ("No", False), ("off", False)])
def test_bool_parsing(monkeypatch, raw, value):
    monkeypatch.setenv("FXTRAIN_FULLGRAPH", raw)
    assert resolve(None).fullgraph is value


def test_bad_env_value_names_variable(monkeypatch):
    monkeypatch.setenv("FXTRAIN_RECOMPILE_LIMIT", "many")
    with pytest.raises(ValueError, match="FXTRAIN_RECOMPILE_LIMIT"):
        resolve(None)
    monkeypatch.setenv("FXTRAIN_RECOMPILE_LIMIT", "3")
    monkeypatch.setenv("FXTRAIN_FULLGRAPH", "maybe")
    with pytest.raises(ValueError, match="FXTRAIN_FULLGRAPH"):
        resolve(None)


def test_bad_env_choice_is_rejected(monkeypatch):
    monkeypatch.setenv("FXTRAIN_EXECUTOR", "tensorrt")
    with pytest.raises(ValueError, match="executor"):
        resolve(None)


def test_bad_option_values():
    with pytest.raises(ValueError, match="fallback"):
        Options(fallback="ignore")
    with pytest.raises(ValueError, match="recompile_limit"):
        Options(recompile_limit=0)
    with pytest.raises(TypeError, match="Options"):
        fxtrain.TrainModule(torch.nn.Linear(2, 2), options={"fallback": "raise"})


def test_unknown_env_variable_warns(monkeypatch, caplog):
    monkeypatch.setenv("FXTRAIN_EXECUTR", "eager")
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        resolve(None)
    assert "FXTRAIN_EXECUTR" in caplog.text


def test_effective_options_logged_at_info(monkeypatch, caplog):
    monkeypatch.setenv("FXTRAIN_FALLBACK", "raise")
    with caplog.at_level(logging.INFO, logger="fxtrain"):
        tm = fxtrain.TrainModule(torch.nn.Linear(2, 2))
    assert tm.options.fallback == "raise"
    assert "fallback='raise'" in caplog.text


def test_table_lists_every_field():
    import dataclasses
    table = options_table()
    for f in dataclasses.fields(Options):
        assert f"`FXTRAIN_{f.name.upper()}`" in table
