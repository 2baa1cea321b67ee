"""Expected logits for tests/hf_reference.rs, computed by Hugging Face transformers.

Usage (from the repository root, after `make build`):
    for m in llama-untied llama-tied gpt2; do ...  # see export_models() below
    .venv/bin/python tests/data/hf_reference.py > tests/data/hf_reference.json

The models are tierzero's seeded initial weights exported with `tierzero export
--config configs/default.json --set model.preset=... --hf DIR --dtype fp32`, so the
numbers below come from transformers' own LlamaForCausalLM / GPT2LMHeadModel code run on
the same weights: an implementation independent of tierzero's blocks.
"""
import json
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

MODELS = {
    "llama-untied": ["model.preset=llama-tiny", "model.tie_word_embeddings=false"],
    "llama-tied": ["model.preset=llama-tiny", "model.tie_word_embeddings=true"],
    "gpt2": ["model.preset=gpt2-tiny"],
}


def batch(vocab):
    tokens = [(i * 7 + 3) % vocab for i in range(32)]
    targets = [(i * 5 + 1) % vocab for i in range(32)]
    return torch.tensor(tokens).view(2, 16), torch.tensor(targets).view(2, 16)


def main():
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in MODELS.items():
            d = f"{tmp}/{name}"
            args = ["target/release/tierzero", "export", "--config", "configs/default.json", "--hf", d, "--dtype", "fp32"]
            for s in sets:
                args += ["--set", s]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
            model.eval()
            tokens, targets = batch(model.config.vocab_size)
            with torch.no_grad():
                logits = model(tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            out[name] = {
                "sets": sets,
                "logits_row0_pos0": logits[0, 0, :8].tolist(),
                "logits_row1_pos15": logits[1, 15, :8].tolist(),
                "loss": loss.item(),
            }
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
