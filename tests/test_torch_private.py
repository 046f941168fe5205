"""fxtrain's private torch APIs stay behind ``fxtrain/torch_private.py`` (issue #14).

(a) No other module under fxtrain/ names a private torch API: the source is parsed, every import
    and every attribute chain rooted at a torch module is resolved to its dotted name, and a name
    with a segment starting with one underscore (``torch._dynamo``, ``torch.fx._graph_pickler``,
    ``torch.utils._pytree``, ``torch._C._nn.linear``, ``stateless._reparametrize_module``) fails.
    Op names under ``torch.ops`` (``torch.ops.aten._unsafe_view``) are public op schemas, not APIs.
(b) Each accessor of torch_private is called once, so a torch upgrade that moved a name fails here
    with the accessor's name, not deep inside a capture.
"""
from __future__ import annotations

import ast
import logging
import pathlib
from typing import Dict, Iterator, List, Optional

import pytest
import torch
import torch.fx

from fxtrain import torch_private as tp
from utils import current_device

# What most accessors find is the same on any device; test_aot_accessors, whose inductor compiles
# kernels for its tensors' device, runs on the test device.
LOOKUP = pytest.mark.cpu_only(reason="torch private APIs found by name: the same on any device")

PACKAGE = pathlib.Path(tp.__file__).resolve().parent

# Modules allowed to name private torch APIs, and why. Keep it to torch_private itself.
ALLOWED = {
    "torch_private.py",  # the one place (issue #14)
}


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[:2] == ["torch", "ops"]:
        return False  # op namespaces and op names, not Python APIs
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _dotted(node: ast.AST) -> Optional[List[str]]:
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _violations(path: pathlib.Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child._parent = parent  # type: ignore[attr-defined]
    aliases: Dict[str, str] = {}   # local name -> dotted torch name, from this module's imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    if _private(a.name):
                        yield f"{node.lineno}: import {a.name}"
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "torch" or node.module.startswith("torch.")):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _private(full):
                    yield f"{node.lineno}: from {node.module} import {a.name}"
                aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent", None), ast.Attribute):
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                full = ".".join([aliases[parts[0]]] + parts[1:])
                if _private(full):
                    yield f"{node.lineno}: {'.'.join(parts)} ({full})"


def _modules() -> List[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if str(p.relative_to(PACKAGE)) not in ALLOWED)


@pytest.mark.cpu_only(reason="source scan (the AST of fxtrain/): no tensors")
def test_no_private_torch_names_outside_torch_private() -> None:
    found = []
    for path in _modules():
        found += [f"fxtrain/{path.relative_to(PACKAGE)}:{v}" for v in dict.fromkeys(_violations(path))]
    assert not found, ("private torch APIs named outside fxtrain/torch_private.py (add an accessor there):\n"
                       + "\n".join(found))


@pytest.mark.cpu_only(reason="source scan (the AST of fxtrain/): no tensors")
def test_scanner_sees_private_names(tmp_path: pathlib.Path) -> None:
    """The check above would catch each form of private use."""
    source = tmp_path / "m.py"
    source.write_text("import torch\nimport torch._dynamo\nimport torch.utils._pytree as pytree\n"
                      "from torch._subclasses import FakeTensor\nfrom torch.nn.utils.stateless import _reparametrize_module\n"
                      "from torch import _C\nx = torch._C._nn.linear\ny = torch.ops.aten._unsafe_view\n"
                      "z = torch.autograd.Variable._execution_engine\n")
    found = list(_violations(source))
    assert len([v for v in found if v.startswith(("2:", "3:", "4:", "5:", "6:", "7:", "9:"))]) >= 7, found
    assert not [v for v in found if v.startswith("8:")], found


def _op_graph() -> torch.fx.GraphModule:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, x).relu()
    return torch.fx.symbolic_trace(f)


def _check(name: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"torch_private.{name} (checked on torch {tp.CHECKED_ON}) no longer finds its torch API "
                    f"on torch {torch.__version__}: {type(e).__name__}: {e}")


