"""The default sizes policy (dynamic=None) and what capture_info() says about captures; eager is the oracle.

Static first, then, from the first change of sizes, a symbolic entry for good (symbolic: the dimensions
seen to change and the leading one of each input; static: the rest). Dynamo's own automatic
dynamic shapes are per code object and per dimension: through the static entry alone a model captured
again for each new combination of changed dimensions and, with graph breaks, for sizes it had already
run (the code after a break that only symbolic sizes expose starts static when dynamo first meets it;
HF Longformer, tiny, 3 sizes twice: 42 captures against 28).
"""
import torch
from torch import nn
from torch._dynamo.utils import counters

from utils import to_device, train_parity, wrap_pair


def _sum(out, _):
    return out


def test_second_size_is_the_last_capture_without_graph_breaks():
    """README: the first size change captures once more with symbolic sizes; later sizes reuse it.
    Before: (4, 16) -> (4, 20) made only the sequence symbolic, and (5, 20) captured a third time."""
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(50, 8), nn.Linear(8, 8)

        def forward(self, ids):
            return self.lin(self.emb(ids)).softmax(-1).pow(2).sum()   # (a softmax sums to 1: no gradient)

    torch.manual_seed(0)
    tm, ref = wrap_pair(Seq(), dynamic=None)
    batches = [dict(ids=torch.randint(0, 50, s)) for s in ((4, 16), (4, 20), (5, 20), (4, 16), (6, 7))]
    train_parity(tm, ref, batches[:2], _sum)
    assert tm.capture_info().graphs == 2
    train_parity(tm, ref, batches[2:], _sum)
    assert tm.capture_info().graphs == 2


class SizeBreak(nn.Module):
    """HF Longformer's pattern: a size computed with torch.div is a constant under static sizes and
    data under symbolic ones, so the graph breaks (and dynamo makes a function of the rest) only then."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        n = torch.div(h.size(1), 2, rounding_mode="trunc")
        h = h.reshape(h.size(0), n, 2, 8).sum(2)
        return self.out(h).tanh().sum()


def test_no_capture_on_sizes_already_run_when_symbolic_sizes_break_the_graph():
    """Before: 5 captures, two of them on sizes already run; torch.compile itself makes 4, one so."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(SizeBreak(), dynamic=None)
    batches = [dict(x=torch.randn(b, s, 8)) for b, s in ((2, 6), (3, 10))]
    train_parity(tm, ref, batches, _sum)
    info = tm.capture_info()
    captures = info.graphs
    if info.break_reasons[0].startswith("Attempted to call torch in-graph function on only torch.SymInt"):
        # Dynamo without tensorify (torch 2.11) cannot put torch.div on SymInts in a graph: it breaks
        # there, and the rest of forward, whose reshape then reads a tensor, fails in the backend
        # (aten._local_scalar_dense: a second break) and runs as Python, as under torch.compile.
        assert (captures, info.graph_breaks) == (2, 2), info.break_reasons
        assert "_local_scalar_dense" in info.break_reasons[1], info.break_reasons
    else:   # the div is in the graph; the size read from it breaks once
        assert (captures, info.graph_breaks) == (3, 1), info.break_reasons
    train_parity(tm, ref, batches + [dict(x=torch.randn(4, 12, 8))] + batches[:1], _sum)
    assert info.graphs == captures
    # Each capture says why it happened: the two after the first, the switch to symbolic sizes.
    reasons = [r.reason for r in info.records]
    switch = ("sizes changed: symbolic kwargs['x'] dim 0 (2 -> 3), kwargs['x'] dim 1 (6 -> 10); "
              "every other input size static")
    assert reasons[0] == "first call" and all(r.startswith(switch) or r.startswith("after a graph break")
                                             for r in reasons[1:]), reasons
    assert switch in str(info)


def _captures_per_step(tm, ref, batches):
    captures = []
    for batch in batches:
        before = tm.capture_info().graphs
        train_parity(tm, ref, [batch], _sum)
        captures.append(tm.capture_info().graphs - before)
    return captures


