"""Logits, loss and greedy continuations of the Llama family's relatives for
tests/hf_reference.rs and tests/generate.rs, computed by transformers' own
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

Usage (from the repository root, after `make build`; needs torch and transformers 4.57):
    python tests/data/families_reference.py tests/data/families_reference.json

As hf_reference.py: tierzero's seeded initial weights of the `*-tiny` presets are
exported (`tierzero export --config configs/default.json --set model.preset=NAME --hf
DIR --dtype fp32`), transformers loads the directory (no missing or unexpected keys:
Qwen2's q/k/v biases and Qwen3's q/k norms are where transformers looks for them), every
norm scale and bias is perturbed by the same formula, and transformers computes the
logits and loss of the fixed batch and a 24-token greedy continuation of a prompt.
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_reference import batch, load_perturbed  # noqa: E402
from generate_reference import NEW, PROMPT  # noqa: E402

MODELS = ["mistral-tiny", "qwen2-tiny", "qwen3-tiny"]


def main():
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            d = f"{tmp}/{name}"
            sets = [f"model.preset={name}"]
            args = ["target/release/tierzero", "export", "--config", "configs/default.json", "--hf", d, "--dtype", "fp32"]
            for s in sets:
                args += ["--set", s]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            model = load_perturbed(d, name)
            with safe_open(f"{d}/model.safetensors", "pt") as f:
                keys = sorted(f.keys())
            tokens, targets = batch(model.config.vocab_size)
            with torch.no_grad():
                logits = model(tokens).logits
                model.generation_config.eos_token_id = None
                model.generation_config.pad_token_id = 0
                greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            out[name] = {
                "sets": sets,
                "model_type": model.config.model_type,
                "keys": keys,
                "logits_row0_pos0": logits[0, 0, :8].tolist(),
                "logits_row1_pos15": logits[1, 15, :8].tolist(),
                "loss": loss.item(),
                "greedy": greedy[0, len(PROMPT):].tolist(),
            }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