CONSTANTS = ["NN_LINEAR", "NN_GELU", "NN_SILU", "NN_PAD", "NN_SDPA", "ASSERT_ASYNC", "FakeTensor", "FakeTensorMode",
             "unset_fake_temporarily", "DynamicOutputShapeException", "TorchDispatchMode", "pytree", "tree_flatten",
             "tree_map", "tree_map_only", "DisableTorchFunctionSubclass", "DispatchKey", "DispatchKeySet",
             "AFTER_AUTOGRAD_KEYSET", "is_grad_enabled", "set_grad_enabled", "any_requires_grad",
             "dispatch_tls_include_set", "dispatch_tls_exclude_set", "ForceDispatchKeyGuard", "dispatch_mode_depth",
             "current_autograd_node", "run_backward", "CHECKPOINT_OP", "RNG_STATE_OPS"]


@LOOKUP
@pytest.mark.parametrize("name", CONSTANTS)
def test_constant_is_there(name: str) -> None:
    assert getattr(tp, name) is not None


@LOOKUP
def test_constants_behave() -> None:
    x = torch.ones(2, 2)
    assert tp.NN_LINEAR(x, x).shape == (2, 2)
    tp.ASSERT_ASYNC(torch.tensor(True))
    assert tp.is_grad_enabled() is torch.is_grad_enabled()
    assert tp.dispatch_mode_depth() == 0 and tp.current_autograd_node() is None
    assert not tp.any_requires_grad([x])
    keys = tp.DispatchKeySet(tp.DispatchKey.Python)
    assert (keys & tp.AFTER_AUTOGRAD_KEYSET).raw_repr()
    with tp.ForceDispatchKeyGuard(tp.dispatch_tls_include_set(), tp.dispatch_tls_exclude_set()):
        pass
    previous = tp.is_grad_enabled()
    tp.set_grad_enabled(False)
    tp.set_grad_enabled(previous)
    with tp.FakeTensorMode() as mode:
        fake = torch.empty(3)
    assert tp.is_fake(fake) and tp.detect_fake_mode([fake]) is mode
    with tp.unset_fake_temporarily(), tp.disable_current_modes():
        pass
    assert tp.tree_flatten([x, (1,)])[0][1] == 1
    assert "cuda" in tp.foreach_kernel_devices() and "cpu" not in tp.foreach_kernel_devices()
    into, values = [torch.zeros(3), torch.zeros(2, 2, dtype=torch.float64)], [torch.arange(3.0), torch.eye(2)]
    tp.foreach_copy(into, values)
    assert all(torch.equal(a, b) for a, b in zip(into, values)) and into[1].dtype == torch.float64
    tp.foreach_copy([], [])


@LOOKUP
def test_checkpoint_region_accessors() -> None:
    """What fxtrain reads and writes of a checkpointed region: the tags AOTAutograd's trace would put
    on its ops (the partitioner reads them), torch's region counter, a selective policy."""
    graph = torch.fx.Graph()
    node = graph.call_function(torch.sin, (graph.placeholder("x"),))
    assert not tp.is_checkpoint_call(node)
    assert tp.is_checkpoint_call(graph.call_function(tp.CHECKPOINT_OP, ()))
    first, second = tp.new_checkpoint_region(), tp.new_checkpoint_region()
    assert second > first
    assert tp.recompute_region(node) is None
    tp.tag_recompute(node, second)
    from torch.utils.checkpoint import CheckpointPolicy
    assert tp.recompute_region(node) == second and node.meta["recompute"] is CheckpointPolicy.PREFER_RECOMPUTE
    tp.untag_recompute(node)
    assert tp.recompute_region(node) is None and "ac_graph_id" not in node.meta
    body = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    assert tp.checkpoint_context_fn(body) is None
    body.meta["_checkpoint_context_fn"] = policy = lambda: None
    assert tp.checkpoint_context_fn(body) is policy


