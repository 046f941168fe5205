"""The joint-graph pass that drops copies eager does not make (passes/noop_copies.py): the graphs
lose them, training keeps eager's numbers, and a copy whose source or result is written stays."""
import re

import torch
import torch.fx
from torch import nn

from fxtrain.passes.noop_copies import noop_copies
from utils import to_device, train_parity, wrap_pair

aten = torch.ops.aten


class _Copies(nn.Module):
    """A Dropout(p=0) (a clone in the traced graph), a whole-width slice (a slice_backward in the
    backward) and one tensor cast to float64 twice while the first cast is still read."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.0)
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.drop(self.inner(x))[:, :8]
        a, b = h.to(torch.float64), h.to(torch.float64)
        h = (a * torch.tanh(b)).to(torch.float32)
        return nn.functional.cross_entropy(self.out(h), y)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_the_copies_leave_the_graphs_and_training_matches_eager():
    torch.manual_seed(0)
    # The replay of the aten graphs (the pass's graphs); "auto" runs this small backward under autograd.
    tm, ref = wrap_pair(_Copies(), backward="graph")
    batches = [{"x": torch.randn(n, 8), "y": torch.randint(0, 3, (n,))} for n in (5, 7, 5)]
    train_parity(tm, ref, batches, lambda loss, _: loss)
    info = tm.capture_info()
    report = info.optimizations["noop_copies"]
    # The dropout's clone, and (torch 2.11-2.13) the slice's backward, a zero fill and a copy where
    # 2.14 traces no copy for it.
    assert re.fullmatch(r"on: dropped [12] copies of unwritten tensors, 1 whole-tensor slices, 1 repeated casts, "
                        r"\d+ detaches", report), report
    record = info.records[0]
    assert record.runtime.startswith("graph"), record.runtime
    targets = _targets(record.forward_graph) + _targets(record.backward_graph)
    assert not {aten.clone.default, aten.slice_backward.default, aten.detach.default} & set(targets)
    assert _targets(record.forward_graph).count(aten._to_copy.default) == 2   # to float64 once, back once


class _ClonesAWrittenBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        before = self.seen.clone()
        self.seen.add_(x.detach().mean(0))
        return (self.lin(x) * before + self.lin(x) * self.seen).square().mean()


def test_a_clone_of_a_buffer_written_in_the_step_keeps_the_value_before_the_write():
    torch.manual_seed(0)
    tm, ref = wrap_pair(_ClonesAWrittenBuffer(), backward="graph")
    train_parity(tm, ref, [{"x": torch.randn(3, 4)} for _ in range(3)], lambda loss, _: loss)


def _graph(build):
    graph = torch.fx.Graph()
    outputs = build(graph)
    graph.output(outputs)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    return gm


def _with_vals(gm, *inputs):
    """Each node's ``val`` meta, as the joint graph has them."""
    from torch.fx.passes.shape_prop import ShapeProp
    ShapeProp(gm).propagate(*inputs)
    for n in gm.graph.nodes:
        meta = n.meta.get("tensor_meta")
        if n.op != "output" and meta is not None:
            n.meta["val"] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    return gm


def test_copies_that_a_write_or_an_output_can_tell_apart_stay():
    x, z = to_device((torch.randn(3, 4), torch.randn(3, 4)))

    def written(g):   # clone(x), then x written in place: the clone holds the value before
        a, b = g.placeholder("a"), g.placeholder("b")
        m = g.call_function(aten.mul.Tensor, (a, 2))
        kept = g.call_function(aten.clone.default, (m,))
        g.call_function(aten.copy_.default, (m, b))
        return (g.call_function(aten.mul.Tensor, (kept, b)),)

    def returned(g):  # the copy is an output beside its source
        m = g.call_function(aten.mul.Tensor, (g.placeholder("a"), 2))
        g.placeholder("b")
        return (m, g.call_function(aten.clone.default, (m,)))

    def of_a_view(g):  # a compact copy of a transposed view
        a = g.placeholder("a")
        g.placeholder("b")
        t = g.call_function(aten.t.default, (g.call_function(aten.mul.Tensor, (a, 2)),))
        return (g.call_function(aten.mul.Tensor, (g.call_function(aten.clone.default, (t,)), 2)),)

    def cast_after_write(g):  # the second cast reads x after an in-place write
        a, b = g.placeholder("a"), g.placeholder("b")
        first = g.call_function(aten._to_copy.default, (a,), {"dtype": torch.float64})
        g.call_function(aten.add_.Tensor, (a, b))
        second = g.call_function(aten._to_copy.default, (a,), {"dtype": torch.float64})
        return (g.call_function(aten.add.Tensor, (first, second)),)

    def of_an_input(g):  # the runtime may write an input back after the forward (a buffer's update)
        a = g.placeholder("a")
        g.placeholder("b")
        return (g.call_function(aten.mul.Tensor, (g.call_function(aten.clone.default, (a,)), 2)),)

    for build in (written, returned, of_a_view, cast_after_write, of_an_input):
        gm = _with_vals(_graph(build), x.clone(), z)
        before = len(gm.graph.nodes)
        expected = gm(x.clone(), z)
        report = noop_copies(gm)
        assert not report.applied and len(gm.graph.nodes) == before, (build.__name__, report)
        for got, want in zip(gm(x.clone(), z), expected):
            torch.testing.assert_close(got, want)


def test_a_copy_nothing_writes_goes():
    x = to_device(torch.randn(3, 4))

    def build(g):
        a = g.placeholder("a")
        copy = g.call_function(aten.clone.default, (g.call_function(aten.mul.Tensor, (a, 3)),))
        whole = g.call_function(aten.slice.Tensor, (copy, 1, 0, 4))
        return (g.call_function(aten.mul.Tensor, (whole, 2)),)

    gm = _with_vals(_graph(build), x)
    expected = gm(x)
    report = noop_copies(gm)
    assert report.applied and report.reason == "dropped 1 copies of unwritten tensors, 1 whole-tensor slices"
    assert _targets(gm) == [aten.mul.Tensor, aten.mul.Tensor]
    torch.testing.assert_close(gm(x)[0], expected[0])
