"""Greedy continuations for tests/generate.rs, computed by transformers' `generate`.

Usage (from the repository root, after `make build`; needs torch and transformers):
    python tests/data/generate_reference.py tests/data/generate_reference.json

The models are those of hf_reference.py (tierzero's seeded initial weights exported
with `tierzero export --config configs/default.json --hf DIR --dtype fp32`, every norm
scale and bias perturbed by the same formula); each continues the same prompt by 24
greedy tokens with its KV cache, no end-of-sequence token stopping it.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_reference import load_perturbed  # noqa: E402

MODELS = {
    "llama-untied": ["model.preset=llama-tiny", "model.tie_word_embeddings=false"],
    "llama-tied": ["model.preset=llama-tiny", "model.tie_word_embeddings=true"],
    "gpt2": ["model.preset=gpt2-tiny"],
}
PROMPT = [3, 10, 17, 24, 31, 38]
NEW = 24


def main():
    out = {"prompt": PROMPT}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in MODELS.items():
            d = f"{tmp}/{name}"
            args = ["target/release/tierzero", "export", "--config", "configs/default.json", "--hf", d, "--dtype", "fp32"]
            for s in sets:
                args += ["--set", s]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            model = load_perturbed(d, name)
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            with torch.no_grad():
                ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)
            out[name] = {"sets": sets, "greedy": ids[0, len(PROMPT):].tolist()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
