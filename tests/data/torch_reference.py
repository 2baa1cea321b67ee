"""An independent training reference for tests/torch_reference.rs, in plain PyTorch.

Usage: .venv/bin/python tests/data/torch_reference.py DIR

DIR holds what the Rust test wrote: `ds_config.json` (the DeepSpeed config tierzero
trained with), `model/` (the initial weights as a Hugging Face directory: config.json +
model.safetensors, fp32) and `batches.bin` (int64 inputs then targets, shaped
[steps, micro-batches, rows, seq_len] as `batches.json` says). It writes `losses.json`
(per step: mean loss, learning rate, loss scale, skipped) and `final/model.safetensors`
(the fp32 master weights after the last step).

Nothing here comes from tierzero: the Llama forward is Hugging Face's LlamaForCausalLM
written out (RMSNorm with fp32 statistics, RoPE, grouped-query attention with an fp32
softmax, SwiGLU), AdamW is torch.optim.AdamW, clipping is torch's
clip_grad_norm_ formula, and the schedule and fp16 loss scaling follow DeepSpeed
0.19.8 as its engine runs them (a scheduler starts at iteration -1 and steps after each
applied update; DynamicLossScaler with hysteresis).
"""
import json
import math
import os
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = bytearray(data[8 + n :])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        t = torch.frombuffer(body[a:b], dtype=DTYPES[entry["dtype"]]).clone()
        out[name] = t.view(entry["shape"]).float()
    return out


def write_safetensors(path, tensors):
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.detach().float().contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


