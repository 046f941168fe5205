"""First training steps of a small HF Mixtral under bf16 autocast, eager and fxtrain, in one process:
the first step (a static capture, partitioned later by the worker) and the first at a new batch size
(the symbolic capture, partitioned in the training process: what every run with dynamic padding meets).

    PYTHONPATH=<checkout> python bench/moe_first_step.py

With transformers before 5.2x (5.17 is the GPU image's, tested with torch 2.11) the experts'
``transformers::grouped_mm_fallback`` has a backward AOTAutograd cannot trace
(fxtrain/capture/untraceable_ops.py): this times what that costs the first step, and says how many
graphs and breaks the capture made. To compare two versions of fxtrain, run it from each checkout in
alternating processes.
"""
import time
import warnings

import torch
import transformers

import fxtrain
from fxtrain import models

warnings.simplefilter("ignore")
config = transformers.MixtralConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    max_position_embeddings=64, pad_token_id=0, attention_dropout=0.0,
                                    num_local_experts=4, num_experts_per_tok=2)
torch.manual_seed(0)
eager = transformers.MixtralForCausalLM(config)
tm = fxtrain.TrainModule(transformers.MixtralForCausalLM(config))
tm.module.load_state_dict(eager.state_dict())
g = torch.Generator().manual_seed(0)
batches = [models.synthetic_batch("clm", b, s, 1000, padding=0.4, pad_id=0, label_density=0.2, generator=g)
           for b, s in ((4, 16), (3, 11))]
rows = []
for batch in batches:
    times, losses = {}, {}
    for name, model in (("fxtrain", tm), ("eager", eager)):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        times[name], losses[name] = time.perf_counter() - start, loss.item()
    rows.append(f"{tuple(batch['input_ids'].shape)}: fxtrain {times['fxtrain']:.1f} s, eager {times['eager']:.1f} s, "
                f"loss difference {abs(losses['fxtrain'] - losses['eager']):.1e}")
info = tm.capture_info()
print(f"transformers {transformers.__version__}, torch {torch.__version__}: {'; '.join(rows)}; "
      f"{info.graphs} graph(s), {info.graph_breaks} break(s)")
