"""The zero-bubble backward split (fxtrain/runtime/weight_split.py), in one process.

A stage-like module (an activation input that takes a gradient, custom Functions kept as
PythonOps, an embedding tied to the head, a parameter read twice) runs its backward whole, then
as B (under ``defer_weight_gradients``) followed by W: the input gradient and every parameter
gradient must be bitwise the whole backward's, each user backward must run once, and W must hold
the weight-gradient products.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import fxtrain
from fxtrain.runtime.absent_grads import AbsentGradBackward
from fxtrain.runtime.weight_split import NotSplittable, defer_weight_gradients, split_backward
from utils import CALLS, NumpyGate, RoundSTE, ToyLM

pytestmark = pytest.mark.cpu_only("numpy custom Function; the split is device-independent graph surgery")


class Stage(ToyLM):
    """The toy LM cut as a middle-and-last stage: an activation input that takes a gradient, the
    two custom Functions, the tied head, and the second layer read twice."""

    def __init__(self) -> None:
        super().__init__(layers=2)

    def forward(self, h, ids, labels):
        l1, l2 = self.layers
        h = h + self.embed(ids)
        h = RoundSTE.apply(torch.tanh(l1(h))) + h
        h = NumpyGate.apply(h, self.gate)
        h = torch.tanh(l2(h)) + l2(h * 0.5)       # l2 read twice
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, 16, generator=g), torch.randint(0, 40, (2, 5), generator=g), \
        torch.randint(0, 40, (2, 5), generator=g)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_b_then_w_is_the_whole_backward_bitwise():
    torch.manual_seed(0)
    model = Stage()
    # The eager executor: B and W are separate graphs, which inductor would fuse differently from the
    # whole backward (float rounding), and RoundSTE's rounding turns such noise into large steps.
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise", backward="graph", executor="eager"))
    batches = [_batch(1), _batch(2)]

    # Whole backwards, two microbatches accumulating.
    whole_inputs = []
    for h, ids, labels in batches:
        x = h.clone().requires_grad_()
        tm(x, ids, labels).backward()
        whole_inputs.append(x.grad)
    whole = _grads(model)
    model.zero_grad(set_to_none=True)

    # B for both microbatches first, then W in the other order (as a schedule may). Hooks on a
    # parameter see its gradient in W. In B torch runs the parameter's AccumulateGrad node with no
    # gradient, as for any custom Function (here the graph's) returning None for an input: a
    # tensor hook gets None, a post-accumulate-grad hook finds .grad unchanged.
    seen = []
    model.layers[0].weight.register_hook(lambda g: seen.append("hook" if g is not None else "None") or None)
    model.layers[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append("post"))
    CALLS.update(ste=0, gate=0)
    pending, split_inputs = [], []
    for h, ids, labels in batches:
        x = h.clone().requires_grad_()
        loss = tm(x, ids, labels)
        with defer_weight_gradients(list(model.parameters())) as p:
            loss.backward()
        assert all(q.grad is None for q in model.parameters()), "B accumulated a parameter gradient"
        assert p.deferred_graphs == 1 and len(p) == 1
        pending.append(p)
        split_inputs.append(x.grad)
    assert CALLS == {"ste": 2, "gate": 2}       # each user backward ran once per microbatch, in B
    assert seen == ["None", "post"] * 2 and all(q.grad is None for q in model.parameters())
    for p in reversed(pending):
        p.run()
        assert len(p) == 0
    assert seen == ["None", "post"] * 2 + ["hook", "post"] * 2
    assert CALLS == {"ste": 2, "gate": 2}       # W reused their results
    for a, b in zip(whole_inputs, split_inputs):
        assert torch.equal(a, b)
    for name, g in _grads(model).items():
        # Bitwise for each microbatch; two accumulations may add in the other order.
        torch.testing.assert_close(g, whole[name], rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert set(_grads(model)) == {n for n, _ in model.named_parameters()}

    # What went where: the PythonOps' backwards in B, the weight products in W.
    backward = tm.capture_info().records[0].backward_runner
    assert isinstance(backward, AbsentGradBackward)
    (compiled, _), = [v for v in backward.splits.values()]
    split = compiled.split
    b_ops = [n.target for n in split.input_graph.graph.nodes if n.op == "call_function"]
    w_ops = [n.target for n in split.weight_graph.graph.nodes if n.op == "call_function"]
    assert b_ops.count(torch.ops.fxtrain.python_op_backward.default) == 2
    assert torch.ops.fxtrain.python_op_backward.default not in w_ops
    assert w_ops.count(torch.ops.aten.mm.default) >= 3    # l1 weight, l2 weight (read twice), head
    assert split.n_carried > 0 and len(split.weight_outputs) == 7


def test_whole_backward_outside_the_context_and_in_autograd_mode():
    """No context: nothing is deferred. The autograd runtime mode has no aten backward graph to
    cut: under the context its backward runs whole (exact, not split)."""
    torch.manual_seed(0)
    model = Stage()
    h, ids, labels = _batch(3)
    model(h.clone().requires_grad_(), ids, labels).backward()
    eager = _grads(model)
    for backward in ("graph", "autograd"):
        model.zero_grad(set_to_none=True)
        tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise", backward=backward, executor="eager"))
        loss = tm(h.clone().requires_grad_(), ids, labels)
        if backward == "graph":
            loss.backward()
        else:
            with defer_weight_gradients(list(model.parameters())) as pending:
                loss.backward()
            assert pending.deferred_graphs == 0
        for name, g in _grads(model).items():
            torch.testing.assert_close(g, eager[name], rtol=1e-5, atol=1e-7)


def _graph_with_in_place_across_the_cut() -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    saved, tangent = g.placeholder("saved"), g.placeholder("tangents_1")
    for p in (saved, tangent):
        p.meta["val"] = torch.empty(3)
    grad_in = g.call_function(torch.ops.aten.mul.Tensor, (tangent, saved))
    grad_w = g.call_function(torch.ops.aten.add_.Tensor, (grad_in, tangent))   # updates B's output in place
    g.output((grad_in, grad_w))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_an_in_place_update_across_the_cut_runs_whole():
    gm = _graph_with_in_place_across_the_cut()
    with pytest.raises(NotSplittable, match="in place"):
        split_backward(gm, [1])
    backward = AbsentGradBackward(gm)
    saved, tangent = torch.tensor([1.0, 2.0, 3.0]), torch.ones(3)
    grads, run_weights = backward.split_call([saved, tangent], (1,))
    assert run_weights is None
    assert torch.equal(grads[0], torch.tensor([2.0, 3.0, 4.0])) and torch.equal(grads[1], grads[0])


def test_multi_output_nodes_stay_whole_in_b():
    """A node returning a list (a PythonOp's backward) keeps its getitems: only tensors cross."""
    g = torch.fx.Graph()
    a = g.placeholder("a")
    a.meta["val"] = torch.empty(4)
    parts = g.call_function(torch.ops.aten.split.Tensor, (a, 2))
    parts.meta["val"] = [torch.empty(2), torch.empty(2)]
    first = g.call_function(operator.getitem, (parts, 0))
    second = g.call_function(operator.getitem, (parts, 1))
    w = g.call_function(torch.ops.aten.mul.Tensor, (second, 2.0))
    g.output((first, w))
    split = split_backward(torch.fx.GraphModule(torch.nn.Module(), g), [1])
    b_targets = [n.target for n in split.input_graph.graph.nodes if n.op == "call_function"]
    assert b_targets.count(operator.getitem) == 2 and split.n_carried == 1
    out = split.input_graph(torch.arange(4.0))
    assert torch.equal(split.weight_graph(out[1])[0], torch.tensor([4.0, 6.0]))
