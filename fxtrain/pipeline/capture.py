"""Capture a model's forward (and its loss) as one dynamo graph whose inputs are named.

The pipeline cuts this graph into stages, so it needs, for every graph input, what it is: a
parameter or buffer (by the model's qualified name, so stages hold the very same tensors and
``named_parameters()`` keeps the original names), or a user input (by its path in ``args``/``kwargs``,
so a training step's batch can be routed to the first stage). Dynamo hands its backend the real
tensors behind each placeholder, so the mapping is by identity, not by parsing dynamo's names.

Custom ``torch.autograd.Function``s are routed to fxtrain PythonOps during this capture, so the
graph holds one opaque node per call that runs the user's forward and, at backward, the user's
own backward (torch's pipeline tracer inlines the forward and loses the backward).
"""
from __future__ import annotations

import contextlib

import dataclasses
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from ..capture.entry import make_entry
from ..capture.settings import dynamo_settings
from ..cost.step import find_loss
from ..options import Options
from ..pythonop import routing
from ..torch_private import dynamo_config_patch, dynamo_unsupported
from .errors import SplitError
from ..errors import Error

logger = logging.getLogger("fxtrain")

Path = Tuple[Any, ...]
PARAM, BUFFER, INPUT, CONSTANT = "param", "buffer", "input", "constant"
EXAMPLE_KEY = "fxtrain_pipeline_example"


@dataclasses.dataclass
class GraphInput:
    """One placeholder of the captured graph and what it stands for."""

    node: torch.fx.Node
    kind: str                       # PARAM | BUFFER | INPUT | CONSTANT
    name: str                       # qualified name (param/buffer), path text (input), synthetic (constant)
    value: torch.Tensor             # the real tensor seen at capture
    path: Optional[Path] = None     # for INPUT: where it sits in (args, kwargs, target)


@dataclasses.dataclass
class CapturedGraph:
    gm: torch.fx.GraphModule
    inputs: List[GraphInput]
    has_loss: bool                   # the graph's single output is the training loss
    aliases: Dict[str, List[str]]    # canonical parameter name -> every name it has (tied weights)
    python_ops: List[str] = dataclasses.field(default_factory=list)  # custom Functions kept opaque

    def by_node(self) -> Dict[torch.fx.Node, GraphInput]:
        return {i.node: i for i in self.inputs}

    def user_inputs(self) -> List[GraphInput]:
        return [i for i in self.inputs if i.kind == INPUT]


class _Captured(Error):
    """Raised by our backend's compiled function: the graph is all we wanted, not a run."""


class _WithLoss(nn.Module):
    """The model followed by its loss, as one module for dynamo to trace."""

    def __init__(self, model: nn.Module, loss_fn: Optional[Callable[..., Any]], want_loss: bool) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.want_loss = want_loss

    def forward(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], target: Any) -> Any:
        out = self.model(*args, **kwargs)
        if self.loss_fn is not None:
            return self.loss_fn(out, target)
        loss = find_loss(out)
        if loss is None or not self.want_loss:
            return out
        return loss


