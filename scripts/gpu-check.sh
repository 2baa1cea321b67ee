#!/usr/bin/env bash
# The GPU checks of issue 7, in one command on a GPU machine (no Rust needed there).
#
# Build here:  make gpu-bundle   (target/gpu/tierzero and target/gpu/tests, stripped)
# Run there:   bash scripts/gpu-check.sh target/gpu/tierzero OUT_DIR
#
# It links NCCL where the binary looks for it, puts torch's lib/ on LD_LIBRARY_PATH, and
# runs: the CUDA tests (tests/cuda.rs: copies, a lane on its torch pool stream ordered
# against compute by events, NCCL on device memory, NCCL communicators through the store
# sharing the collectives stream), bench gpu, bench h2d, the tiny Llama on CPU and on CUDA (stage 3;
# params and optimizer on cpu, then on nvme) with a loss comparison, with two GPUs the
# tiny Llama over 2 torchrun processes on NCCL against 2 ranks of one process, the 1B Llama (tokens/s, MFU,
# peak GPU memory), and bench memory on the GPU. Every result lands in OUT_DIR.
# Each training run on a GPU is printed beside the simulated step of the same config on
# PROFILE (default: h200 on an H200, else h100-pcie5): the first run on a GPU calibrates
# the profile.
# With PARTS=disk it also measures that machine's disk for the NVMe tier (bench nvme,
# bench swap), which issue 3's targets need; with PARTS=profile it writes the machine's
# profile as `bench profile` measures it on the GPU (OUT_DIR/profile-measured.json) and
# prices llama-1b on it beside the h200-vm profile.
# PARTS="tests bench tiny big memory sanitizer" (the default) picks parts, so a run that would
# exceed one command's time limit can be split over several calls. Each run is stopped
# after RUN_TIMEOUT seconds (default 300): one hung run costs its own time, not the rest.
set -uo pipefail
PARTS=${PARTS:-tests bench tiny big memory sanitizer}
part() { [[ " $PARTS " == *" $1 "* ]]; }
BIN=$(realpath "${1:?usage: gpu-check.sh BINARY OUT_DIR}")
OUT=$(realpath -m "${2:?usage: gpu-check.sh BINARY OUT_DIR}")
mkdir -p "$OUT"
# configs/ and profiles/ are read from the repository's root, wherever this was started
cd "$(dirname "$(realpath "$0")")/.."
PY=${PYTHON:-python3}
TORCH=$($PY -c "import torch, os; print(os.path.dirname(torch.__file__))")
export LD_LIBRARY_PATH="$TORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$(dirname "$BIN")/nccl"
ln -sf "$TORCH/../nvidia/nccl/lib/libnccl.so.2" "$(dirname "$BIN")/nccl/libnccl.so"
export RUST_LOG=${RUST_LOG:-warn}
WORK=${WORK:-/tmp/tierzero-gpu-check}
rm -rf "$WORK" && mkdir -p "$WORK"
# The acceptance thresholds: each breach is a line in $OUT/breaches.txt, and the script
# exits 1 when there is any.
: >"$OUT/breaches.txt"
breach() { echo "   BREACH: $*" | tee -a "$OUT/summary.txt" >>"$OUT/breaches.txt"; }
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
run() { # name, command...
  local name=$1; shift
  log "$name: $*"
  local t0=$(date +%s%N)
  # through bash -c, so that the exported functions below (tiny, big) can be timed out too
  timeout -k 5 "${RUN_TIMEOUT:-300}" bash -c '"$@"' _ "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"; local rc=$?
  [ $rc -eq 124 ] && echo "   stopped after RUN_TIMEOUT=${RUN_TIMEOUT:-300} s" | tee -a "$OUT/summary.txt"
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "   rc=$rc, $((ms / 1000)).$(printf %03d $((ms % 1000))) s" | tee -a "$OUT/summary.txt"
  tail -n 30 "$OUT/$name.out" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || tail -n 15 "$OUT/$name.err" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || breach "$name exited $rc"
  return 0
}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "torch sees no GPU on this machine: nothing to check" | tee "$OUT/summary.txt"
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt" 2>&1
$PY -c "import torch; print(torch.__version__, torch.cuda.is_available())" >>"$OUT/nvidia-smi.txt" 2>&1
TESTS="$(dirname "$BIN")/tests"
if part tests && [ -x "$TESTS" ]; then
  mkdir -p "$(dirname "$TESTS")/nccl"
  run cuda-tests "$TESTS" cuda:: --ignored --test-threads 1 --nocapture
  # the same with checked lanes: random delays on every lane job, NaN-poisoned pools
  run cuda-tests-checked env TIERZERO_CHECKED_LANES=1 "$TESTS" cuda:: --ignored --test-threads 1 --nocapture
