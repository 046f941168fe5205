"""The row gathers and scatters the sparsity passes insert (passes/row_ops.py, passes/scatter_in_place.py):
row ops on dim 0 in the forward and in the backward AOTAutograd derives from them, with eager's
numbers (eager PyTorch is the oracle)."""
import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxtrain import models
from fxtrain.passes.scatter_in_place import scatter_in_place
from utils import to_device, train_parity, wrap_pair

# What these tests check is what the passes compute: on an accelerator they stay on whatever their
# launches cost there (tests/conftest.py: passes_whatever_they_cost).
pytestmark = pytest.mark.usefixtures("passes_whatever_they_cost")

aten = torch.ops.aten
STATE_ATOL = 3e-4  # AdamW magnifies rounding noise in zero-true gradients (see test_label_sparsity)
# Element-wise scatters (index_add's CPU kernel is scatter_add through an index expanded over the
# features), and functional scatters that clone the tensor they scatter into.
NOT_ROW_OPS = {aten.index_add.default, aten.index_add_.default, aten.scatter_add.default, aten.scatter.src,
               aten.index_copy.default, aten.index_put.default}
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _mlm_batches(pad_id, seed, shapes=((4, 16), (3, 11), (5, 20))):
    g = torch.Generator().manual_seed(seed)
    return [models.synthetic_batch("mlm", b, s, 1000, padding=0.45, label_density=0.1, pad_id=pad_id, generator=g)
            for b, s in shapes]


@pytest.mark.parametrize("name,build,pad", [
    pytest.param("distilbert", lambda: models.distilbert_mlm(hidden=32, layers=2, heads=2, vocab=1000), 0,
                 marks=pytest.mark.extended),
    ("bert", lambda: models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000), 0),
])
def test_padding_and_label_rows_move_by_row_ops(name, build, pad):
    """Label sparsity and padding elimination together, the aten graphs replayed (the graph runtime):
    eager's numbers, and in both graphs only row gathers. The labelled rows are taken from the packed
    real tokens, and attention runs on them sequence by sequence: nothing is re-padded."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(build(), backward="graph")
    train_parity(tm, ref, _mlm_batches(pad, 1), lambda out, _: out.loss, state_atol=STATE_ATOL)
    why = tm.capture_info().optimizations
    for name in ("label_sparsity", "padding_elimination"):
        assert why[name].startswith("on:"), (name, why[name])
    assert why["scatter_in_place"] == "off: no scatter into a private zero tensor", why["scatter_in_place"]
    for record in tm.capture_info().records:
        assert record.runtime.startswith("graph"), record.runtime
        forward, backward = _targets(record.forward_graph), _targets(record.backward_graph)
        assert not NOT_ROW_OPS & set(forward + backward)
        assert not forward.count(SDPA) and not forward.count(aten.index_copy_.default), forward
        assert forward.count(torch.ops.fxtrain.varlen_attention.default) == 2
        assert aten.embedding_dense_backward.default in backward  # the row gathers' backward


class _BroadcastLM(nn.Module):
    """Token rows plus operands broadcast over them: ``[1, seq, h]`` positions, a ``[batch, 1, h]``
    per-sequence style, a ``[1, 1, h]`` bias. The embedding's padding_idx marks padding."""

    def __init__(self, vocab=100, hidden=16, seq=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, seq, hidden))
        self.bias = nn.Parameter(torch.randn(1, 1, hidden))
        self.style = nn.Linear(4, hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, 32), nn.GELU(), nn.Linear(32, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, style, labels):
        s = input_ids.shape[1]
        h = self.emb(input_ids) + self.pos[:, :s] + self.style(style)[:, None, :] + self.bias
        h = h + self.ffn(h)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


@pytest.mark.parametrize("backward", ["autograd", "graph"])
def test_broadcast_operands_are_gathered_at_their_own_rows(backward):
    """Each real token reads its row of a broadcast operand (its position's, its sequence's, the one
    row) straight from the operand, not from a ``[batch * seq, h]`` expanded copy: eager's loss and
    gradients (which sum the tokens' rows back into the operand)."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(_BroadcastLM(), label_sparsity="off", backward=backward)
    g = torch.Generator().manual_seed(3)
    batches = []
    for b, s in ((4, 16), (3, 11), (5, 20)):
        batch = models.synthetic_batch("mlm", b, s, 100, padding=0.5, label_density=0.3, generator=g)
        batches.append({"input_ids": batch["input_ids"], "style": torch.randn(b, 4, generator=g),
                        "labels": batch["labels"]})
    train_parity(tm, ref, batches, lambda out, _: out)
    assert tm.capture_info().optimizations["padding_elimination"].startswith("on:")
    graph = tm.capture_info().records[0].dynamo_graph
    assert not [n for n in graph.graph.nodes if n.op == "call_method" and n.target == "expand"]


def test_kept_position_is_taken_from_the_packed_rows():
    """A classifier's ``h[:, 0]`` after padding elimination: one packed row per sequence, no re-padding
    at all (attention runs on the packed rows sequence by sequence)."""
    torch.manual_seed(0)
    tm, ref = wrap_pair(models.roberta_cls(32, 2, 2, 1000), backward="graph")
    g = torch.Generator().manual_seed(4)
    batches = [models.synthetic_batch("cls", b, s, 1000, padding=0.4, pad_id=1, generator=g)
               for b, s in ((4, 16), (3, 11))]
    train_parity(tm, ref, batches, lambda out, _: out.loss, state_atol=STATE_ATOL)
    why = tm.capture_info().optimizations
    assert why["padding_elimination"].startswith("on:") and why["upstream_slicing"].startswith("on:"), why
    graph = tm.capture_info().records[-1].dynamo_graph
    targets = [n.target for n in graph.graph.nodes]
    assert not targets.count(torch._C._nn.scaled_dot_product_attention) and not targets.count("index_copy_")
    assert targets.count(torch.ops.fxtrain.varlen_attention.default) >= 1  # every attention of this graph


def _scatter_graph(share_zeros: bool) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    rows, index = graph.placeholder("rows"), graph.placeholder("index")
    zeros = graph.call_function(aten.new_zeros.default, (rows, [6, 3]))
    full = graph.call_function(aten.index_copy.default, (zeros, 0, index, rows))
    graph.output((full, zeros) if share_zeros else (full,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("share_zeros", [False, True])
def test_scatter_into_private_zeros_runs_in_place(share_zeros):
    """In place only when nothing else reads the zeros; the value is the functional op's either way."""
    gm = _scatter_graph(share_zeros)
    rows, index = to_device((torch.randn(2, 3), torch.tensor([1, 4])))
    expected = gm(rows, index)
    report = scatter_in_place(gm)
    assert report.applied is not share_zeros
    assert (aten.index_copy_.default in _targets(gm)) is not share_zeros
    for got, want in zip(gm(rows, index), expected):
        torch.testing.assert_close(got, want)
