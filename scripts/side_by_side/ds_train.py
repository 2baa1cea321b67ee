"""DeepSpeed's side of the side-by-side benchmark: trains a Hugging Face Llama directory
with a ds_config on CPU ranks (DS_ACCELERATOR=cpu, gloo), one torch thread per rank, and
reports tokens/s over the timed steps and every rank's peak resident set.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 ds_train.py --hf-dir D --config C \
        --steps 6 --warmup 2 --seq 256 --out result.json

Keys DeepSpeed does not know (tierzero's `model`, `data`, `train`) are dropped from the
config; random token ids (seeded per rank and step) are the data.
"""
import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--hf-dir", required=True)
p.add_argument("--config", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--out", required=True)
a = p.parse_args()

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
import deepspeed  # noqa: E402  (after the thread count, as a user's script would)
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = json.load(open(a.config))
for key in ("model", "data", "train"):
    config.pop(key, None)
keep = HfDeepSpeedConfig(config)  # makes from_pretrained build under zero.Init
# the config's precision, as tierzero reads the same file
bf16 = config.get("bf16", {}).get("enabled") is True
model = AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.bfloat16 if bf16 else torch.float32)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
vocab = model.config.vocab_size
micro = config.get("train_micro_batch_size_per_gpu", 1)
times, losses = [], []
for step in range(a.warmup + a.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (micro, a.seq), generator=g)
    dist.barrier()
    start = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    dist.barrier()
    if step >= a.warmup:
        times.append(time.perf_counter() - start)
    losses.append(float(loss.detach()))
peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
peaks = [torch.zeros_like(peak) for _ in range(world)]
dist.all_gather(peaks, peak)
if rank == 0:
    tokens = world * micro * a.seq
    result = {
        "trainer": "deepspeed " + deepspeed.__version__,
        "ranks": world,
        "step_seconds": times,
        "median_step_s": sorted(times)[len(times) // 2],
        "tokens_per_s": tokens / sorted(times)[len(times) // 2],
        "peak_rss_per_rank": [int(x.item()) for x in peaks],
        "peak_rss_sum": int(sum(x.item() for x in peaks)),
        "losses": losses,
    }
    json.dump(result, open(a.out, "w"), indent=1)
    print(json.dumps(result))
dist.barrier()
