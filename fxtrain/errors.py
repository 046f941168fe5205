"""The roots of everything fxtrain raises or warns, so a training script can tell fxtrain's own
failures from its model's with one ``except fxtrain.Error`` (or one warnings filter).

Ground layer: imports nothing from fxtrain, so any module can define its exceptions on these.
Classes keep the builtin base a caller may already catch (``class CaptureError(Error, RuntimeError)``);
``tests/test_errors.py`` fails on an exception or warning class of fxtrain that derives from neither.
"""
from __future__ import annotations


class Error(Exception):
    """Base of every exception fxtrain defines."""


class FxtrainWarning(UserWarning):
    """Base of every warning fxtrain issues (a UserWarning, so default filters show it once)."""


__all__ = ["Error", "FxtrainWarning"]
