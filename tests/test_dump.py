"""Options.save_graphs_dir writes each capture as readable code, and never breaks training."""
import json
import logging
import os

import torch

import fxtrain
from utils import to_device


def _train(tm):
    tm(to_device(torch.randn(3, 4))).pow(2).sum().backward()


def test_each_capture_gets_a_folder_with_readable_graphs(tmp_path):
    tm = fxtrain.TrainModule(to_device(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())),
                             fxtrain.Options(executor="eager", fallback="raise", save_graphs_dir=str(tmp_path)))
    _train(tm)
    tm.eval()
    _train(tm)
    folders = sorted(os.listdir(tmp_path))
    assert len(folders) == 2 and folders[0].endswith("-000-train") and folders[1].endswith("-001-eval")
    train = tmp_path / folders[0]
    assert {p.name for p in train.iterdir()} == {"dynamo_graph.py", "forward_graph.py", "backward_graph.py",
                                                   "summary.json"}
    assert "torch.ops.aten.addmm" in (train / "forward_graph.py").read_text()
    assert "torch.ops.aten.tanh_backward" in (train / "backward_graph.py").read_text()
    summary = json.loads((train / "summary.json").read_text())
    assert summary["mode"] == "train" and summary["executor"] == "eager" and summary["nodes"]["forward"] > 0


def test_unwritable_dir_warns_and_trains(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tm = fxtrain.TrainModule(to_device(torch.nn.Linear(4, 4)), fxtrain.Options(fallback="raise", save_graphs_dir=str(blocker)))
    with caplog.at_level(logging.WARNING, logger="fxtrain"):
        _train(tm)
    assert "could not write graphs" in caplog.text
    assert tm.module.weight.grad is not None


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class _WithFunction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _Double.apply(self.lin(x), 2.0).pow(2).sum()


def test_dump_names_python_ops_and_the_optimizations(tmp_path):
    tm = fxtrain.TrainModule(to_device(_WithFunction()), fxtrain.Options(fallback="raise", save_graphs_dir=str(tmp_path)))
    tm(to_device(torch.randn(3, 4))).backward()
    (folder,) = [tmp_path / f for f in os.listdir(tmp_path)]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["python_ops"] == tm.capture_info().python_ops and summary["python_ops"][0].endswith("_Double")
    # Every pass reports on or off with its reason, backward-graph passes included.
    assert {"label_sparsity", "padding_elimination", "cross_entropy_grad"} <= set(summary["optimizations"])
    assert "fxtrain.python_op" in (folder / "forward_graph.py").read_text()
    assert "fxtrain.python_op_backward" in (folder / "backward_graph.py").read_text()
