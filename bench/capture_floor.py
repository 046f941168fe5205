"""How fast can any capture of BERT-base be? torch's own tracing, with none of fxtrain's work.

    python bench/capture_floor.py [--layers 1,12] [--shapes static,dynamic] [--regional]

The profiler's first costing of fxtrain's graph is bound by capture: dynamo traces the Python, then
AOTAutograd traces the joint forward+backward and partitions it. This measures those two stages
alone, with a backend that does nothing else (identity compilers, ``default_partition`` as fxtrain
uses), on BERT-base dimensions with 1 and 12 layers, static and symbolic sizes. Each configuration
runs in a fresh process (a user's first call pays dynamo's one-time start-up) and captures a second
model in the same process (the cost without start-up). ``--regional`` also wraps every layer in
``torch.compiler.nested_compile_region``, torch's own way of tracing repeated layers once.
Sizes do not change tracing work, so a small real batch stands in for 1,000,000 x 512.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Dict, List


def _capture_once(layers: int, dynamic: bool, regional: bool) -> Dict[str, float]:
    import torch
    import transformers
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition
    from functorch.compile import make_boxed_func

    from fxtrain.capture.settings import dynamo_settings
    from fxtrain.options import Options

    model = transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=layers))
    if regional:
        for layer in model.bert.encoder.layer:
            layer.forward = torch.compiler.nested_compile_region(type(layer).forward).__get__(layer)
    stamps: Dict[str, float] = {}

    def compiler(name: str):
        def compile_graph(gm, example_inputs):
            stamps[name] = time.perf_counter()
            return make_boxed_func(gm.forward)
        return compile_graph

    def backend(gm, example_inputs):
        if "dynamo" in stamps:
            raise RuntimeError("dynamo called the backend twice: the timings would mix two captures")
        stamps["dynamo"] = time.perf_counter()
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler("aot_forward"),
                                     bw_compiler=compiler("aot_backward"), partition_fn=default_partition)

    torch._dynamo.reset()
    ids = torch.randint(0, 1000, (4, 32))
    compiled = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)
    started = time.perf_counter()
    with torch._dynamo.config.patch(dynamo_settings(Options())):   # what fxtrain captures under
        out = compiled(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    before_backward = time.perf_counter()
    out.loss.backward()
    # AOTAutograd compiles the backward at the first backward, or right after the forward when
    # sizes are symbolic: count whichever it did.
    backward = stamps["aot_backward"] - (before_backward if stamps["aot_backward"] > before_backward
                                         else stamps["aot_forward"])
    return {"dynamo": stamps["dynamo"] - started, "aot_forward": stamps["aot_forward"] - stamps["dynamo"],
            "aot_backward": backward,
            "capture": stamps["aot_forward"] - started + backward}


def _child(layers: int, dynamic: bool, regional: bool) -> None:
    rows = []
    for _ in range(2):
        try:
            rows.append(_capture_once(layers, dynamic, regional))
        except Exception as e:  # torch's regional capture does not support every configuration
            rows.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"})
    print(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="1,12")
    p.add_argument("--shapes", default="static,dynamic")
    p.add_argument("--regional", action="store_true")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(int(a.child[0]), a.child[1] == "dynamic", a.child[2] == "1")
        return
    print("| layers | sizes | layers traced | process | dynamo | AOT forward | AOT backward | capture |")
    print("|---:|---|---|---|---:|---:|---:|---:|")
    for regional in ([False, True] if a.regional else [False]):
        for shapes in a.shapes.split(","):
            for layers in (int(n) for n in a.layers.split(",")):
                out = subprocess.run([sys.executable, __file__, "--child", str(layers), shapes, str(int(regional))],
                                     capture_output=True, text=True)
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
                rows: List[Dict[str, float]] = json.loads(lines[-1]) if lines else [{"error": out.stderr[-200:]}] * 2
                for which, row in zip(("first", "second"), rows):
                    how = "once (nested_compile_region)" if regional else "each"
                    if "error" in row:
                        print(f"| {layers} | {shapes} | {how} | {which} | {row['error']} | | | |")
                        continue
                    print(f"| {layers} | {shapes} | {how} | {which} | {row['dynamo']:.2f} s | {row['aot_forward']:.2f} s "
                          f"| {row['aot_backward']:.2f} s | {row['capture']:.2f} s |")


if __name__ == "__main__":
    main()
