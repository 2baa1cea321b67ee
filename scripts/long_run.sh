#!/usr/bin/env bash
# A long run's host memory: trains the default config's model (2 ranks, ZeRO-3, optimizer
# on NVMe) with short sequences for STEPS steps (100,000 by default) and prints the resident
# set at step 1,000 and at the end, from metrics.jsonl's host_rss.
#   scripts/long_run.sh                 # 100,000 steps into runs/long
#   STEPS=20000 OUT=runs/long2 scripts/long_run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-100000}
out=${OUT:-runs/long}
[ -x target/release/tierzero ] || make build
rm -rf "$out"; mkdir -p "$out"
target/release/tierzero train --config configs/default.json \
  --set train.steps="$steps" --set train.output_dir="$out" \
  --set zero_optimization.offload_optimizer.nvme_path="$out/nvme" \
  --set train.log_interval=10000 --set scheduler.params.total_num_steps="$steps" \
  --set data.seq_len=16 --set train_micro_batch_size_per_gpu=1 > "$out/run.log" 2>&1
python3 - "$out/metrics.jsonl" <<'PY'
import json, sys
rss = {}
for line in open(sys.argv[1]):
    row = json.loads(line)
    rss[row["step"]] = row["host_rss"]
last = max(rss)
for step in sorted({100, 1000, 10000, last} & set(rss)):
    print(f"step {step:>7}: resident {rss[step] / 1e6:.1f} MB")
print(f"end against step 1,000: {100 * (rss[last] / rss[1000] - 1):+.2f}%")
PY
