"""Packed batches: attention within documents only.

A packed batch puts several documents in one row (HF's ``DataCollatorWithFlattening``: ``input_ids``
and ``labels`` of shape ``[1, N]``, ``position_ids`` restarting at 0 with every document, no
``attention_mask``). HF then builds, under tracing, a ``[batch, 1, N, N]`` mask that lets a token
see the tokens of its own document only (at or before it in a causal LM). Eager runs SDPA over
the whole row with that mask: ``batch * N**2`` work, of which the documents need ``sum(len**2)``.

This pass replaces each such SDPA by ``fxtrain::varlen_attention`` (``runtime/varlen_attention.py``)
over the rows flattened to ``[batch * N, heads, dim]``, the documents being consecutive blocks.
For every query row that is what eager computes: the same keys (those of its document, in causal
order), the same softmax over them; keys outside the document get weight 0 in eager (``False`` or
``-inf``) and are not read at all here.

What is relied on, and where it is checked:

- the mask is exactly "same document" (and causal, or not), documents being the runs of a
  ``[batch, seq]`` integer input that restart whenever it does not grow by one from one token to
  the next (HF's ``find_packed_sequence_indices`` convention): evaluated on the capturing batch to
  find that input and the kind, and written into the batch guard, so that any later batch whose
  mask is something else (padding from an ``attention_mask``, a plain causal mask across documents,
  a sliding window) runs the dense graph: eager's numbers. The decision follows the mask, never
  ``position_ids`` alone: with ``use_cache=True`` HF builds a plain causal mask, which eager
  applies across documents, and so must fxtrain;
- no attention dropout, a constant scale, q, k and v of the same ``[batch, heads, seq, dim]``
  (grouped-query key/value heads are repeated, as SDPA's ``enable_gqa`` does).

Document lengths reach the op as a host tensor without a synchronisation of their own: the batch
guard reads the per-token document-start flags (fixed size, whatever the number of documents) in
its one transfer, and the host turns them into lengths (``host_counts.document_lengths``).

An attention that fails any check stays as it is (exact), with its reason in the pass report.
"""
from __future__ import annotations

import logging
import operator
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from ..options import Options
from ..runtime.varlen_attention import VARLEN_ATTENTION, kernel_calls
from ..torch_private import NN_SDPA, size_hint
from ..runtime.step import PassReport, Plans
from ..runtime.host_counts import HOST_DOCUMENT_LENGTHS
from .batch_guard import GuardBuilder, host_numbers
from .density import ExampleSource, density_reason
from . import eager_attention
from .rows import ancestors, attention_flops_at_capture, value
from .varlen import Attention, as_sdpa_sees_them, erase_replaced

logger = logging.getLogger("fxtrain")
Node = torch.fx.Node
NAME = "packed_attention"
_SDPA = {NN_SDPA, F.scaled_dot_product_attention}


def emit_document_starts(graph: torch.fx.Graph, positions: Node) -> Node:
    """Nodes of ``graph`` computing ``[batch, seq]`` bool: the tokens that begin a document, a
    document being a run of positions that grow by one (a row's first token always begins one).
    Plain torch ops, so that the step, the batch guard and the on-disk cache all take them."""
    step = graph.call_function(torch.ne, (graph.call_function(torch.diff, (positions,), {"dim": -1}), 1))
    first = graph.call_function(operator.getitem, (positions, (slice(None), slice(None, 1))))
    first = graph.call_function(torch.ones_like, (first,), {"dtype": torch.bool})
    return graph.call_function(torch.cat, ([first, step],), {"dim": -1})


