"""The plain implementation of the whole model in torch: `reference.model.ref_forward` with
`dtype=float32, storage=float16`, op for op, on whichever device the weights live (a GPU for a large
model, where NumPy on the host would take minutes a prompt and a second float32 copy of the weights).

It is the graph rung's floor: its logits against the HF simulation's are the error a correct
implementation of the precision contract makes. Like ref_forward, and unlike the HF simulation, every
activation between ops and K/V is rounded to fp16, the residual stays fp32 and the lm_head reads the
fp16-rounded final norm; the arithmetic is float32 with TF32 off (reference/hf.py `model_device`). The
sums run in torch's order rather than NumPy's: a float32 difference, far under the fp16 rounding this
forward exists to measure (ladder/unit/test_gpu_references.py compares the two on two models).

Independent of engine/ and kernels/, like all of reference/: weights arrive as a dict of Hugging Face
names to float32 torch tensors (quantized linears already dequantized by the caller).
"""

from __future__ import annotations

import numpy as np


def plain_forward(config: dict, weights: dict, ids) -> np.ndarray:
    """float32 logits [T, V] of a full causal pass over `ids` at positions 0 .. T-1 (fp16 storage)."""
    import torch

    c = config
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c["hidden_size"] // nq
    group = nq // nkv
    theta = float(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    eps = float(c.get("rms_norm_eps", 1e-6))
    embed = weights["model.embed_tokens.weight"]
    dev = embed.device
    f32 = torch.float32

    def st(a):  # an activation stored in fp16 between ops, computed on in fp32
        return a.half().float()

    def rmsnorm(x, w):
        return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w

    def rope(x, cos, sin):  # x [T, heads, d], rotate-half (Qwen2's convention)
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * cos + rot * sin

    T = len(ids)
    with torch.no_grad():
        pos = torch.arange(T, device=dev, dtype=f32)
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=dev, dtype=f32) / d)
        ang = pos[:, None] * inv_freq[None, :]
        cos = torch.cat([torch.cos(ang)] * 2, dim=-1)[:, None, :]
        sin = torch.cat([torch.sin(ang)] * 2, dim=-1)[:, None, :]
        causal = torch.ones(T, T, device=dev, dtype=torch.bool).tril()
        x = embed[torch.as_tensor([int(t) for t in ids], device=dev)].to(f32)
        for layer in range(c["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            w = {k[len(p):]: v for k, v in weights.items() if k.startswith(p)}

            def lin(a, name, bias=True):
                y = a @ w[name + ".weight"].T
                return y + w[name + ".bias"] if bias else y

            h = st(rmsnorm(x, w["input_layernorm.weight"]))
            q = st(lin(h, "self_attn.q_proj")).view(T, nq, d)
            k = st(lin(h, "self_attn.k_proj")).view(T, nkv, d)
            v = st(lin(h, "self_attn.v_proj")).view(T, nkv, d)
            q, k = st(rope(q, cos, sin)), st(rope(k, cos, sin))
            kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [nq, T, d]: head h reads kv head h // group
            vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
            s = (q.transpose(0, 1) @ kk.transpose(1, 2)) / float(np.sqrt(d))  # [nq, T, T]
            s = s.masked_fill(~causal, float("-inf"))
            prob = torch.exp(s - s.max(dim=-1, keepdim=True).values)
            a = st(((prob / prob.sum(dim=-1, keepdim=True)) @ vv).transpose(0, 1).reshape(T, nq * d))
            x = x + lin(a, "self_attn.o_proj", bias=False)
            h = st(rmsnorm(x, w["post_attention_layernorm.weight"]))
            gate, up = lin(h, "mlp.gate_proj", bias=False), lin(h, "mlp.up_proj", bias=False)
            act = st(gate / (1.0 + torch.exp(-gate)) * up)
            x = x + lin(act, "mlp.down_proj", bias=False)
        x = st(rmsnorm(x, weights["model.norm.weight"]))
        head = embed if c.get("tie_word_embeddings") else weights["lm_head.weight"]
        return (x @ head.T).float().cpu().numpy()
