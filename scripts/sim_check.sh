#!/usr/bin/env bash
# The simulated step against real CPU runs: for each of three runs, measures this
# machine's profile at the run's shapes (`tierzero bench profile`, right before the run),
# runs it for real, and prints the prediction (`plan --simulate`) beside the
# measurement: step time and each phase's busy time (medians of the steps after the
# warm-up); each run also times itself on the profile's clocks (`train --simulate`, the
# simulated device running the engine).
#
#   scripts/sim_check.sh [STEPS]          (default 6; the first 2 are warm-up)
#
# REUSE=1 keeps the real runs already in $WORK (runs/sim_check), measures the profiles
# again and simulates again; PROFILE=FILE prices every run on that profile instead of
# measuring (with REUSE=1: a model change priced on the same runs and rates).
#
# Runs: the default config (llama-tiny, 2 ranks, optimizer on NVMe); a ~130M Llama
# (hidden 768, 12 layers, vocab 32000) with parameters and optimizer on NVMe over 2
# ranks; llama-1b with parameters and optimizer on NVMe on 1 rank (seq 128). All fp32:
# on a CPU without bf16 matmul units compute would hide the data path.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
steps=${1:-6}
work=${WORK:-runs/sim_check}
bin=target/release/tierzero
mkdir -p "$work"
[ -x "$bin" ] || cargo build --release

common=(--set bf16.enabled=false --set train.log_interval=1)
tiny=(--config configs/default.json "${common[@]}" --set "train.steps=$((steps * 5))"
      --set "zero_optimization.offload_optimizer.nvme_path=$work/nvme-tiny")
m130=(--config configs/default.json "${common[@]}" --set "train.steps=$steps"
      --set model.hidden_size=768 --set model.intermediate_size=2048 --set model.num_hidden_layers=12
      --set model.num_attention_heads=12 --set model.num_key_value_heads=12 --set model.vocab_size=32000
      --set train_micro_batch_size_per_gpu=1 --set data.seq_len=256 --set zero_optimization.sub_group_size=1e7
      --set zero_optimization.offload_param.device=nvme --set zero_optimization.offload_param.max_in_cpu=0 --set "zero_optimization.offload_param.nvme_path=$work/nvme-130m"
      --set "zero_optimization.offload_optimizer.nvme_path=$work/nvme-130m")
l1b=(--config configs/llama-1b-1gpu-nvme.json "${common[@]}" --set "train.steps=$steps" --set train.devices=1
     --set train.accelerator=cpu --set train_micro_batch_size_per_gpu=1 --set gradient_accumulation_steps=1
     --set data.seq_len=128 --set data.synthetic=markov --set data.path=null --set train.save_interval=0
     --set "zero_optimization.offload_param.nvme_path=$work/nvme-1b"
     --set "zero_optimization.offload_optimizer.nvme_path=$work/nvme-1b")

# each run's profile is measured right before the run (its shapes, and the disk over a
# file the size of its swap files): this machine's disk and cores drift by 2× within the
# hour, and a profile measured an hour before prices another machine
profile_for() { # $1: name; the rest: config arguments. Prints the profile's path.
  local name=$1; shift
  if [ -n "${PROFILE:-}" ]; then
    echo "$PROFILE"
    return
  fi
  "$bin" bench profile "$@" --dir "$work/nvme-profile" --out "$work/profile-$name.json" --name this-machine >/dev/null
  echo "$work/profile-$name.json"
}

compare() { # $1: name; the rest: config arguments
  local name=$1; shift
  local profile
  profile=$(profile_for "$name" "$@")
  "$bin" plan "$@" --set "train.output_dir=$work/out-$name" --simulate "$profile" --json > "$work/sim-$name.json"
  if [ -z "${REUSE:-}" ] || [ ! -s "$work/out-$name/metrics.jsonl" ]; then
    rm -rf "$work/out-$name"
    # the run also times itself on the profile's clocks (the simulated device)
    "$bin" train "$@" --no-save --simulate "$profile" --set "train.output_dir=$work/out-$name" > "$work/train-$name.log" 2>&1
  fi
  python3 - "$work" "$name" <<'PY'
import json, sys
work, name = sys.argv[1], sys.argv[2]
sim = json.load(open(f"{work}/sim-{name}.json"))
steps = [json.loads(l) for l in open(f"{work}/out-{name}/metrics.jsonl")][2:]
med = lambda xs: sorted(xs)[len(xs) // 2]
real = med([s["step_seconds"] for s in steps])
print(f"{name}: step {sim['step_s']:.4f} s predicted, {real:.4f} s measured ({sim['step_s'] / real - 1:+.0%})")
if all("simulated" in s for s in steps):
    device = med([s["simulated"]["step_seconds"] for s in steps])
    print(f"  the same run on the simulated device: {device:.4f} s ({device / real - 1:+.0%})")
for phase in ("forward", "backward", "all_gather", "reduce", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer"):
    r = med([s["breakdown"]["seconds"].get(phase, 0.0) for s in steps])
    p = sim["phases"].get(phase, 0.0)
    if max(r, p) > 0.02 * real:
        print(f"  {phase:<11} {p:.4f} s predicted, {r:.4f} s measured ({p / r - 1 if r else float('inf'):+.0%})")
PY
}
compare tiny "${tiny[@]}"
compare m130 "${m130[@]}"
compare l1b "${l1b[@]}"