def emit_document_mask_check(graph: torch.fx.Graph, mask: Node, positions: Node, causal: bool,
                             dtype: torch.dtype) -> Node:
    """Nodes of ``graph`` computing a 0-d bool: ``mask`` (an SDPA mask, ``[batch or 1, heads or 1,
    seq, seq]``, bool or additive as its ``dtype`` says) lets each token see exactly the tokens of
    its own document (at or before it when ``causal``), documents read from ``positions``. An
    additive mask must block with ``-inf`` or its dtype's lowest value (transformers' eager masks):
    each token sees at least itself, and for scores short of the dtype's range ``exp`` of a score
    plus the lowest value, less the row's largest, is exactly 0, the weight of a skipped key (the
    padding rule's, ``varlen.mask_kind``)."""
    is_bool = dtype == torch.bool
    g = graph
    doc = g.call_method("cumsum", (emit_document_starts(g, positions), -1))
    q_doc = g.call_function(operator.getitem, (doc, (slice(None), None, slice(None), None)))
    k_doc = g.call_function(operator.getitem, (doc, (slice(None), None, None, slice(None))))
    expected = g.call_function(torch.eq, (q_doc, k_doc))                       # [batch, 1, seq, seq]
    if causal:
        square = g.call_function(operator.getitem, (expected, (0, 0)))
        lower = g.call_method("tril", (g.call_function(torch.ones_like, (square,)),))
        expected = g.call_function(torch.logical_and, (expected, lower))
    allowed = mask if is_bool else g.call_function(torch.eq, (mask, 0))
    bad = g.call_method("any", (g.call_function(torch.ne, (allowed, expected)),))
    ok = g.call_function(torch.logical_not, (bad,))
    if not is_bool:
        blocked = g.call_function(torch.le, (mask, torch.finfo(dtype).min))   # -inf, or the lowest value
        formed = g.call_method("all", (g.call_function(torch.logical_or, (allowed, blocked)),))
        ok = g.call_function(torch.logical_and, (ok, formed))
    return ok


