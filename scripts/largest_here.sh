#!/usr/bin/env bash
# The largest model this machine trains (issue "Fill every tier"): `plan --largest` finds
# the most layers of Llama-8B's shape whose plan fits this machine's free host memory
# and the free space under runs/ (parameters in host memory then NVMe, optimizer state
# on NVMe, seq 128, bf16), then that model trains 2 steps and saves its final checkpoint
# (the NVMe swap files taken into it as they are), and `inspect --verify` reads it back.
# Prints plan's host row beside the measured peak resident set.
#
#   scripts/largest_here.sh            (needs ~60 GB free beside the repository)
#
# KEEP=1 keeps the checkpoint (it takes the disk the swap files took).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bin=target/release/tierzero
config=configs/largest-here.json
work=runs/largest-here
[ -x "$bin" ] || cargo build --release
rm -rf "$work"
mkdir -p "$work"
"$bin" plan --config "$config" --largest | tee "$work/largest.txt"
layers=$(sed -n 's/^  tierzero  *\([0-9][0-9]*\) layers.*/\1/p' "$work/largest.txt")
[ -n "$layers" ] || { echo "plan --largest placed no model" >&2; exit 1; }
"$bin" plan --config "$config" --set "model.num_hidden_layers=$layers" | tee "$work/plan.txt"
/usr/bin/time -v "$bin" train --config "$config" --set "model.num_hidden_layers=$layers" 2>&1 | tee "$work/train.log"
"$bin" inspect --verify "$work/checkpoints/$(cat "$work/checkpoints/latest")" | tee "$work/verify.txt"
echo
echo "layers $layers: $(grep -m1 '^  parameters ' "$work/plan.txt" | sed 's/^  parameters *//')"
grep -E '^  host memory per process' "$work/plan.txt"
grep -E '^host: peak resident' "$work/train.log"
echo "checkpoint on disk: $(du -sh "$work/checkpoints/$(cat "$work/checkpoints/latest")" | cut -f1)"
[ "${KEEP:-0}" = 1 ] || rm -rf "$work/checkpoints"
