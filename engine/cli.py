"""The `nanoqwen` command line: the product's commands (generate, convert, inspect) and the table that
finds the others (`python -m ladder` runs the same `main` from a plain checkout).

    nanoqwen ladder [--model FILE|HF_DIR] [--quant FORMAT|all] [--prompts FILE] [--backend B] [--keep-going]
                    [--report DIR] [--baseline DIR] [--coverage]
    nanoqwen ladder merge REPORT... [--report DIR] [--baseline DIR] [--coverage]
    nanoqwen generate [--model FILE] (--prompt TEXT | --prompt-ids 1,2,3) [--new-tokens N]
    nanoqwen convert HF_DIR OUT.nanoqwen [--quant FORMAT]     (the formats: docs/FORMAT.md, `convert --help`)
    nanoqwen inspect FILE
    nanoqwen bisect --good REV [--bad REV] [--backend B] [--repo PATH] [-- PYTEST ARGS, default -m unit]
    nanoqwen bisect --baseline REPORT_DIR [--good REV] [--bad REV] [-- LADDER ARGS]
    nanoqwen descend [--model FILE|HF_DIR] [--quant FORMAT] [--backend B] [--prompt TEXT | --prompt-ids 1,2,3]
                     [--plant-fault NAME[@LAYER][:FORMAT]]

Errors about the user's input (a malformed model file or checkpoint, an output path that cannot be
written, a bad argument, a token id out of range, a prompt longer than the cache, a backend this
machine cannot run) are one line on stderr, `nanoqwen: error: ...`, and exit status 2, never a
traceback; an error under a progress bar starts on a fresh line. A reader that closes the pipe early
(`nanoqwen inspect F | head`) ends the command quietly with status 141; Ctrl-C is status 130.

The ladder's commands and the benchmark live with the ladder and the benchmark (`COMMANDS`: a command's
name -> "module:register"); a command's module is imported only when that command is chosen (all of
them for `nanoqwen --help` or an unknown command), so `nanoqwen generate` loads neither ladder/, bench/,
reference/ nor fixtures/ beyond the default model's lookup (engine/resolve.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys

from engine.errors import NanoqwenError
from engine.formats import DEFAULT_FORMAT, FORMATS

# The commands that live outside the engine: name -> "module:register", `register(subparsers)` adding it.
COMMANDS = {
    "ladder": "ladder.run.runner:register",
    "ladder-merge": "ladder.run.runner:register_merge",  # typed `nanoqwen ladder merge`
    "bisect": "ladder.tools.bisect:register",
    "descend": "ladder.tools.descend:register",
    "bench": "bench.cli:register",
    "quant-report": "ladder.tools.quant_report:register",
    "mutate": "ladder.tools.mutate:register",
}


from engine.progress import end_progress_line, progress_bar  # noqa: F401  (the commands' bars)


# --- argument types: a bad value is one line and exit 2, before any work ---------------------------

INT32_MAX = 2**31 - 1


def int_at_least(minimum: int, what: str):
    """argparse type: an integer >= `minimum`, refused as "expected WHAT, got ..." (one line, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


non_negative_int = int_at_least(0, "a non-negative integer")  # a token count


def token_ids_arg(text: str) -> str:
    """argparse type for `--prompt-ids 1,2,3`: comma-separated token ids, each an integer in
    [0, 2**31); returned as the same list, normalized ("1,2,3"). Ids past the model's vocabulary are
    the engine's TokenIdError, once the model is known."""
    parts = [s.strip() for s in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("expected comma-separated token ids (e.g. 1,2,3), got none")
    ids = []
    for s in parts:
        if not s:
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}; expected comma-separated token ids")
        try:
            value = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s[:40]!r} is not an integer; expected comma-separated token ids") from None
        if not 0 <= value <= INT32_MAX:
            raise argparse.ArgumentTypeError(f"token id {s[:40]} is out of range; token ids are integers in [0, {INT32_MAX}]")
        ids.append(value)
    return ",".join(map(str, ids))


def comma_names(text: str, what: str) -> list[str]:
    """argparse helper: the items of a comma list, stripped, in order, once each; "expected comma-separated
    WHAT" for none and "an empty item" for `a,,b` (one line, exit 2)."""
    names = [s.strip() for s in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got none")
    if not all(names):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}; expected comma-separated {what}")
    return list(dict.fromkeys(names))


def formats_arg(text: str) -> list[str]:
    """argparse type for `--quant a,b|all` (quant-report, bench): known format names (engine.formats.FORMATS),
    in order, once each; an unknown one is get_format's UnknownFormatError line."""
    from engine.errors import UnknownFormatError
    from engine.formats import get_format

    if text.strip() == "all":
        return list(FORMATS)
    names = comma_names(text, "format names (or all)")
    for name in names:
        try:
            get_format(name)
        except UnknownFormatError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def version() -> str:
    """The installed distribution's version, else the checkout's pyproject.toml's (a plain checkout on a
    GPU machine), else "unknown"."""
    from importlib import metadata

    try:
        return metadata.version("nanoqwen")
    except metadata.PackageNotFoundError:
        pass
    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(pyproject) as f:
            m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
        return m.group(1) if m else "unknown"
    except OSError:
        return "unknown"


# --- one vocabulary of flags across the commands (docs/LADDER.md, "Command-line vocabulary") -------
#
#   -n/--workers N        parallel workers          --report DIR   the folder a command writes
#   --quant FORMAT[,..]   formats (or all)          --json FILE    one JSON file (bench's scripts)
#   --new-tokens N        tokens to generate        --backend B    numpy | cuda (| all where a command tests)
#
# An old spelling stays one release as a hidden alias that says, in one line on stderr, what it is now.
RENAMED: dict[str, str] = {}  # old flag -> new flag, every command's (a self-test reads it)