def _fresh(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def walk(value: Any, path: Path = ()) -> Iterator[Tuple[Path, Any]]:
    """Every leaf of nested tuples/lists/dicts with its path."""
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from walk(v, path + (i,))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from walk(v, path + (k,))
    else:
        yield path, value


def fetch(root: Any, path: Path) -> Any:
    for key in path:
        root = root[key]
    return root


def path_text(path: Path) -> str:
    head, rest = path[0], path[1:]
    if head == "target":
        return "target" + "".join(f"[{k!r}]" for k in rest)
    if head == "kwargs" and rest:
        return str(rest[0]) + "".join(f"[{k!r}]" for k in rest[1:])
    return "args" + "".join(f"[{k!r}]" for k in rest)


def capture(model: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any], *,
            loss_fn: Optional[Callable[..., Any]] = None, target: Any = None,
            want_loss: bool = True) -> CapturedGraph:
    """One dynamo graph of ``model(*args, **kwargs)`` (then its loss), in training mode, without running it."""
    holder: Dict[str, Any] = {}
    python_ops: List[str] = []
    # Fresh tensor objects: dynamo remembers tensors it saw as dynamic (an earlier TrainModule
    # call on the same batch), and stage shapes must be static.
    args, kwargs, target = _fresh((tuple(args), dict(kwargs), target))

    def backend(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        if "gm" in holder:
            raise SplitError("the model's forward was captured as more than one graph")
        holder["gm"], holder["inputs"] = gm, list(example_inputs)

        def stop(*_: Any) -> Any:
            raise _Captured()
        return stop

    wrapper = _WithLoss(model, loss_fn, want_loss)
    # One capture, then the entry is dropped: the settings can wrap the whole call (below).
    entry = make_entry(backend, dynamic=False, fullgraph=True, around_compile=contextlib.nullcontext)
    was_training = model.training
    model.train()
    try:
        # fxtrain's dynamo settings (logging calls inside forward do not break the graph, ...).
        with dynamo_config_patch(dynamo_settings(Options())), torch.enable_grad(), \
                routing(lambda name, why=None: python_ops.append(name) if why is None and name not in python_ops
                        else None):
            entry(wrapper, (tuple(args), dict(kwargs), target), {})
    except _Captured:
        pass
    except dynamo_unsupported() as e:
        raise SplitError(f"fxtrain.split needs the model's forward as one graph, and dynamo could not "
                         f"capture it whole: {str(e).strip().splitlines()[0]}") from e
    finally:
        model.train(was_training)
    if "gm" not in holder:
        raise SplitError("dynamo captured no graph for the model (is its forward pure Python with no tensors?)")
    captured = _describe_inputs(model, holder["gm"], holder["inputs"], args, kwargs, target,
                                want_loss or loss_fn is not None)
    captured.python_ops = python_ops
    return captured


def _describe_inputs(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: List[Any],
                     args: Sequence[Any], kwargs: Dict[str, Any], target: Any, want_loss: bool) -> CapturedGraph:
    params: Dict[int, str] = {}
    aliases: Dict[str, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = params.setdefault(id(p), name)
        aliases.setdefault(canonical, []).append(name)
    buffers: Dict[int, str] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        buffers.setdefault(id(b), name)
    user: Dict[int, Path] = {}
    for path, leaf in walk({"args": tuple(args), "kwargs": dict(kwargs), "target": target}):
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in user:
                raise SplitError(f"the same tensor is passed twice ({path_text(user[id(leaf)])} and "
                                 f"{path_text(path)}); pass separate tensors")
            user[id(leaf)] = path
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise SplitError("captured graph inputs do not match what dynamo passed to the backend")
    inputs: List[GraphInput] = []
    constants = 0
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, torch.Tensor):
            raise SplitError(f"graph input {node.name} is a {type(value).__name__}, not a tensor; "
                             f"pipeline stages need static shapes")
        if id(value) in params:
            inputs.append(GraphInput(node, PARAM, params[id(value)], value))
        elif id(value) in buffers:
            inputs.append(GraphInput(node, BUFFER, buffers[id(value)], value))
        elif id(value) in user:
            path = user[id(value)]
            inputs.append(GraphInput(node, INPUT, path_text(path), value, path))
            node.meta[EXAMPLE_KEY] = value   # the real batch value, for costs that depend on data
        else:
            inputs.append(GraphInput(node, CONSTANT, f"_fxtrain_constant_{constants}", value))
            constants += 1
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    has_loss = False
    if want_loss:
        ex = values[0].meta.get("example_value") if len(values) == 1 and isinstance(values[0], torch.fx.Node) else None
        has_loss = isinstance(ex, torch.Tensor) and ex.numel() == 1 and ex.is_floating_point()
    logger.info("fxtrain.split: captured %d nodes, %d inputs (%d parameters)", len(gm.graph.nodes),
                len(inputs), sum(i.kind == PARAM for i in inputs))
    return CapturedGraph(gm, inputs, has_loss, aliases)
