"""The optional parts of fxtrain's dependencies, and the error that names the extra to install.

``pip install fxtrain`` brings torch, numpy and tqdm: enough to capture, run, cost and split any
``nn.Module``. What only the built-in models, the demo, the bench, the fuzzer and the plots need is
an extra (pyproject.toml): ``fxtrain[hf]`` (transformers) and ``fxtrain[plot]`` (matplotlib). Code
that needs one calls :func:`require` first, so a user without it reads which extra to install
rather than a bare ``ModuleNotFoundError`` from deep inside.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import Error

EXTRAS = {"transformers": "hf", "tokenizers": "hf", "matplotlib": "plot"}


class MissingExtra(Error, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def require(module: str, what: str = "this") -> ModuleType:
    """``module`` imported, or :class:`MissingExtra` saying ``pip install 'fxtrain[<extra>]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS[module.split(".")[0]]
        raise MissingExtra(f"{what} needs {module}, which is not installed: pip install 'fxtrain[{extra}]' "
                           f"(or pip install {module.split('.')[0]})") from e
