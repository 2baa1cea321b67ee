"""Llama-3 RoPE reference values computed by Hugging Face transformers.

Produces a JSON file with the rotary tables transformers builds for Llama-3.2-1B's real
rope settings (head_dim 64, rope_theta 500000, `llama3` scaling with factor 32,
low/high_freq_factor 1/4, original_max_position_embeddings 8192), so a Rust test can
check tierzero's `rope_tables` (src/model/blocks.rs) against them.

Usage (from the repository root; transformers 4.x or 5.x must be importable, torch comes
from the project's virtualenv):
    PYTHONPATH=<dir with transformers> .venv/bin/python tests/data/rope_reference.py tests/data/rope_reference.json

Everything numeric comes from transformers itself:
  * `inv_freq`: `ROPE_INIT_FUNCTIONS["llama3"]` (= `_compute_llama3_parameters`) applied to
    the LlamaConfig. transformers computes it in float32 torch arithmetic (`torch.float`);
    the values are stored exactly, widened to float64 (`inv_freq_dtype` names the dtype).
  * `cos`, `sin`: `LlamaRotaryEmbedding.forward` with a float32 input at `positions`; each
    row has head_dim (64) values, the 32 frequencies twice (transformers' `cat(freqs, freqs)`
    layout). The angle `position * inv_freq` is rounded to float32 before cos/sin, so at
    large positions these differ from float64 math by up to about half an ulp of the angle;
    `max_abs_diff_vs_f64_angle` reports how far (per position) they are from cos/sin
    evaluated in float64 on the same float32 inv_freq.
  * `branch`: for each inv_freq index, which case of the llama3 rule applies, evaluated in
    this script with the same formula (float64): "low" (wavelen > low_freq_wavelen: divided
    by factor), "smooth" (interpolated), "high" (wavelen < high_freq_wavelen: kept as is).
    `inv_freq_unscaled` is plain 1/theta^(2i/d) for comparison.
"""
import json
import math
import sys

import torch
import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

HIDDEN_SIZE = 2048
NUM_HEADS = 32
ROPE_THETA = 500000.0
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
MAX_POSITIONS = 131072
POSITIONS = [0, 1, 7, 100, 4095, 8191, 16384, 131071]


def make_config():
    common = dict(
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=8,
        max_position_embeddings=MAX_POSITIONS,
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        return LlamaConfig(**common, rope_parameters={"rope_theta": ROPE_THETA, **ROPE_SCALING})
    return LlamaConfig(**common, rope_theta=ROPE_THETA, rope_scaling=dict(ROPE_SCALING))


def branch(k, dim):
    """The llama3 rule's case for inv_freq index k (float64, same formula as transformers)."""
    wavelen = 2 * math.pi / ROPE_THETA ** (-2 * k / dim)
    orig = ROPE_SCALING["original_max_position_embeddings"]
    if wavelen < orig / ROPE_SCALING["high_freq_factor"]:
        return "high"
    if wavelen > orig / ROPE_SCALING["low_freq_factor"]:
        return "low"
    return "smooth"


def main(out_path):
    config = make_config()
    head_dim = HIDDEN_SIZE // NUM_HEADS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert attention_factor == 1.0
    rotary = LlamaRotaryEmbedding(config)
    assert torch.equal(rotary.inv_freq, inv_freq)
    x = torch.zeros(1, len(POSITIONS), head_dim, dtype=torch.float32)
    position_ids = torch.tensor([POSITIONS], dtype=torch.int64)
    with torch.no_grad():
        cos, sin = rotary(x, position_ids)
    cos, sin = cos[0], sin[0]
    assert cos.dtype == torch.float32 and cos.shape == (len(POSITIONS), head_dim)

    inv64 = inv_freq.to(torch.float64)
    angles64 = torch.tensor(POSITIONS, dtype=torch.float64)[:, None] * inv64
    angles64 = torch.cat((angles64, angles64), dim=-1)
    max_diff = torch.maximum(
        (cos.double() - angles64.cos()).abs().amax(dim=-1),
        (sin.double() - angles64.sin()).abs().amax(dim=-1),
    )

    branches = [branch(k, head_dim) for k in range(head_dim // 2)]
    counts = {b: branches.count(b) for b in ("high", "smooth", "low")}
    assert all(counts.values()), counts

    out = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "config": {
            "hidden_size": HIDDEN_SIZE,
            "num_attention_heads": NUM_HEADS,
            "head_dim": head_dim,
            "rope_theta": ROPE_THETA,
            "rope_scaling": ROPE_SCALING,
            "max_position_embeddings": MAX_POSITIONS,
        },
        "inv_freq_dtype": str(inv_freq.dtype).replace("torch.", ""),
        "inv_freq": inv64.tolist(),
        "inv_freq_unscaled": [ROPE_THETA ** (-i / head_dim) for i in range(0, head_dim, 2)],
        "branch": branches,
        "branch_counts": counts,
        "cos_sin_dtype": str(cos.dtype).replace("torch.", ""),
        "positions": POSITIONS,
        "cos": cos.double().tolist(),
        "sin": sin.double().tolist(),
        "max_abs_diff_vs_f64_angle": max_diff.tolist(),
    }
    with open(out_path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
