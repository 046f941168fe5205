"""Every exception and warning fxtrain defines has one of two roots, so ``except fxtrain.Error``
catches all of fxtrain's own failures and one filter silences all of its warnings."""
import importlib
import pkgutil
from typing import Dict, List, Set, Type

import pytest

import fxtrain
from fxtrain import Error, FxtrainWarning

pytestmark = pytest.mark.cpu_only(reason="exception classes of fxtrain: no tensors")

# Classes that must not have those roots. Each one is an internal control signal that no
# ``except Exception`` may stop, so it derives from BaseException directly; say why here.
CONTROL_SIGNALS: Dict[str, str] = {
    "ExpensiveSymbolicSizes": "control signal raised asynchronously into a dynamo compile; "
                              "must pass dynamo's `except Exception` handlers",
}


def _import_every_module() -> None:
    failed = []
    for info in pkgutil.walk_packages(fxtrain.__path__, "fxtrain."):
        try:
            importlib.import_module(info.name)
        except Exception as e:  # an fxtrain module that does not import is a failure of its own
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
    assert not failed, failed


def _subclasses(root: type) -> Set[type]:
    found: Set[type] = set()
    stack = [root]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return found


def _fxtrain_exception_classes() -> List[Type[BaseException]]:
    _import_every_module()
    return sorted((c for c in _subclasses(BaseException) if c.__module__.split(".")[0] == "fxtrain"),
                  key=lambda c: (c.__module__, c.__qualname__))


def _unrooted(classes: List[Type[BaseException]]) -> List[str]:
    """The classes among ``classes`` that derive from neither root and are no documented control signal."""
    bad = []
    for c in classes:
        if issubclass(c, Warning):
            ok = issubclass(c, FxtrainWarning)
        elif c.__name__ in CONTROL_SIGNALS:
            ok = not issubclass(c, Exception)   # else nothing justifies leaving it out of Error
        else:
            ok = issubclass(c, Error)
        if not ok:
            bad.append(f"{c.__module__}.{c.__qualname__}{tuple(b.__name__ for b in c.__bases__)}")
    return bad


def test_every_exception_and_warning_class_of_fxtrain_has_an_fxtrain_root():
    classes = _fxtrain_exception_classes()
    names = {c.__name__ for c in classes}
    # The walk sees classes from every layer (a walk that found nothing would pass vacuously).
    assert {"CaptureError", "FallbackWarning", "NotReplayable", "CorruptEntry", "ProfileError", "SplitError",
            "MemoryBudgetWarning", "InlineError"} <= names, sorted(names)
    unrooted = _unrooted(classes)
    assert not unrooted, "derive from fxtrain.Error or fxtrain.FxtrainWarning (fxtrain/errors.py): " + ", ".join(unrooted)


def test_the_check_flags_a_class_without_a_root():
    class Plain(RuntimeError):
        pass

    class PlainWarning(UserWarning):
        pass

    class ExpensiveSymbolicSizes(Exception):   # a control signal that except Exception would stop
        pass

    class Rooted(Error, RuntimeError):
        pass

    flagged = _unrooted([Plain, PlainWarning, ExpensiveSymbolicSizes, Rooted])
    assert [f.split("(")[0].rsplit(".", 1)[-1] for f in flagged] == ["Plain", "PlainWarning", "ExpensiveSymbolicSizes"]


def test_builtin_bases_still_catch_what_they_caught():
    assert issubclass(fxtrain.CaptureError, RuntimeError) and issubclass(fxtrain.SplitError, ValueError)
    assert issubclass(fxtrain.FallbackWarning, UserWarning) and issubclass(FxtrainWarning, UserWarning)
    assert not issubclass(Error, Warning)
