"""Pipeline parallelism against a single-process eager oracle, on real gloo process groups.

Every multi-process test spawns one small world (2 or 4 CPU processes, one thread each) with a
free port and a hard deadline. A 4-process world runs, in turn: two concurrent 2-stage pipelines
(ranks 0-1 GPipe and ranks 2-3 1F1B, on groups the worker creates), then a 4-stage GPipe and a
4-stage 1F1B pipeline. Each rank saves the loss and its parameters' gradients; the parent compares
them with eager PyTorch on the same model and the same microbatches (the loss of a step is the
mean of the microbatch losses).
"""
from __future__ import annotations

import datetime
import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fxtrain
from fxtrain.pipeline import min_max_partition, node_flops
from fxtrain.pipeline.partition import stage_costs
from utils import ToyLM, lm_loss, logits_model, long_params, toy_batch, toy_model

M = 4            # microbatches
BATCH = 8
RTOL = 1e-5      # per-parameter gradient tolerance, relative to the gradient's norm
ZERO = 1e-8      # a reference gradient below this norm is numerically zero (e.g. attention key bias)

# Inherently CPU: gloo process groups of CPU processes (the pipeline picks nccl for CUDA stages); FXTRAIN_TEST_DEVICE does not apply.
pytestmark = pytest.mark.cpu_only("gloo process groups of CPU processes (the pipeline picks nccl for CUDA stages)")


# ------------------------------------------------------------------------------------- test models
def bert_model() -> nn.Module:
    from fxtrain import models
    return models.build("bert-tiny")


def bert_batch(batch: int = BATCH) -> Dict[str, torch.Tensor]:
    from fxtrain import models
    # 15% labelled positions: label sparsity turns itself on in the last stage.
    return models.preset_batch("bert-tiny", batch, 16, padding=0.25, label_density=0.15)


def gpt2_model() -> nn.Module:
    from fxtrain import models
    return models.build("gpt2-tiny")


def gpt2_batch(batch: int = BATCH) -> Dict[str, torch.Tensor]:
    from fxtrain import models
    b = models.preset_batch("gpt2-tiny", batch, 16, padding=0.0)
    return {"input_ids": b["input_ids"], "labels": b["labels"]}


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[..., Dict[str, torch.Tensor]]]] = {
    "toy": (toy_model, toy_batch), "bert": (bert_model, bert_batch), "gpt2": (gpt2_model, gpt2_batch)}


# ------------------------------------------------------------------------------------ the harness
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, job: str, arg: Any) -> None:
    torch.set_num_threads(1)
    # The workers check what the passes compute in each stage (label sparsity in the last, padding
    # elimination in the first) on models as small as the suite's: the passes stay on whatever they
    # cost on the device, as under tests/conftest.py's passes_whatever_they_cost, which a spawned
    # process does not inherit.
    from fxtrain.capture import pipeline as capture_pipeline
    capture_pipeline.rates_for = lambda device_type: None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=40))
    try:
        result = JOBS[job](rank, world, arg)
    except BaseException:
        import traceback
        torch.save({"error": traceback.format_exc()}, os.path.join(out, f"rank{rank}.pt"))
        os._exit(1)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if job.startswith("fail"):
        os._exit(0)  # the group is broken by design: skip a teardown that would wait on the dead peer
    dist.destroy_process_group()


