"""Peers for `nanoqwen bench`, each run in its own process (bench/decode_bench.py gives it a time limit).

    python3 -m bench.peers hf|hf-compile|int4mm --shape qwen2.5-coder-7b --json OUT.json

Same shape, random weights (torch's seeded init), the same protocol where it applies:
- `hf`: Hugging Face transformers Qwen2ForCausalLM in bf16, eager, SDPA attention, dynamic KV cache;
  a 512-token prompt (TTFT: the forward, its argmax on the GPU and the token id read back), then greedy
  steps timed on the host with a synchronize each (the way a user runs it).
- `hf-compile`: the same model with a static KV cache and torch.compile (mode reduce-overhead), through
  `generate`; decode ms/token = (time for N new tokens - time for 1) / (N - 1). Compilation is warm-up.
- `int4mm`: one decode step built from PyTorch's own INT4 matmul (`torch.ops.aten._weight_int4pack_mm`,
  tinygemm, group 128, bf16 activations) for q/k/v, o, gate/up and down of every layer, RMSNorm,
  SDPA over a 512-token bf16 KV cache (GQA), SiLU, the bf16 lm_head and an argmax, captured as one CUDA
  graph and replayed (no RoPE and no KV write: a lower bound on such an engine's step).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _cfg(shape):
    from engine.config import SHAPES

    return SHAPES[shape]


def _sync_ms(fn):
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, r


def _hf_model(c):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hc = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                     rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings)
    hc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(hc)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def _first_token(model, ids):
    """The prompt's forward and its first greedy token, read back as an int (as nanoqwen's TTFT: generate's
    prefill and first token id)."""
    out = model(ids, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    int(tok.item())
    return out, tok


def hf_eager(args):
    import torch

    c = _cfg(args.shape)
    model = _hf_model(c)
    ids = torch.randint(0, c.vocab_size, (1, args.prompt_len), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ttft, steps = [], []
    with torch.inference_mode():
        for rep in range(2):
            ms, (out, tok) = _sync_ms(lambda: _first_token(model, ids))
            ttft.append(ms)
            past = out.past_key_values
            if rep == 1:
                for _ in range(args.new_tokens - 1):
                    t0 = time.perf_counter()
                    out = model(tok, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    tok = out.logits[:, -1].argmax(-1, keepdim=True)
                    int(tok.item())
                    steps.append((time.perf_counter() - t0) * 1e3)
    return {"label": "HF transformers bf16 eager", "ttft_ms": ttft[-1], "decode_ms_median": float(np.median(steps)),
            "decode_ms_p90": float(np.percentile(steps, 90))}


def hf_compile(args):
    import torch

    c = _cfg(args.shape)
    model = _hf_model(c)
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, c.vocab_size, (1, args.prompt_len), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for _ in range(2):  # compile (prefill and decode shapes)
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        compile_s = time.perf_counter() - t0
        t1 = [_sync_ms(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw))[0] for _ in range(3)]
        tn = [_sync_ms(lambda: model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kw))[0]
              for _ in range(2)]
    per = (min(tn) - min(t1)) / (args.new_tokens - 1)
    return {"label": "HF bf16 static cache + torch.compile", "ttft_ms": min(t1), "decode_ms_median": per,
            "compile_s": compile_s, "note": "ms/token from whole generate calls: (t(N) - t(1)) / (N - 1)"}


def int4mm(args):
    import torch
    import torch.nn.functional as F

    c = _cfg(args.shape)
    H, I, V, d, nq, nkv = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    g = torch.Generator("cuda").manual_seed(0)
    dev = "cuda"

    def lin(n, k):
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=g)
        packed = torch.ops.aten._convert_weight_to_int4pack(w, 8)
        sz = torch.empty(k // 128, n, 2, dtype=torch.bfloat16, device=dev)
        sz[..., 0] = 1.0 / (4.6 * k ** 0.5)
        sz[..., 1] = 0.0
        return packed, sz

    layers = []
    for _ in range(c.num_hidden_layers):
        layers.append(dict(qkv=lin(c.qkv_size, H), o=lin(H, c.q_size), gu=lin(2 * I, H), down=lin(H, I),
                           kc=torch.randn(1, nkv, args.prompt_len, d, dtype=torch.bfloat16, device=dev, generator=g),
                           vc=torch.randn(1, nkv, args.prompt_len, d, dtype=torch.bfloat16, device=dev, generator=g),
                           n1=torch.ones(H, dtype=torch.bfloat16, device=dev), n2=torch.ones(H, dtype=torch.bfloat16, device=dev)))
    lm = torch.randn(V, H, dtype=torch.bfloat16, device=dev, generator=g) / H ** 0.5
    x0 = torch.randn(1, H, dtype=torch.bfloat16, device=dev, generator=g)
    mm = torch.ops.aten._weight_int4pack_mm

    def step():
        x = x0.clone()
        for L in layers:
            h = F.rms_norm(x, (H,), L["n1"], c.rms_norm_eps)
            qkv = mm(h, L["qkv"][0], 128, L["qkv"][1])
            q = qkv[:, : nq * d].view(1, nq, 1, d)
            a = F.scaled_dot_product_attention(q, L["kc"], L["vc"], enable_gqa=True).reshape(1, nq * d)
            x = x + mm(a, L["o"][0], 128, L["o"][1])
            h = F.rms_norm(x, (H,), L["n2"], c.rms_norm_eps)
            gu = mm(h, L["gu"][0], 128, L["gu"][1])
            x = x + mm(F.silu(gu[:, :I]) * gu[:, I:], L["down"][0], 128, L["down"][1])
        return (x @ lm.T).argmax(-1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for i in range(args.new_tokens + 5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b))
    return {"label": "torch _weight_int4pack_mm graph", "ttft_ms": None, "decode_ms_median": float(np.median(times)),
            "decode_ms_p90": float(np.percentile(times, 90)),
            "note": "tinygemm INT4 g128 + SDPA + bf16 lm_head as one CUDA graph; no RoPE/KV write"}


PEERS = {"hf": hf_eager, "hf-compile": hf_compile, "int4mm": int4mm}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("peer", choices=sorted(PEERS))
    p.add_argument("--shape", default="qwen2.5-coder-7b")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    res = PEERS[args.peer](args)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
