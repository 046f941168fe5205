"""Peak memory of a steady dense training step: eager vs fxtrain's runtimes (issue 8's memory bullet).

    PYTHONPATH=<checkout> python bench/memory.py [--models gpt2,vit,llama-eager]

``llama-eager`` is not dense: an HF Llama set to ``attn_implementation="eager"`` at 4 x 1024 with
half of each row padding, whose attention in eager ops keeps ``[batch, heads, seq, seq]`` scores
for the backward where fxtrain runs it sequence by sequence (passes/eager_attention.py).

Each (model, contender) runs in a fresh process (Linux) with glibc serving every allocation above
64 kB by mmap (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set at once and RSS
follows live memory. After two warm-up steps the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs``), one step runs, and the peak is ``VmHWM`` minus the RSS before the
step: what the step itself added at its highest (activations, gradients, temporaries), seen by the
kernel whatever allocates it (compiled graphs, the autograd engine, inductor's kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from peak_rss import CHILD_ENV, added_at_peak

CONTENDERS = ("eager", "fxtrain", "fxtrain-graph", "fxtrain-inductor")


def _model(name: str):
    import torch
    from fxtrain import models
    if name == "gpt2":
        m = models.gpt2_lm(hidden=256, layers=4, heads=4, vocab=2000, positions=256)
        b = models.synthetic_batch("clm", 8, 128, 2000, padding=0.0, generator=torch.Generator().manual_seed(0))
        return m, lambda f: f(**b).loss
    if name == "llama-eager":
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                       max_position_embeddings=1024, pad_token_id=0)
        cfg._attn_implementation = "eager"
        m = transformers.LlamaForCausalLM(cfg)
        b = models.synthetic_batch("clm", 4, 1024, 8000, padding=0.5, generator=torch.Generator().manual_seed(0))
        return m, lambda f: f(**b).loss
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                    image_size=64, patch_size=8, num_labels=10)
    m = ViTForImageClassification(cfg)
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    return m, lambda f: f(pixel_values=x, labels=y).loss


def _child(model: str, contender: str) -> None:
    import torch
    import fxtrain
    torch.manual_seed(0)
    m, loss_of = _model(model)
    f = m
    if contender != "eager":
        opts = {"fxtrain": {}, "fxtrain-graph": {"backward": "graph"},
                "fxtrain-inductor": {"executor": "inductor"}}[contender]
        f = fxtrain.TrainModule(m, fxtrain.Options(**opts))
    for _ in range(2):
        loss_of(f).backward(); m.zero_grad(set_to_none=True)
    import gc
    gc.collect()
    peak = added_at_peak(lambda: loss_of(f).backward())
    runtime = getattr(f.capture_info().records[0], "runtime", "") if contender != "eager" else ""
    print(json.dumps({"peak": peak, "runtime": runtime}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,vit")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        _child(*a.child)
        return
    for model in a.models.split(","):
        row = {}
        for c in a.contenders.split(","):
            env = CHILD_ENV
            out = subprocess.run([sys.executable, __file__, "--child", model, c], capture_output=True, text=True,
                                 env=env)
            line = [l for l in out.stdout.splitlines() if l.startswith("{")]
            row[c] = json.loads(line[-1]) if line else {"peak": None, "runtime": out.stderr.strip().splitlines()[-1:]}
        eager = row["eager"]["peak"]
        cells = "  ".join(f"{c} {r['peak'] / 2**20:.1f} MiB ({r['peak'] / eager:.2f}x)" if r["peak"] else f"{c} failed: {r['runtime']}"
                          for c, r in row.items())
        print(f"{model}: step peak above the live state: {cells}")
        for c, r in row.items():
            if r.get("runtime"):
                print(f"    {c}: {r['runtime']}")


if __name__ == "__main__":
    main()