class _RenamedFlag(argparse.Action):
    """An old spelling: stores into the new option's destination and says so once."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"nanoqwen: note: {option_string} is now {self.new}; the old spelling goes in the next release",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def renamed(parser, *old: str, new: str, **kwargs) -> None:
    """Accept the old spellings `old` of the option `new` (already added to `parser`, with `kwargs` its
    `type`/`nargs`), hidden from the help."""
    dest = next(a.dest for a in parser._actions if new in a.option_strings)
    parser.add_argument(*old, dest=dest, action=_RenamedFlag, new=new, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)
    for flag in old:
        RENAMED[flag] = new


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option with a default that says something shows it in its help (`(default: X)`), here and in
    every subcommand's parser, unless its help already names its default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                show_defaults(sub)
            continue
        if (not action.option_strings or action.help == argparse.SUPPRESS
                or action.default in (None, False, argparse.SUPPRESS, "")
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            continue
        text = action.help or ""
        if "default" not in text:
            action.help = (text + " " if text else "") + "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line: `nanoqwen: error: ...` and exit status 2."""

    def error(self, message):
        end_progress_line()
        self.exit(2, f"nanoqwen: error: {self.prog.removeprefix('nanoqwen ')}: {message} (see {self.prog} --help)\n"
                  if self.prog != "nanoqwen" else f"nanoqwen: error: {message} (see nanoqwen --help)\n")


_NEGATIVE_VALUE_OPTIONS = ("--prompt-ids",)


def _attach_negative_values(argv: list[str]) -> list[str]:
    """`--prompt-ids -1,2` as `--prompt-ids=-1,2`, so its value reaches the check that names the
    problem (argparse would take `-1,2` for an option and say the value is missing)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + argv[i:]
        if a in _NEGATIVE_VALUE_OPTIONS and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def cmd_generate(args) -> int:
    import numpy as np

    import engine
    from engine.model import Timings

    from engine.resolve import prompt_ids, resolve_model

    path = resolve_model(args.model)
    model = engine.load(path, backend=args.backend)
    ids, tok = prompt_ids(path, args.prompt, args.prompt_ids)
    timings = Timings()
    stop = [] if args.no_stop else [model.config.eos_token_id]
    out = model.generate(ids, args.new_tokens, stop_ids=stop, timings=timings)
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

    config = convert(args.hf_dir, args.out, quant=args.quant, progress=progress_bar("convert"))
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser: the product's commands, and of `COMMANDS` none when `command` is a product command,
    only `command` when it is one of them, all of them otherwise (None, or an unknown command)."""
    from kernels import backend_names  # the registry: a new backend needs no edit here

    p = _Parser(prog="nanoqwen", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"nanoqwen {version()}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy generation on a model (the embedded default when --model is left out)")
    g.add_argument("--model", help=".nanoqwen file (default: the embedded default model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    src.add_argument("--prompt-ids", type=token_ids_arg, help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--new-tokens", type=non_negative_int, default=32,
                   help="tokens to generate, at most (fewer at the end-of-text token, unless --no-stop)")
    renamed(g, "--max-new-tokens", new="--new-tokens", type=non_negative_int)
    g.add_argument("--backend", default="numpy", choices=backend_names(), help="the engine's backend")
    g.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="Hugging Face Qwen2 folder -> .nanoqwen")
    c.add_argument("hf_dir", help="the Hugging Face model folder (config.json, safetensors, tokenizer.json)")
    c.add_argument("out", help="the .nanoqwen file to write")
    c.add_argument("--quant", default=DEFAULT_FORMAT, metavar="FORMAT",
                   help=f"quantization format of the linears (default {DEFAULT_FORMAT}; one of {', '.join(sorted(FORMATS))})")
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser("inspect", help="print a .nanoqwen file's header and tensor table")
    i.add_argument("file", help="a .nanoqwen file")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum pass")
    i.set_defaults(func=cmd_inspect)

    product = set(sub.choices)
    for name, target in COMMANDS.items():
        if command in product or (command in COMMANDS and name != command):
            continue
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(sub)
    show_defaults(p)
    return p


def chosen_command(argv: list[str]) -> str | None:
    """The command `argv` names, or None (`nanoqwen` takes no option before the command but --help and
    --version)."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def _two_word_commands(argv: list[str]) -> list[str]:
    """`nanoqwen ladder merge ...` is the command `ladder-merge` (its own parser, its own --help)."""
    return ["ladder-merge", *argv[2:]] if argv[:2] == ["ladder", "merge"] else argv


def main(argv=None) -> int:
    from kernels import BackendUnavailableError, FormatNotSupportedError

    try:
        argv = _two_word_commands(_attach_negative_values(sys.argv[1:] if argv is None else list(argv)))
        args = build_parser(chosen_command(argv)).parse_args(argv)
    except SystemExit as e:  # --help (0), or a usage error already printed as one line (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
        return code
    except (NanoqwenError, BackendUnavailableError, FormatNotSupportedError) as e:
        return _fail(str(e))
    except SystemExit as e:
        if isinstance(e.code, str):  # `raise SystemExit("nanoqwen: error: ...")`: an input error
            return _fail(e.code.removeprefix("nanoqwen: error: "))
        end_progress_line()  # e.g. SIGTERM during a write (engine/outpath.py): exit 143, the line ended
        raise
    except BrokenPipeError:  # `nanoqwen inspect F | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a process a closed pipe ended
    except KeyboardInterrupt:
        end_progress_line()
        print("nanoqwen: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a file or folder named on the command line that cannot be read or written
        return _fail(f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}")


def _fail(message: str) -> int:
    end_progress_line()
    print("nanoqwen: error: " + " ".join(message.split()), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
