"""ModuleWithLoss: a training-loop loss inside the graph, so label sparsity can see it."""
import pytest
import torch
import torch.nn.functional as F

import fxtrain
from fxtrain import models
from utils import current_device, to_device, train_parity


def _mlm_loss(outputs, labels):
    return F.cross_entropy(outputs.logits.view(-1, outputs.logits.shape[-1]), labels.view(-1))


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_loop_loss_in_graph_fires_label_sparsity_and_matches_eager():
    torch.manual_seed(0)
    model = to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
    ref = fxtrain.ModuleWithLoss(__import__("copy").deepcopy(model), _mlm_loss)
    tm = fxtrain.TrainModule(fxtrain.ModuleWithLoss(model, _mlm_loss), fxtrain.Options(fallback="raise"))
    g = torch.Generator().manual_seed(1)
    batches = [models.synthetic_batch("mlm", b, s, 1000, padding=0.3, label_density=0.1, generator=g, device=current_device())
               for b, s in [(4, 16), (3, 11), (5, 20)]]
    # What HF Trainer reads: outputs["loss"]; the model got no labels, so its own loss is not computed.
    train_parity(tm, ref, batches, lambda out, _: out["loss"], state_atol=3e-4,
                 compare_outputs=lambda o, r: torch.testing.assert_close(o.logits, r.logits, atol=1e-5, rtol=1e-4))
    assert tm.capture_info().optimizations["label_sparsity"].startswith("on:")
    assert set(tm.state_dict()) == set(model.state_dict())  # checkpoints load into the bare model
    assert [n for n, _ in tm.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_plain_outputs_give_loss_and_outputs_and_missing_target_is_clear():
    lin = to_device(torch.nn.Linear(4, 3))
    mwl = fxtrain.ModuleWithLoss(lin, lambda out, y: F.cross_entropy(out, y), target_keys=("y",))
    x, y = to_device((torch.randn(5, 4), torch.randint(0, 3, (5,))))
    loss, out = mwl(x, y=y)
    torch.testing.assert_close(loss, F.cross_entropy(lin(x), y))
    with pytest.raises(TypeError, match="missing target keyword"):
        mwl(x)
    with pytest.raises(TypeError, match="callable"):
        fxtrain.ModuleWithLoss(lin, "not a function")


@pytest.mark.usefixtures("passes_whatever_they_cost")
def test_hf_trainer_trains_a_module_with_loss_like_eager(tmp_path):
    """The documented recipe (docs/integrations.md): Trainer(model=TrainModule(ModuleWithLoss(...)),
    remove_unused_columns=False). Logged losses equal eager Trainer's, and label sparsity fired."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(12):
        b = models.synthetic_batch("mlm", 1, 16, 1000, padding=0.0, label_density=0.15, generator=g)
        rows.append({k: v[0] for k, v in b.items()})

    def train(wrap):
        torch.manual_seed(0)
        model = to_device(models.bert_mlm(hidden=32, layers=2, heads=2, vocab=1000))
        wrapped = wrap(model)
        # Trainer moves model and batches to its own device: the test device's (a GPU wherever one
        # exists, unless use_cpu).
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                                 logging_steps=1, report_to=[], remove_unused_columns=False, save_strategy="no",
                                 use_cpu=current_device().type == "cpu", seed=0, disable_tqdm=True)
        trainer = Trainer(model=wrapped, args=args, train_dataset=rows)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], wrapped

    ref_losses, _ = train(lambda m: m)
    losses, tm = train(lambda m: fxtrain.TrainModule(fxtrain.ModuleWithLoss(m, _mlm_loss),
                                                     fxtrain.Options(fallback="raise")))
    assert len(losses) == 3
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    assert tm.capture_info().optimizations["label_sparsity"].startswith("on:")