@LOOKUP
def test_dynamo_accessors() -> None:
    for name in ["dynamo_unsupported", "dynamo_recompile_limit_error"]:
        assert issubclass(_check(name, getattr(tp, name)), Exception)
    assert len(_check("dynamo_new_object_mutation_types", tp.dynamo_new_object_mutation_types)) == 2
    assert isinstance(_check("dynamo_frame_counter", tp.dynamo_frame_counter)(), int)
    assert isinstance(_check("dynamo_counters", tp.dynamo_counters), dict)
    assert hasattr(_check("autograd_function_variable", tp.autograd_function_variable), "call_apply")
    assert isinstance(_check("dynamo_traced_code", tp.dynamo_traced_code), list)
    _check("dynamo_recompile_reason", tp.dynamo_recompile_reason)
    with _check("dynamo_config_patch", tp.dynamo_config_patch, {"verbose": False}):
        pass
    assert _check("op_qualified_name", tp.op_qualified_name, torch.ops.aten.cos.default) == "aten::cos"
    assert tp.op_qualified_name(torch.ops.aten.cos) == "aten::cos" and tp.op_qualified_name(torch.cos) is None
    assert all(issubclass(e, Exception) for e in tp.DATA_DEPENDENT_ERRORS)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    with _check("fake_trial", tp.fake_trial, tp.FakeTensorMode()):   # no shape environment: nothing to do
        pass
    env = ShapeEnv()
    with tp.FakeTensorMode(shape_env=env) as mode, tp.fake_trial(mode):
        assert isinstance(torch.empty(3).nonzero().shape[0], torch.SymInt)
    assert not env.pending_fresh_unbacked_symbols


@torch.library.custom_op("fxtrain_test_private::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


@LOOKUP
def test_dynamo_break_at_breaks_the_graph_until_undone() -> None:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    twice = torch.ops.fxtrain_test_private.twice   # called as a packet, as transformers calls its ops

    def f(x):
        return twice(x + 1) * 2
    try:
        assert _check("dynamo_break_at", tp.dynamo_break_at, twice) and not tp.dynamo_break_at(twice)
        torch._dynamo.reset()
        torch.compile(f, backend=record)(torch.randn(3))
        assert len(graphs) == 2, graphs   # x + 1, then * 2: the op ran between them
    finally:
        _check("dynamo_unbreak_at", tp.dynamo_unbreak_at, twice)
    graphs.clear()
    torch._dynamo.reset()
    torch.compile(f, backend=record)(torch.randn(3))
    assert len(graphs) == 1, graphs


@LOOKUP
def test_dynamo_config_patch_with_logging_functions_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """Dynamo dumps its config into its metrics after each compile; fxtrain's set of logging functions
    in it logs no error (2.11's dump fails sorting the functions: that record is dropped)."""
    settings = {"ignore_logging_functions": {logging.Logger.info, logging.Logger.warning}}
    with caplog.at_level(logging.ERROR, logger="torch._dynamo"), tp.dynamo_config_patch(settings):
        fn = torch.compile(lambda t: t + 1, backend="eager")
        assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    assert not [r for r in caplog.records if "compilation metrics" in r.getMessage()], caplog.records


@LOOKUP
def test_dynamo_accessors_inside_a_capture() -> None:
    """The accessors that only work while dynamo converts a frame, called from a backend."""
    seen = {}

    def backend(gm: torch.fx.GraphModule, inputs):
        seen["tx"] = tp.current_instruction_translator()
        seen["files"] = tp.dynamo_traced_code()
        seen["reason"] = tp.dynamo_recompile_reason()
        seen["variable"] = tp.build_variable(seen["tx"], 1)
        copy = torch.fx.Graph()
        copy.output(copy.graph_copy(gm.graph, {}))
        tp.carry_dynamo_sources(gm.graph, copy)
        seen["sources"] = [(a._dynamo_source, b._dynamo_source) for a, b in
                           zip(gm.graph.find_nodes(op="placeholder"), copy.find_nodes(op="placeholder"))]
        return gm.forward

    def marked(x):
        return x
    tp.allow_in_graph(marked)

    fn = torch.compile(lambda x: marked(x) + 1, backend=backend, fullgraph=True)
    fn(torch.ones(2))
    assert seen["tx"] is not None and seen["tx"].f_code is not None
    assert isinstance(seen["files"], list) and seen["variable"].as_python_constant() == 1
    assert seen["sources"] and all(a is b and a is not None for a, b in seen["sources"]), seen["sources"]


@LOOKUP
def test_graph_and_op_accessors(tmp_path: pathlib.Path) -> None:
    gm = _op_graph()
    boxed = tp.boxed_copy(gm)
    x = torch.ones(2, 2)
    assert torch.equal(boxed([x.clone()]), gm(x))
    payload = tp.pickle_graphs(gm)
    back = tp.unpickle_graphs(payload, tp.FakeTensorMode())
    assert isinstance(back, torch.fx.GraphModule)
    assert tp.placeholder_examples(gm) == [None]
    import fxtrain.pythonop.op as op
    assert tp.custom_op_impl(op.python_op) is not None
    assert tp.custom_op_impl_of(torch.ops.fxtrain.python_op.default) is tp.custom_op_impl(op.python_op)
    assert tp.custom_op_impl_of(torch.ops.aten.add.Tensor) is None
    assert callable(tp.redispatcher(torch.ops.aten.add.Tensor))
    assert tp.current_graph_task_keeps_graph() in (True, False)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    dropout = {p: g.call_function(torch.ops.aten.native_dropout.default, (x, p, True)) for p in (0.0, 0.1)}
    sdpa = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (x, x, x))
    assert [tp.draws_random_numbers(n) for n in (x, dropout[0.0], dropout[0.1], sdpa)] == [False, False, True, False]
    lin = torch.nn.Linear(2, 2)
    with tp.reparametrize_module(lin, {"weight": torch.zeros(2, 2)}, tie_weights=False, strict=False):
        assert not lin.weight.any()
    assert lin.weight.any()


