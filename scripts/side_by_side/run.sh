#!/usr/bin/env bash
# tierzero beside DeepSpeed 0.19.8 on this machine's CPUs (README, "tierzero beside
# DeepSpeed"): the same Hugging Face Llama directory, the same ds_config (2 ranks, ZeRO-3,
# parameters and optimizer state on NVMe, bf16), one torch thread per rank, runs
# interleaved. Prints each run's tokens/s and peak RSS (DeepSpeed: its processes summed)
# and the medians.
#
#   scripts/side_by_side/run.sh [ROUNDS]          (environment: WORK, default runs/side_by_side;
#                                                  BF16=false trains both in fp32;
#                                                  DSVENV, default .dsvenv; SEQ, STEPS, WARMUP;
#                                                  PAUSE, seconds of rest before each run)
#
# Each run starts after PAUSE seconds (default 120) with the disk at rest: on a virtual
# disk a run that follows another's gigabytes of writes pays for their flush (README,
# "tierzero beside DeepSpeed": tierzero's bf16 step 3.60 s right after DeepSpeed's run,
# 2.46-2.91 s after a 150 s rest), and without the rest the trainer that runs second in
# each round pays it every round.
#
# DeepSpeed lives in its own virtualenv ($DSVENV) that reuses the project's torch:
#   python3 -m venv $DSVENV
#   echo "$(ls -d .venv/lib/python3*/site-packages)" > $DSVENV/lib/python3*/site-packages/tierzero_torch.pth
#   $DSVENV/bin/pip install deepspeed==0.19.8 transformers accelerate ninja     (apt: libaio-dev)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
rounds=${1:-3}
work=${WORK:-$repo/runs/side_by_side}
dsvenv=${DSVENV:-$repo/.dsvenv}
seq=${SEQ:-256}
pause=${PAUSE:-120}
steps=${STEPS:-4}
warmup=${WARMUP:-2}
mkdir -p "$work/nvme-tz" "$work/nvme-ds"
[ -f "$work/llama/config.json" ] || "$dsvenv/bin/python" "$here/make_llama.py" "$work/llama"

config() { # $1: nvme path; $2: output dir
  cat <<JSON
{
 "train_micro_batch_size_per_gpu": 1,
 "gradient_accumulation_steps": 1,
 "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
 "bf16": {"enabled": ${BF16:-true}},
 "zero_optimization": {
  "stage": 3,
  "stage3_param_persistence_threshold": 0,
  "sub_group_size": 1e7,
  "offload_param": {"device": "nvme", "nvme_path": "$1"},
  "offload_optimizer": {"device": "nvme", "nvme_path": "$1"}
 },
 "model": {"hf_dir": "$work/llama"},
 "data": {"synthetic": "markov", "seq_len": $seq},
 "train": {"steps": $((steps + warmup)), "devices": 2, "output_dir": "$2", "seed": 1}
}
JSON
}
config "$work/nvme-tz" "$work/out-tz" > "$work/tierzero.json"
config "$work/nvme-ds" "$work/out-ds" > "$work/deepspeed.json"

tierzero_run() {
  rm -rf "$work/out-tz"
  OMP_NUM_THREADS=1 "$repo/target/release/tierzero" train --config "$work/tierzero.json" > "$work/tz.log" 2>&1
  python3 - "$work/out-tz" $warmup <<'PY'
import json, sys
out, warmup = sys.argv[1], int(sys.argv[2])
steps = [json.loads(l) for l in open(out + "/metrics.jsonl")]
times = sorted(s["step_seconds"] for s in steps[warmup:])
median = times[len(times) // 2]
summary = json.load(open(out + "/summary.json"))
tokens = steps[0]["tokens"]  # metrics.jsonl counts tokens cumulatively
peak = max(summary["host"]["startup_peak_rss"], summary["host"]["steps"]["peak_rss"])
print(json.dumps({"trainer": "tierzero", "tokens_per_s": tokens / median, "median_step_s": median,
                  "peak_rss": peak, "kernel_fraction": summary["host"]["steps"]["kernel_fraction"]}))
PY
}

deepspeed_run() {
  # the venv's bin first: its ninja JIT-builds DeepSpeed's ops
  PATH="$dsvenv/bin:$PATH" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 "$dsvenv/bin/python" -m torch.distributed.run --nproc_per_node 2 \
    "$here/ds_train.py" --hf-dir "$work/llama" --config "$work/deepspeed.json" \
    --steps $steps --warmup $warmup --seq $seq --out "$work/ds.json" > "$work/ds.log" 2>&1
  python3 -c "
import json; d = json.load(open('$work/ds.json'))
print(json.dumps({'trainer': d['trainer'], 'tokens_per_s': d['tokens_per_s'], 'median_step_s': d['median_step_s'], 'peak_rss': d['peak_rss_sum']}))"
}

: > "$work/runs.jsonl"
for r in $(seq 1 "$rounds"); do
  sleep "$pause"
  tierzero_run | tee -a "$work/runs.jsonl"
  sleep "$pause"
  deepspeed_run | tee -a "$work/runs.jsonl"
done
python3 - "$work/runs.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
tz = [r for r in runs if r["trainer"] == "tierzero"]
ds = [r for r in runs if r["trainer"] != "tierzero"]
med = lambda rs, k: statistics.median(r[k] for r in rs)
print(f"tierzero  {med(tz,'tokens_per_s'):8.1f} tok/s  peak RSS {med(tz,'peak_rss')/1e9:.2f} GB  ({len(tz)} runs)")
print(f"{ds[0]['trainer']} {med(ds,'tokens_per_s'):8.1f} tok/s  peak RSS {med(ds,'peak_rss')/1e9:.2f} GB (processes summed)")
print(f"ratio     tokens/s {med(tz,'tokens_per_s')/med(ds,'tokens_per_s'):.2f}x   peak RSS {med(tz,'peak_rss')/med(ds,'peak_rss'):.2f}x")
PY
