"""Per-step time of fxtrain / eager on tiny workloads, interleaved step by step in one process.

    PYTHONPATH=<checkout> python bench/step_tax.py

One thread. To compare two versions of fxtrain, run it from each checkout in alternating processes
and compare the ratios (absolute times drift on a shared machine). Issue 8's bench/overhead.py will
add torch.compile, a ViT and a PythonOp.
"""
import statistics, sys, time, copy, torch, fxtrain
from torch import nn
from fxtrain import models
torch.set_num_threads(1)
def mlp():
    m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    return m, (lambda: ((torch.randn(8, 16),), {})), (lambda out: out.sum())
def gpt2():
    m = models.gpt2_lm(hidden=64, layers=2, heads=2, vocab=1000, positions=64)
    g = torch.Generator().manual_seed(0)
    b = models.synthetic_batch("clm", 4, 24, 1000, padding=0.0, generator=g)
    return m, (lambda: ((), b)), (lambda out: out.loss)
def bert_padded():
    m = models.bert_mlm(hidden=64, layers=2, heads=2, vocab=1000)
    g = torch.Generator().manual_seed(0)
    b = models.synthetic_batch("mlm", 8, 64, 1000, padding=0.5, label_density=0.15, generator=g)
    return m, (lambda: ((), b)), (lambda out: out.loss)
for name, make in (("mlp", mlp), ("gpt2-tiny dense", gpt2), ("bert-tiny padded", bert_padded)):
    torch.manual_seed(0)
    m, inputs, loss_of = make()
    runs = {"eager": (m, torch.optim.SGD(m.parameters(), lr=1e-3), [])}
    m2 = copy.deepcopy(m); tm = fxtrain.TrainModule(m2)
    runs["fxtrain"] = (tm, torch.optim.SGD(m2.parameters(), lr=1e-3), [])
    for i in range(300 if name == "mlp" else 60):
        for k, (fn, opt, ts) in (runs.items() if i % 2 else reversed(list(runs.items()))):
            a, kw = inputs()
            t = time.perf_counter()
            loss_of(fn(*a, **kw)).backward(); opt.step(); opt.zero_grad()
            if i >= 10: ts.append(time.perf_counter() - t)
    e, f = statistics.median(runs["eager"][2]), statistics.median(runs["fxtrain"][2])
    print(f"{name:18s} eager {e*1e6:9.0f} us  fxtrain {f*1e6:9.0f} us  fxtrain/eager {f/e:.2f}")
