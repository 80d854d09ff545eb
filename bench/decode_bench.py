"""`nanoqwen bench`: decode speed of the CUDA engine at a real model shape, against the bandwidth floor.

    python3 -m ladder bench --shape qwen2.5-coder-7b [--report DIR] [--peers hf,int4mm,hf-compile]

What it does, in order, on one GPU, with no checkpoint:
1. the copy-rate ceiling: a device-to-device copy of a few GB (read + write counted), so the floor is
   this machine's: floor = bytes a decode step must read / copy rate;
2. seeded random INT4 weights of the shape, made on the GPU (a hash of the tensor's name and index,
   so a rerun builds the same model);
3. the decode step with the shipped defaults (`before`), then (optional) a sweep of the GEMV kernel
   variants per op and of the decode-attention kernels, each checked against reference/ops.py (TOL),
   times with cold weights (all layers in one graph), keeping the fastest that passes;
4. correctness before any time is printed: greedy tokens of the captured graph == eager, and the first
   8 tokens agree with a float32 PyTorch run of the same dequantized weights (teacher-forced on the
   engine's tokens; a disagreement under the ladder's near-tie epsilon is a near-tie, anything else
   fails). A failed check prints FAIL and no times;
5. the article's protocol: a 512-token prompt (TTFT: `Model.generate(prompt, max_new_tokens=1)` on the
   host's clock, the prefill and the first token's id, picked on the device as generate does and read
   back), then 128 greedy tokens through the fast graph loop (per-step times from CUDA events), and eager
   steps;
6. a per-kernel table of one decode step at that context (and one of the prefill, op by op): each op replayed for every layer in one
   graph (distinct weights and KV per layer, so nothing is served from L2 that a real step would not
   find there), time, bytes, share of the copy rate;
7. peers, each in its own process with a time limit (bench/peers.py): HF transformers bf16 eager,
   HF static cache + torch.compile, PyTorch's tinygemm INT4 matmul chained as a decode step;
8. JSON (bench.json) and, where matplotlib exists, a chart (bench.png) under --report.

Steps 1-3 and 6 measure with bench/measure.py; this module runs the protocol, the checks and the peers,
and writes the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.measure import (build_model, copy_rate, per_kernel_table, prefill_table, prefilled, step_bytes,
                           sweep_attention, sweep_gemv)
from kernels.base import switch_value

ROOT = Path(__file__).resolve().parents[1]
GROUP = 128


def _shape(text: str) -> str:
    """argparse type: a named shape of engine/config.py SHAPES (one line and exit 2 otherwise, before any work)."""
    from bench.checks import shape_problem

    problem = shape_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    # formats_arg: the one `--quant a,b|all` reading (quant-report's too); a count out of range, like a bad
    # format, is one line and exit 2, before any work
    from engine.cli import formats_arg, int_at_least, non_negative_int, renamed

    p.add_argument("--shape", default="qwen2.5-coder-7b", type=_shape, help="a named shape of engine/config.py SHAPES")
    p.add_argument("--prompt-len", type=int_at_least(1, "a prompt of at least 1 token"), default=512)
    # the protocol times the steps between tokens, and drops the first two eager ones: 4 at least
    p.add_argument("--new-tokens", type=int_at_least(4, "at least 4 new tokens"), default=128)
    p.add_argument("--seed", type=non_negative_int, default=0)

    p.add_argument("--quant", default="int4_sym_g128", type=formats_arg, metavar="FORMAT,...|all",
                   help="weight formats to time, each in its own model (default int4_sym_g128); the first gets "
                        "the before run, the per-kernel tables and the peers, each its own GEMV sweep, checks, "
                        "TTFT and decode, in one table with bytes per step")
    p.add_argument("--report", default="reports/bench", metavar="DIR", help="folder for bench.json and bench.png")
    renamed(p, "--out", new="--report")
    p.add_argument("--peers", default="hf,int4mm", help="comma list of hf, hf-compile, int4mm ('' for none)")
    p.add_argument("--peer-timeout", type=float, default=150.0, help="seconds per peer process")
    p.add_argument("--no-sweep", action="store_true", help="skip the GEMV and attention variant sweeps")
    p.add_argument("--no-before", action="store_true",
                   help="skip the decode step and TTFT timed with the shipped defaults before the sweeps picked")
    p.add_argument("--before-set", default="", metavar="KNOB=VALUE,...",
                   help="backend settings for the 'before' run, e.g. attention_variant=block,"
                        "attention_prefill_variant=block,prefill_variant.int4_sym_g128=mma (the previous kernels); "
                        "a nested table's entry by both keys: gemv_config.int4_sym_g128.down_residual=t128_r4")
    p.add_argument("--no-reference", action="store_true", help="skip the float32 PyTorch check (not recommended)")


# ---- the float32 PyTorch reference ------------------------------------------------------------------

def _torch_nibbles(qweight):
    """uint32 words `[out, in/8]` as int32 (a torch tensor) -> the nibbles `[out, in]`, element order:
    nibble k of a word holds element (0, 2, 4, 6, 1, 3, 5, 7)[k] of its 8 (docs/FORMAT.md)."""
    import torch

    order = [0, 2, 4, 6, 1, 3, 5, 7]
    out_f, words = qweight.shape
    nib = torch.stack([(qweight >> (4 * k)) & 0xF for k in range(8)], dim=-1)  # [out, words, nibble k]
    elem = torch.empty_like(nib)
    elem[..., order] = nib
    return elem.reshape(out_f, words * 8)


def torch_dequant(fmt: str, t: dict):
    """float32 `[out, in]` of a format's stored tensors, read in torch from docs/FORMAT.md on whatever
    device they are on (no engine/ or kernels/ code): the bench's float32 check, every format. `t`: the
    stored tensors as torch tensors, the uint32 words viewed as int32."""
    import torch

    if fmt == "int4_sym_g128":  # (n - 8) * the row's scale of its group of 128
        return (_torch_nibbles(t["qweight"]).float() - 8.0) * t["scales"].float().repeat_interleave(GROUP, dim=1)
    if fmt == "int4_asym_g128":  # (q - z) * s; a group's word: fp16 s in bits 0..15, fp16 (1024 + z) in 16..31
        sz = t["scale_zero"]
        s = (sz & 0xFFFF).to(torch.int16).view(torch.float16).float()
        z = ((sz >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float() - 1024.0
        q = _torch_nibbles(t["qweight"]).float()
        return (q - z.repeat_interleave(GROUP, dim=1)) * s.repeat_interleave(GROUP, dim=1)
    if fmt == "int8_sym_channel":  # q * the row's scale
        return t["qweight"].float() * t["scales"].float()[:, None]
    if fmt == "fp8_e4m3_channel":  # e4m3(q) * the row's scale (torch's float8_e4m3fn: the same encoding)
        return t["qweight"].view(torch.float8_e4m3fn).float() * t["scales"].float()[:, None]
    raise ValueError(f"the bench's float32 check has no reading of format {fmt!r}")


def torch_reference_logits(model, ids, last: int):
    """fp32 logits of the last `last` positions of `ids` (one causal forward pass), from the engine's
    device tensors dequantized independently in PyTorch (`torch_dequant`). TF32 off."""
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    c = model.config
    t = lambda a: torch.from_dlpack(a)  # noqa: E731  zero-copy from CuPy (or NumPy)
    dev = t(model.embed_tokens).device

    def deq(q):
        return torch_dequant(q.format, {k: t(a.view(np.int32) if a.dtype == np.uint32 else a) for k, a in q.tensors.items()})

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * t(w).float()

    T = len(ids)
    d, nq, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    ids_t = torch.as_tensor(np.asarray(ids, np.int64), device=dev)
    x = t(model.embed_tokens)[ids_t].float()
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    ang = torch.arange(T, device=dev, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(v):  # [T, heads, d]
        v1, v2 = v[..., : d // 2], v[..., d // 2:]
        return v * cos[:, None] + torch.cat([-v2, v1], -1) * sin[:, None]

    for w in model.layers:
        h = rms(x, w.input_layernorm)
        qkv = h @ deq(w.qkv).T + t(w.qkv_bias).float()
        q = rope(qkv[:, : nq * d].reshape(T, nq, d))
        k = rope(qkv[:, nq * d: (nq + nkv) * d].reshape(T, nkv, d))
        v = qkv[:, (nq + nkv) * d:].reshape(T, nkv, d)
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True)[0].transpose(0, 1).reshape(T, nq * d)
        x = x + a @ deq(w.o_proj).T
        h = rms(x, w.post_attention_layernorm)
        gu = h @ deq(w.gate_up).T
        g, u = gu[:, : c.intermediate_size], gu[:, c.intermediate_size:]
        x = x + (F.silu(g) * u) @ deq(w.down).T
    h = rms(x[-last:], model.norm)
    out = (h @ t(model.lm_head).float().T).cpu().numpy()
    del x, h
    torch.cuda.empty_cache()
    return out


def reference_check(model, prompt, tokens, n=8):
    """The engine's first n tokens against the fp32 reference, teacher-forced on the engine's tokens."""
    from ladder.judges.tolerances import NEAR_TIE_EPS

    ids = list(prompt) + list(tokens[: n - 1])
    ref = torch_reference_logits(model, ids, n)
    rows, ok = [], True
    for j in range(n):
        top = int(np.argmax(ref[j]))
        margin = float(ref[j][top] - ref[j][tokens[j]])
        status = "match" if top == tokens[j] else ("near-tie" if margin <= NEAR_TIE_EPS else "MISMATCH")
        ok &= status != "MISMATCH"
        sorted_ = np.sort(ref[j])
        rows.append({"pos": j, "engine": int(tokens[j]), "reference": top, "margin": margin, "status": status,
                     "ref_top2_gap": float(sorted_[-1] - sorted_[-2])})
    return ok, rows


# ---- the protocol ---------------------------------------------------------------------------------

def run_protocol(model, prompt, new_tokens):
    """TTFT (host, `first_token`), graph decode step times (CUDA events), eager step times."""
    import cupy as cp

    out = {}
    ttft = [first_token_ms(model, prompt) for _ in range(5)]
    out["ttft_ms"] = float(np.median(ttft[1:]))
    out["ttft_all_ms"] = ttft

    model.enable_cuda_graph(True)
    steps = []
    wall = []
    for rep in range(3):
        seq, first = prefilled(model, prompt)
        ev = []
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        toks = list(model._graph.tokens(seq, first, new_tokens - 1, events=ev))  # generate's graph token source
        wall.append((time.perf_counter() - t0) * 1e3 / len(toks))
        seq.free()
        if rep > 0:
            steps += [cp.cuda.get_elapsed_time(a, b) for a, b in zip(ev[:-1], ev[1:])]
    steps = np.array(steps)
    out["graph_ms_median"] = float(np.median(steps))
    out["graph_ms_p90"] = float(np.percentile(steps, 90))
    out["graph_wall_ms_per_token"] = float(np.median(wall[1:]))
    out["captures"] = model._graph.captures

    model.enable_cuda_graph(False)
    seq, first = prefilled(model, prompt)
    tok, eager = first, []
    for _ in range(min(32, new_tokens - 1)):
        t0 = time.perf_counter()
        logits = model.decode_step(seq, tok)
        eager.append((time.perf_counter() - t0) * 1e3)
        tok = int(np.argmax(logits))
    seq.free()
    out["eager_ms_median"] = float(np.median(eager[2:]))
    out["eager_ms_p90"] = float(np.percentile(eager[2:], 90))
    model.enable_cuda_graph(True)
    return out


def _as_type_of(old, value: str, name: str):
    """A --before-set value as the type of the knob's current one where that is a number or a switch
    (att_blocks=528 is the int 528, rmsnorm_held=off the bool False); a knob that is None now is an
    optional count (pages_per_split: None, the dynamic split), so `none` or an integer; strings and the
    knobs that read strings themselves (pdl) take the text as given."""
    if isinstance(old, bool):
        try:
            return switch_value(value, name)
        except ValueError:
            raise SystemExit(f"nanoqwen bench: --before-set {name}={value!r}: expected on or off") from None
    if old is None:
        if value.strip().lower() == "none":
            return None
        from engine.cli import non_negative_int

        try:
            return non_negative_int(value)
        except argparse.ArgumentTypeError:
            raise SystemExit(f"nanoqwen bench: --before-set {name}={value!r}: expected an integer >= 0 or none") from None
    if not isinstance(old, (int, float)):
        return value
    try:
        return type(old)(value)
    except ValueError:
        raise SystemExit(f"nanoqwen bench: --before-set {name}={value!r}: expected {type(old).__name__}") from None


@contextlib.contextmanager
def backend_settings(be, spec: str):
    """Set backend knobs from "name=value,name.key=value" for the block (restored after); yields them.
    A table knob takes one entry by its keys, as deep as the table goes (prefill_variant.int4_sym_g128=mma,
    gemv_config.int4_sym_g128.down_residual=tc_w8_u4). A name the backend lacks, a key its table lacks
    (a typo would change nothing), a table named without its entry, or a value its knob refuses later, is
    an error naming it."""
    saved, settings = [], {}
    try:
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"nanoqwen bench: --before-set item {item!r} is not NAME=VALUE")
            attr, *keys = name.split(".")
            if not hasattr(be, attr):
                raise SystemExit(f"nanoqwen bench: the backend has no setting {attr!r}")
            if keys:
                table = getattr(be, attr)
                for depth, key in enumerate(keys):
                    if not isinstance(table, dict) or key not in table:
                        known = ", ".join(sorted(table)) if isinstance(table, dict) else "none: not a table"
                        raise SystemExit(f"nanoqwen bench: --before-set {name}: "
                                         f"{'.'.join([attr, *keys[:depth]])} has no entry {key!r} (its keys: {known})")
                    if depth < len(keys) - 1:
                        table = table[key]
                if isinstance(table[key], dict):
                    raise SystemExit(f"nanoqwen bench: --before-set {name}: a table; name one of its entries "
                                     f"({', '.join(sorted(table[key]))})")
                saved.append((table, key, table[key]))
                table[key] = value
            else:
                old = getattr(be, attr)
                saved.append((be, attr, old))
                setattr(be, attr, _as_type_of(old, value, name))
            settings[name] = value
        yield settings
    finally:
        for obj, key, old in reversed(saved):
            if isinstance(obj, dict):
                obj[key] = old
            else:
                setattr(obj, key, old)


def first_token_ms(model, prompt) -> float:
    """One TTFT: the host's time for `model.generate(prompt, max_new_tokens=1)` from an idle device, the
    prompt's prefill and its first token's id (the argmax on the device, one int read back), what a
    caller of generate waits for. Until v5's eleventh step the bench timed its own path instead, the whole
    last logits row copied to the host and its argmax taken there: 0.35-0.44 ms more at the 7B shape
    (bench/NOTES.md), work generate never does."""
    import cupy as cp

    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    model.generate(prompt, max_new_tokens=1)
    return (time.perf_counter() - t0) * 1e3


def ttft_ms(model, prompt, reps: int = 3) -> float:
    """Median `first_token_ms` (after one warm-up)."""
    return float(np.median([first_token_ms(model, prompt) for _ in range(reps + 1)][1:]))


def graph_step_ms(model, prompt, n: int = 32) -> float:
    """Median ms of a captured decode step (CUDA events) over n greedy tokens after the prompt."""
    import cupy as cp

    model.enable_cuda_graph(True)
    steps = []
    for rep in range(2):
        seq, first = prefilled(model, prompt)
        ev = []
        list(model._graph.tokens(seq, first, n, events=ev))
        seq.free()
        if rep:
            steps += [cp.cuda.get_elapsed_time(a, b) for a, b in zip(ev[:-1], ev[1:])]
    model.enable_cuda_graph(False)
    return float(np.median(steps))


def greedy_tokens(model, prompt, n, graph: bool):
    model.enable_cuda_graph(graph)
    toks = model.generate(prompt, n)
    model.enable_cuda_graph(False)
    return toks


def run_peers(args, results):
    names = [p for p in args.peers.split(",") if p]
    peers, skip = {}, set()
    for name in names:
        if name in skip:
            peers[name] = {"error": "skipped: the hf peer failed", "wall_s": 0.0}
            continue
        out = Path(args.report) / f"peer-{name}.json"
        cmd = [sys.executable, "-m", "bench.peers", name, "--shape", args.shape, "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--json", str(out)]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.peer_timeout)
            if out.exists():
                peers[name] = json.loads(out.read_text())
            else:
                tail = (res.stdout + res.stderr).strip().splitlines()[-3:]
                peers[name] = {"error": f"exit {res.returncode}: " + " | ".join(tail)}
        except subprocess.TimeoutExpired:
            peers[name] = {"error": f"time-boxed: no result within {args.peer_timeout:.0f} s"}
        peers[name]["wall_s"] = time.perf_counter() - t0
        print(f"  peer {name}: {peers[name]}", flush=True)
        if name == "hf" and "error" in peers[name]:  # hf-compile builds the same model: skip it too
            skip.add("hf-compile")
    results["peers"] = peers


def chart(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed here: no chart)")
        return None
    labels, vals = ["nanoqwen graph", "nanoqwen eager"], [results["decode"]["graph_ms_median"], results["decode"]["eager_ms_median"]]
    for q, f in list(results.get("formats", {}).items())[1:]:
        if f.get("passed"):
            labels.append(f"nanoqwen graph [{q}]")
            vals.append(f["decode"]["graph_ms_median"])
    for name, p in results.get("peers", {}).items():
        if "decode_ms_median" in p:
            labels.append(p.get("label", name))
            vals.append(p["decode_ms_median"])
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(labels) + 1.5))
    ax.barh(labels[::-1], vals[::-1], color="#4477aa")
    ax.axvline(results["floor_ms"], color="#cc3311", ls="--", label=f"floor {results['floor_ms']:.2f} ms")
    ax.set_xlabel("decode ms / token (lower is better)")
    ax.set_xscale("log")
    ax.set_title(f"{results['shape']}, {results['prompt_len']}-token prompt, {results['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def main(args) -> int:
    import cupy as cp

    from engine.config import SHAPES

    cfg = SHAPES[args.shape]  # a known shape: the parser's `_shape` took it
    outdir = Path(args.report)
    outdir.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    results = {"out": str(outdir), "shape": args.shape, "device": props["name"].decode(), "sms": props["multiProcessorCount"],
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seed": args.seed}
    print(f"nanoqwen bench: {args.shape} on {results['device']} ({results['sms']} SMs)", flush=True)

    t0 = time.perf_counter()
    results["copy_tbs"] = copy_rate()
    print(f"  copy rate {results['copy_tbs']:.3f} TB/s ({time.perf_counter() - t0:.1f} s)", flush=True)

    from engine.cli import formats_arg

    formats = args.quant if isinstance(args.quant, list) else formats_arg(args.quant)
    results["formats"] = {}
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).astype(np.int32).tolist()
    for i, quant in enumerate(formats):
        t0 = time.perf_counter()
        model = build_model(cfg, args.seed, cache_tokens=args.prompt_len + args.new_tokens + 16, quant=quant)
        print(f"[{quant}] random model built on the GPU ({time.perf_counter() - t0:.1f} s)", flush=True)
        try:
            if i == 0:
                row = bench_first_format(model, prompt, args, results)
            else:
                row = bench_format(model, prompt, args, results["copy_tbs"])
        finally:
            model.close()  # its memory back to the device for the next format and the peers
        results["formats"][quant] = row
        if not row["passed"]:
            (outdir / "bench.json").write_text(json.dumps(results, indent=1))
            print(f"FAIL: the engine's tokens are wrong in {quant}; no times are reported")
            return 1
    results.update({k: results["formats"][formats[0]][k] for k in ("checks", "bytes_per_step", "floor_ms", "decode")})
    model = None  # the last backend's scratch goes too, before the peers load their models
    cp.get_default_memory_pool().free_all_blocks()
    run_peers(args, results)

    (outdir / "bench.json").write_text(json.dumps(results, indent=1))
    png = chart(results, outdir / "bench.png")
    print_table(results, png)
    return 0


def bench_first_format(model, prompt, args, results) -> dict:
    """The first format: the before run, the sweeps, the checks, the protocol and the per-kernel tables
    (into `results`); returns its row of the formats table."""
    quant = model.quant
    if not args.no_before:  # the step as shipped (or as --before-set says), before the sweeps pick: same run, ratios hold
        try:
            with backend_settings(model.backend, args.before_set) as settings:
                results["before"] = {"settings": settings, "gemv_config": dict(model.backend.gemv_config[quant]),
                                     "graph_ms_median": graph_step_ms(model, prompt), "ttft_ms": ttft_ms(model, prompt)}
        except ValueError as e:  # a knob refused its value (the message names the value and the choices)
            raise SystemExit(f"nanoqwen bench: --before-set {args.before_set}: {e}") from None
        print(f"  before ({settings or 'shipped defaults'}): decode step {results['before']['graph_ms_median']:.3f} ms, "
              f"TTFT {results['before']['ttft_ms']:.2f} ms", flush=True)
    seq, first = prefilled(model, prompt)
    if not args.no_sweep:
        t0 = time.perf_counter()
        results["gemv_sweep"] = sweep_gemv(model, seq, first)
        print_sweep(results["gemv_sweep"])
        results["attention_sweep"] = sweep_attention(model, seq, first)
        att = results["attention_sweep"]

        def timings(rows: dict) -> str:  # "name 4.7us, name 11.1us WRONG, name refused"
            return ", ".join(f"{k} refused" if "error" in v else f"{k} {v['ms'] * 1e3:.1f}us{'' if v['ok'] else ' WRONG'}"
                             for k, v in rows.items())

        vs, bs = timings(att["variants"]), timings(att["att_blocks"])
        print(f"  sweep attention_decode   chosen {att['chosen']}: {vs}; att_blocks chosen {att['chosen_att_blocks']}: {bs}",
              flush=True)
        print(f"  sweeps done ({time.perf_counter() - t0:.1f} s)", flush=True)
    results["gemv_config"] = dict(model.backend.gemv_config)
    results["attention_variant"] = model.backend.attention_variant
    seq.free()
    row = checked_and_timed(model, prompt, args, results["copy_tbs"])
    if row["passed"]:
        seq, first = prefilled(model, prompt)
        results["kernels"] = per_kernel_table(model, seq, first, results["copy_tbs"])
        seq.free()
        results["prefill_kernels"] = prefill_table(model, prompt)
    return row


def bench_format(model, prompt, args, copy_tbs: float) -> dict:
    """A further format: its own GEMV sweep (each format at its fastest variants), the checks, the
    protocol; its row of the formats table."""
    if not args.no_sweep:
        seq, first = prefilled(model, prompt)
        sweep = sweep_gemv(model, seq, first)
        seq.free()
        print_sweep(sweep)
    row = checked_and_timed(model, prompt, args, copy_tbs)
    if not args.no_sweep:
        row["gemv_sweep"] = sweep
    return row


def print_sweep(sweep: dict) -> None:
    for op, r in sweep.items():
        vs = ", ".join(f"{k} {v['ms'] * 1e3:.1f}us{'' if v['ok'] else ' WRONG'}" for k, v in r["variants"].items())
        print(f"  sweep {op:16s} chosen {r['chosen']}: {vs}", flush=True)


def checked_and_timed(model, prompt, args, copy_tbs: float) -> dict:
    """Correctness first (graph == eager, the first 8 tokens against the float32 reference; a fast wrong
    engine reports nothing), then the protocol and the bytes a step reads: the format's row."""
    t0 = time.perf_counter()
    eager = greedy_tokens(model, prompt, args.new_tokens, graph=False)
    graph = greedy_tokens(model, prompt, args.new_tokens, graph=True)
    checks = {"graph_equals_eager": eager == graph, "n_tokens": len(graph)}
    if not checks["graph_equals_eager"]:
        diff = next(i for i, (a, b) in enumerate(zip(eager, graph)) if a != b) if len(eager) == len(graph) else -1
        checks["first_difference"] = diff
    if not args.no_reference:
        ok, rows = reference_check(model, prompt, graph)
        checks["reference_ok"], checks["reference"] = ok, rows
    print(f"  checks ({time.perf_counter() - t0:.1f} s): graph == eager: {checks['graph_equals_eager']}; "
          f"fp32 reference: {checks.get('reference_ok', 'skipped')} "
          f"{[r['status'] for r in checks.get('reference', [])]}", flush=True)
    row = {"checks": checks, "passed": checks["graph_equals_eager"] and checks.get("reference_ok", True)}
    if not row["passed"]:
        return row
    ctx = args.prompt_len + 1
    row["bytes_per_step"] = step_bytes(model, ctx)
    row["floor_ms"] = row["bytes_per_step"] / (copy_tbs * 1e12) * 1e3
    d = row["decode"] = run_protocol(model, prompt, args.new_tokens)
    d["tokens_per_s"] = 1e3 / d["graph_ms_median"]
    d["achieved_tbs"] = row["bytes_per_step"] / (d["graph_ms_median"] * 1e-3) / 1e12
    d["ratio_to_floor"] = d["graph_ms_median"] / row["floor_ms"]
    print(f"  {model.quant}: TTFT {d['ttft_ms']:.2f} ms, decode {d['graph_ms_median']:.3f} ms/token "
          f"({d['achieved_tbs']:.2f} TB/s of {row['bytes_per_step'] / 1e9:.3f} GB a step)", flush=True)
    return row


