"""The cache key: everything that changes the captured graph, hashed.

Parts: the module tree (class and plain attributes of every submodule, the code of every method its
classes define, forward hooks), each parameter and buffer (name, shape, dtype, requires_grad,
device, which ones are one tensor), the call's input schema (structure, dtypes, ranks, scalar
values), the options that shape the graph, the training/grad/autocast mode, and the versions of
torch, Python and fxtrain (its source files, so an edited pass never meets an old graph). The
source files dynamo traced (model code, library helpers) are checked at load time instead, from
hashes stored in the entry: the key has to be computed before anything is traced.
"""
from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..capture.inputs import autocast_state
from ..options import Options
from ..torch_private import TORCH_VERSION_TEXT
from ..version import __version__
from ..errors import Error

# Options that do not change a captured graph: where files go, logging, what happens on failure,
# when and how long the compiled tier's background compile runs (it compiles the stored graphs).
_NOT_IN_KEY = {"cache_dir", "save_graphs_dir", "log_density", "fallback", "recompile_limit", "sparsity_guard",
               "compile_after", "compile_timeout", "capture_warning_seconds"}
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


class Unkeyable(Error):
    """The call cannot be described by a key that means the same in another process."""


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _const_text(value: Any) -> str:
    if isinstance(value, types.CodeType):
        return "code:" + _code_digest(value).hex()
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ",".join(map(_const_text, value)) + ")"
    if isinstance(value, frozenset):  # iteration order follows string hashing, which varies by process
        return "frozenset(" + ",".join(sorted(map(_const_text, value))) + ")"
    return f"{type(value).__name__}:{value!r}"


@functools.lru_cache(maxsize=None)
def _code_digest(code: types.CodeType) -> bytes:
    """What a function does, the same in every process. Not ``marshal.dumps``: its bytes depend on
    the reference counts of the constants (shared objects are written as back-references only when
    something else holds them), so they change once dynamo has traced the code."""
    h = hashlib.sha256(code.co_code)
    for part in (code.co_consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)):
        h.update(_const_text(part).encode())
    return h.digest()


def _function_digest(fn: Any) -> Optional[bytes]:
    fn = getattr(fn, "__func__", fn)            # classmethod / staticmethod / bound method
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    return _code_digest(code) if code is not None else None


@functools.lru_cache(maxsize=None)
def _class_digest(cls: type) -> str:
    """Hash of the code of every method a class (and its non-torch bases) defines."""
    h = hashlib.sha256()
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch.nn.modules.module"):
            continue
        h.update(_qualname(klass).encode())
        for name, member in sorted(vars(klass).items()):
            for part in [member.fget, member.fset] if isinstance(member, property) else [member]:
                digest = _function_digest(part) if part is not None else None
                if digest is not None:
                    h.update(name.encode())
                    h.update(digest)
    return h.hexdigest()


def _plain(value: Any, depth: int = 0) -> Optional[str]:
    """repr of a value made of plain Python data, or None for anything else."""
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (list, tuple)) and depth < 3:
        items = [_plain(v, depth + 1) for v in value]
        return None if None in items else f"{type(value).__name__}[{','.join(items)}]"  # type: ignore[arg-type]
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def _config_digest(config: Any, seen: Dict[int, str]) -> str:
    if id(config) not in seen:
        try:
            data = config.to_dict()
            text = json.dumps(data, sort_keys=True, default=repr)
        except Exception:  # a to_dict that fails: fall back to the plain attributes
            text = repr(sorted((k, _plain(v)) for k, v in vars(config).items()))
        seen[id(config)] = hashlib.sha256(text.encode()).hexdigest()
    return seen[id(config)]


def _module_state(module: nn.Module, configs: Dict[int, str]) -> List[str]:
    parts = [_qualname(type(module)), _class_digest(type(module)), f"training={module.training}"]
    for name, value in sorted(vars(module).items()):
        if name in ("_parameters", "_buffers", "_modules", "training") or isinstance(value, (torch.Tensor, nn.Module)):
            continue
        if name.endswith("hooks") and isinstance(value, dict):
            parts.append(f"{name}=" + ",".join(_qualname(h) + ((_function_digest(h) or b"").hex()[:16])
                                               for h in value.values()))
            continue
        text = _plain(value)
        if text is not None:
            parts.append(f"{name}={text}")
        elif hasattr(value, "to_dict"):
            parts.append(f"{name}=config:{_config_digest(value, configs)}")
    return parts


def module_digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    configs: Dict[int, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        h.update(f"[{name}]".encode())
        h.update("|".join(_module_state(sub, configs)).encode())
    first: Dict[int, str] = {}
    for kind, named in (("param", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False))):
        for name, t in named:
            tied = first.setdefault(id(t), name)
            h.update(f"{kind} {name} {tuple(t.shape)} {t.dtype} {t.requires_grad} {t.device.type} "
                     f"{tied if tied != name else ''}".encode())
    return h.hexdigest()


def _schema(value: Any, path: str) -> str:
    if isinstance(value, torch.Tensor):
        return (f"T({value.dtype},{value.dim()},{value.requires_grad},{value.device.type},{value.layout},"
                f"{value.is_contiguous()})")
    text = _plain(value)
    if text is not None:
        return text
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_schema(v, f'{path}[{k!r}]')}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}(" + ",".join(_schema(v, f"{path}[{i}]") for i, v in enumerate(value)) + ")"
    raise Unkeyable(f"input {path} is a {type(value).__name__}, which has no meaning across processes")


def input_digest(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    text = "args:" + ",".join(_schema(a, f"args[{i}]") for i, a in enumerate(args))
    text += ";kwargs:" + ",".join(f"{k}={_schema(v, f'kwargs[{k!r}]')}" for k, v in kwargs.items())
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def fxtrain_digest() -> str:
    """Version plus a hash of fxtrain's own source: a changed pass must not meet an old graph."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def options_digest(options: Options) -> str:
    items = sorted((k, repr(v)) for k, v in options.as_dict().items() if k not in _NOT_IN_KEY)
    return hashlib.sha256(repr(items).encode()).hexdigest()


def versions() -> Dict[str, str]:
    return {"fxtrain": __version__, "torch": TORCH_VERSION_TEXT, "python": platform.python_version()}


def cache_key(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], mode: str, options: Options) -> str:
    """Raises Unkeyable when an input is an arbitrary object (identity means nothing on disk)."""
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    kind, enabled, dtype = autocast_state(devices.pop() if len(devices) == 1 else None, args, kwargs)
    autocast = (kind, enabled, str(dtype))
    parts = [repr(sorted(versions().items())), fxtrain_digest(), sys.platform, module_digest(module),
             input_digest(args, kwargs), mode, repr(autocast), options_digest(options)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]