fi
if part bench; then
  run bench-gpu "$BIN" bench gpu
  run bench-h2d "$BIN" bench h2d --size-mb 256
  # the host adds of a block's gradient against memcpy on this machine's cores (whether
  # the reduce lane's add, 31.9 GB/s in an H200 trace, is memory-bound there)
  run bench-unit "$BIN" bench unit --config configs/llama-1b-1gpu-cpu.json --set train.accelerator=cpu \
    --set train_micro_batch_size_per_gpu=1 --set data.seq_len=128
fi

tiny() { # name, accelerator, param tier, optimizer tier, more train arguments
  "$BIN" train --config configs/default.json --devices 1 \
    --set train.accelerator="$2" --set train.steps=40 --set train.output_dir="$WORK/$1" \
    --set bf16.enabled=true --set zero_optimization.stage=3 \
    --set zero_optimization.offload_param.device="$3" \
    --set zero_optimization.offload_param.nvme_path="$WORK/$1/nvme-param" \
    --set zero_optimization.offload_param.max_in_cpu=0 \
    --set zero_optimization.offload_optimizer.device="$4" \
    --set zero_optimization.offload_optimizer.nvme_path="$WORK/$1/nvme-opt" "${@:5}"
}
export BIN WORK
export -f tiny
compare() { # reference run, run compared with it (names under $WORK), tolerance (default 2e-2)
  local tolerance=${3:-2e-2}
  $PY - "$WORK/$1/metrics.jsonl" "$WORK/$2/metrics.jsonl" "$1" "$2" "$tolerance" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, sys
try:
    a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
    b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
except OSError as e:
    sys.exit(f"   no losses to compare: {e}")
tolerance = float(sys.argv[5])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if len(a) == len(b) and a else float("inf")
ok = worst == 0 if tolerance == 0 else worst < tolerance
print(f"   {len(a)} steps: {sys.argv[3]} {a[0]:.4f} -> {a[-1]:.4f}, {sys.argv[4]} {b[0]:.4f} -> {b[-1]:.4f}, max relative loss difference {worst:.2e} ({'within' if ok else 'OUTSIDE'} tolerance {sys.argv[5]})")
sys.exit(0 if ok else 1)
PYEOF
  [ "${PIPESTATUS[0]}" -eq 0 ] || breach "losses of $2 against $1 outside $tolerance"
}
# the lent H200 machine has a profile measured on it; elsewhere public figures
PROFILE=${PROFILE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && echo profiles/h200-vm.json || echo h100-pcie5)}
# the step against the simulated one, PCIe bytes and the device peak against the plan
# (GAP, default 0.3: relative; the tiny model's steps are all launch overhead, which the
# profiles do not model, so its runs print the comparison without thresholds)
predict() { # run name (under $WORK), thresholds (1 or 0), then the run's train arguments
  local name=$1 strict=$2; shift 2
  "$BIN" plan "$@" --simulate "$PROFILE" --json >"$WORK/$name/simulated.json" 2>/dev/null
  $PY - "$WORK/$name" "$PROFILE" "$strict" "${GAP:-0.3}" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, sys
work, profile, strict, gap = sys.argv[1], sys.argv[2], sys.argv[3] == "1", float(sys.argv[4])
try:
    sim = json.load(open(work + "/simulated.json"))
    steps = [json.loads(l) for l in open(work + "/metrics.jsonl")][2:]
    summary = json.load(open(work + "/summary.json"))
except (OSError, ValueError) as e:
    sys.exit(f"   nothing to compare: {e}")
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")
real = med([s["step_seconds"] for s in steps])
print(f"   simulated on {profile}: step {sim['step_s']:.4f} s, measured {real:.4f} s (prediction {sim['step_s'] / real - 1:+.0%})")
for phase in ("forward", "backward", "all_gather", "reduce", "h2d", "d2h", "nvme_read", "nvme_write", "optimizer"):
    r = med([s["breakdown"]["seconds"].get(phase, 0.0) for s in steps])
    p = sim["phases"].get(phase, 0.0)
    print(f"     {phase:<11} {p:.4f} s simulated, {r:.4f} s measured")
breaches = []
moved = summary["breakdown"]["bytes"]
simulated = sim["phase_bytes"]
for what in ("h2d", "d2h"):
    m, p = moved.get(what, 0), simulated.get(what, 0)
    print(f"     {what} bytes   {p / 1e9:.3f} GB simulated, {m / 1e9:.3f} GB measured")
    if strict and m > 1.1 * p + 1e6:
        breaches.append(f"{what} bytes {m / 1e9:.3f} GB over 1.1 × the simulated {p / 1e9:.3f} GB")
peak = max((g["peak_allocated"] for g in summary.get("gpu_memory") or []), default=0)
plan = summary["device_bytes_predicted"]["total"]
print(f"     device peak {peak / 2**30:.2f} GiB allocated by torch, plan {plan / 2**30:.2f} GiB")
if strict:
    if abs(sim["step_s"] / real - 1) > gap:
        breaches.append(f"step {real:.4f} s measured against {sim['step_s']:.4f} s simulated: outside ±{gap:.0%}")
    if peak > 1.1 * plan:
        breaches.append(f"device peak {peak / 2**30:.2f} GiB over 1.1 × the plan's {plan / 2**30:.2f} GiB")
for b in breaches:
    print(f"   BREACH: {b}")
sys.exit(1 if breaches else 0)
PYEOF
  [ "${PIPESTATUS[0]}" -eq 0 ] || breach "$name against its plan and simulated step (above)"
}
# "none none": parameters, gathers, gradient buckets and AdamW on the GPU
part tiny && for tiers in "none none" "none cpu" "cpu cpu" "nvme nvme"; do
  set -- $tiers
  run "tiny-$1-cpu" tiny "tiny-$1-cpu" cpu "$1" "$2"
  run "tiny-$1-cuda" tiny "tiny-$1-cuda" cuda "$1" "$2"
  predict "tiny-$1-cuda" 0 --config configs/default.json --devices 1 --set train.accelerator=cuda \
    --set bf16.enabled=true --set zero_optimization.stage=3 \
    --set zero_optimization.offload_param.device="$1" --set zero_optimization.offload_optimizer.device="$2" \
    --set zero_optimization.offload_param.nvme_path="$WORK/tiny-$1-cuda/nvme-param" \
    --set zero_optimization.offload_optimizer.nvme_path="$WORK/tiny-$1-cuda/nvme-opt"
  compare "tiny-$1-cpu" "tiny-$1-cuda"
