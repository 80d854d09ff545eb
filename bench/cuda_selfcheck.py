"""Check every CUDA op against the NumPy backend (the executable spec), then the decode CUDA graph.

Run from the repository root (no install needed); it lives in bench/ because it drives the engine too,
and kernels/ never imports engine/.

    python3 -m bench.cuda_selfcheck            # small shapes, the 7B shape, the graph; a table last
    python3 -m bench.cuda_selfcheck --quick    # small shapes only

Not the ladder (that compares against float64 references with the tolerance table): this is the
kernel engineer's quick look, backend against backend on the same random inputs, with NaN sentinels
in every output and NaN in every free page and unwritten KV slot. Exits non-zero on any failure.
Cases: GQA ratios 1, 2, 4, 7; head_dim 64 and 128; lengths 15/16/17/31/32/33 (page boundaries);
shuffled page tables; split-K decode attention; the Qwen2.5-Coder-7B shapes (hidden 3584, MLP 18944,
28/4 heads of 128, a 600-token context, vocab 152064); the captured decode step against eager, bit
for bit, and its re-capture when an op is wrapped.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

PAGE = 16
# Pass when max |cuda - numpy| <= TOL * max(1, max |numpy|): a few fp16 ulps (2^-10 = 9.8e-4) for
# fp16 outputs, whose roundings may flip by one ulp when the fp32 sums are ordered differently;
# fp32 outputs are sums of up to 18944 terms in another order.
TOL = {"float16": 4e-3, "float32": 2e-5}


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, bool, float, float, str]] = []

    def add(self, op, case, ok, max_err, rel_l2, note=""):
        self.rows.append((op, case, bool(ok), float(max_err), float(rel_l2), note))
        status = "PASS" if ok else "FAIL"
        print(f"  {status} {op:22s} {case:44s} max_err={max_err:.3e} rel_l2={rel_l2:.3e} {note}", flush=True)

    def failed(self):
        return [r for r in self.rows if not r[2]]


def compare(rep: Report, op: str, case: str, out, ref, tol=None, note=""):
    out = np.asarray(out)
    ref = np.asarray(ref)
    tol = TOL[str(ref.dtype)] if tol is None else tol
    o, r = out.astype(np.float64), ref.astype(np.float64)
    nan_o, nan_r = np.isnan(o), np.isnan(r)
    if out.shape != ref.shape:
        rep.add(op, case, False, np.inf, np.inf, f"shape {out.shape} != {ref.shape}")
        return
    if not np.array_equal(nan_o, nan_r):
        rep.add(op, case, False, np.inf, np.inf, f"NaN mismatch: {int(nan_o.sum())} vs {int(nan_r.sum())} NaN")
        return
    d = np.abs(o - r)[~nan_r]
    rv = r[~nan_r]
    max_err = float(d.max()) if d.size else 0.0
    rel = float(np.linalg.norm(d) / max(np.linalg.norm(rv), 1e-30)) if d.size else 0.0
    scale = max(1.0, float(np.abs(rv).max()) if rv.size else 1.0)
    rep.add(op, case, max_err <= tol * scale, max_err, rel, note)


def rand_qweight(rng, out_f, in_f):
    """Random int4_sym_g128 tensors: uniform nibbles, scales giving the layer about unit gain."""
    qweight = rng.integers(0, 2**32, size=(out_f, in_f // 8), dtype=np.uint64).astype(np.uint32)
    scales = (rng.uniform(0.5, 1.5, size=(out_f, in_f // 128)) / (4.6 * np.sqrt(in_f))).astype(np.float16)
    return {"qweight": qweight, "scales": scales}


def rand16(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float16)


def paged_kv(rng, nkv, d, length, n_pages, shuffle=True):
    """NaN-filled K/V pages with `length` tokens written through a (shuffled) page table."""
    k = np.full((n_pages, nkv, PAGE, d), np.nan, np.float16)
    v = np.full((n_pages, nkv, PAGE, d), np.nan, np.float16)
    order = rng.permutation(n_pages) if shuffle else np.arange(n_pages)
    table = order.astype(np.int32)
    for t in range(length):
        k[table[t // PAGE], :, t % PAGE] = rand16(rng, nkv, d)
        v[table[t // PAGE], :, t % PAGE] = rand16(rng, nkv, d)
    return k, v, table


class Checker:
    def __init__(self, cu, npb, rep: Report, seed=0):
        self.cu, self.np, self.rep = cu, npb, rep
        self.rng = np.random.default_rng(seed)

    def dev(self, a):
        return self.cu.asarray(a)

    def sentinel(self, shape, dtype):
        return self.cu.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype)

    def host(self, a):
        self.cu.synchronize()
        return self.cu.to_numpy(a)

    # ---- ops ------------------------------------------------------------------------------------

    def embed(self, T, V, H):
        ids = self.rng.integers(0, V, T).astype(np.int32)
        table = rand16(self.rng, V, H)
        o, r = self.sentinel((T, H), np.float32)
        self.cu.embed(self.dev(ids), self.dev(table), o)
        self.np.embed(ids, table, r)
        compare(self.rep, "embed", f"T={T},V={V},H={H}", self.host(o), r, tol=0.0)

    def rmsnorm(self, T, H, sliced=False):
        x = (self.rng.standard_normal((T + 2, H)) * 3).astype(np.float32)
        w = rand16(self.rng, H)
        xs = x[1:T + 1] if sliced else x[:T]
        dx = self.dev(x)
        dxs = dx[1:T + 1] if sliced else dx[:T]
        o, r = self.sentinel((T, H), np.float16)
        self.cu.rmsnorm(dxs, self.dev(w), 1e-6, o)
        self.np.rmsnorm(xs, w, 1e-6, r)
        compare(self.rep, "rmsnorm", f"T={T},H={H}" + (",row-slice" if sliced else ""), self.host(o), r)

    def linear(self, op, T, out_f, in_f, timing=False):
        t_q = rand_qweight(self.rng, out_f, in_f)
        wd = self.cu.prepare_linear("int4_sym_g128", t_q, out_f, in_f)
        wn = self.np.prepare_linear("int4_sym_g128", t_q, out_f, in_f)
        x = rand16(self.rng, T, in_f)
        case = f"T={T},out={out_f},in={in_f}"
        if op == "qkv_proj":
            b = rand16(self.rng, out_f, scale=0.1)
            o, r = self.sentinel((T, out_f), np.float16)
            args_d, run_n = (self.dev(x), wd, self.dev(b), o), lambda: self.np.qkv_proj(x, wn, b, r)
        elif op == "gate_up_silu":
            o, r = self.sentinel((T, out_f // 2), np.float16)
            args_d, run_n = (self.dev(x), wd, o), lambda: self.np.gate_up_silu(x, wn, r)
        else:
            res = self.rng.standard_normal((T, out_f)).astype(np.float32)
            o, r = self.dev(res), res.copy()
            args_d, run_n = (self.dev(x), wd, o), lambda: getattr(self.np, op)(x, wn, r)
        getattr(self.cu, op)(*args_d)
        out = self.host(o)
        run_n()
        compare(self.rep, op, case, out, r)
        if timing:
            return self.time_op(lambda: getattr(self.cu, op)(*args_d), (t_q["qweight"].nbytes + t_q["scales"].nbytes))
        return None

    def time_op(self, fn, nbytes, reps=20):
        import cupy as cp

        fn()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        ms = float(np.median(times))
        return ms, nbytes / (ms * 1e-3) / 1e12

    def rope(self, T, nq, nkv, d, start, n_pages, theta=1e6):
        qkv = rand16(self.rng, T, (nq + 2 * nkv) * d)
        k, v, table = paged_kv(self.rng, nkv, d, start, n_pages)
        pos = np.arange(start, start + T, dtype=np.int32)
        kd, vd = self.dev(k), self.dev(v)
        o, r = self.sentinel((T, nq, d), np.float16)
        self.cu.rope_kv_write(self.dev(qkv), self.dev(pos), kd, vd, self.dev(table), theta, o)
        self.np.rope_kv_write(qkv, pos, k, v, table, theta, r)
        case = f"T={T},nq={nq},nkv={nkv},d={d},pos={start}.."
        compare(self.rep, "rope_kv_write[q]", case, self.host(o), r)
        compare(self.rep, "rope_kv_write[k]", case, self.host(kd), k)
        compare(self.rep, "rope_kv_write[v]", case, self.host(vd), v, tol=0.0)

    def attention(self, kind, group, nkv, d, length, T=None, pages_per_split=None, extra_pages=3):
        nq = group * nkv
        T = (1 if kind == "decode" else length) if T is None else T
        n_pages = -(-length // PAGE) + extra_pages
        k, v, table = paged_kv(self.rng, nkv, d, length, n_pages)
        q = rand16(self.rng, T, nq, d, scale=2.0)
        pos = np.arange(length - T, length, dtype=np.int32)
        o, r = self.sentinel((T, nq * d), np.float16)
        saved = self.cu.pages_per_split
        if pages_per_split:
            self.cu.pages_per_split = pages_per_split
        try:
            fn = self.cu.attention_decode if kind == "decode" else self.cu.attention_prefill
            fn(self.dev(q), self.dev(k), self.dev(v), self.dev(table), self.dev(pos), o)
            out = self.host(o)
        finally:
            self.cu.pages_per_split = saved
        self.np.attention_prefill(q, k, v, table, pos, r)
        splits = -(-n_pages // pages_per_split) if (pages_per_split and T == 1) else None
        case = f"{kind} g={group},nkv={nkv},d={d},len={length},T={T}" + (f",splits={splits}" if splits else "")
        compare(self.rep, "attention", case, out, r)

    def lm_head_argmax(self, V, H, tie=True):
        x = rand16(self.rng, 1, H)
        w = rand16(self.rng, V, H, scale=1 / np.sqrt(H))
        o, r = self.sentinel((V,), np.float32)
        wd = self.dev(w)
        self.cu.lm_head(self.dev(x), wd, o)
        self.np.lm_head(x, w, r)
        compare(self.rep, "lm_head", f"V={V},H={H}", self.host(o), r)
        logits = r.copy()
        if tie:  # two equal maxima: the lower index must win
            i, j = sorted(self.rng.choice(V, 2, replace=False))
            logits[i] = logits[j] = logits.max() + 1.0
        ai, ar = self.cu.full((1,), -1, np.int32), np.full((1,), -1, np.int32)
        self.cu.argmax(self.dev(logits), ai)
        self.np.argmax(logits, ar)
        got = self.host(ai)
        self.rep.add("argmax", f"V={V}" + (",tie" if tie else ""), bool(got[0] == ar[0]), float(got[0] != ar[0]), 0.0,
                     f"got {int(got[0])} want {int(ar[0])}")
        return wd, o


def small_cases(c: Checker):
    c.embed(5, 1000, 256)
    for T, H, sl in ((1, 256, False), (3, 896, False), (4, 3584, True)):
        c.rmsnorm(T, H, sl)
    for T in (1, 7):
        c.linear("qkv_proj", T, 576, 256)
        c.linear("qkv_proj", T, 72, 384)  # rows not a multiple of a warp's 4 or a block's 16
        c.linear("o_proj_residual", T, 256, 384)
        c.linear("gate_up_silu", T, 2 * 200, 256)
        c.linear("down_residual", T, 264, 768)
    for d in (64, 128):
        c.rope(1, 7, 1, d, 40, 8)
        c.rope(17, 4, 2, d, 15, 8)
    for group in (1, 2, 4, 7):
        for d in (64, 128):
            for length in (15, 16, 17, 31, 32, 33):
                c.attention("decode", group, 2, d, length)
                c.attention("prefill", group, 2, d, length)
            c.attention("decode", group, 2, d, 33, pages_per_split=1)  # split-K + combine, empty splits
            c.attention("prefill", group, 2, d, 33, T=5)  # a chunk of queries after a cached prefix
    c.lm_head_argmax(1000, 256)
    c.lm_head_argmax(777, 64, tie=False)


def shape_7b(c: Checker, timings: list):
    H, I, nq, nkv, d, V, ctx = 3584, 18944, 28, 4, 128, 152064, 600
    qkv = (nq + 2 * nkv) * d
    c.rmsnorm(1, H)
    for op, out_f, in_f in (("qkv_proj", qkv, H), ("o_proj_residual", H, nq * d),
                            ("gate_up_silu", 2 * I, H), ("down_residual", H, I)):
        t = c.linear(op, 1, out_f, in_f, timing=True)
        timings.append((f"{op} T=1 [{out_f}x{in_f}]", *t))
        c.linear(op, 64, out_f, in_f)
    c.rope(1, nq, nkv, d, ctx - 1, ctx // PAGE + 4)
    c.attention("decode", nq // nkv, nkv, d, ctx)
    c.attention("decode", nq // nkv, nkv, d, ctx, pages_per_split=8)
    c.attention("prefill", nq // nkv, nkv, d, ctx)
    wd, o = c.lm_head_argmax(V, H)
    x = c.dev(rand16(c.rng, 1, H))
    timings.append((f"lm_head [{V}x{H}] fp16", *c.time_op(lambda: c.cu.lm_head(x, wd, o), V * H * 2)))


def tiny_model(backend, seed=0, cache_tokens=256):
    from engine.config import SHAPES
    from engine.model import Model
    from engine.weights import linear_names, plain_tensor_specs

    c = SHAPES["tiny"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (dtype, shape) in plain_tensor_specs(c).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float16)
        elif name.endswith(".bias"):
            tensors[name] = rand16(rng, *shape, scale=0.1)
        elif name == "lm_head.weight":
            tensors[name] = rand16(rng, *shape, scale=4 / np.sqrt(c.hidden_size))
        else:
            tensors[name] = rand16(rng, *shape)
    for i in range(c.num_hidden_layers):
        for name, (out_f, in_f) in linear_names(c, i).items():
            q = rand_qweight(rng, out_f, in_f)
            tensors[name + ".qweight"], tensors[name + ".scales"] = q["qweight"], q["scales"]

    def get(name, dtype, shape):
        a = tensors[name]
        assert a.dtype == np.dtype(dtype) and a.shape == tuple(shape), name
        return a

    return Model(c, "int4_sym_g128", backend, get, cache_tokens=cache_tokens)


def graph_cases(cu, npb, rep: Report, timings: list):
    from engine.kv_cache import PagedKVCache

    prompt = list(range(3, 16))  # 13 tokens; 24 decode steps cross the boundaries at 16 and 32
    steps = 24

    def run(model, graph, token_seq=None):
        model.enable_cuda_graph(graph) if graph is not None else None
        seq = model.new_sequence()
        logits = [model.prefill(seq, prompt)]
        toks = []
        for s in range(steps):
            tok = int(np.argmax(logits[-1])) if token_seq is None else token_seq[s]
            toks.append(tok)
            logits.append(model.decode_step(seq, tok))
        seq.free()
        return np.stack(logits), toks

    ref_model = tiny_model(npb)
    ref_logits, ref_toks = run(ref_model, None)
    m = tiny_model(cu)
    cu.pages_per_split = 4  # 16 pages -> 4 splits: the captured step includes the split-K combine
    m.use_cache(PagedKVCache(m.config, cu, num_pages=16, debug_nan=True, shuffle_seed=3))
    eager, toks_e = run(m, False, ref_toks)
    graph, toks_g = run(m, True, ref_toks)
    compare(rep, "model eager vs numpy", f"tiny, {len(prompt)}+{steps} tokens", eager, ref_logits, tol=1e-2)
    same = np.array_equal(eager.view(np.uint32), graph.view(np.uint32))
    rep.add("graph == eager (bits)", f"tiny, {steps} decode steps", same, float(np.abs(eager - graph).max()), 0.0,
            f"captures={m._graph.captures}")
    greedy_e, _ = run(m, False)
    repeats = [run(m, mode, ref_toks)[0] for mode in (False, True, True)]
    rep.add("determinism (bits)", "3 more runs: eager, graph, graph", all(np.array_equal(r.view(np.uint32), eager.view(np.uint32))
                                                                         for r in repeats), 0.0, 0.0)
    rep.add("greedy tokens", "cuda eager == numpy", [int(np.argmax(x)) for x in greedy_e] == [int(np.argmax(x)) for x in ref_logits],
            0.0, 0.0)

    # Wrapping an op invalidates the graph: a planted fault must show up, then unwrapping restores it.
    m.enable_cuda_graph(True)
    g = m._graph
    seq = m.new_sequence()
    m.prefill(seq, prompt)
    base = m.decode_step(seq, ref_toks[0])
    seq.free()
    original = cu.rmsnorm

    def faulty_rmsnorm(x, weight, eps, out):
        original(x, weight, eps, out)
        out *= 2  # planted fault

    cu.rmsnorm = faulty_rmsnorm
    try:
        seq = m.new_sequence()
        m.prefill(seq, prompt)
        before = g.captures
        faulty = m.decode_step(seq, ref_toks[0])
        seq.free()
    finally:
        del cu.rmsnorm  # back to the class's method
    seq = m.new_sequence()
    m.prefill(seq, prompt)
    again = m.decode_step(seq, ref_toks[0])
    seq.free()
    ok = g.captures >= before + 1 and not np.allclose(faulty, base) and np.array_equal(again, base)
    rep.add("graph re-capture", "wrap rmsnorm, unwrap", ok, float(np.abs(faulty - base).max()), 0.0,
            f"captures={g.captures}")

    # Decode step time, eager vs graph (tiny model; launch-bound)
    for mode in (False, True):
        m.enable_cuda_graph(mode)
        seq = m.new_sequence()
        m.prefill(seq, prompt)
        m.decode_step(seq, 1)
        t0 = time.perf_counter()
        for i in range(20):
            m.decode_step(seq, 1 + i)
        dt = (time.perf_counter() - t0) / 20 * 1e3
        seq.free()
        timings.append((f"tiny decode_step ({'graph' if mode else 'eager'}, incl. logits copy)", dt, float("nan")))
    cu.pages_per_split = 16


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    args = ap.parse_args(argv)

    import cupy as cp

    from kernels import get_backend

    t0 = time.perf_counter()
    cu = get_backend("cuda")
    print(f"compiled every module in {time.perf_counter() - t0:.2f} s; device "
          f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy {cp.__version__}", flush=True)
    npb = get_backend("numpy")
    rep = Report()
    timings: list = []
    c = Checker(cu, npb, rep)
    sections = [("small shapes", lambda: small_cases(c))]
    if not args.quick:
        sections += [("Qwen2.5-Coder-7B shapes", lambda: shape_7b(c, timings)),
                     ("decode CUDA graph", lambda: graph_cases(cu, npb, rep, timings))]
    for title, fn in sections:
        print(f"== {title}", flush=True)
        try:
            fn()
        except Exception as e:  # report and carry on: one broken op must not hide the others
            import traceback

            traceback.print_exc()
            rep.add(title, "raised", False, np.inf, np.inf, f"{type(e).__name__}: {e}")

    print("\n== summary (worst case per op)")
    print(f"{'op':24s} {'cases':>5s} {'fail':>4s} {'max_err':>10s} {'max rel_l2':>10s}")
    ops = dict.fromkeys(r[0] for r in rep.rows)
    for op in ops:
        rows = [r for r in rep.rows if r[0] == op]
        print(f"{op:24s} {len(rows):5d} {sum(not r[2] for r in rows):4d} {max(r[3] for r in rows):10.3e} "
              f"{max(r[4] for r in rows):10.3e}")
    if timings:
        # The same weights every launch: a weight smaller than L2 (50 MB) is read from L2, so its TB/s is
        # not a DRAM bandwidth figure. The speed issue measures with weights rotated through memory.
        print(f"\n{'timing (median of 20, same buffers each launch)':56s} {'ms':>8s} {'TB/s':>6s}")
        for name, ms, tbs in timings:
            print(f"{name:56s} {ms:8.3f} {tbs:6.2f}")
    bad = rep.failed()
    print(f"\n{len(rep.rows) - len(bad)}/{len(rep.rows)} checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