def test_first_image_size_after_another_runs_its_static_capture():
    """Image sizes stay static on the symbolic entry (a capture per size, capture/sizes.py), so the
    first size, captured by the static entry, goes back there. Before: HF Swin's 4x32 images after
    3x48 were captured a third time (found by the edge fuzzer, seed 221)."""
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.lin = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(self.conv(x).relu().mean((2, 3))).pow(2).sum()

    torch.manual_seed(0)
    tm, ref = wrap_pair(Conv(), dynamic=None)
    sizes = ((4, 32), (3, 48), (4, 32), (3, 48), (3, 32), (4, 32))
    batches = [dict(x=torch.randn(b, 3, s, s)) for b, s in sizes]
    # (3, 32): a capture on the symbolic entry (symbolic batch at 32), which then serves 4x32 too.
    assert _captures_per_step(tm, ref, batches) == [1, 1, 0, 0, 1, 0], tm.capture_info().capture_reasons


def test_a_break_in_another_schema_keeps_the_first_sizes_on_their_capture():
    """A graph break while capturing one call schema (HF's output_hidden_states=True breaks at its
    hooks) no longer sends another schema's first sizes to the symbolic entry, where a size 1 that
    dynamo specialises captured them again (found by the edge fuzzer, seed 221: DistilBERT, 1x1)."""
    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, hooks=False):
            h = self.lin(x)
            if hooks:
                torch._dynamo.graph_break()
            return h.tanh().sum()

    torch.manual_seed(0)
    tm, ref = wrap_pair(Flagged(), dynamic=None)
    batches = [dict(x=torch.randn(*s)) for s in ((1, 8), (3, 8))] + [dict(x=torch.randn(2, 8), hooks=True),
                                                                      dict(x=torch.randn(1, 8))]
    captures = _captures_per_step(tm, ref, batches)
    assert tm.capture_info().graph_breaks >= 1
    assert captures[-1] == 0, (captures, tm.capture_info().capture_reasons)


def test_recapture_reason_is_the_failed_guard():
    """A new requires_grad pattern inside the model (as Longformer's attention helper called on
    the queries, then on the mask): dynamo's failing guard, in its own words."""
    class TwoCalls(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def helper(self, a):
            torch._dynamo.graph_break()
            return a * 2

        def forward(self, x):
            return (self.helper(self.lin(x)) + self.helper(x)).sum()

    torch.manual_seed(0)
    tm, ref = wrap_pair(TwoCalls(), dynamic=None)
    train_parity(tm, ref, [dict(x=torch.randn(3, 4))], _sum)
    info = tm.capture_info()
    assert any("requires_grad mismatch" in r.reason for r in info.records), str(info)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent branch: dynamo counts it under "unimplemented"
            return (h * 2).sum()
        return (h - 1).sum()


class ExplicitBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        torch._dynamo.graph_break()  # counted under "graph_break"
        return h.tanh().sum()


def _dynamo_breaks():
    return sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())


def test_graph_breaks_counted_as_torch_compile_counts_them():
    """Our entry function breaks too when the model does (nothing captured on either side of its one
    call): counted once, not twice. Reasons are this call's, not whatever the process compiled before."""
    counters["graph_break"]["an earlier, unrelated break"] += 1
    for model_type in (Branchy, ExplicitBreak):
        torch.manual_seed(0)
        x = to_device(torch.randn(5, 4))
        before = _dynamo_breaks()
        torch.compile(to_device(model_type()), backend="aot_eager")(x)
        theirs = _dynamo_breaks() - before
        tm, ref = wrap_pair(model_type(), dynamic=None)
        train_parity(tm, ref, [dict(x=x)], _sum)
        info = tm.capture_info()
        assert (theirs, info.graph_breaks, info.graphs) == (1, 1, 2), model_type.__name__
        assert len(info.break_reasons) == 1 and "unrelated" not in info.break_reasons[0]
