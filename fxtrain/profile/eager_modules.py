"""Which module an op belongs to when the step runs eagerly (``optimizations=False``).

Forward: global module hooks keep the stack of modules being called; the innermost one owns the op.
Backward: when a module's forward returns, the autograd nodes it created (reachable from its outputs,
newer than its inputs, not already claimed by an inner module) are labelled with its name by sequence
number; during backward, the node the engine is running names the module.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..torch_private import current_autograd_node, tree_flatten


def _grad_fns(values: Any) -> List[Any]:
    return [t.grad_fn for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]


class ModuleAttribution:
    def __init__(self, root: torch.nn.Module) -> None:
        self.names: Dict[int, str] = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
        self.stack: List[tuple] = []
        self.labels: Dict[int, str] = {}
        self.handles: List[Any] = []

    def __enter__(self) -> "ModuleAttribution":
        self.handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        newest = max((fn._sequence_nr() for fn in _grad_fns(args) if type(fn).__name__ != "AccumulateGrad"),
                     default=-1)
        self.stack.append((id(module), name, newest))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.stack or self.stack[-1][0] != id(module):
            return
        _, name, newest = self.stack.pop()
        todo = _grad_fns(output)
        seen = set()
        while todo:
            fn = todo.pop()
            if fn is None or type(fn).__name__ == "AccumulateGrad":
                continue
            seq = fn._sequence_nr()
            if seq in seen or seq <= newest:
                continue
            seen.add(seq)
            self.labels.setdefault(seq, name)
            todo.extend(f for f, _ in fn.next_functions)

    def current(self) -> Optional[str]:
        node = current_autograd_node()
        if node is not None:
            return self.labels.get(node._sequence_nr())
        return self.stack[-1][1] if self.stack else None