@LOOKUP
def test_copy_graph_copies_pytree_specs_without_torchs_warning() -> None:
    """A graph with pytree calling conventions (AOTAutograd's joint graph has them) copies without
    the FutureWarning torch 2.13 raises for every LeafSpec built, and the copy runs as the original."""
    import warnings
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda xs: [xs[0] * xs[1]])([torch.ones(2), torch.ones(2)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        copied = tp.copy_graph(gm.graph)
    assert not seen, [str(w.message) for w in seen]
    assert copied is not gm.graph and len(copied.nodes) == len(gm.graph.nodes)
    assert all(a is not b for a, b in zip(copied.nodes, gm.graph.nodes))
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(torch.fx.GraphModule(gm, copied)([x, y]), [x * y])


@pytest.mark.parametrize("partition", ["default_partition", "min_cut_partition", "inductor_partition"])
def test_aot_accessors(partition: str) -> None:
    """AOTAutograd as a backend, with each partitioner, the metadata read inside the forward compiler,
    and inductor compiling the forward graph it hands over."""
    seen = {}

    def fw(gm: torch.fx.GraphModule, inputs):
        seen["meta"] = tp.aot_metadata()
        seen["examples"] = tp.placeholder_examples(gm)
        seen["compiled"] = tp.inductor_compile(gm, inputs, is_backward=False, is_inference=False)
        return tp.boxed_copy(gm)

    def bw(gm: torch.fx.GraphModule, inputs):
        return tp.boxed_copy(gm)

    table = _check("inductor_decompositions", tp.inductor_decompositions, keep=tp.BACKWARD_PASS_OPS)
    assert table and not set(tp.BACKWARD_PASS_OPS) & set(table)
    backend = _check("aot_autograd", tp.aot_autograd, fw_compiler=fw, bw_compiler=bw,
                     partition_fn=getattr(tp, partition), decompositions=table)
    x = torch.randn(4, device=current_device(), requires_grad=True)   # inductor compiles for its device
    out = torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend, fullgraph=True)(x)
    out.backward()
    assert torch.allclose(x.grad, 2 * x.detach().cos())
    assert seen["meta"] is not None and hasattr(seen["meta"], "input_info")
    assert all(v is not None for v in seen["examples"]) and callable(seen["compiled"])


@LOOKUP
def test_partition_saving_and_size_accessors() -> None:
    """partition_saving splits a joint graph saving only what it is told (the rest recomputed in the
    backward); the size helpers read hints without guards; outside_compile clears is_compiling."""
    seen = {}

    def partition(joint, inputs, **kwargs):
        fw, bw = tp.default_partition(joint, inputs, **kwargs)
        out = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
        names = {n.name: n for n in joint.graph.nodes}
        saved = [names[n.name] for n in out[kwargs["num_fwd_outputs"]:]]
        seen["sizes"] = [n for n in saved if _check("is_size_node", tp.is_size_node, n)]
        primals = [n for n in joint.graph.nodes if n.op == "placeholder" and "primals" in n.name]
        fw2, bw2 = _check("partition_saving", tp.partition_saving, joint, primals, seen["sizes"],
                          num_fwd_outputs=kwargs["num_fwd_outputs"])
        seen["bw_ops"] = {str(n.target) for n in bw2.graph.nodes if n.op == "call_function"}
        x = next(p.meta["val"] for p in primals if isinstance(p.meta["val"], torch.Tensor))
        seen["hint"] = _check("size_hint", tp.size_hint, x.shape[0])
        seen["symbol"] = tp.size_symbol(x.shape[0])
        return fw2, bw2

    backend = tp.aot_autograd(fw_compiler=lambda g, i: g, bw_compiler=lambda g, i: g, partition_fn=partition)
    x = torch.randn(6, requires_grad=True)
    fn = torch.compile(lambda t: t.sin().sin().sum(), backend=backend, fullgraph=True, dynamic=True)
    fn(x).backward()
    assert torch.allclose(x.grad, x.detach().cos() * x.detach().sin().cos())
    assert "aten.sin.default" in seen["bw_ops"]      # sin(x) recomputed from the saved primal
    assert seen["hint"] == 6 and seen["symbol"] is not None
    with _check("outside_compile", tp.outside_compile):
        assert not torch.compiler.is_compiling()


@LOOKUP
def test_dynamo_compile_runs_around_compile() -> None:
    entered = []

    def around(code_name):
        import contextlib
        entered.append(code_name)
        return contextlib.nullcontext()

    def plus_one(t):
        return t + 1

    fn = _check("dynamo_compile", tp.dynamo_compile, plus_one, "eager", False, True, around)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    fn(torch.ones(2))
    assert entered == ["plus_one"]   # once, with the converted frame's name


@LOOKUP
def test_dims_static_marks_and_takes_back() -> None:
    x = torch.randn(4, 3)
    graphs = []

    def backend(gm, inputs):
        graphs.append([i for i in inputs if isinstance(i, torch.SymInt)])   # the graph's symbolic sizes
        return gm.forward

    fn = torch.compile(lambda t: t * 2, backend=backend, dynamic=True)
    with _check("dims_static", tp.dims_static, [(x, [1])]):
        assert torch.equal(fn(x), x * 2)
    assert not hasattr(x, "_dynamo_static_indices") and not hasattr(x, "_has_dynamo_dim_marking")
    assert len(graphs[0]) == 1                                     # dim 0 symbolic, dim 1 static
    y = torch.randn(7, 3)
    assert torch.equal(fn(y), y * 2) and len(graphs) == 1          # unmarked tensors hit the graph
    z = torch.randn(4, 5)
    assert torch.equal(fn(z), z * 2) and len(graphs) == 2          # the static size is guarded


@pytest.mark.cpu_only(reason="a gloo process group of one CPU process")
def test_distributed_and_subclass_accessors() -> None:
    import torch.distributed as dist
    with pytest.raises(Exception) as failure:
        tp.default_store()
    assert not isinstance(failure.value, (ImportError, AttributeError)), failure.value
    assert not dist.is_initialized()  # the suite's process groups live in spawned processes
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert tp.default_store() is not None
        assert _check("process_group_timeout", tp.process_group_timeout, dist.group.WORLD) is not None
    finally:
        dist.destroy_process_group()

    class Wrapper(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError
    w = tp.make_wrapper_subclass(Wrapper, (2, 3), dtype=torch.float32, device=torch.device("cpu"),
                                 requires_grad=False)
    assert isinstance(w, Wrapper) and w.shape == (2, 3)


@LOOKUP
def test_pipeline_stage_class_is_torchs_stage() -> None:
    """The stage class the pipeline runner derives from: torch's PipelineStage, or on a release whose
    stage assumes floating-point activations, a subclass of it that takes any dtype."""
    from torch.distributed.pipelining import PipelineStage
    cls = _check("pipeline_stage_class", tp.pipeline_stage_class)
    assert issubclass(cls, PipelineStage) and tp.pipeline_stage_class() is cls


@LOOKUP
def test_schedule_actions_reads_torch_schedule_orders() -> None:
    """Every rank's F/B/I/W actions of torch's multi-stage schedules (the pipeline simulation)."""
    orders = _check("schedule_actions", tp.schedule_actions, "ScheduleInterleavedZeroBubble", 2, 4, 2)
    assert len(orders) == 2
    for rank, order in enumerate(orders):
        # rank r runs stages r and r + 2 (looped), each microbatch's F, I and W once per stage
        assert sorted(order) == sorted((k, s, i) for k in "FIW" for s in (rank, rank + 2) for i in range(4))
    dual = _check("schedule_actions", tp.schedule_actions, "ScheduleDualPipeV", 2, 4, 2)
    assert {s for _, s, _ in dual[0]} == {0, 3} and any(k == "B" for k, _, _ in dual[0])  # OVERLAP_F_B unpacked


@LOOKUP
def test_set_custom_op_kernels_is_reachable() -> None:
    """``set_custom_op_kernels`` ran when fxtrain.pythonop.op was imported; its attributes are there."""
    import fxtrain.pythonop.op as op
    assert hasattr(op.python_op, "_lib") and hasattr(op.python_op, "_name")


@pytest.mark.cpu_only(reason="torch_private.attention_with_lse knows only the CPU kernels")
def test_attention_with_lse_kernels_match_sdpa() -> None:
    """The CPU kernel pair behind varlen attention: forward as F.scaled_dot_product_attention, and
    the backward from its log-sum-exp as autograd's (issue 15)."""
    kernels = tp.attention_with_lse("cpu")
    assert kernels is not None and tp.attention_with_lse("no-such-device") is None
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    out, lse = kernels[0](q.detach(), k.detach(), v.detach(), True, 0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, ref)
    assert lse.shape == (1, 2, 5)
    grad = torch.randn_like(ref)
    for a, b in zip(kernels[1](grad, q.detach(), k.detach(), v.detach(), out, lse, True, 0.5),
                    torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b)



# The arguments varlen_kernels passes by position, per op: a release that renamed or moved one fails here.
_VARLEN_POSITIONAL = {
    "_efficient_attention_forward": ["query", "key", "value", "bias", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                     "max_seqlen_k", "dropout_p", "custom_mask_type", "compute_log_sumexp"],
    "_efficient_attention_backward": ["grad_out_", "query", "key", "value", "bias", "out", "cu_seqlens_q",
                                      "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "logsumexp", "dropout_p",
                                      "philox_seed", "philox_offset", "custom_mask_type", "bias_requires_grad"],
    "_flash_attention_forward": ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                                 "is_causal", "return_debug_mask"],
    "_flash_attention_backward": ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
                                  "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused"],
}