def spawn(job: str, world: int, tmp_path: Path, arg: Any = None, deadline: float = 60.0,
          may_die: Tuple[int, ...] = ()) -> List[Any]:
    """Run JOBS[job] on ``world`` spawned processes; fail (and kill them all) past ``deadline`` seconds."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, str(tmp_path), job, arg), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    try:
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        late = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not late, f"{job}: rank(s) {late} did not finish within {deadline:.0f} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    results = []
    for r, p in enumerate(procs):
        path = tmp_path / f"rank{r}.pt"
        if r in may_die and not path.exists():
            results.append({"exitcode": p.exitcode})
            continue
        assert path.exists(), f"{job}: rank {r} exited with code {p.exitcode} and no result"
        res = torch.load(path, weights_only=False)
        assert "error" not in res, f"{job}: rank {r} raised:\n{res['error']}"
        results.append(res)
    return results


def _train(runner: Any, batch: Dict[str, torch.Tensor], steps: int = 1) -> Dict[str, Any]:
    losses = [runner.step(**batch) for _ in range(steps)]
    info = runner.module.capture_info()
    return {"stage": runner.stage_index, "stages": runner.num_stages, "losses": losses,
            "grads": {n: p.grad.clone() for n, p in runner.named_parameters() if p.grad is not None},
            "names": [n for n, _ in runner.named_parameters()],
            "optimizations": dict(info.optimizations), "python_ops": runner.python_ops,
            "python_op_calls": runner.python_op_calls,
            "stats": dict(runner.last_stats)}


def _parity_job(rank: int, world: int, name: str) -> Dict[str, Any]:
    """2-stage GPipe (ranks 0-1) and 1F1B (ranks 2-3) at once, then 4-stage GPipe and 1F1B."""
    build_model, build_batch = MODELS[name]
    batch = build_batch()
    opts = fxtrain.Options(fallback="raise")
    steps = 2 if name == "toy" else 1   # toy: a second step without zero_grad must accumulate
    results: Dict[str, Any] = {}
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rank // 2
    schedule = ("gpipe", "1f1b")[mine]
    model = build_model()
    pipe2 = fxtrain.split(model, example_kwargs=batch, num_stages=2)
    runner = pipe2.build(schedule, n_microbatches=M, group=pair[mine], options=opts)
    results[f"2/{schedule}"] = _train(runner, batch, steps)
    if name == "toy":
        try:
            runner.step(**build_batch(6))
        except Exception as e:  # every rank validates its own batch: no rank waits on another
            results["indivisible"] = f"{type(e).__name__}: {e}"
        # A model that returns logits: positional input, a keyword constant, loss_fn and target.
        ids, labels = batch["input_ids"], batch["labels"]
        logits_pipe = fxtrain.split(logits_model(), (ids,), {"temperature": 2.0}, num_stages=2, example_target=labels)
        lrunner = logits_pipe.build(schedule, n_microbatches=M, loss_fn=lm_loss, group=pair[mine], options=opts)
        losses = [lrunner.step(ids, temperature=2.0, target=labels)]
        results["2/loss_fn"] = {"stage": lrunner.stage_index, "losses": losses,
                                "grads": {n: p.grad.clone() for n, p in lrunner.named_parameters()
                                          if p.grad is not None}}
        try:
            lrunner.step(ids, temperature=3.0, target=labels)
        except fxtrain.PipelineError as e:
            results["constant_changed"] = str(e)
    pipe = pipe2.replan(num_stages=4)  # same captures, another cut
    for schedule in ("gpipe", "1f1b"):
        model.zero_grad(set_to_none=True)
        runner = pipe.build(schedule, n_microbatches=M, options=opts, timeout=datetime.timedelta(seconds=30))
        results[f"4/{schedule}"] = _train(runner, batch, steps)
    return results


def _oracle(name: str) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], nn.Module]:
    build_model, build_batch = MODELS[name]
    model, batch = build_model(), build_batch()
    losses = [model(**{k: v[i * BATCH // M:(i + 1) * BATCH // M] for k, v in batch.items()}) for i in range(M)]
    losses = [l if isinstance(l, torch.Tensor) else l.loss for l in losses]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


def _compare(results: List[Dict[str, Any]], config: str, ranks: List[int], ref_loss: torch.Tensor,
             ref_grads: Dict[str, torch.Tensor], steps: int = 1) -> Dict[int, Dict[str, Any]]:
    got = {results[r][config]["stage"]: results[r][config] for r in ranks}
    last = got[max(got)]
    for loss in last["losses"]:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7, msg=lambda m: f"{config} loss: {m}")
    for s, res in got.items():
        if s != max(got):
            assert all(l is None for l in res["losses"]), f"{config}: stage {s} returned a loss"
    held: Dict[str, List[int]] = {}
    for s, res in got.items():
        for n, g in res["grads"].items():
            held.setdefault(n, []).append(s)
            ref = ref_grads[n] * steps
            err, scale = (g - ref).norm().item(), ref.norm().item()
            assert err <= RTOL * scale or (scale < ZERO and err < ZERO), \
                f"{config}: stage {s} gradient of {n} off by {err:.3g} (norm {scale:.3g})"
    assert set(held) == set(ref_grads), f"{config}: parameters without a gradient: {set(ref_grads) - set(held)}"
    return got


# -------------------------------------------------------------------------------- parity tests
def _run_parity(name: str, tmp_path: Path) -> Tuple[List[Dict[str, Any]], Dict[str, List[int]]]:
    results = spawn("parity", 4, tmp_path, name, deadline=150.0)   # 30 s quiet; 4 processes on 2 cores
    ref_loss, ref_grads, _ = _oracle(name)
    steps = 2 if name == "toy" else 1
    shared: Dict[str, List[int]] = {}
    for config, ranks in (("2/gpipe", [0, 1]), ("2/1f1b", [2, 3]), ("4/gpipe", [0, 1, 2, 3]), ("4/1f1b", [0, 1, 2, 3])):
        got = _compare(results, config, ranks, ref_loss, ref_grads, steps)
        for s, res in got.items():
            for n in res["names"]:
                shared.setdefault(f"{config}:{n}", []).append(s)
    return results, shared


@pytest.mark.extended   # 47 s; make test runs the same toy model (custom Functions, tied embedding) through
                       # every schedule in test_every_schedule_matches_single_process[toy]
def test_custom_function_tied_weights_kwargs(tmp_path):
    """Custom Functions (user backward runs), a tied embedding/head across stages, two steps."""
    results, shared = _run_parity("toy", tmp_path)
    # The tied embedding is held by the first and the last stage in every configuration.
    for config in ("2/gpipe", "2/1f1b", "4/gpipe", "4/1f1b"):
        assert sorted(shared[f"{config}:embed.weight"]) == [0, int(config[0]) - 1], config
    for config in ("2/gpipe", "2/1f1b", "4/gpipe", "4/1f1b"):
        got = [r[config] for r in results if config in r]
        assert sorted(op.rsplit(".", 1)[-1] for op in got[0]["python_ops"]) == ["NumpyGate", "RoundSTE"]
        assert sum(res["python_op_calls"] for res in got) == 2, config  # each call in exactly one stage
    for r in results:
        assert "not divisible by n_microbatches=4" in r["indivisible"], r["indivisible"]
        assert "temperature=3.0 differs from the value the model was split with (2.0)" in r["constant_changed"]
    # loss_fn + target: compare with eager on the logits model
    model = logits_model()
    batch = toy_batch()
    chunks = [slice(i * BATCH // M, (i + 1) * BATCH // M) for i in range(M)]
    ref = torch.stack([lm_loss(model(batch["input_ids"][c], temperature=2.0), batch["labels"][c]) for c in chunks]).mean()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for config in ("2/loss_fn",):
        for ranks in ([0, 1], [2, 3]):
            _compare(results, config, ranks, ref.detach(), ref_grads)


@pytest.mark.extended
def test_bert_mlm_label_sparsity_in_last_stage(tmp_path):
    results, shared = _run_parity("bert", tmp_path)
    for config in ("2/gpipe", "2/1f1b", "4/gpipe", "4/1f1b"):
        assert len(shared[f"{config}:bert.embeddings.word_embeddings.weight"]) == 2, config  # tied decoder
        last = [res[config] for res in results if config in res and res[config]["stage"] == int(config[0]) - 1][0]
        why = last["optimizations"].get("label_sparsity", "")
        assert why.startswith("on:"), f"{config}: label sparsity did not fire in the last stage: {why}"
        # 25% padding: padding elimination runs in the stage holding the embedding.
        first = [res[config] for res in results if config in res and res[config]["stage"] == 0][0]
        why = first["optimizations"].get("padding_elimination", "")
        assert why.startswith("on:"), f"{config}: padding elimination did not fire in the first stage: {why}"


@pytest.mark.extended
def test_gpt2_tied_lm_head(tmp_path):
    results, shared = _run_parity("gpt2", tmp_path)
    for config in ("2/gpipe", "2/1f1b", "4/gpipe", "4/1f1b"):
        # Held by the stage with the token embedding and by the last stage (the LM head); with
        # 4 stages the balanced plan may give the first stage only mask/position work.
        holders = shared[f"{config}:transformer.wte.weight"]
        assert len(holders) == 2 and int(config[0]) - 1 in holders, (config, holders)


# ------------------------------------------------------------- every schedule, 2 stages per rank
# torch's schedule classes, by fxtrain name: 2-stage plans (one per rank) for GPipe and 1F1B,
# 4-stage plans (two per rank: looped for interleaved-1f1b/zb1p, V-shaped for zbv/dualpipev).
ALL_SCHEDULES = (("gpipe", 2), ("1f1b", 2), ("interleaved-1f1b", 4), ("zb1p", 4), ("zbv", 4), ("dualpipev", 4))
SPLIT_BACKWARD = {"zb1p", "zbv", "dualpipev"}


def _schedules_job(rank: int, world: int, name: str) -> Dict[str, Any]:
    """Every schedule in turn on one 2-process group; the stage TrainModules (graph runtime, which
    the zero-bubble schedules need) are captured once per stage and reused by later schedules."""
    build_model, build_batch = MODELS[name]
    batch = build_batch()
    opts = fxtrain.Options(fallback="raise", backward="graph")
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=40))
    model = build_model()
    pipes = {2: fxtrain.split(model, example_kwargs=batch, num_stages=2)}
    pipes[4] = pipes[2].replan(num_stages=4)
    steps = 2 if name == "toy" else 1   # toy: a second step without zero_grad must accumulate
    results: Dict[str, Any] = {}
    for schedule, stages in ALL_SCHEDULES:
        model.zero_grad(set_to_none=True)
        runner = pipes[stages].build(schedule, n_microbatches=M, group=group, options=opts)
        losses = [runner.step(**batch) for _ in range(steps)]
        results[schedule] = {
            "stages": list(runner.stage_indices), "losses": losses,
            "grads": {n: p.grad.clone() for n, p in runner.named_parameters() if p.grad is not None},
            "names": {s: [n for n, _ in mod.named_parameters()] for s, mod in runner.modules.items()},
            "optimizations": {s: dict(mod.capture_info().optimizations) for s, mod in runner.modules.items()},
            "runtime": {s: [r.runtime for r in mod.capture_info().records] for s, mod in runner.modules.items()},
            "python_op_calls": runner.python_op_calls, "stats": dict(runner.last_stats)}
    if name == "toy":
        # torch's convention: the example is one microbatch (mb_kwargs=); a step takes M of them.
        first = {k: v[:BATCH // M] for k, v in batch.items()}
        model.zero_grad(set_to_none=True)
        mb_pipe = fxtrain.split(model, mb_kwargs=first, num_stages=4)
        runner = mb_pipe.build("zbv", n_microbatches=M, group=group, options=opts)
        results["mb_kwargs"] = {"stages": list(runner.stage_indices), "losses": [runner.step(**batch)],
                                "grads": {n: p.grad.clone() for n, p in runner.named_parameters()},
                                "describe": mb_pipe.describe()}
        for wrong, who in ((first, "mb_kwargs runner"), ({k: torch.cat([v] * M) for k, v in batch.items()}, "batch runner")):
            try:
                (runner if who == "mb_kwargs runner" else pipes[4].build("zb1p", n_microbatches=M, group=group,
                                                                        options=opts)).step(**wrong)
            except fxtrain.PipelineError as e:  # every rank validates its batch before communicating
                results[f"wrong: {who}"] = str(e)
    return results


@pytest.mark.parametrize("name", long_params(["toy", "gpt2", "bert"], keep=["toy"]))
def test_every_schedule_matches_single_process(tmp_path, name):
    """Loss and every gradient of each torch schedule against one process running the same
    microbatches: custom Functions and a tied embedding/head (toy), HF GPT-2 and BERT-MLM."""
    results = spawn("schedules", 2, tmp_path, name, deadline=150.0)
    ref_loss, ref_grads, _ = _oracle(name)
    steps = 2 if name == "toy" else 1
    for schedule, stages in ALL_SCHEDULES:
        got = [r[schedule] for r in results]
        per_rank = stages // 2
        assert sorted(s for g in got for s in g["stages"]) == list(range(stages)), schedule
        assert all(len(g["stages"]) == per_rank for g in got), schedule
        if schedule in ("zbv", "dualpipev"):
            assert got[0]["stages"] == [0, 3] and got[1]["stages"] == [1, 2], schedule  # V-shaped
        elif stages == 4:
            assert got[0]["stages"] == [0, 2] and got[1]["stages"] == [1, 3], schedule  # looped
        last = [g for g in got if stages - 1 in g["stages"]]
        assert len(last) == 1
        for loss in last[0]["losses"]:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7, msg=lambda m: f"{schedule} loss: {m}")
        held = set()
        for g in got:
            for n, grad in g["grads"].items():
                held.add(n)
                ref = ref_grads[n] * steps
                err, scale = (grad - ref).norm().item(), ref.norm().item()
                assert err <= RTOL * scale or (scale < ZERO and err < ZERO), \
                    f"{schedule}: stages {g['stages']} gradient of {n} off by {err:.3g} (norm {scale:.3g})"
        assert held == set(ref_grads), f"{schedule}: parameters without a gradient: {set(ref_grads) - held}"
        # The zero-bubble schedules did split: W parts ran on the rank whose stages are not all first.
        parts = [g["stats"]["weight_parts"] for g in got]
        if schedule in SPLIT_BACKWARD:
            assert all(p > 0 for p in parts), (schedule, parts)
            for g in got:
                assert all(rt == ["graph: asked for (Options.backward)"] or all(r.startswith("graph") for r in rt)
                           for rt in g["runtime"].values()), (schedule, g["runtime"])
        else:
            assert parts == [0, 0], (schedule, parts)
        if name == "toy":
            # Each custom Function call runs in exactly one stage; the tied embedding sits in the
            # first and the last stage (on one rank under the V placement, on two otherwise).
            assert sum(g["python_op_calls"] for g in got) == 2, schedule
            holders = [s for g in got for s, names in g["names"].items() if "embed.weight" in names]
            assert sorted(holders) == [0, stages - 1], (schedule, holders)
        if name == "bert":
            why = last[0]["optimizations"][stages - 1].get("label_sparsity", "")
            assert why.startswith("on:"), f"{schedule}: label sparsity did not fire in the last stage: {why}"
    if name == "toy":
        got = [r["mb_kwargs"] for r in results]
        torch.testing.assert_close(got[0]["losses"][0], ref_loss, rtol=1e-6, atol=1e-7)  # rank 0: stages 0 and 3
        for g in got:
            for n, grad in g["grads"].items():
                assert (grad - ref_grads[n]).norm() <= RTOL * ref_grads[n].norm(), n
        assert "example: one microbatch (2 rows" in got[0]["describe"]
        for r in results:
            assert "a step takes n_microbatches=4 of them: a batch of 8" in r["wrong: mb_kwargs runner"]
            assert "fxtrain.split, which takes the whole batch as example" in r["wrong: batch runner"]


# ----------------------------------------------------------------------------------- failures
class FailOnDemand(torch.autograd.Function):
    """Identity, unless the test asks this process's stage to raise or to die in its forward."""

    @staticmethod
    def forward(ctx, x):
        mode = os.environ.get("FXTRAIN_TEST_FAIL")
        if mode == "raise":
            raise ValueError("deliberate failure in the last stage")
        if mode == "die":
            os._exit(3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class FailingLM(ToyLM):
    def forward(self, input_ids, labels=None, *, temperature=1.0):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = torch.tanh(layer(h)) + h
        h = FailOnDemand.apply(h)       # in the last stage: after every layer, right before the head
        logits = F.linear(h, self.embed.weight, self.head_bias) / temperature
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


FAIL_TIMEOUT = 8.0


def _failure_job(rank: int, world: int, mode: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    model, batch = FailingLM(), toy_batch()
    pipe = fxtrain.split(model, example_kwargs=batch, split_points={"layers.3": "before"})
    runner = pipe.build("1f1b", n_microbatches=M, timeout=datetime.timedelta(seconds=FAIL_TIMEOUT),
                        options=fxtrain.Options(fallback="raise"))
    # A healthy step first; only the first stage needs the batch, the last calls step() bare.
    loss = runner.step(**batch) if rank == 0 else runner.step()
    assert (loss is None) == (rank == 0)
    dist.barrier()
    if rank == 1:
        os.environ["FXTRAIN_TEST_FAIL"] = mode
    start = time.monotonic()
    try:
        runner.step(**batch)
        error = None
    except fxtrain.PipelineError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    if rank == 1 and mode == "raise":
        # Stay alive past the timeout: the peer must give up on its own, not because we exited.
        torch.save({"error_message": error, "elapsed": elapsed}, os.path.join(os.environ["FXTRAIN_TEST_OUT"], "rank1.pt"))
        time.sleep(FAIL_TIMEOUT + 6)
    return {"error_message": error, "elapsed": elapsed}


@pytest.mark.parametrize("mode", ["raise", "die"])
def test_failing_stage_ends_peers_within_timeout(tmp_path, mode, monkeypatch):
    monkeypatch.setenv("FXTRAIN_TEST_OUT", str(tmp_path))
    results = spawn(f"fail_{mode}", 2, tmp_path, mode, deadline=55.0, may_die=(1,) if mode == "die" else ())
    first = results[0]
    assert first["error_message"] is not None, "the healthy stage did not notice its peer failed"
    assert "pipeline stage 0 (rank 0, 1f1b) stopped" in first["error_message"], first["error_message"]
    assert first["elapsed"] < FAIL_TIMEOUT + 5, f"rank 0 took {first['elapsed']:.1f} s to give up"
    if mode == "raise":
        assert "ValueError: deliberate failure in the last stage" in results[1]["error_message"]
        assert "stage 1" in results[1]["error_message"]
        # The peer names the stage that failed and why (read from the rendezvous store).
        assert "stage 1 (rank 1) raised ValueError: deliberate failure" in first["error_message"], first["error_message"]
    else:
        assert results[1] == {"exitcode": 3}
        assert "process ended without reporting an error (it probably died)" in first["error_message"]


def _measured_job(rank: int, world: int, _: Any) -> Dict[str, Any]:
    """ZB1P on a measured plan; rank 1 reports its stage timings as if stage 0 were 20x slower:
    the group times each plan together (as the pipeline itself), averages, and runs one plan."""
    from fxtrain.pipeline import runner as runner_module
    real = runner_module.time_in_pipeline
    seen: List[Tuple[List[int], Any]] = []

    def recorded(pipe, schedule, m, loss_fn, group, timeout, options, cuts, before):
        times = real(pipe, schedule, m, loss_fn, group, timeout, options, cuts, before)
        if rank == 1:
            times = [(f * 20, b * 20, w * 20) if i == 0 else (f, b, w) for i, (f, b, w) in enumerate(times)]
        seen.append((list(cuts), times))
        return times
    runner_module.time_in_pipeline = recorded
    model, batch = toy_model(), toy_batch()
    pipe = fxtrain.split(model, example_kwargs=batch, num_stages=4, balance="measured")
    runner = pipe.build("zb1p", n_microbatches=M, options=fxtrain.Options(fallback="raise"))
    untouched = all(p.grad is None for p in model.parameters())
    kept = sorted({key[-1] for key in pipe._stage_modules})   # the timing runs' other plans are let go
    return {"cuts": runner.plan.cuts, "how": runner.plan.how, "seen": seen, "untouched": untouched, "kept": kept,
            "times": [(st.forward_time, st.backward_time, st.weight_time) for st in runner.plan.stages],
            "stages": list(runner.stage_indices), "losses": [runner.step(**batch)],
            "grads": {n: p.grad.clone() for n, p in runner.named_parameters() if p.grad is not None}}


JOBS: Dict[str, Callable[[int, int, Any], Any]] = {"parity": _parity_job, "fail_raise": _failure_job,
                                                    "fail_die": _failure_job, "schedules": _schedules_job,
                                                    "measured": _measured_job}


def test_measured_plan_is_rank_zeros_and_exact(tmp_path):
    """balance="measured": ranks that time their stages differently all run rank 0's plan, cut for
    the schedule build runs, and train exactly like one process."""
    results = spawn("measured", 2, tmp_path, deadline=120.0)
    ref_loss, ref_grads, _ = _oracle("toy")
    assert results[0]["cuts"] == results[1]["cuts"]
    assert results[0]["times"] == results[1]["times"] and all(f > 0 and b > 0 for f, b, _ in results[0]["times"])
    # ZB1P splits each backward: the weight part was timed on its own (stage 0's is its whole backward).
    assert all(0 < w <= b for _, b, w in results[0]["times"])
    # Every plan the first rank wanted was run by both ranks as a pipeline, in the same order; the
    # plan kept is one of them, with the mean of the two ranks' reports (rank 1's skew included).
    assert [c for c, _ in results[0]["seen"]] == [c for c, _ in results[1]["seen"]] and results[0]["seen"]
    assert results[0]["cuts"] in [c for c, _ in results[0]["seen"]]
    for (cuts, t0), (_, t1) in zip(results[0]["seen"], results[1]["seen"]):
        if cuts == results[0]["cuts"]:
            mean = [tuple((a + b) / 2 for a, b in zip(x, y)) for x, y in zip(t0, t1)]
            assert results[0]["times"] == [pytest.approx(m) for m in mean]
            assert t1[0][0] == pytest.approx(20 * t0[0][0])   # both ranks measured the same pipeline
    assert results[0]["untouched"] and results[1]["untouched"]   # the timing steps left no gradient
    assert all(r["kept"] == [tuple(r["cuts"])] for r in results)
    assert "measured time" in results[0]["how"] and "simulated zb1p step" in results[0]["how"]
    last = next(r for r in results if 3 in r["stages"])
    torch.testing.assert_close(last["losses"][0], ref_loss, rtol=1e-6, atol=1e-7)
    held = set()
    for r in results:
        for n, g in r["grads"].items():
            held.add(n)
            assert (g - ref_grads[n]).norm() <= RTOL * ref_grads[n].norm() + ZERO, n
    assert held == set(ref_grads)


# ------------------------------------------------------------------ planning (single process)
def _brute_force(costs, k, allowed, weights):
    n = len(costs)
    best = None
    for cuts in itertools.combinations([c for c in range(1, n) if allowed[c]], k - 1):
        worst = max(stage_costs(costs, list(cuts)))
        sent = sum(weights[c] for c in cuts)
        if best is None or (worst, sent) < best:
            best = (worst, sent)
    return best


def test_partition_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(300):
        n = int(rng.integers(2, 10))
        k = int(rng.integers(1, min(n, 4) + 1))
        costs = [float(c) for c in rng.integers(0, 20, n)] if trial % 2 else list(rng.random(n) * 10)
        allowed = [True] + [bool(b) for b in rng.random(n - 1) > 0.25] + [True]
        weights = [float(w) for w in rng.integers(0, 5, n + 1)]
        if sum(allowed[1:n]) < k - 1:
            with pytest.raises(ValueError):
                min_max_partition(costs, k, allowed=allowed, cut_weights=weights)
            continue
        cuts, optimum = min_max_partition(costs, k, allowed=allowed, cut_weights=weights)
        worst, sent = _brute_force(costs, k, allowed, weights)
        assert len(cuts) == k - 1 and all(allowed[c] for c in cuts) and cuts == sorted(set(cuts))
        assert max(stage_costs(costs, cuts)) == pytest.approx(worst, rel=1e-12, abs=1e-12)
        assert optimum == pytest.approx(worst, rel=1e-12, abs=1e-12)
        assert sum(weights[c] for c in cuts) == pytest.approx(sent)
        checked += 1
    assert checked > 200


def test_twelve_layer_transformer_four_stages_balanced():
    from fxtrain import models
    torch.manual_seed(0)
    model = models.bert_mlm(hidden=64, layers=12, heads=2, vocab=1000)
    batch = models.preset_batch("bert-tiny", 8, 32, padding=0.0, label_density=0.15)
    pipe = fxtrain.split(model, example_kwargs=batch, num_stages=4)
    flops = [r["flops"] for r in pipe.stage_table()]
    assert max(flops) / (sum(flops) / 4) <= 1.10, flops
    assert sum(flops) == sum(node_flops(pipe.plan.captured.gm))
    by_params = pipe.replan(num_stages=4, balance="params")
    params = [r["params"] for r in by_params.stage_table()]
    flops_plan_params = [r["params"] for r in pipe.stage_table()]
    assert max(params) <= max(flops_plan_params)  # balancing what it is asked to balance


def test_flop_counts_are_analytic():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 12)
            self.conv = nn.Conv2d(3, 5, 3, padding=1)
            self.w = nn.Parameter(torch.randn(12, 7))

        def forward(self, x, img):
            h = self.lin(x)                                       # [2, 4, 8] @ [8, 12]
            q = h.view(2, 4, 2, 6).transpose(1, 2)                 # [2, 2, 4, 6]
            a = F.scaled_dot_product_attention(q, q, q)            # L = S = 4, E = Ev = 6
            y = a.transpose(1, 2).reshape(2, 4, 12) @ self.w       # [2, 4, 12] @ [12, 7]
            return y.sum() + self.conv(img).sum()

    x, img = torch.randn(2, 4, 8), torch.randn(2, 3, 6, 6)
    pipe = fxtrain.split(Net(), (x, img), num_stages=1)
    # forward, then one more product per operand that needs a gradient (x and img do not)
    lin = 2 * 8 * 8 * 12 * 2                 # weight grad only
    attn = 2 * 2 * 2 * 4 * 4 * (6 + 6) * 3   # Q·Kᵀ and P·V, backward twice the forward
    mm = 2 * 8 * 12 * 7 * 3                  # both operands need grads
    conv = 2 * (2 * 5 * 6 * 6) * 3 * 9 * 2   # weight grad only
    assert sum(node_flops(pipe.plan.captured.gm)) == lin + attn + mm + conv


def test_flop_counts_of_method_and_function_products_agree():
    """x.matmul / x.addmm count as torch.matmul / torch.addmm (one rule for both call forms)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 4))
            self.b = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return (torch.addmm(self.b, x, self.w).sum() + self.b.addmm(x, self.w).sum()
                    + torch.matmul(x, self.w).sum() + x.matmul(self.w).sum())

    pipe = fxtrain.split(Net(), (torch.randn(3, 8),), num_stages=1)
    assert sum(node_flops(pipe.plan.captured.gm)) == 4 * (2 * 3 * 8 * 4 * 2)   # weight grad only


def test_sparse_flops_count_the_lm_head_on_labelled_rows():
    from fxtrain.pipeline.costs import module_of, node_sparse_flops
    batch = bert_batch()
    density = float((batch["labels"] != -100).float().mean())
    pipe = fxtrain.split(bert_model(), example_kwargs=batch, num_stages=2, balance="sparse_flops")
    gm = pipe.plan.captured.gm
    dense, sparse = node_flops(gm), node_sparse_flops(gm)
    nodes = list(gm.graph.nodes)
    changed = {module_of(nodes[i]): sparse[i] / dense[i] for i in range(len(nodes)) if sparse[i] != dense[i]}
    # the matmuls the label-sparsity pass runs on labelled rows: decoder, head transform, last FFN ...
    assert {"cls.predictions.decoder", "cls.predictions.transform.dense"} <= set(changed), changed
    assert all(r == pytest.approx(density) for r in changed.values()), changed
    costs = [s.cost for s in pipe.plan.stages]
    assert sum(costs) == pytest.approx(sum(sparse))
    # With the head cheaper, the last stage takes more of the encoder than under dense FLOPs.
    assert pipe.plan.cuts[0] < pipe.replan(num_stages=2).plan.cuts[0]
    assert "balanced on sparse_flops" in pipe.describe()


def test_time_cost_prices_the_embedding_gradient_and_views():
    """FLOPs price an embedding at zero, but its backward writes a table-sized gradient and
    accumulates it every microbatch: balance="time" adds the bytes each node moves."""
    from fxtrain.pipeline.costs import node_sparse_flops, node_time, traffic_of
    from fxtrain.cost.flops import FLOPS_PER_BYTE
    model = toy_model()
    pipe = fxtrain.split(model, example_kwargs=toy_batch(), num_stages=2, balance="time")
    gm = pipe.plan.captured.gm
    nodes = list(gm.graph.nodes)
    flops, time_cost = node_sparse_flops(gm), node_time(gm)
    embedding = nodes.index(next(n for n in nodes if n.target is F.embedding))
    table = model.embed.weight.numel() * 4
    ids, rows = 8 * 5 * 8, 8 * 5 * 16 * 4       # int64 ids, float32 looked-up rows
    # forward: ids and rows read, rows written; backward: the rows' gradient read, a dense table
    # written and accumulated into .grad (read both, write one)
    assert traffic_of(nodes[embedding]) == (ids + 3 * rows, 4 * table)
    assert flops[embedding] == 0 and time_cost[embedding] == FLOPS_PER_BYTE * (ids + 3 * rows + 4 * table)
    tanh = next(n for n in nodes if n.target is torch.tanh)
    assert traffic_of(tanh) == (3 * 2 * rows, 0)   # in and out, forward and twice that backward
    views = [n for n in nodes if n.op == "call_method" and n.target == "flatten"]
    assert views and all(traffic_of(n) == (0, 0) for n in views)
    assert all(t >= f for t, f in zip(time_cost, flops))
    assert sum(s.cost for s in pipe.plan.stages) == pytest.approx(sum(time_cost))
    assert "balanced on time" in pipe.describe()


class Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i in (1, 3):
                fxtrain.pipe_split()
            x = torch.relu(layer(x))
        return x.pow(2).mean()


def test_markers_and_split_points():
    model, x = Marked(), torch.randn(4, 6)
    ref = nn.Sequential(*[nn.Sequential(layer, nn.ReLU()) for layer in model.layers])(x).pow(2).mean()
    assert torch.equal(model(x), ref)  # pipe_split() is a no-op in eager ...
    tm = fxtrain.TrainModule(model, fxtrain.Options(fallback="raise"))
    torch.testing.assert_close(tm(x), ref)  # ... and inside a captured graph
    pipe = fxtrain.split(model, (x,))
    assert [(s.first_module, s.last_module) for s in pipe.plan.stages] == [
        ("layers.0", "layers.0"), ("layers.1", "layers.2"), ("layers.3", "layers.3")]
    after = pipe.replan(split_points={"layers.0": "after", "layers.2": "before"})
    assert [s.params for s in after.plan.stages] == [
        ["layers.0.weight", "layers.0.bias"], ["layers.1.weight", "layers.1.bias"],
        ["layers.2.weight", "layers.2.bias", "layers.3.weight", "layers.3.bias"]]
    with pytest.raises(fxtrain.SplitError, match="names no module"):
        pipe.replan(split_points=["layers.9"])
    with pytest.raises(fxtrain.SplitError, match="either num_stages or split_points"):
        fxtrain.split(model, (x,), num_stages=2, split_points=["layers.1"])


def test_describe_simulate_and_plot(tmp_path):
    from fxtrain.pipeline.timeline import simulate
    for p, m in ((2, 4), (4, 4), (4, 8)):
        for schedule in ("gpipe", "1f1b"):
            sim = simulate([1.0] * p, [2.0] * p, schedule, m)
            assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (p, m, schedule)
    pipe = fxtrain.split(toy_model(), example_kwargs=toy_batch(), num_stages=3)
    text = pipe.describe()
    assert "3 stages balanced by flops" in text and "max/mean stage FLOPs" in text
    rows = pipe.stage_table()
    assert [r["stage"] for r in rows] == [0, 1, 2] and rows[0]["send_bytes"] > 0 and rows[-1]["send_bytes"] == 0
    out = pipe.plot(str(tmp_path / "timeline.png"), schedule="gpipe", n_microbatches=4)
    assert Path(out).stat().st_size > 1000


def test_placement_is_torchs():
    """The runner places stages as torch's schedules expect (looped, or V for ZBV/DualPipeV)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    from fxtrain.pipeline.schedules import placement
    for ranks in (1, 2, 3, 4):
        for per_rank in (1, 2, 3, 4):
            n = ranks * per_rank
            assert placement(n, ranks, "loop") == [generate_stage_to_rank_mapping(ranks, n, "loop")[s] for s in range(n)]
            assert placement(n, ranks, "v") == [generate_stage_to_rank_mapping(ranks, n, "v")[s] for s in range(n)]
    assert placement(4, 2, "v") == [0, 1, 1, 0]


def test_schedule_layouts_and_textbook_bubbles():
    from fxtrain.pipeline.schedules import SCHEDULE_INFO, check_layout
    from fxtrain.pipeline.timeline import simulate
    assert check_layout("zb1p", 6, 2) == 3 and check_layout("1f1b", 2, 2) == 1
    with pytest.raises(ValueError, match="'gpipe' runs one stage per rank.*interleaved-1f1b, zb1p, zbv, dualpipev"):
        check_layout("gpipe", 4, 2)
    with pytest.raises(ValueError, match="'zbv' runs two stages per rank"):
        check_layout("zbv", 6, 2)
    with pytest.raises(ValueError, match="cannot share evenly"):
        check_layout("zb1p", 5, 2)
    # Uniform stages (forward 1, backward 2 = input 1 + weight 1), free communication: the classic
    # schedules land on their textbook bubble; the zero-bubble ones below it.
    for p, m in ((2, 4), (2, 8), (4, 8)):
        for name, info in SCHEDULE_INFO.items():
            v = 1 if info.placement == "single" else 2
            sim = simulate([1.0] * (p * v), [2.0] * (p * v), name, m, weight=[1.0] * (p * v), ranks=p)
            if not info.split_backward:
                assert sim.bubble_fraction == pytest.approx(info.bubble(p, v, m)), (name, p, m)
            else:
                assert sim.bubble_fraction <= (p - 1) / (3 * m) + 1e-9, (name, p, m)


def test_microbatch_example_convention():
    """torch's pipeline() takes one microbatch (mb_args); fxtrain.split a whole batch, or mb_args."""
    whole = fxtrain.split(toy_model(), example_kwargs=toy_batch(2), num_stages=2)
    assert "example: the whole batch (2 rows)" in whole.describe()
    with pytest.raises(fxtrain.SplitError, match=r"not divisible by n_microbatches=4: fxtrain.split takes the "
                                                 r"whole batch as example.*mb_args="):
        whole.microbatch_plan(4, None)
    mb = fxtrain.split(toy_model(), mb_kwargs=toy_batch(2), num_stages=2)
    assert mb.example_is_microbatch and "example: one microbatch (2 rows" in mb.describe()
    captured, plan = mb.microbatch_plan(4, None)
    assert tuple(captured.user_inputs()[0].value.shape) == (2, 5)  # captured at the example's own shape
    with pytest.raises(fxtrain.SplitError, match="not both"):
        fxtrain.split(toy_model(), example_kwargs=toy_batch(2), mb_kwargs=toy_batch(2), num_stages=2)


def test_cli_split_prints_the_plan(tmp_path, capsys):
    from fxtrain.cli import main
    png = tmp_path / "plan.png"
    assert main(["split", "bert-tiny", "--stages", "2", "--batch", "4", "--seq", "16", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "2 stages balanced by flops" in out and "bert.embeddings" in out and png.stat().st_size > 1000


# --------------------------------------------------------------- measured plans (single process)
def test_measured_balance_times_the_stages_and_leaves_no_trace():
    """split(balance="measured") times every stage as the runner builds it; the timing runs leave
    no gradient behind and do not move the random stream."""
    model, batch = toy_model(), toy_batch()
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    pipe = fxtrain.split(model, example_kwargs=batch, num_stages=3, balance="measured")
    assert torch.equal(torch.rand(4), expected)
    assert all(p.grad is None for p in model.parameters())
    plan = pipe.plan
    assert plan.balance == "measured" and "balanced by measured time" in plan.how
    assert all(st.forward_time > 0 and st.backward_time > 0 for st in plan.stages)
    assert [st.cost for st in plan.stages] == [st.forward_time + st.backward_time for st in plan.stages]
    text = pipe.describe()
    assert "ms per stage (forward + backward, measured)" in text and "simulated from measured stage times" in text
    sim = pipe.simulate("1f1b", 4)   # the simulation replays the measured times
    first_forward = next(e for e in sim.events if e[1] == 0 and e[2] == "F")
    assert first_forward[5] - first_forward[4] == pytest.approx(plan.stages[0].forward_time)


def _true_stage_times(true_f, true_b):
    n = len(true_f)

    def measure(cuts):
        bounds = [0] + list(cuts) + [n]
        return [(sum(true_f[a:b]), sum(true_b[a:b]), sum(true_b[a:b]) / 2) for a, b in zip(bounds, bounds[1:])]
    return measure


def test_calibration_converges_on_the_measured_times():
    """Counted costs wrong by 5x on a third of the graph: the measured plan lands within a few
    percent of the plan the true costs would give, for min-max and for a schedule's step."""
    from fxtrain.pipeline.measure import Target, calibrate
    rng = np.random.default_rng(0)
    target = Target("zb1p", 8, 2)
    for _ in range(5):
        n = 30
        true_f = list(rng.random(n) * (1 + 4 * (np.arange(n) < 10)))
        true_b = [2 * f for f in true_f]
        total = [f + b for f, b in zip(true_f, true_b)]
        measure = _true_stage_times(true_f, true_b)
        timed = []
        cuts, times, tried = calibrate([1.0] * n, 4, lambda c: timed.append(tuple(c)) or measure(c),
                                       forward_share=[1 / 3] * n, weight_share=[0.5] * n)
        assert tuple(cuts) in timed and times == measure(cuts) and tried == len(timed) <= 4
        best, worst = min_max_partition(total, 4)
        start, _ = min_max_partition([1.0] * n, 4)
        assert max(stage_costs(total, cuts)) <= 1.07 * worst < max(stage_costs(total, start))

        def step(c):
            f, b, w = zip(*measure(list(c)))
            return target.step(f, b, w)
        cuts, _, _ = calibrate([1.0] * n, 4, measure, forward_share=[1 / 3] * n, weight_share=[0.5] * n,
                               target=target)
        optimum = min(itertools.combinations(range(1, n), 3), key=step)
        assert step(cuts) <= 1.02 * step(optimum) and step(cuts) < step(start)


def test_schedule_search_is_the_brute_force_optimum():
    from fxtrain.pipeline.measure import Target, _Costs, search_cuts
    rng = np.random.default_rng(1)
    for schedule, ranks in (("zb1p", 2), ("zbv", 2), ("1f1b", 4), ("interleaved-1f1b", 2)):
        target = Target(schedule, 8, ranks)
        for _ in range(6):
            n = 12
            f = list(rng.random(n) * 3)
            costs = _Costs(f, [x * rng.uniform(1, 3) for x in f], list(rng.random(n) * 0.6))
            seed, _ = min_max_partition(costs.total(), 4)
            got = search_cuts(costs, 4, target, [seed])
            best = min(target.step(*costs.stages(c)) for c in itertools.combinations(range(1, n), 3))
            assert target.step(*costs.stages(got)) == pytest.approx(best, rel=1e-9), schedule


def test_no_automatic_cut_between_logits_and_their_loss():
    """A cut between the vocabulary projection and its label-sparse loss would ship the logits and
    keep label sparsity from firing (the projection then runs on every row): plans never cut there."""
    from fxtrain.pipeline.plan import _Graph, _keep_logits_with_loss
    model, batch = bert_model(), bert_batch()
    pipe = fxtrain.split(model, example_kwargs=batch, num_stages=2)
    g = _Graph(pipe.plan.captured)
    allowed, _ = g.cut_tables()
    kept = _keep_logits_with_loss(g, allowed)
    banned = [c for c in range(len(allowed)) if allowed[c] and not kept[c]]
    decoder = next(n for n in g.sequence if "decoder" in (n.meta.get("nn_module_stack") and
                                                         list(n.meta["nn_module_stack"].values())[-1][0] or ""))
    loss = max(g.position[n] for n in g.sequence if "cross_entropy" in str(n.target))
    assert banned == list(range(g.position[decoder] + 1, loss + 1))
    # Dense FLOPs make the decoder alone a stage; the loss still sits with it.
    for k in (3, 5):
        plan = pipe.replan(num_stages=k, balance="params").plan
        assert all(c not in banned for c in plan.cuts), (k, plan.cuts)
