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

    from ladder.runner import register as register_ladder
    register_ladder(sub)

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