done
# stages 0–2 (stage 3 above), the optimizer on the host at stages 1–2 (parameter offload
# is stage 3's, optimizer offload stages 1–3's, as in DeepSpeed)
part tiny && for stage in 0 1 2; do
  opt=$([ $stage = 0 ] && echo none || echo cpu)
  run "tiny-stage$stage-cpu" tiny "tiny-stage$stage-cpu" cpu none $opt --set zero_optimization.stage=$stage
  run "tiny-stage$stage-cuda" tiny "tiny-stage$stage-cuda" cuda none $opt --set zero_optimization.stage=$stage
  compare "tiny-stage$stage-cpu" "tiny-stage$stage-cuda"
done
# checked lanes on the GPU (random delays on every lane job, also queued on the device;
# NaN-poisoned pools): a missing wait shows as a different loss, so the losses must be
# the unchecked run's bit for bit
if part tiny; then
  run tiny-cpu-cuda-checked env TIERZERO_CHECKED_LANES=1 bash -c 'tiny "$@"' _ tiny-cpu-cuda-checked cuda cpu cpu
  compare tiny-cpu-cuda tiny-cpu-cuda-checked 0
fi
# gradient accumulation: on the GPU "auto" keeps the sums on the device (flushed through
# pinned memory once per step) and every unit gathered for the step; on the CPU neither
if part tiny; then
  for tiers in "cpu cpu" "nvme nvme"; do
    set -- $tiers
    run "tiny-accum-$1-cpu" tiny "tiny-accum-$1-cpu" cpu "$1" "$2" --set gradient_accumulation_steps=4
    run "tiny-accum-$1-cuda" tiny "tiny-accum-$1-cuda" cuda "$1" "$2" --set gradient_accumulation_steps=4
    compare "tiny-accum-$1-cpu" "tiny-accum-$1-cuda"
  done
fi

# NCCL in training: with two or more GPUs, torchrun starts 2 processes × 1 GPU whose
# communicators join through the agent's TCPStore, and one process's 2 CUDA ranks join
# theirs through a loopback store; both against 2 CPU ranks (tests/cuda.rs covers the
# one-GPU join)
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if part tiny && [ "$GPUS" -ge 2 ]; then
  run tiny-nccl-2proc $PY -m torch.distributed.run --nproc_per_node 2 --no-python "$BIN" train \
    --config configs/default.json --devices 1 --set train.accelerator=cuda --set train.steps=40 \
    --set bf16.enabled=true --set zero_optimization.stage=3 --set train.output_dir="$WORK/tiny-nccl-2proc"
  run tiny-threads-2 "$BIN" train --config configs/default.json --devices 2 --set train.accelerator=cuda \
    --set train.steps=40 --set bf16.enabled=true --set zero_optimization.stage=3 \
    --set train.output_dir="$WORK/tiny-threads-2"
  compare tiny-threads-2 tiny-nccl-2proc
  run tiny-cpu-threads-2 "$BIN" train --config configs/default.json --devices 2 \
    --set train.steps=40 --set bf16.enabled=true --set zero_optimization.stage=3 \
    --set train.output_dir="$WORK/tiny-cpu-threads-2"
  compare tiny-cpu-threads-2 tiny-threads-2
