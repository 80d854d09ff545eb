"""The `nanoqwen` command line (`python -m ladder` does the same from a plain checkout).

    nanoqwen ladder [--model FILE|HF_DIR] [--prompts FILE] [--backend B] [--keep-going] [--report DIR]
                    [--baseline DIR] [--coverage]
    nanoqwen generate [--model FILE] (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
    nanoqwen convert HF_DIR OUT.nanoqwen [--quant int4_sym_g128]
    nanoqwen inspect FILE
    nanoqwen bisect --good REV [--bad REV] [--backend B] [--repo PATH] [-- PYTEST ARGS, default -m unit]
    nanoqwen descend [--model FILE|HF_DIR] [--prompt TEXT | --prompt-ids 1,2,3] [--plant-fault NAME[@LAYER]]

Errors about the user's input (a malformed model file, a token id out of range, a prompt longer than
the cache, a backend this machine cannot run) are one line on stderr and exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _progress(label: str):
    """A one-line progress bar on stderr (tensor i of n)."""
    start = time.perf_counter()

    def show(i: int, n: int, name: str) -> None:
        width = 30
        done = int(width * i / n)
        sys.stderr.write(f"\r{label} [{'#' * done}{'.' * (width - done)}] {i}/{n} "
                         f"{time.perf_counter() - start:5.1f}s {name[-48:]:<48}")
        if i == n:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def cmd_generate(args) -> int:
    import numpy as np

    import engine
    from engine.model import Timings

    from ladder.models import prompt_ids, resolve_model

    path = resolve_model(args.model)
    model = engine.load(path, backend=args.backend)
    ids, tok = prompt_ids(path, args.prompt, args.prompt_ids)
    timings = Timings()
    stop = [] if args.no_stop else [model.config.eos_token_id]
    out = model.generate(ids, args.max_new_tokens, stop_ids=stop, timings=timings)
    print(f"model:      {path}")
    print(f"prompt ids: {ids}")
    print(f"new ids:    {out}")
    if tok is not None:
        print("text:")
        print((args.prompt or tok.decode(ids)) + tok.decode(out))
    per_tok = float(np.median(timings.decode_s)) * 1e3 if timings.decode_s else float("nan")
    print(f"backend {model.backend.name}: prefill {len(ids)} tokens {timings.prefill_s * 1e3:.1f} ms, "
          f"decode {per_tok:.2f} ms/token (median of {len(timings.decode_s)})")
    return 0


RUNGS = ("unit", "layer", "graph")


def cmd_ladder(args) -> int:
    """Run the rungs in order, each as its own pytest process; stop at the first red one."""
    import datetime
    import os
    import subprocess

    from ladder import report as R

    pkg = Path(__file__).resolve().parent
    root = pkg.parent
    out = Path(args.report or f"reports/ladder-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    unknown = set(rungs) - set(RUNGS)
    if unknown:
        raise SystemExit(f"nanoqwen: error: unknown rung(s) {sorted(unknown)}; the rungs are {', '.join(RUNGS)}")
    if args.model:  # resolve once (an HF folder is converted here, not by each worker)
        from ladder.models import resolve_model

        args.model = str(resolve_model(args.model))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    results, started = {}, datetime.datetime.now().isoformat(timespec="seconds")
    failed = False
    for i, rung in enumerate(rungs, 1):
        print(f"[{i}/{len(rungs)}] rung {rung}", flush=True)
        cmd = [sys.executable, "-m", "pytest", str(pkg / rung), "-m", rung, "-p", "ladder.plugin", "-q",
               "--rootdir", str(root), "--ladder-json", str(out / f"{rung}.json"),
               "--junitxml", str(out / f"junit-{rung}.xml"), "-o", "junit_family=xunit2"]
        if args.workers != "0":
            cmd += ["-n", args.workers]
        for opt in ("backend", "model", "prompts", "plant_fault", "hypothesis_profile"):
            value = getattr(args, opt)
            if value:
                cmd += [f"--{opt.replace('_', '-')}", value]
        if args.require_backend:
            cmd += ["--require-backend", args.require_backend]
        t0 = time.perf_counter()
        code = subprocess.call(cmd, cwd=root, env=env)
        data = json.loads((out / f"{rung}.json").read_text()) if (out / f"{rung}.json").exists() else {}
        ran = sum(data.get("rungs", {}).get(rung, {}).values()) if data else 0
        if code == 5 or ran == 0:  # pytest's "no tests collected"
            print(f"nanoqwen: rung {rung} collected no test", file=sys.stderr)
            code = code or 5
        results[rung] = {**data, "exit": code, "seconds": time.perf_counter() - t0}
        if code != 0:
            failed = True
            if not args.keep_going:
                print(f"nanoqwen: rung {rung} is red; stopping (--keep-going runs the rest)", file=sys.stderr)
                break
    meta = {"model": args.model or "default", "backends": [args.backend or "auto"], "started": started,
            "plant_fault": args.plant_fault, "argv": sys.argv[1:]}
    rep = R.merge(results, meta)
    if args.baseline:
        rep["regressions"] = R.compare_baseline(rep, R.load(Path(args.baseline)))
        failed = failed or bool(rep["regressions"])
    uncovered = [f"{b}/{op}" for b, ops in rep["coverage"].items() for op, r in ops.items() if not r]
    if args.coverage and uncovered and len(rungs) == len(RUNGS):
        failed = True
    rep["meta"]["result"] = "FAILED" if failed else "passed"
    R.write(out, rep)
    _print_ladder_table(rep, args.coverage)
    print(f"report: {out}/report.md, report.json, junit-*.xml")
    return 1 if failed else 0


def _print_ladder_table(rep: dict, show_coverage: bool) -> None:
    print()
    print(f"{'rung':<7}{'exit':>5}{'passed':>8}{'failed':>8}{'skipped':>9}{'seconds':>9}")
    for rung, r in rep["rungs"].items():
        print(f"{rung:<7}{r['exit']:>5}{r.get('passed', 0):>8}{r.get('failed', 0):>8}{r.get('skipped', 0):>9}"
              f"{r['seconds']:>9.1f}")
    worst = {}
    for o in rep["ops"]:
        k = (o["backend"], o["op"])
        if k not in worst or o["multiple"] > worst[k]["multiple"]:
            worst[k] = o
    if worst:
        print(f"\n{'backend':<10}{'op':<22}{'worst / floor':>14}  rung")
        for (b, op), o in sorted(worst.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            m = o["multiple"]
            print(f"{str(b):<10}{op:<22}{'exact' if m == 0 else f'{m:.2f}x':>14}  {o['rung']}"
                  + ("" if o.get("passed", True) else "  FAILED"))
    if show_coverage:
        print("\ncoverage (rungs that called each op):")
        for b, ops in rep["coverage"].items():
            for op, rungs in ops.items():
                print(f"  {b:<8}{op:<22}{', '.join(rungs) if rungs else 'NO RUNG CALLS IT (a finding)'}")
    for r in rep.get("regressions", []):
        print(f"REGRESSION {r}")


def cmd_convert(args) -> int:
    from engine.convert import convert

    config = convert(args.hf_dir, args.out, quant=args.quant, progress=_progress("convert"))
    print(f"wrote {args.out}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, {args.quant}")
    return 0


def cmd_inspect(args) -> int:
    from engine.modelfile import ModelFile

    mf = ModelFile(args.file, verify_checksums=not args.no_verify)
    h = mf.header
    print(f"file:     {mf.path} ({mf.size} bytes), version {h['version']}, quant {mf.quant}")
    print("config:   " + json.dumps({k: v for k, v in mf.config_dict.items() if v is not None}, sort_keys=True))
    print(f"files:    {', '.join(f'{n} ({e.length} bytes)' for n, e in mf.files.items()) or '-'}")
    print(f"tensors:  {len(mf.tensors)}")
    width = max((len(n) for n in mf.tensors), default=4)
    print(f"  {'name':<{width}}  {'dtype':<8} {'shape':<16} {'offset':>12} {'bytes':>12}  checksum")
    for e in mf.tensors.values():
        print(f"  {e.name:<{width}}  {e.dtype:<8} {str(list(e.shape)):<16} {e.offset:>12} {e.length:>12}  {e.checksum}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanoqwen", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    lad = sub.add_parser("ladder", help="run the unit, layer and graph rungs in order and write a report")
    lad.add_argument("--model", help=".nanoqwen file or Hugging Face folder (default: the embedded default model)")
    lad.add_argument("--prompts", help="graph-rung prompts (JSON lines)")
    lad.add_argument("--backend", choices=["numpy", "cuda", "all"], help="default: numpy, plus cuda where present")
    lad.add_argument("--require-backend", choices=["numpy", "cuda"], help="a backend that must run (skip = failure)")
    lad.add_argument("--rungs", default=",".join(RUNGS), help="comma-separated subset, in order (default: all)")
    lad.add_argument("--keep-going", action="store_true", help="run every rung even after a red one")
    lad.add_argument("--report", help="report folder (default: reports/ladder-TIMESTAMP)")
    lad.add_argument("--baseline", help="an earlier report folder: flag ops that regressed or newly fail")
    lad.add_argument("--coverage", action="store_true", help="list each backend's ops and the rungs that called them")
    lad.add_argument("--plant-fault", help="plant a fault from ladder/faults.py (the run must go red)")
    lad.add_argument("--hypothesis-profile", choices=["ci", "nightly"], help="Hypothesis profile (default ci)")
    lad.add_argument("-n", "--workers", default="auto", help="pytest-xdist workers per rung ('0' for none)")
    lad.set_defaults(func=cmd_ladder)

    g = sub.add_parser("generate", help="greedy generation on a model (the embedded default when --model is left out)")
    g.add_argument("--model", help=".nanoqwen file (default: the embedded default model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--backend", default="numpy", choices=["numpy", "cuda"])
    g.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="Hugging Face Qwen2 folder -> .nanoqwen")
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--quant", default="int4_sym_g128")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="print a .nanoqwen file's header and tensor table")
    i.add_argument("file")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum pass")
    i.set_defaults(func=cmd_inspect)

    from ladder.bench import register as register_bench
    register_bench(sub)
    from ladder.bisect import register as register_bisect
    register_bisect(sub)
    from ladder.descend import register as register_descend
    register_descend(sub)
    return p


def main(argv=None) -> int:
    from engine.errors import NanoqwenError
    from kernels import BackendUnavailableError, FormatNotSupportedError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (NanoqwenError, BackendUnavailableError, FormatNotSupportedError) as e:
        print(f"nanoqwen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nanoqwen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