def print_table(r, png):
    d = r["decode"]
    print(f"\n== nanoqwen bench {r['shape']} on {r['device']}: prompt {r['prompt_len']}, {r['new_tokens']} new tokens")
    print(f"copy rate {r['copy_tbs']:.3f} TB/s; a step reads {r['bytes_per_step'] / 1e9:.3f} GB -> floor {r['floor_ms']:.3f} ms/token")
    print(f"checks: graph tokens == eager ({r['checks']['n_tokens']}), first 8 vs fp32 PyTorch: "
          f"{[x['status'] for x in r['checks'].get('reference', [])] or 'skipped'}")
    print(f"\n{'engine':34s} {'TTFT ms':>8s} {'ms/tok':>8s} {'p90':>8s} {'tok/s':>7s} {'x floor':>8s}")
    print(f"{'nanoqwen graph (fast loop)':34s} {d['ttft_ms']:8.2f} {d['graph_ms_median']:8.3f} {d['graph_ms_p90']:8.3f} "
          f"{1e3 / d['graph_ms_median']:7.1f} {d['graph_ms_median'] / r['floor_ms']:8.2f}")
    print(f"{'nanoqwen eager (logits to host)':34s} {d['ttft_ms']:8.2f} {d['eager_ms_median']:8.3f} {d['eager_ms_p90']:8.3f} "
          f"{1e3 / d['eager_ms_median']:7.1f} {d['eager_ms_median'] / r['floor_ms']:8.2f}")
    for name, p in r.get("peers", {}).items():
        if "decode_ms_median" in p:
            ttft = p.get("ttft_ms")
            print(f"{p.get('label', name)[:34]:34s} {ttft if ttft is not None else float('nan'):8.2f} {p['decode_ms_median']:8.3f} "
                  f"{p.get('decode_ms_p90', float('nan')):8.3f} {1e3 / p['decode_ms_median']:7.1f} {p['decode_ms_median'] / r['floor_ms']:8.2f}")
        else:
            print(f"{name:34s} -- {p.get('error', 'no result')[:80]}")
    print(f"{'floor (bytes / copy rate)':34s} {'':8s} {r['floor_ms']:8.3f}")
    print(f"graph: {d['achieved_tbs']:.3f} TB/s achieved, {d['graph_wall_ms_per_token']:.3f} ms/token host wall; "
          f"graph vs eager {d['eager_ms_median'] / d['graph_ms_median']:.2f}x")
    print(f"\n{'op (one decode step, ctx ' + str(r['prompt_len'] + 1) + ')':34s} {'calls':>5s} {'us/call':>8s} {'ms/step':>8s} "
          f"{'MB/call':>8s} {'TB/s':>6s} {'%copy':>6s}")
    tot = 0.0
    for k in r["kernels"]:
        tot += k["ms_per_step"]
        print(f"{k['op']:34s} {k['calls']:5d} {k['ms_per_call'] * 1e3:8.1f} {k['ms_per_step']:8.3f} "
              f"{k['bytes_per_call'] / 1e6:8.2f} {k['tbs']:6.2f} {k['pct_copy_rate']:6.1f}")
    print(f"{'sum of ops (each alone, in graphs)':34s} {'':5s} {'':8s} {tot:8.3f}   vs graph step {d['graph_ms_median']:.3f} ms")
    print(f"GEMV config: {r['gemv_config']}; attention: {r.get('attention_variant')}")
    if "before" in r:
        b = r["before"]
        print(f"before ({b['settings'] or 'shipped defaults'}; GEMVs {b['gemv_config']}): decode step "
              f"{b['graph_ms_median']:.3f} ms -> {d['graph_ms_median']:.3f} ms ({b['graph_ms_median'] / d['graph_ms_median']:.2f}x), "
              f"TTFT {b['ttft_ms']:.2f} ms -> {d['ttft_ms']:.2f} ms ({b['ttft_ms'] / d['ttft_ms']:.2f}x)")
    if r.get("prefill_kernels"):
        print(f"\n{'op (prefill of ' + str(r['prompt_len']) + ' tokens)':34s} {'calls':>5s} {'us/call':>8s} {'ms':>8s}")
        tot = 0.0
        for k in r["prefill_kernels"]:
            tot += k["ms_per_step"]
            vs = "  ".join(f"{v} {ms:.3f}" for v, ms in k.get("variants", {}).items())
            print(f"{k['op']:34s} {k['calls']:5d} {k['ms_per_call'] * 1e3:8.1f} {k['ms_per_step']:8.3f}" + (f"   kernels: {vs}" if vs else ""))
        print(f"{'sum of ops':34s} {'':5s} {'':8s} {tot:8.3f}   vs TTFT {d['ttft_ms']:.2f} ms (host wall)")
    print_formats(r)
    print("JSON: bench.json" + (f", chart: {Path(png).name}" if png else "") + f" in {r.get('out', '')}")


