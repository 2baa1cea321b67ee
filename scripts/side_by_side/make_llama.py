"""Writes a randomly initialised Llama as a Hugging Face directory (safetensors, bf16).

    python make_llama.py OUT_DIR [--hidden 768 --intermediate 2048 --layers 12 --heads 12 --vocab 32000]

The model both trainers load in the side-by-side benchmark (README, "tierzero beside
DeepSpeed"). Norm scales are random too, so a loader that ignores them shows.
"""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--hidden", type=int, default=768)
p.add_argument("--intermediate", type=int, default=2048)
p.add_argument("--layers", type=int, default=12)
p.add_argument("--heads", type=int, default=12)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--seed", type=int, default=1)
a = p.parse_args()
torch.manual_seed(a.seed)
config = LlamaConfig(
    hidden_size=a.hidden,
    intermediate_size=a.intermediate,
    num_hidden_layers=a.layers,
    num_attention_heads=a.heads,
    num_key_value_heads=a.heads,
    vocab_size=a.vocab,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
model = LlamaForCausalLM(config)
with torch.no_grad():
    for name, p_ in model.named_parameters():
        if name.endswith("norm.weight"):
            p_.uniform_(0.5, 1.5)
model.to(torch.bfloat16).save_pretrained(a.out)
print(f"{a.out}: {sum(p_.numel() for p_ in model.parameters())} parameters")