fi

big() { # name, config, more train arguments
  "$BIN" train --config "$2" --trace --no-save --set data.path=null --set data.synthetic=markov \
    --set train.steps="${STEPS_1B:-6}" --set gradient_accumulation_steps=1 \
    --set scheduler.params.warmup_num_steps=2 \
    --set train.output_dir="$WORK/$1" --set train.save_interval=0 \
    --set zero_optimization.offload_param.nvme_path="$WORK/$1/nvme" \
    --set zero_optimization.offload_optimizer.nvme_path="$WORK/$1/nvme" "${@:3}"
}
export -f big
# BIG="cpu nvme" (the default) picks the 1B configs' tiers; "none" is the cpu config with
# nothing offloaded (parameters, gradients and optimizer state on the GPU), "ddp" the same
# at stage 0, "ratio" the cpu config with offload_optimizer.ratio=auto (the state, and the
# shards of the units kept gathered, where the GPU has room)
if part big; then
  for tier in ${BIG:-cpu nvme}; do
    config="configs/llama-1b-1gpu-$tier.json" sets=()
    nothing=(--set zero_optimization.offload_param.device=none --set zero_optimization.offload_optimizer.device=none)
    case $tier in
      none) config=configs/llama-1b-1gpu-cpu.json sets=("${nothing[@]}") ;;
      ddp) config=configs/llama-1b-1gpu-cpu.json sets=("${nothing[@]}" --set zero_optimization.stage=0) ;;
      ratio) config=configs/llama-1b-1gpu-cpu.json sets=(--set zero_optimization.offload_optimizer.ratio=auto) ;;
    esac
    # BIG_SETS: more `--set key=value` words for every 1B run (e.g. the config's own
    # gradient_accumulation_steps instead of 1)
    [ -n "${BIG_SETS:-}" ] && sets+=($BIG_SETS)
    # (${sets[@]+...}: an empty array under set -u, for bash before 4.4 too)
    run "llama-1b-$tier" big "llama-1b-$tier" "$config" ${sets[@]+"${sets[@]}"}
    predict "llama-1b-$tier" 1 --config "$config" --set gradient_accumulation_steps=1 ${sets[@]+"${sets[@]}"}
    cp "$WORK/llama-1b-$tier/summary.json" "$OUT/llama-1b-$tier-summary.json" 2>/dev/null
  done
fi
# compute-sanitizer's memcheck over a few steps of the tiny Llama (host and device tiers,
# pinned staging, NCCL), torch's caching allocator off so that every device buffer is
# its own allocation
if part sanitizer && command -v compute-sanitizer >/dev/null; then
  run sanitizer-memcheck env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
    --leak-check no --error-exitcode 3 "$BIN" train --config configs/default.json --devices 1 \
    --set train.accelerator=cuda --set train.steps=3 --set bf16.enabled=true \
    --set zero_optimization.stage=3 --set zero_optimization.offload_param.device=cpu \
    --set zero_optimization.offload_optimizer.device=cpu --set train.output_dir="$WORK/sanitizer"
fi
part memory && run bench-memory "$BIN" bench memory --config configs/default.json --devices 1 --stages 0,3 \
  --set train.output_dir="$WORK/memory" --set zero_optimization.offload_optimizer.nvme_path="$WORK/memory/nvme"
if part profile; then
  # a 2 GiB disk pass, the CPU AdamW and llama-1b's compute: more than one run's usual bound
  RUN_TIMEOUT=${PROFILE_TIMEOUT:-600} run bench-profile "$BIN" bench profile \
    --config configs/llama-1b-1gpu-cpu.json --set gradient_accumulation_steps=1 \
    --dir "$WORK/profile-nvme" --out "$OUT/profile-measured.json" --name measured-here
  for p in "$OUT/profile-measured.json" profiles/h200-vm.json; do
    [ -s "$p" ] || continue
    log "llama-1b cpu/cpu, accumulation 1, on $p: $("$BIN" plan --config configs/llama-1b-1gpu-cpu.json \
      --set gradient_accumulation_steps=1 --simulate "$p" --json 2>/dev/null | $PY -c 'import json,sys; print(round(json.load(sys.stdin)["step_s"], 4), "s")')"
  done
fi
if part disk; then
  run bench-nvme "$BIN" bench nvme --dir "$WORK/nvme-bench"
  run bench-swap "$BIN" bench swap --dir "$WORK/swap-bench" --params 100000000 --sub-group-size 10000000
fi
if [ -s "$OUT/breaches.txt" ]; then
  log "done: $(wc -l <"$OUT/breaches.txt") breaches ($OUT/breaches.txt)"
  exit 1
fi
log "done: no breaches"
