"""Shared test helpers: eager PyTorch is the oracle."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, Tuple

import torch

import fxtrain


def wrap_pair(model: torch.nn.Module, **options: Any) -> Tuple[fxtrain.TrainModule, torch.nn.Module]:
    """(TrainModule around ``model``, an untouched deep copy for eager)."""
    ref = copy.deepcopy(model)
    options.setdefault("fallback", "raise")
    # Most tests change batch and sequence sizes between steps and check that one capture serves them
    # all: symbolic sizes from the first capture. The default (static first) is tested in test_module.
    options.setdefault("dynamic", True)
    return fxtrain.TrainModule(model, fxtrain.Options(**options)), ref


def assert_grads_equal(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    checked = 0
    for name in pa:
        ga, gb = pa[name].grad, pb[name].grad
        assert (ga is None) == (gb is None), f"{name}: grad presence differs"
        if ga is not None:
            torch.testing.assert_close(ga, gb, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
            checked += 1
    assert checked > 0, "no gradient was compared"


def assert_state_equal(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-5) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=1e-4, msg=lambda m: f"{k}: {m}")


def train_parity(tm: fxtrain.TrainModule, ref: torch.nn.Module, batches: Iterable[Dict[str, Any]],
                 loss_of: Callable[[Any, Dict[str, Any]], torch.Tensor], atol: float = 1e-5,
                 compare_outputs: Callable[[Any, Any], None] | None = None,
                 state_atol: float | None = None) -> None:
    """Train both copies with AdamW step by step; losses, outputs, grads and state must agree."""
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    tm.train(); ref.train()
    for batch in batches:
        out, ref_out = tm(**batch), ref(**batch)
        loss, ref_loss = loss_of(out, batch), loss_of(ref_out, batch)
        torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=1e-4)
        if compare_outputs is not None:
            compare_outputs(out, ref_out)
        loss.backward(); ref_loss.backward()
        assert_grads_equal(tm.module, ref, atol=atol)
        opt.step(); ref_opt.step()
        opt.zero_grad(); ref_opt.zero_grad()
    assert_state_equal(tm.module, ref, atol=state_atol or atol)