@pytest.mark.cpu_only(reason="op schemas of the CUDA varlen kernels: no tensors (test_varlen_route.py runs them)")
@pytest.mark.parametrize("op", sorted(_VARLEN_POSITIONAL))
def test_varlen_kernel_schemas(op: str) -> None:
    """The variable-length attention kernels (CUDA) are there with the arguments varlen_kernels passes
    by position, and ``scale`` as a keyword; their output counts are those it unpacks."""
    for kind in ("efficient", "flash"):
        assert all(callable(f) for f in _check("varlen_kernels", tp.varlen_kernels, kind))
    schema = getattr(torch.ops.aten, op).default._schema
    names = [a.name for a in schema.arguments]
    assert names[:len(_VARLEN_POSITIONAL[op])] == _VARLEN_POSITIONAL[op], names
    assert "scale" in [a.name for a in schema.arguments if a.kwarg_only], names
    assert len(schema.returns) == {"_efficient_attention_forward": 6, "_efficient_attention_backward": 4,
                                   "_flash_attention_forward": 5, "_flash_attention_backward": 3}[op]
    assert tp.EFFICIENT_LSE_ALIGN == 32

@LOOKUP
def test_pythonop_capture_accessors() -> None:
    """What PythonOp capture reads of dynamo: checked inside dynamo's conversion of a frame, where a
    Function's ``call_apply`` meets them (a plain accessor check for the rest)."""
    class NewStyle(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

    class OldStyle(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    assert _check("setup_context_defined", tp.setup_context_defined, NewStyle)
    assert not tp.setup_context_defined(OldStyle)
    assert issubclass(_check("dynamo_restart", tp.dynamo_restart, "why").__class__, _check(
        "dynamo_restart_errors", tp.dynamo_restart_errors)[0])
    assert tp.refused_for_side_effects(tp.dynamo_unsupported()("HOP: Unsafe side effect"))
    assert not _check("refused_for_side_effects", tp.refused_for_side_effects, ValueError("side effect"))
    with tp.FakeTensorMode():
        assert _check("free_unbacked_symbols", tp.free_unbacked_symbols, torch.empty(3)) == set()

    seen = {}
    variable = tp.autograd_function_variable()
    original = variable.call_apply

    def probe(self, tx, args, kwargs):
        seen["items"] = _check("sequence_items", tp.sequence_items, args[1])
        seen["dict"] = _check("dict_items", tp.dict_items, args[2])
        seen["number"] = _check("symbolic_scalar_type", tp.symbolic_scalar_type, args[3])
        seen["hint"] = _check("scalar_hint", tp.scalar_hint, args[3])
        seen["expr"] = _check("size_expr", tp.size_expr, args[3].sym_num)
        seen["value"] = _check("resolve_source_value", tp.resolve_source_value, tx, args[0].source)
        with _check("dynamo_scalar_outputs", tp.dynamo_scalar_outputs, tx):
            fn = tp.build_variable(tx, lambda t: (t * 2).sum().item())
            seen["speculated"] = _check("speculate", tp.speculate, tx, fn, [args[0]])
        try:
            _check("dynamo_graph_break", tp.dynamo_graph_break, "probe", "what", "why")
        except tp.dynamo_unsupported():
            seen["break"] = True
        return args[0]

    variable.call_apply = probe
    try:
        fn = torch.compile(lambda x: OldStyle.apply(x, [x], {"k": 1}, x.shape[0]), backend="eager", dynamic=True)
        x = torch.ones(3)
        fn(x)
    finally:
        variable.call_apply = original
    assert len(seen["items"]) == 1 and seen["dict"][0][0] == "k"
    assert seen["number"] is int and seen["hint"] == 3 and seen["expr"] is not None
    assert seen["value"] is x
    assert tp.symbolic_scalar_type(seen["speculated"]) is float and seen["break"]


@LOOKUP
def test_tier_accessors(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What runtime/tiered.py needs: a retrace with inductor's decompositions that keeps placeholder
    names, dynamo's compile lock, and a cache-only inductor compile that refuses a miss and loads a
    graph inductor generates no code for (the positive path, a hit, is tests/test_tiered.py's
    switch)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # nothing cached from before
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = tp.FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x = torch.empty(4, 8)
        gm = make_fx(lambda t: (torch.nn.functional.gelu(t).sum(-1),))(x)
    next(n for n in gm.graph.nodes if n.op == "placeholder")._rename("tangents_1")
    gm.recompile()
    new = _check("retrace", tp.retrace, gm, _check("inductor_decompositions", tp.inductor_decompositions))
    assert [n.name for n in new.graph.nodes if n.op == "placeholder"] == ["tangents_1"]
    assert torch.ops.aten.gelu.default not in {n.target for n in new.graph.nodes}   # decomposed
    with _check("dynamo_compile_lock", tp.dynamo_compile_lock):
        with pytest.raises(tp.NotInInductorCache):
            tp.inductor_compile(new, tp.placeholder_examples(new), is_backward=False, is_inference=True,
                                cached_only=True)
        # A graph without calls: inductor returns it as it is and caches nothing, so it loads
        # (HF RoBERTa's inference graph after a graph break, returning nothing, was refused).
        with mode:
            empty = make_fx(lambda t: ())(x)
        assert not _check("_generates_code", tp._generates_code, empty) and tp._generates_code(new)
        assert tp.inductor_compile(empty, tp.placeholder_examples(empty), is_backward=False, is_inference=True,
                                   cached_only=True)([torch.randn(4, 8)]) == ()


@LOOKUP
def test_decompose_calls_splices_each_decomposable_call() -> None:
    """What passes/__init__.py and the tier's worker need: the calls of an op decomposed in place,
    computing what the op computes, every other node left as it was (its metadata included); a
    call whose decomposition asks something of a size only the batch knows (an unbacked count, as
    the sparsity passes' row counts are) stays whole instead of raising."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    edb = torch.ops.aten.embedding_dense_backward.default
    table = tp.inductor_decompositions()
    mode = tp.FakeTensorMode(shape_env=ShapeEnv())

    def step(grad, ids):
        return (edb(grad.tanh(), ids, 10, 3, False) * 2,)
    with mode:
        gm = make_fx(step)(torch.empty(4, 5, 8), torch.zeros(4, 5, dtype=torch.long))
    tanh = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.tanh.default)
    tanh.meta["kept"] = True
    assert _check("decompose_calls", tp.decompose_calls, gm, [edb], table) == 1
    assert edb not in {n.target for n in gm.graph.nodes} and tanh in gm.graph.nodes and tanh.meta["kept"]
    grad, ids = torch.randn(4, 5, 8), torch.randint(0, 10, (4, 5))
    ids[0, :3] = 3   # padding_idx: no gradient
    torch.testing.assert_close(gm(grad, ids)[0], step(grad, ids)[0])

    def gather_back(grad, keep):   # the gradient of a gather from the rows ``keep`` selects
        rows = keep.nonzero().shape[0]
        return (edb(grad, torch.zeros(grad.shape[0], dtype=torch.long), rows, -1, False),)

    def asking(grad, indices, rows, padding_idx, by_freq):
        # torch 2.13's decomposition asks ``numel() == 0`` of the rows; 2.11's asks nothing
        return grad.new_zeros(0, grad.shape[1]) if rows == 0 else table[edb](grad, indices, rows, padding_idx, by_freq)
    unbacked = tp.FakeTensorMode(shape_env=ShapeEnv())
    with unbacked:
        gm = make_fx(gather_back)(torch.empty(6, 8), torch.empty(6, dtype=torch.bool))
    assert tp.decompose_calls(gm, [edb], {edb: asking}) == 0
    assert edb in {n.target for n in gm.graph.nodes}
    del mode, unbacked


@LOOKUP
def test_size_guard_accessors() -> None:
    """What runtime/tiered.py reads back from loaded graphs: their ShapeEnv, the guards recorded on
    it, and a per-call check of new guards over the graph inputs (a tensor and a SymInt input)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = tp.FakeTensorMode(shape_env=ShapeEnv())
    gm = make_fx(lambda t, n: (t * n,), tracing_mode="symbolic")(torch.empty(4, 8), 3)
    assert _check("shape_env_of", tp.shape_env_of, [None, make_fx(lambda t: (t + 1,))(torch.empty(2))]) is None
    env = _check("shape_env_of", tp.shape_env_of, [gm])
    assert env is not None
    examples = tp.placeholder_examples(gm)
    known = len(_check("shape_guards", tp.shape_guards, env))
    assert bool(examples[0].shape[0] == 4) and bool(examples[0].shape[1] > 5)   # as a compile specialising records them
    added = tp.shape_guards(env)[known:]
    assert len(added) == 2, [str(g.expr) for g in added]
    check = _check("size_guard_check", tp.size_guard_check, env, examples, added)
    assert check([torch.empty(4, 8), 3]) and check([torch.empty(4, 6), 5])
    assert not check([torch.empty(5, 8), 3]) and not check([torch.empty(4, 5), 3])
    assert _check("size_guard_check", tp.size_guard_check, env, examples, [])([torch.empty(9, 9), 1])
    del mode


@pytest.mark.cpu_only(reason="reads graphs built by hand; no tensor is made")
def test_custom_op_modules_names_the_module_that_defined_each_python_custom_op() -> None:
    """``torch._library.custom_ops.OPDEFS`` on this torch: a graph's call of a Python custom op, as an
    overload (aten graphs) or a packet (dynamo's), is traced to its module, which a pickled payload
    carries to the process that loads it (test_partition_later.py: the worker partitions HF's MoE)."""
    import transformers.integrations.moe  # noqa: F401  (defines transformers::grouped_mm_fallback)
    packet = torch.ops.transformers.grouped_mm_fallback
    for target in (packet, packet.default):
        graph = torch.fx.Graph()
        x, w, offs = (graph.placeholder(n) for n in ("x", "w", "offs"))
        graph.output(graph.call_function(target, (x, w, offs)))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        assert tp.custom_op_modules(({"graphs": [gm]},)) == ["transformers.integrations.moe"]
    # aten ops and fxtrain's own (registered at import) name no module to import; the payload's
    # header is there only when asked for.
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.ops.aten.relu.default, (graph.placeholder("x"),)))
    plain = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert tp.custom_op_modules(plain) == []
    assert tp.pickle_graphs(plain, for_another_process=True).startswith(b'fxtrain-imports\0{"modules": [], "path": []}\0')
    assert not tp.pickle_graphs(plain).startswith(b"fxtrain-imports")