def _run(build: Any, *args: torch.Tensor) -> torch.Tensor:
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(len(args))]
    graph.output(build(graph, *inputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)(*args)


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """``emit_document_starts`` on a tensor (the capturing batch, the bench's FLOP count)."""
    return _run(emit_document_starts, positions)


def is_document_mask(mask: torch.Tensor, positions: torch.Tensor, causal: bool) -> bool:
    """``emit_document_mask_check`` on tensors: the capturing batch's check, the one every later
    batch gets in the guard. False where the shapes do not fit (no document mask either)."""
    b, s = positions.shape
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (s, s) or mask.shape[0] not in (1, b):
        return False
    return bool(_run(lambda g, m, p: emit_document_mask_check(g, m, p, causal, mask.dtype),
                     mask, positions))


_NO_MASK = "no mask (plain or causal attention over whole rows)"
# transformers 5.17 (with torch 2.11) builds this tensor where later releases pass no mask.
_CAUSAL_ROWS = "a plain causal mask over whole rows (no [batch, seq] integer input among its mask's inputs)"


def _packed_without_mask(gm: torch.fx.GraphModule, examples: ExampleSource, what: str) -> Optional[str]:
    """Where no attention has a per-document mask (``what``: none, or a plain causal one) but the
    capturing batch is packed (a ``[batch, seq]`` integer input restarting within rows:
    ``position_ids`` of ``DataCollatorWithFlattening``), what the user sees and how to get
    attention within documents: HF builds that mask only without a cache."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        real = examples.value(node)
        if not isinstance(real, torch.Tensor) or real.dim() != 2 or real.dtype in (torch.bool,) \
                or real.is_floating_point() or real.is_complex() or real.shape[1] < 2:
            continue
        step = real[:, 1:] - real[:, :-1]
        restart = step != 1
        # Positions: every row starts at 0, grows by one within a document and restarts at 0. Not
        # positions: BERT's token_type_ids (all zeros, or 0s then 1s) repeat a value or jump to 1.
        if not bool((real[:, 0] == 0).all()) or not bool(restart.any()) or not bool((~restart).any()) \
                or not bool((real[:, 1:][restart] == 0).all()):
            continue   # not positions, or positions that never restart
        documents = len(_lengths(real))
        name = re.sub(r"^l_(kwargs_)?|_$", "", node.name)   # dynamo's placeholder name of the input
        return (f"a packed batch ({documents} documents in {real.shape[0]} row(s): {name} restarts) "
                f"with {what}: each token attends (the earlier) tokens of its whole row, across "
                "documents, as eager computes it. For attention within documents pass use_cache=False "
                "(or set model.config.use_cache = False), as HF's packing guide says: HF then builds the "
                "per-document mask, which this pass runs document by document")
    return None


def _hint_shape(node: Any) -> Optional[Tuple[int, ...]]:
    v = value(node)
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(size_hint(d) for d in v.shape)


def _check_call(args: Dict[str, Any]) -> Tuple[Optional[Tuple[int, int, int, int, int]], str]:
    """``(batch, heads, seq, dim, key/value heads)`` of an attention (SDPA's arguments by name) that
    can run document by document whatever its mask, or why not."""
    if not isinstance(args["attn_mask"], Node):
        return None, _NO_MASK
    if not isinstance(args["dropout_p"], (int, float)) or args["dropout_p"] != 0:
        return None, "attention dropout is on (its mask over whole rows has no per-document form)"
    if args["is_causal"] is not False:
        return None, "is_causal set next to a mask"
    if args["scale"] is not None and not isinstance(args["scale"], (int, float)):
        return None, "the scale is not a constant"
    shapes = [_hint_shape(args[n]) for n in ("query", "key", "value")]
    if any(s is None or len(s) != 4 for s in shapes):
        return None, "q, k or v is not [batch, heads, seq, dim]"
    (b, h, s, d), (kb, kh, ks, kd), vs = shapes
    if (kb, ks, kd) != (b, s, d) or vs != (kb, kh, ks, kd):
        return None, "q, k and v differ in batch, length or head size (cross-attention, a cache)"
    if kh != h and not (args["enable_gqa"] is True and h % kh == 0):
        return None, "k and v have other heads than q"
    return (b, h, s, d, kh), ""


def _documents_of(mask: Any, sdpa_mask: Node, b: int, s: int,
                  examples: ExampleSource) -> Tuple[Optional[Tuple[Node, bool]], str]:
    """The ``[batch, seq]`` integer input whose runs are the documents of ``mask`` (the capturing
    batch's value of ``sdpa_mask``), and whether it is causal."""
    if not isinstance(mask, torch.Tensor):
        return None, "its mask cannot be evaluated on the capturing batch"
    candidates = []
    for node in ancestors(sdpa_mask):
        real = examples.value(node)
        if real is not None and real.dim() == 2 and not real.is_floating_point() and not real.is_complex() \
                and real.dtype != torch.bool and tuple(real.shape) == (b, s):
            candidates.append((node, real))
    if not candidates:
        rows = torch.arange(s, device=mask.device).expand(b, s)   # one document a row
        if is_document_mask(mask, rows, causal=True):
            return None, _CAUSAL_ROWS
        return None, "no [batch, seq] integer input (position_ids) among its mask's inputs"
    for node, real in sorted(candidates, key=lambda c: c[0].name):
        for causal in (True, False):   # one-token documents fit both: causal is the stricter
            if is_document_mask(mask, real.to(mask.device), causal):
                return (node, causal), ""
    return None, "its mask is not 'same document' (and causal) over the runs of position_ids"


def packed_attention(gm: torch.fx.GraphModule, examples: ExampleSource, options: Options,
                     plans: Plans) -> PassReport:
    if options.packed_attention == "off":
        return PassReport(NAME, False, "off by option")
    graph = gm.graph
    why: List[str] = []
    attentions = [Attention.of_sdpa(n) for n in graph.nodes if n.op == "call_function" and n.target in _SDPA]
    for block in eager_attention.find(gm):   # a plain block in eager ops is the SDPA it computes
        equivalent, why_not = block.sdpa_equivalent()
        if equivalent is None:
            why.append(f"{block.out.name}: attention in eager ops: {why_not}")
        else:
            attentions.append(equivalent)
    if not attentions and not why:
        return PassReport(NAME, False, "no attention")
    total = len(attentions) + len(why)
    found: Dict[Attention, Tuple[Tuple[int, int, int, int, int], Node, bool]] = {}
    evaluated: Dict[Node, Any] = {}
    documents: Dict[Tuple[Node, int, int], Tuple[Optional[Tuple[Node, bool]], str]] = {}
    for attention in attentions:
        dims, reason = _check_call(attention.args)
        if dims is None:
            why.append(f"{attention.name}: {reason}")
            continue
        mask = attention.args["attn_mask"]
        if mask not in evaluated:
            evaluated[mask] = examples.evaluate(gm, mask)
        # Once per mask: the layers share theirs, and reading one is a few passes over
        # [batch, heads, seq, seq] (Llama at 4 x 4096: 0.18 s a layer on the CPU).
        if (mask, dims[0], dims[2]) not in documents:
            documents[mask, dims[0], dims[2]] = _documents_of(evaluated[mask], mask, dims[0], dims[2], examples)
        docs, reason = documents[mask, dims[0], dims[2]]
        if docs is None:
            why.append(f"{attention.name}: {reason}")
            continue
        found[attention] = (dims, *docs)
    if not found:
        reasons = sorted({w.split(": ", 1)[1] for w in why})
        packed = None
        if set(reasons) <= {_NO_MASK, _CAUSAL_ROWS}:
            what = "no attention mask" if reasons == [_NO_MASK] else "a plain causal mask over whole rows"
            packed = _packed_without_mask(gm, examples, what)
        return PassReport(NAME, False, packed or "; ".join(reasons))
    # The capturing batch's attention work, documents over whole rows: what 'auto' weighs.
    positions = {p for _, p, _ in found.values()}
    work = whole = 0
    lengths: Dict[Node, List[int]] = {}
    for p in positions:
        real = examples.value(p)
        lengths[p] = _lengths(real)
        work += sum(n * n for n in lengths[p])
        whole += real.numel() * real.shape[1]
    on, reason = density_reason("attention density", work / whole if whole else None,
                                options.packed_attention, options.sparsity_threshold)
    if not on:
        return PassReport(NAME, False, reason)
    builder = GuardBuilder.of(gm, plans)
    guarded: Dict[Tuple[Node, Node, bool], bool] = {}
    lengths_of: Dict[Node, Node] = {}
    done = saved = run_calls = 0
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for attention, ((b, h, s, d, kh), pos, causal) in found.items():
        args = attention.args
        key = (args["attn_mask"], pos, causal)
        if key not in guarded:
            g_mask, g_pos = builder.node(args["attn_mask"]), builder.node(pos)
            guarded[key] = g_mask is not None and g_pos is not None
            if guarded[key]:
                ok = emit_document_mask_check(builder.graph, g_mask, g_pos, causal, evaluated[args["attn_mask"]].dtype)
                kind = "causal " if causal else ""
                builder.require(ok, f"the attention mask is not the {kind}document mask of position_ids "
                                    "that the per-document attention relies on")
        if not guarded[key]:
            why.append(f"{attention.name}: its mask cannot be checked before each step")
            continue
        if pos not in lengths_of:
            with graph.inserting_before(first):
                starts = emit_document_starts(graph, pos)
                lengths_of[pos] = host_numbers(gm, plans, starts, HOST_DOCUMENT_LENGTHS)
        scale = float(args["scale"]) if args["scale"] is not None else d ** -0.5
        with graph.inserting_before(attention.out):
            rows = []
            for name in ("query", "key", "value"):
                x = args[name]
                if name != "query" and kh != h:   # grouped-query heads: SDPA's enable_gqa pairing
                    x = graph.call_method("repeat_interleave", (x, h // kh), {"dim": 1})
                tokens_first = graph.call_method("transpose", (x, 1, 2))          # [b, s, heads, dim]
                rows.append((tokens_first, graph.call_method("flatten", (tokens_first, 0, 1))))
            both = graph.call_function(VARLEN_ATTENTION, (*as_sdpa_sees_them(graph, attention.out, [r for _, r in rows],
                                                                             args),
                                                          lengths_of[pos], scale, bool(causal)))
            out = graph.call_function(operator.getitem, (both, 0))
            out = graph.call_method("transpose", (graph.call_method("view_as", (out, rows[0][0])), 1, 2))
        saved += round(attention_flops_at_capture(attention.out, args) * (1 - work / whole))
        attention.out.replace_all_uses_with(out)
        erase_replaced(graph, attention.own)
        done += 1
        run_calls += kernel_calls(value(args["query"]), value(args["value"]), lengths[pos])
    builder.store(plans)
    for w in why:
        logger.info("fxtrain %s: attention stays over whole rows: %s", NAME, w)
    if not done:
        return PassReport(NAME, False, why[0])
    note = f" (over whole rows: {'; '.join(why)})" if why else ""
    return PassReport(NAME, True, f"{reason}: {done} of {total} attention(s) run document by document{note}",
                      saved_flops=saved, attention_calls=done, attention_runs=run_calls)


def _lengths(positions: torch.Tensor) -> List[int]:
    """Every row's document lengths, in order (the capturing batch's)."""
    starts = document_starts(positions.cpu())
    out: List[int] = []
    for row in starts:
        at = row.nonzero().view(-1).tolist() + [row.numel()]
        out += [e - a for a, e in zip(at, at[1:])]
    return out