def print_formats(r) -> None:
    """One row a format (--quant): what a step reads, its floor, TTFT and decode, and the rate it reads its
    bytes at against int4_sym_g128's in the same run (a format slower per byte has a kernel to mend)."""
    rows = {q: f for q, f in r.get("formats", {}).items() if f.get("passed")}
    if len(rows) < 2:
        return
    base = rows.get("int4_sym_g128", {}).get("decode", {}).get("achieved_tbs")
    print(f"\n{'format (prompt ' + str(r['prompt_len']) + ')':34s} {'GB/step':>8s} {'floor':>8s} {'TTFT ms':>8s} "
          f"{'ms/tok':>8s} {'x floor':>8s} {'TB/s':>6s} {'per byte':>9s}")
    for q, f in rows.items():
        d = f["decode"]
        rel = f"{d['achieved_tbs'] / base:9.2f}" if base else f"{'-':>9s}"
        print(f"{q:34s} {f['bytes_per_step'] / 1e9:8.3f} {f['floor_ms']:8.3f} {d['ttft_ms']:8.2f} "
              f"{d['graph_ms_median']:8.3f} {d['ratio_to_floor']:8.2f} {d['achieved_tbs']:6.2f} {rel}")
    if base:
        print("per byte: the format's TB/s over int4_sym_g128's, in this run (below 1: slower per byte read)")


def cli_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="nanoqwen bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli_main())
