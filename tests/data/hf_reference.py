"""Expected logits for tests/hf_reference.rs, computed by Hugging Face transformers.

Usage (from the repository root, after `make build`; transformers 5 lives in DeepSpeed's
virtualenv, see README "tierzero beside DeepSpeed"):
    .dsvenv/bin/python tests/data/hf_reference.py tests/data/hf_reference.json

Each case starts from tierzero's seeded initial weights exported with `tierzero export
--config configs/default.json --set ... --hf DIR --dtype fp32`; transformers loads the
directory (no missing or unexpected keys allowed), then every norm scale and every bias
is overwritten by `perturbed()` — initial weights have scales 1 and biases 0, so code
that ignored or misnamed them would still match — and transformers' own
LlamaForCausalLM / GPT2LMHeadModel computes the logits. The Rust test applies the same
formula to the same parameters by name.

The `llama3-*` cases add Llama-3 RoPE scaling with `original_max_position_embeddings` 8,
so the batch's 16 positions run past it, in both config forms: `rope_parameters` as
transformers 5 writes it (`config_json` is the file save_pretrained wrote) and the
top-level `rope_theta` + `rope_scaling` of transformers 4 (written by hand).
"""
import json
import math
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}

MODELS = {
    "llama-untied": (["model.preset=llama-tiny", "model.tie_word_embeddings=false"], None),
    "llama-tied": (["model.preset=llama-tiny", "model.tie_word_embeddings=true"], None),
    "gpt2": (["model.preset=gpt2-tiny"], None),
    "llama3-rope-parameters": (["model.preset=llama-tiny"], "new"),
    "llama3-rope-scaling": (["model.preset=llama-tiny"], "old"),
}


def perturbed(name, numel):
    """Norm scales around 1 and biases around 0, different per tensor and element."""
    seed = (sum(name.encode()) % 101) * 0.1
    wave = [math.sin(0.37 * j + seed) for j in range(numel)]
    if name.endswith(".bias"):
        return [0.1 * w for w in wave]
    return [1.0 + 0.5 * w for w in wave]


def is_perturbed(name):
    return name.endswith(".bias") or "norm" in name or ".ln_" in name


def load_perturbed(directory, name):
    """transformers' model of an exported directory (no missing or unexpected keys
    allowed), with every norm scale and bias perturbed."""
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:
        sys.exit(f"{name}: transformers loading tierzero's export reports {problems}")
    model.eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if is_perturbed(param_name):
                p.copy_(torch.tensor(perturbed(param_name, p.numel()), dtype=torch.float64).view(p.shape))
    return model


def batch(vocab):
    tokens = [(i * 7 + 3) % vocab for i in range(32)]
    targets = [(i * 5 + 1) % vocab for i in range(32)]
    return torch.tensor(tokens).view(2, 16), torch.tensor(targets).view(2, 16)


def add_rope(directory, form):
    path = f"{directory}/config.json"
    with open(path) as f:
        config = json.load(f)
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        config.pop(key, None)
    if form == "old":
        config["rope_theta"] = 10000.0
        config["rope_scaling"] = dict(LLAMA3_SCALING)
    else:
        config["rope_parameters"] = dict(LLAMA3_SCALING, rope_theta=10000.0)
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def main():
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (sets, rope) in MODELS.items():
            d = f"{tmp}/{name}"
            args = ["target/release/tierzero", "export", "--config", "configs/default.json", "--hf", d, "--dtype", "fp32"]
            for s in sets:
                args += ["--set", s]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            if rope:
                add_rope(d, rope)
            model = load_perturbed(d, name)
            saved = f"{tmp}/{name}-saved"
            model.save_pretrained(saved)
            with safe_open(f"{saved}/model.safetensors", "pt") as f:
                keys = sorted(f.keys())
            # the old form as written by hand; the new one as transformers saves it
            with open(f"{d if rope == 'old' else saved}/config.json") as f:
                config_json = json.load(f)
            tokens, targets = batch(model.config.vocab_size)
            with torch.no_grad():
                logits = model(tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            case = {
                "sets": sets,
                "keys": keys,
                "logits_row0_pos0": logits[0, 0, :8].tolist(),
                "logits_row1_pos15": logits[1, 15, :8].tolist(),
                "loss": loss.item(),
            }
            if rope:
                case["config_json"] = config_json
            out[name] = case
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