class Llama:
    """LlamaForCausalLM on `params` (name -> tensor, already in the compute dtype)."""

    def __init__(self, config, params):
        self.c = config
        self.p = params

    def rms_norm(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])
        return w * xf.to(x.dtype)

    def rope(self, seq, head_dim, dtype):
        theta = self.c.get("rope_theta", 10000.0)
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        t = torch.arange(seq, dtype=torch.float64)
        freqs = torch.outer(t, inv).float()
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def hidden(self, tokens, dtype):
        c, p = self.c, self.p
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c["hidden_size"] // heads
        b, t = tokens.shape
        x = p["model.embed_tokens.weight"][tokens]
        cos, sin = self.rope(t, hd, dtype)
        mask = torch.full((t, t), float("-inf")).triu(1)
        for layer in range(c["num_hidden_layers"]):
            w = lambda n: p[f"model.layers.{layer}.{n}"]
            h = self.rms_norm(x, w("input_layernorm.weight"))
            q = (h @ w("self_attn.q_proj.weight").T).view(b, t, heads, hd).transpose(1, 2)
            k = (h @ w("self_attn.k_proj.weight").T).view(b, t, kv, hd).transpose(1, 2)
            v = (h @ w("self_attn.v_proj.weight").T).view(b, t, kv, hd).transpose(1, 2)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
            k = k.repeat_interleave(heads // kv, dim=1)
            v = v.repeat_interleave(heads // kv, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd) + mask.to(dtype)
            attn = torch.softmax(scores.float(), -1).to(dtype) @ v
            x = x + attn.transpose(1, 2).reshape(b, t, heads * hd) @ w("self_attn.o_proj.weight").T
            h = self.rms_norm(x, w("post_attention_layernorm.weight"))
            gate = torch.nn.functional.silu(h @ w("mlp.gate_proj.weight").T)
            x = x + (gate * (h @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
        return self.rms_norm(x, p["model.norm.weight"])

    def loss(self, tokens, targets, dtype):
        h, p = self.hidden(tokens, dtype), self.p
        head = p["model.embed_tokens.weight"] if self.c.get("tie_word_embeddings") else p["lm_head.weight"]
        logits = h.float() @ head.float().T
        return torch.nn.functional.cross_entropy(
            logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1
        )


def schedule(ds, applied):
    """The rate of the `applied`-th applied optimizer step: DeepSpeed's scheduler at
    iteration applied - 1 (its state before the first scheduler.step())."""
    lr = ds["optimizer"]["params"]["lr"]
    sched = ds.get("scheduler")
    if sched is None:
        return lr
    kind, sp = sched["type"], sched["params"]
    it = applied - 1
    warmup = max(2, sp.get("warmup_num_steps", 1000))
    log = sp.get("warmup_type", "log") == "log"

    def gamma():
        return math.log(it + 1) / math.log(warmup) if log else it / warmup

    if kind == "WarmupLR":
        lo, hi = sp.get("warmup_min_lr", 0.0), sp.get("warmup_max_lr", lr)
        return lo if it < 0 else lo + (hi - lo) * (gamma() if it < warmup else 1.0)
    if kind == "WarmupCosineLR":
        if it < 0:
            return 0.0
        lo = sp.get("warmup_min_ratio", 0.0)
        floor = sp.get("cos_min_ratio", 0.0001)
        if it < warmup:
            return lr * (lo + gamma() * (1 - lo))
        progress = min(1.0, (it - warmup + 1) / max(1, sp["total_num_steps"] - warmup))
        return lr * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    sys.exit(f"torch_reference.py does not know scheduler {kind}")


class LossScaler:
    """DeepSpeed's DynamicLossScaler (consecutive_hysteresis false)."""

    def __init__(self, fp16):
        self.scale = 2.0 ** fp16.get("initial_scale_power", 16)
        self.window = fp16.get("loss_scale_window", 1000)
        self.hysteresis = self.cur_hysteresis = fp16.get("hysteresis", 2)
        self.min_scale = fp16.get("min_loss_scale", 1)
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow):
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.cur_hysteresis = self.hysteresis
            self.scale *= 2
        self.iteration += 1


def main():
    d = sys.argv[1]
    with open(f"{d}/ds_config.json") as f:
        ds = json.load(f)
    with open(f"{d}/model/config.json") as f:
        config = json.load(f)
    with open(f"{d}/batches.json") as f:
        shape = json.load(f)["shape"]
    with open(f"{d}/batches.bin", "rb") as f:
        raw = torch.frombuffer(bytearray(f.read()), dtype=torch.int64)
    inputs, targets = raw.view(2, *shape)
    steps, micro = shape[0], shape[1]
    gas = ds.get("gradient_accumulation_steps", 1)
    world = micro // gas

    master = read_safetensors(f"{d}/model/model.safetensors")
    names = list(master)
    fp16 = ds.get("fp16", {}).get("enabled", False)
    bf16 = ds.get("bf16", {}).get("enabled", False)
    dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    scaler = LossScaler(ds["fp16"]) if fp16 else None
    params = [torch.nn.Parameter(master[n].clone()) for n in names]
    op = ds["optimizer"]["params"]
    adam = torch.optim.AdamW(
        params,
        lr=op["lr"],
        betas=tuple(op.get("betas", (0.9, 0.999))),
        eps=op.get("eps", 1e-8),
        weight_decay=op.get("weight_decay", 0.01),
    )
    clip = ds.get("gradient_clipping", 0.0)
    applied, records = 0, []
    for step in range(steps):
        # the model computes in the training precision from the masters' current values
        low = {n: p.detach().to(dtype).requires_grad_(True) for n, p in zip(names, params)}
        model = Llama(config, low)
        scale = scaler.scale if scaler else 1.0
        acc = [torch.zeros_like(p) for p in params]
        losses = []
        for m in range(micro):
            loss = model.loss(inputs[step, m], targets[step, m], dtype)
            losses.append(loss.item())
            # DeepSpeed divides each micro-batch's loss by the accumulation steps before
            # backward (the 16-bit gradients carry scale / gas) and averages over ranks
            # as it reduces
            (loss * (scale / gas)).backward()
            for a, n in zip(acc, names):
                a += low[n].grad.float() / world
                low[n].grad = None
        overflow = not all(torch.isfinite(a).all() for a in acc)
        lr = schedule(ds, applied)
        if not overflow:
            for p, a in zip(params, acc):
                p.grad = a / scale
            if clip > 0:
                norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
                coef = clip / (norm + 1e-6)
                if coef < 1:
                    for p in params:
                        p.grad.mul_(coef)
            for g in adam.param_groups:
                g["lr"] = lr
            adam.step()
            applied += 1
        records.append({"loss": sum(losses) / len(losses), "lr": lr, "loss_scale": scale, "skipped": overflow})
        if scaler:
            scaler.update(overflow)

    os.makedirs(f"{d}/final", exist_ok=True)
    write_safetensors(f"{d}/final/model.safetensors", dict(zip(names, params)))
    with open(f"{d}/losses.json", "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
