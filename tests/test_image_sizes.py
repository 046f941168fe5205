"""HF image classifiers with changing batch and image sizes train as eager under the default sizes
policy, and no recapture stalls (issue #31: HF Swin's second batch size did not finish in 8 minutes:
every size was made symbolic, and sympy spent minutes on the window partition's floor divisions).

Each model trains in a fresh process with a time limit, so a stall fails its test instead of
stalling the suite. The parent only reads what the child found."""
import json
import os
import subprocess
import sys

import pytest

TIME_LIMIT = 420   # seconds: the quiet machine needs ~30; a stall never ends

pytestmark = [pytest.mark.cpu_only("fresh processes that build their own CPU models"), pytest.mark.long]


def _child(case: str) -> None:
    """Train ``case`` with default options against an eager copy; print what the parent checks."""
    import copy

    import torch

    import fxtrain
    from fxtrain import models
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from utils import assert_grads_equal, assert_state_equal

    torch.manual_seed(0)
    model = {"swin": models.swin_cls, "convnext": models.convnext_cls}[case]()
    ref = copy.deepcopy(model)
    tm = fxtrain.TrainModule(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (tm, ref))
    g = torch.Generator().manual_seed(1)
    captures = []
    # Batch sizes 4, 3, 5 (the repro), then a new image size, then sizes already run, then
    # a third and a fourth image size (the fourth is made symbolic, for Swin expensively).
    steps = ((4, 32), (3, 32), (5, 32), (3, 48), (4, 32), (2, 48)) + (((3, 40), (2, 56)) if case == "swin" else ())
    for b, size in steps:
        batch = models.image_batch(b, size, generator=g)
        before = tm.capture_info().graphs
        out, ref_out = tm(**batch), ref(**batch)
        torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out.loss, ref_out.loss, atol=1e-5, rtol=1e-4)
        out.loss.backward(); ref_out.loss.backward()
        assert_grads_equal(tm.module, ref)
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
        captures.append(tm.capture_info().graphs - before)
    assert_state_equal(tm.module, ref)
    info = tm.capture_info()
    print(json.dumps(dict(captures=captures, reasons=[r.reason for r in info.records],
                          fallback=info.fallback_reason, breaks=info.graph_breaks)))


def _train(case: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FXTRAIN_")}
    try:
        proc = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True,
                              timeout=TIME_LIMIT, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: training 6 steps did not finish in {TIME_LIMIT} s (a capture stalled)")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# 70 s: make test runs the image-size policy on ConvNeXt below; the watchdog's stop of expensive
# symbolic reasoning (Swin's window partition) runs with make test-long.
@pytest.mark.extended
def test_swin_new_batch_and_image_sizes():
    found = _train("swin")
    assert found["fallback"] is None and found["breaks"] == 0
    # One capture for the first sizes, one for the first new batch size (symbolic batch, static
    # image size), one for each new image size, none for sizes (or batch sizes) already served.
    assert found["captures"] == [1, 1, 0, 1, 0, 0, 1, 1], found
    reasons = found["reasons"]
    assert reasons[1].startswith("sizes changed: symbolic kwargs['pixel_values'] dim 0 (4 -> 3)"), reasons
    assert "every other input size static" in reasons[1]
    # The first three image sizes are captured static (capture/sizes.py, IMAGE_SIZES_STATIC)...
    for i, size in ((2, 48), (3, 40)):
        assert f"image sizes static (a capture per size, symbolic from the 4th distinct size): " \
               f"kwargs['pixel_values'] dim 2 (32 -> {size})" in reasons[i], reasons
    # ...the fourth is made symbolic, and Swin's window partition on a symbolic image size is the
    # expensive case: the watchdog stops it and keeps the size static, and says so.
    assert "their symbolic reasoning proved expensive: kwargs['pixel_values'] dim 2 (32 -> 56)" in reasons[4], reasons


def test_convnext_new_batch_and_image_sizes():
    found = _train("convnext")
    assert found["fallback"] is None and found["breaks"] == 0
    assert found["captures"][:3] == [1, 1, 0] and sum(found["captures"]) <= 3, found
    assert "dim 0 (4 -> 3)" in found["reasons"][1]


if __name__ == "__main__":
    _child(sys.argv[1])
