#!/usr/bin/env bash
# The simulated step against real CPU runs: for each of three runs, measures this
# machine's profile at the run's shapes (`tierzero bench profile`, right before the run
# and right after it), runs it for real, and prints the prediction (`plan --simulate` on
# the mean of the two profiles) beside the measurement: step time and each phase's busy
# time (medians of the steps after the warm-up); each run also times itself on the
# clocks of the profile measured before it (`train --simulate`, the simulated device
# running the engine), and the disk's rates in the profiles before and after it (this
# machine's disk drifts by 2-3x within the hour: a gap in the NVMe phases often is that).
#
#   scripts/sim_check.sh [STEPS]          (default 6; the first 2 are warm-up)
#
# ONLY=NAME runs one of them (tiny, m130, l1b). REPRICE=1 measures and runs nothing: it
# prices the runs in $WORK again on the profiles they were priced on (a model change,
# on the same runs and rates). REUSE=1 keeps the real runs already in $WORK (runs/sim_check), measures the profiles
# again and simulates again; PROFILE=FILE prices every run on that profile instead of
# measuring (with REUSE=1: a model change priced on the same runs and rates). Each
# run's profiles stay in $WORK: profile-NAME-before.json, -after.json and their mean,
# profile-NAME.json, which prices it.
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
# file the size of its swap files) and again right after it, and the run is priced on
# the mean of the two: this machine's disk and cores drift by 2× within the hour (by a
# third within one run of llama-1b), and a profile measured an hour before prices
# another machine
measure() { # $1: output file; the rest: config arguments
  local out=$1; shift
  "$bin" bench profile "$@" --dir "$work/nvme-profile" --out "$out" --name this-machine >/dev/null
}

# the mean of two profiles of this machine: every measured figure (a value with its
# source, a compute rate) averaged as the time it prices averages (a rate's harmonic
# mean, a time's arithmetic mean), rows of the disk's rates by file size paired by size,
# the first's sources kept with a note
mean_profile() { # $1, $2: the profiles; $3: output file
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
def is_time(key):
    # a time, or the cores the disk takes while it streams (nvme.cores): averaged as they are
    return (key.endswith("_s") and not key.endswith("_gb_s") and not key.endswith("per_s")) or key.startswith("while_")
def average(x, y, time):
    return (x + y) / 2 if time else 2 / (1 / x + 1 / y) if x > 0 and y > 0 else (x + y) / 2
def mean(x, y, key=""):
    if isinstance(x, dict) and isinstance(y, dict):
        out = {k: mean(v, y[k], k) if k in y else v for k, v in x.items()}
        for field in ("value", "flops_per_s"):
            if isinstance(x.get(field), (int, float)) and isinstance(y.get(field), (int, float)):
                out[field] = average(x[field], y[field], is_time(key))
                if "source" in x:
                    out["source"] = x["source"] + "; the mean of this measurement just before and just after the run (scripts/sim_check.sh)"
        return out
    if isinstance(x, list) and isinstance(y, list):
        if key == "by_file_size":
            by_size = {r["file_bytes"]: r for r in y}
            return [mean(r, by_size[r["file_bytes"]]) if r["file_bytes"] in by_size else r for r in x]
        if len(x) == len(y):
            return [mean(u, v) for u, v in zip(x, y)]
    return x
json.dump(mean(a, b), open(sys.argv[3], "w"), indent=2)
PY
}

compare() { # $1: name; the rest: config arguments
  local name=$1; shift
  local before=$work/profile-$name-before.json after=$work/profile-$name-after.json profile=$work/profile-$name.json
  if [ -n "${REPRICE:-}" ]; then
    if [ ! -s "$profile" ] || [ ! -s "$work/out-$name/metrics.jsonl" ]; then
      echo "$name: no run and profile in $work to price again"
      return 0
    fi
  else
    if [ -z "${PROFILE:-}" ]; then
      measure "$before" "$@"
    fi
    if [ -z "${REUSE:-}" ] || [ ! -s "$work/out-$name/metrics.jsonl" ]; then
      rm -rf "$work/out-$name"
      # the run also times itself on the clocks of the profile measured before it (the
      # simulated device)
      "$bin" train "$@" --no-save --simulate "${PROFILE:-$before}" --set "train.output_dir=$work/out-$name" > "$work/train-$name.log" 2>&1
    fi
    if [ -n "${PROFILE:-}" ]; then
      profile=$PROFILE
    else
      measure "$after" "$@"
      mean_profile "$before" "$after" "$profile"
    fi
  fi
  "$bin" plan "$@" --set "train.output_dir=$work/out-$name" --simulate "$profile" --json > "$work/sim-$name.json"
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
# the disk as measured around the run, by file size: this machine's drifts
def disk(which):
    try:
        nvme = json.load(open(f"{work}/profile-{name}-{which}.json"))["nvme"]
    except (OSError, KeyError, ValueError):
        return {}
    return {r["file_bytes"] >> 20: (r["read_gb_s"]["value"], r["write_gb_s"]["value"]) for r in nvme.get("by_file_size", [])}
before, after = disk("before"), disk("after")
rows = [f"{mib} MiB read {before[mib][0]:.2f} -> {after[mib][0]:.2f}, write {before[mib][1]:.2f} -> {after[mib][1]:.2f}" for mib in sorted(before) if mib in after]
if rows:
    print("  the disk before -> after the run (GB/s): " + "; ".join(rows))
for phase in ("forward", "backward", "all_gather", "reduce", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer"):
    r = med([s["breakdown"]["seconds"].get(phase, 0.0) for s in steps])
    p = sim["phases"].get(phase, 0.0)
    if max(r, p) > 0.02 * real:
        print(f"  {phase:<11} {p:.4f} s predicted, {r:.4f} s measured ({p / r - 1 if r else float('inf'):+.0%})")
PY
}
for name in tiny m130 l1b; do
  if [ -z "${ONLY:-}" ] || [ "$ONLY" = "$name" ]; then
    args="$name[@]"
    compare "$name" "${!args}"
  fi
done
