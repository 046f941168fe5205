"""HF Trainer end to end, with its default arguments, eager against fxtrain.

    python examples/trainer_bert_mlm.py [--steps 60] [--repeats 2] [--cache-dir DIR]

The data is the built-in corpus (``fxtrain.corpus``: the standard library's documentation, a
word-level tokenizer trained on it), dynamically padded and masked by ``DataCollatorForLanguageModeling``
as a real MLM run would be. The only change to the Trainer recipe is ``model=fxtrain.TrainModule(model)``.
Runs alternate eager / fxtrain ``--repeats`` times (interleaved, so load on the machine hits both alike);
each prints Trainer's own progress bar, and the table gives Trainer's ``train_samples_per_second``
(whole run, captures included) and the rate after the first ``--warmup`` steps (steady state).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128, help="longest row (texts are truncated to it)")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the steady rate")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="fxtrain's capture cache (Options.cache_dir)")
    args = parser.parse_args()

    import fxtrain
    from fxtrain import corpus, models
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    logging.getLogger("fxtrain").setLevel(logging.INFO)
    logging.basicConfig(format="%(message)s")
    texts = corpus.paragraphs()
    tok = corpus.tokenizer(texts, 8000)
    rows = corpus.mlm_rows(tok, texts, args.seq)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.times = []

        def on_step_end(self, *_: object, **__: object) -> None:
            self.times.append(time.perf_counter())

    def run(wrap: bool) -> tuple:
        torch.manual_seed(0)
        model = models.bert_mlm(hidden=256, layers=4, heads=4, vocab=len(tok))
        if wrap:
            model = fxtrain.TrainModule(model, fxtrain.Options(cache_dir=args.cache_dir))
        clock = StepClock()
        with tempfile.TemporaryDirectory() as out:
            targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
                                      report_to="none", save_strategy="no", logging_steps=args.steps, seed=0)
            trainer = Trainer(model=model, args=targs, train_dataset=rows, callbacks=[clock],
                              data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.15, seed=0))
            metrics = trainer.train().metrics
        steady = clock.times[args.warmup:]
        rate = args.batch * (len(steady) - 1) / (steady[-1] - steady[0])
        return metrics["train_samples_per_second"], rate, metrics["train_loss"]

    results = {"eager": [], "fxtrain": []}
    for _ in range(args.repeats):
        for name in results:
            print(f"--- {name}")
            results[name].append(run(name == "fxtrain"))
    print(f"\nBERT-MLM (hidden 256, 4 layers, vocab {len(tok)}), batch {args.batch}, rows up to {args.seq} tokens, "
          f"{args.steps} steps, {torch.get_num_threads()} threads; median of {args.repeats} interleaved runs")
    print(f"{'':10}{'samples/s (run)':>18}{'samples/s (steady)':>20}{'train loss':>12}")
    for name, rs in results.items():
        print(f"{name:10}{statistics.median(r[0] for r in rs):18.1f}{statistics.median(r[1] for r in rs):20.1f}"
              f"{rs[0][2]:12.4f}")
    e, f = (statistics.median(r[0] for r in results[n]) for n in results)
    es, fs = (statistics.median(r[1] for r in results[n]) for n in results)
    print(f"fxtrain / eager: {f / e:.2f}x over the run, {fs / es:.2f}x steady")


if __name__ == "__main__":
    main()
