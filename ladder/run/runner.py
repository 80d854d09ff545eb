"""`nanoqwen ladder`: the unit, layer and graph rungs in order, each as its own pytest process, and the
report folder at the end (ladder/run/report.py).

It must work the way a user runs it: the installed command, started from any folder, on any model.
So every path the user gives (`--model`, `--prompts`, `--report`, `--baseline`) is made absolute
against the user's folder before a rung starts, and the rungs write only into the report folder (no
pytest cache; Hypothesis keeps its example database under the nanoqwen cache folder). A rung's pytest
reads no configuration file, so neither a user's own nor a missing one (a non-editable install has no
pyproject.toml) changes it: the project's settings travel on its command line and in the plugin
(markers, `--strict-markers`).

    nanoqwen ladder [--model FILE|HF_DIR] [--prompts FILE] [--backend B] [--rungs unit,layer,graph]
                    [--keep-going] [--report DIR] [--baseline DIR] [--coverage] [--plant-fault NAME[@LAYER][:FORMAT]]
                    [--new-tokens N] [--skip-determinism] [--shard I/N] [--changed REV] [--record-launches]
                    [-n WORKERS] [-- EXTRA PYTEST ARGS]
    nanoqwen ladder merge REPORT... [--report DIR] [--baseline DIR] [--coverage]

Exit status (`nanoqwen ladder` and `ladder merge` alike), so that a broken run never reads as a regression:

    0  green
    1  a rung is red: tests failed, or the report's judgement (a --baseline regression, --coverage, the
       graph rung's near-tie flip rule)
    2  bad input, refused before any rung runs (one line, `nanoqwen: error: ...`)
    3  the harness broke, not a kernel: a rung's pytest ended in a usage error (pytest exit 4), an internal
       error (3), a collection error or an interruption (2), or collected no test (5); one line on stderr
       names the rung and pytest's first error line where it can be read. It stops the ladder at once, even
       under --keep-going (the later rungs would break the same way), and wins over red. A shard or a
       --changed run whose rung holds no test of it is green for that rung; `ladder merge` exits 3 when
       a shard's rung broke, or a rung is empty in every shard.
"""

from __future__ import annotations

import codecs
import datetime
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.errors import NanoqwenError, one_line
from engine.cli import int_at_least

RUNGS = ("unit", "layer", "graph")
PACKAGE = Path(__file__).resolve().parents[1]  # ladder/: the rungs' test folders live here
ROOT = PACKAGE.parent  # the folder that holds the project's packages (a checkout, or site-packages)


def rung_command(rung: str, out: Path, args, extra: list[str], workers: str | None = None) -> list[str]:
    """The pytest command line of one rung: absolute paths only, the project's settings explicit.
    `workers`: its `-n`, where already chosen (side by side); else worker_count's."""
    cmd = [sys.executable, "-m", "pytest", str(PACKAGE / rung), "-m", rung, "-p", "ladder.plugin",
           # No configuration file is searched for (one above site-packages could be the user's own):
           # the settings are these flags and the plugin's markers; conftest files load from ROOT down.
           "-c", os.devnull, "--rootdir", str(ROOT), "--confcutdir", str(ROOT),
           "-p", "no:cacheprovider", "--strict-markers", "-q", "-ra",
           "--ladder-json", str(out / f"{rung}.json"),
           "--junitxml", str(out / f"junit-{rung}.xml"), "-o", "junit_family=xunit2"]
    workers = worker_count(args, rung) if workers is None else workers
    if workers != "0":  # a format's cases stay together on one worker (ladder/plugin/__init__.py marks the groups)
        cmd += ["-n", workers, "--dist", "loadgroup"]
    for opt in ("backend", "quant", "model", "prompts", "plant_fault", "hypothesis_profile", "new_tokens", "shard"):
        value = getattr(args, opt, None)
        if value:
            cmd += [f"--{opt.replace('_', '-')}", str(value)]
    if args.require_backend:
        cmd += ["--require-backend", args.require_backend]
    cmd += getattr(args, "launch_flags", [])
    if getattr(args, "skip_determinism", False):
        cmd += ["--skip-determinism"]
    return cmd + extra


def selected_backends(args) -> list[str]:
    """The backends the run asks for: `--backend B`, or every registered one (none given, or `all`)."""
    from kernels import backend_names

    return list(backend_names()) if args.backend in (None, "all") else [args.backend]


def running_backends(args) -> list[str]:
    """The selected backends that can run on this machine."""
    from kernels import backend_available

    return [n for n in selected_backends(args) if backend_available(n)[0]]


def device_backends(args) -> list[str]:
    """The selected backends that need a device and can run on this machine."""
    from kernels import backend_needs_device

    return [n for n in running_backends(args) if backend_needs_device(n)]


def worker_count(args, rung: str) -> str:
    """`-n`: what the user gave; for `auto` with a device backend that runs here, the layer and graph rungs
    take the backend's own measured choice (kernels/base.py test_workers: four per GPU on CUDA, whatever
    the model's size: the GPU runs one process's kernels at a time), while the unit rung, whose time goes
    to float64 references on the host, keeps one worker per core. A user's model then caps the layer and
    graph rungs' workers at what fits the GPU's and the host's memory (ladder/run/workers.py), and one
    line says what was chosen."""
    from kernels import backend_class

    if args.workers != "auto" or rung == "unit":
        chosen = args.workers
    else:
        device = [backend_class(n).test_workers() for n in device_backends(args)]
        device = [n for n in device if n]
        chosen = str(min(device)) if device else "auto"
    files = getattr(args, "model_files", None)
    if rung == "unit" or not files or chosen == "0":
        return chosen
    from ladder.run.workers import size_workers

    running = running_backends(args)
    n = (os.cpu_count() or 1) if chosen == "auto" else int(chosen)
    workers, line = size_workers(rung, n, files, running, explicit=args.workers != "auto")
    if line:
        print(line, flush=True)
    return str(workers)


def rung_environment() -> dict:
    """The rungs import the project from ROOT, and Hypothesis stores examples in the nanoqwen cache."""
    from engine.resolve import cache_root

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(cache_root() / "hypothesis"))
    return env


class LadderArgumentError(NanoqwenError):
    """A `nanoqwen ladder` argument that names nothing usable (one line, exit 2)."""


def _absolute(value: str | None) -> str | None:
    return None if value is None else str(Path(value).expanduser().resolve())


def check_required_backends(args) -> None:
    """A backend required (--require-backend, NANOQWEN_REQUIRE_GPU=1) that cannot run on this machine stops
    the command before any rung starts or any model is converted: one line, exit 2 (ladder/plugin/required.py;
    each rung's pytest would refuse the run too, one rung after another under --keep-going)."""
    from ladder.plugin.required import refusal, required_backends

    why = refusal(required_backends([args.require_backend] if args.require_backend else []), selected_backends(args))
    if why:
        raise LadderArgumentError(why)


# The command's exit statuses (the module docstring says what each means).
GREEN, RED, BAD_INPUT, HARNESS_BROKE = 0, 1, 2, 3
# pytest's exit statuses that mean its run judged nothing: the harness broke, not a kernel.
PYTEST_BROKE = {2: "collection error or interruption", 3: "internal error", 4: "usage error"}
NO_TEST = 5  # pytest's "no tests collected"
# pytest's own error lines on stderr: `ERROR: file or directory not found: x`, argparse's
# `__main__.py: error: unrecognized arguments: --x` (`python -m pytest: error: ...` since Python 3.12),
# the plugin's `nanoqwen: error: ...`
_ERROR_LINE = re.compile(r"^(?:ERROR: |[^\s:][^:]{0,60}: error: )(.+)")


def pytest_error_line(text: str) -> str | None:
    """The first of pytest's own error lines in `text` (its stderr), without the prefix; argparse's usage
    line, which comes before its reason (`unrecognized arguments: -n`), is passed over."""
    for line in text.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m and not m.group(1).startswith("usage:"):
            return m.group(1).strip()
    return None


def run_rung(cmd: list[str], env: dict, rung: str | None = None, out: Path | None = None) -> tuple[int, str | None]:
    """Run one rung's pytest: (its exit status, its first error line on stderr, or None).

    stdout stays the rung's own (a terminal stays a terminal: colours, progress dots). stderr passes
    through a pipe chunk by chunk, to this process's stderr as it comes, so the user sees it live and a
    usage error's reason (`unrecognized arguments: --x`) can be named in the harness line.

    A watchdog. The rung gets a fresh progress folder (NANOQWEN_PROGRESS_DIR: `out/.progress-RUNG`, removed
    at the end), where its processes write their progress lines and signs of life (engine/progress.py,
    ladder/plugin/liveness.py): each new progress line is printed here on stderr (a worker's, from inside a
    fixture, would be captured by pytest), and a rung in which no file there changed, so no test finished
    and none started, for NANOQWEN_STALL_SECONDS (default 900; 0: never) is stopped: SIGINT to its
    process group (pytest writes what it has), SIGKILL STOP_GRACE seconds later, and one line naming the
    last sign of life and the cases that had started and not ended (before the first case starts, the
    limit is at least STARTUP_SECONDS). A stalled rung is red (exit status
    1), as one whose worker died. The rung runs in a session of its own so that its workers are stopped
    with it; Ctrl-C, SIGTERM or SIGHUP to this process stops it the same way. `rung` (for the lines) and
    `out` default to what the command line says (`-m RUNG`, `--ladder-json OUT/...`)."""
    run = RungRun(cmd, env, rung, out)
    try:
        with _signals_as_exceptions():
            while run.poll(WATCH_SECONDS) is None:
                pass
    except BaseException:  # Ctrl-C, SIGTERM: stop the rung, its workers too, before passing it on
        run.stop()
        run.tidy()
        raise
    return run.finish()


class RungRun:
    """One rung's pytest, started at construction: `poll()` until it has an exit status, then `finish()`.

    run_rung runs one at a time; `nanoqwen ladder` runs several side by side on a small model (run_side_by_side),
    each as here. `stdout`, when given, is a file the rung's stdout goes to instead of this process's (a rung
    run beside another prints it once the rungs before it have printed theirs)."""

    def __init__(self, cmd: list[str], env: dict, rung: str | None = None, out: Path | None = None, stdout=None):
        from engine.progress import PROGRESS_DIR

        self.cmd = cmd
        self.rung = rung or _rung_in(cmd)
        stall = stall_seconds(env)
        self.folder = _progress_folder(out or _report_folder(cmd), self.rung)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, PROGRESS_DIR: str(self.folder)}, stderr=subprocess.PIPE,
                                     stdout=stdout, start_new_session=True)
        self.watch = RungWatch(self.folder, self.rung, stall)
        self.kept = bytearray()
        self.code: int | None = None
        self.stalled: str | None = None
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := self.proc.stderr.read1(65536):
            if len(self.kept) < 65536:  # the error lines come first; a long run's later stderr need not be kept
                self.kept.extend(chunk)
            text = decode.decode(chunk)
            with self.watch.lock:
                sys.stderr.write(text)
                sys.stderr.flush()
                if text:
                    self.watch.mid_line = not text.endswith("\n")

    def poll(self, timeout: float = 0.0) -> int | None:
        """The rung's exit status once it has one (RED for a stall, which stops it), else None after waiting
        up to `timeout` seconds and looking at the progress folder."""
        if self.code is not None:
            return self.code
        try:
            self.code = self.proc.wait(timeout=timeout) if timeout else self.proc.poll()
        except subprocess.TimeoutExpired:
            self.code = None
        if self.code is None:
            self.stalled = self.watch.tick()
            if self.stalled:
                stop_group(self.proc)
                self.code = RED
        return self.code

    def stop(self, grace: float | None = None) -> None:
        """Stop the rung and its workers (Ctrl-C, a red rung before it); finish() still tidies up."""
        stop_group(self.proc, grace)
        if self.code is None:
            self.code = self.proc.returncode

    def tidy(self) -> None:
        """The progress lines written since the last look printed, and the progress folder removed."""
        import shutil

        try:
            self.watch.tick(final=True)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def finish(self) -> tuple[int, str | None]:
        """(the exit status, the first error line on stderr or None), once poll() has one; tidied."""
        self.tidy()
        # A process the rung left behind may hold the pipe open; the status is known, so wait only briefly.
        self.reader.join(timeout=5)
        code, rung = self.code, self.rung
        if self.stalled:
            self.watch.say(self.stalled)
            self.watch.record(self.cmd, self.stalled)
            return RED, None
        if code < 0:  # pytest itself was killed (its workers' deaths it reports itself, one line each)
            from ladder.plugin.liveness import cause

            self.watch.say(f"nanoqwen: rung {rung}: its pytest process was {cause(code, {})}")
        return code, pytest_error_line(bytes(self.kept).decode(errors="replace"))


STALL_SECONDS = "NANOQWEN_STALL_SECONDS"  # a rung with no sign of life for this long is stopped (default 900)
STALL_DEFAULT = 900.0
STARTUP_SECONDS = 120.0  # the least stall time before a rung's first case starts
STOP_GRACE = 10.0  # seconds between the SIGINT that stops a rung and the SIGKILL
WATCH_SECONDS = 0.25  # between looks at the progress folder (a line replaced sooner is not printed)


def stall_seconds(env: dict) -> float:
    text = env.get(STALL_SECONDS, os.environ.get(STALL_SECONDS, "")).strip()
    try:
        value = float(text) if text else STALL_DEFAULT
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise LadderArgumentError(f"{STALL_SECONDS}={text}: not a number of seconds (0: no limit)")
    return value


def _rung_in(cmd: list[str]) -> str:
    """The rung a pytest command line selects (`-m RUNG`), for its lines; `pytest` where none."""
    return next((b for a, b in zip(cmd, cmd[1:]) if a == "-m" and b in RUNGS), "pytest")


def _report_folder(cmd: list[str]) -> Path | None:
    """The report folder of a rung's command line: the folder of its `--ladder-json` file."""
    return next((Path(b).parent for a, b in zip(cmd, cmd[1:]) if a == "--ladder-json"), None)


def _progress_folder(out: Path | None, rung: str) -> Path:
    import shutil
    import tempfile

    if out is None:
        return Path(tempfile.mkdtemp(prefix=f"nanoqwen-progress-{rung}-"))
    folder = Path(out) / f".progress-{rung}"
    shutil.rmtree(folder, ignore_errors=True)  # a folder a killed run left behind
    folder.mkdir(parents=True)
    return folder


def stop_group(proc: subprocess.Popen, grace: float | None = None) -> None:
    """Stop a rung and every process of its group: SIGINT, as a terminal's Ctrl-C (pytest then ends its
    session and writes its results), and SIGKILL to whatever is left after `grace` seconds."""
    import signal

    def send(sig) -> None:
        try:
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, sig)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass

    try:
        send(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_GRACE if grace is None else grace)
        except subprocess.TimeoutExpired:
            pass
    finally:  # also after a second Ctrl-C during the grace
        send(signal.SIGKILL)
        proc.wait()


class _Signalled(SystemExit):
    """SIGTERM or SIGHUP to `nanoqwen ladder` while a rung runs (its session no longer shares this one's)."""


class _signals_as_exceptions:
    """While a rung runs, SIGTERM and SIGHUP raise in this process, so that the rung is stopped with it
    (in the main thread only; elsewhere a signal handler cannot be set, and nothing changes)."""

    NAMES = ("SIGTERM", "SIGHUP")

    def __enter__(self):
        import signal

        self.old = {}
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.NAMES:
            sig = getattr(signal, name, None)
            if sig is not None:
                self.old[sig] = signal.signal(sig, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise _Signalled(128 + signum)

    def __exit__(self, *exc):
        import signal

        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        return False


_STDERR = threading.Lock()  # one writer at a time on stderr, whichever rung (side by side) it comes from


class RungWatch:
    """The rung's progress folder, looked at every WATCH_SECONDS: the new progress lines (`PID.line`) go to
    stderr; a change of any file (a line, a case started or ended, tests finished: ladder/plugin/liveness.py) is
    progress; `tick()` returns the stall line once there has been none for `stall` seconds."""

    def __init__(self, folder: Path, rung: str, stall: float):
        self.folder, self.rung, self.stall = folder, rung, stall
        self.lock = _STDERR  # stderr: the rungs' own, passed through, and the lines printed here
        self.mid_line = False  # the rung's stderr ended without a newline (a line printed here starts fresh)
        self.seen: dict[str, tuple] = {}  # file name -> (mtime, size, inode, text) at the last look
        self.last: str | None = None  # the latest sign of life's text
        self.last_change = time.monotonic()
        self.begun = False  # whether a case has started

    def tick(self, final: bool = False) -> str | None:
        from ladder.plugin.liveness import CASE, LINE

        changed = []
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            entries = []
        for entry in entries:
            if entry.name.endswith(".tmp"):
                continue
            try:
                st = entry.stat()
                text = Path(entry.path).read_text(errors="replace").strip()
            except OSError:  # replaced or removed between the listing and the look
                continue
            sig = (st.st_mtime_ns, st.st_size, st.st_ino, text)
            if self.seen.get(entry.name) != sig:
                self.seen[entry.name] = sig
                changed.append((st.st_mtime_ns, entry.name, text))
        for _, name, text in sorted(changed):
            if name.endswith(f".{LINE}") and text:
                self.say(text)
            self.last = text or self.last
        now = time.monotonic()
        self.begun = self.begun or any(t.partition("started ")[1] for _, n, t in changed if n.endswith(f".{CASE}"))
        if changed:
            self.last_change = now
        elif not final and self.stall > 0 and now - self.last_change >= self.limit():
            return self.stall_line()
        return None

    def limit(self) -> float:
        """The stall time; until the first case starts (imports, collection, workers starting, a device's
        one-time compile) at least STARTUP_SECONDS, whose signs of life come seconds apart."""
        return self.stall if self.begun else max(self.stall, STARTUP_SECONDS)

    def running(self) -> list[str]:
        """`[gw1] NODE ID` of each live process whose last case beat says its case started and has not ended."""
        from ladder.plugin.liveness import CASE

        out = []
        for name, sig in self.seen.items():
            pid, _, kind = name.partition(".")
            head, started, case = sig[3].partition("started ")
            if kind != CASE or not started or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                continue  # a worker that died: its death has its own line
            except OSError:
                pass
            out.append(f"{head}{case}")
        return out

    def stall_line(self) -> str:
        self.cases = [r.split("] ", 1)[-1] for r in self.running()]  # node ids, for the report
        running = [r for r in self.running() if self.last is None or not self.last.endswith(r.split("] ", 1)[-1])]
        last = self.last or "no sign of life since the rung started"
        return (f"nanoqwen: rung {self.rung}: no progress for {self.limit():g} s (last: {last}"
                + (f"; running: {', '.join(running)}" if running else "") + "); stopped")

    def record(self, cmd: list[str], line: str) -> None:
        """The stall as a failure of the rung's JSON (`--ladder-json`), so that the report lists it: under the
        case that had started, or the rung where none had. Where the stopped pytest wrote no JSON (SIGKILLed
        after STOP_GRACE, on a loaded machine) the file holds the stall alone."""
        import shlex

        path = next((Path(b) for a, b in zip(cmd, cmd[1:]) if a == "--ladder-json"), None)
        if path is None:
            return
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):  # killed before it wrote one (a loaded machine, past STOP_GRACE): the stall alone
            data = {}
        cases = getattr(self, "cases", [])
        data.setdefault("failures", []).append(
            {"test": ", ".join(cases) or f"rung {self.rung}", "rung": self.rung, "backend": None, "format": None,
             "when": "stalled", "message": [line.removeprefix(f"nanoqwen: rung {self.rung}: ")],
             "rerun": f"python -m pytest {shlex.quote(cases[0])}" if len(cases) == 1 else None})
        path.write_text(json.dumps(data, indent=1, default=str))

    def say(self, line: str) -> None:
        with self.lock:
            sys.stderr.write(("\n" if self.mid_line else "") + line + "\n")
            sys.stderr.flush()
            self.mid_line = False


def collection_error(junit: Path) -> str | None:
    """The first collection error of a rung's JUnit file: the exception's last line and where, or None.

    pytest prints its collection errors on stdout, which is left to the terminal; the JUnit file holds
    them too."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return None
    for case in root.iter("testcase"):
        err = case.find("error")
        if err is None or err.get("message") != "collection failure":
            continue
        lines = [line[1:].strip() for line in (err.text or "").splitlines() if line.startswith("E ")]
        where = ".".join(p for p in (case.get("classname"), case.get("name")) if p)
        return (lines[-1] if lines else "collection failure") + (f" (collecting {where})" if where else "")
    return None


def harness_line(where: str, what: str, detail: str | None = None, tail: str = " (pytest's own error is above)") -> str:
    """The one stderr line of a harness break (exit 3): where, what, and pytest's first error line (or `tail`)."""
    return (f"nanoqwen: {where}: {what}: the harness broke, not a kernel; nothing was judged"
            + (f"; pytest: {one_line(detail)}" if detail else tail))


def broken_shard(folders: list[str]) -> str | None:
    """The harness line of the first shard report whose rung's pytest judged nothing (exit 3 of `ladder
    merge`), or None. A folder without a readable report is left to merge_reports to refuse (exit 2)."""
    for folder in folders:
        try:
            rungs = json.loads((Path(folder).expanduser() / "report.json").read_text())["rungs"]
            exits = [(rung, r.get("exit")) for rung, r in rungs.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        for rung, code in exits:
            if code in PYTEST_BROKE or code == NO_TEST:
                what = f"pytest {PYTEST_BROKE[code]}" if code in PYTEST_BROKE else "collected no test"
                return harness_line(f"ladder merge: {folder}: rung {rung}", f"{what} (pytest exit {code})",
                                    tail=" (that shard's run said why)")
    return None


def cmd_ladder(args) -> int:
    """Run the rungs in order; stop at the first red one unless --keep-going, at a broken one always.
    What the run takes of the machine is sampled from the model's conversion to the last rung
    (ladder/run/resources.py) and goes into the report."""
    from ladder.run.resources import Resources

    args.started_at = time.perf_counter()  # the total, last line but one
    resources = Resources().start()
    try:
        return _ladder(args, resources)
    finally:
        resources.stop()
        end_warm_up(getattr(args, "warming", None), stop=True)  # a refused model: nothing left compiling


def start_warm_up(args) -> subprocess.Popen | None:
    """The selected device backends' once-per-machine cost (CUDA: NVRTC on every module, into CuPy's
    on-disk kernel cache), started in a process of its own while the parent converts and checks the model;
    the rungs start once it has ended (`end_warm_up`). Each rung's controller still warms up (ladder/plugin)
    and finds the cache full. Without this, on a fresh machine the three side-by-side controllers each ran
    NVRTC on every module at once, after the conversion: the 0.5B-size model's first run on one H200 took
    9 s longer than the same run with the cache full. None where no selected backend needs a device or can
    run here (a CPU machine: nothing is started)."""
    names = device_backends(args)
    if not names:
        return None
    code = "from kernels import backend_class\n" + "".join(f"backend_class({n!r}).warm_up()\n" for n in names)
    # its failure is not reported here: the controllers' own warm-up says it, in the rung's output
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=rung_environment(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def end_warm_up(proc: subprocess.Popen | None, stop: bool = False) -> None:
    """Wait for the warm-up process to end (or, with `stop`, end it)."""
    if proc is None or proc.poll() is not None:
        return
    if stop:
        proc.kill()
    proc.wait()


def _ladder(args, resources) -> int:
    from ladder.run import report as ladder_report
    from engine.resolve import resolve_model

    check_required_backends(args)
    from ladder.plugin.groups import spread_below

    spread_below()  # a bad NANOQWEN_SPREAD_BELOW is one line and exit 2, before any rung
    if args.shard:
        from ladder.plugin.sharding import ShardError, parse_shard

        try:
            parse_shard(args.shard)
        except ShardError as e:
            raise LadderArgumentError(str(e)) from None
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    unknown = sorted(set(rungs) - set(RUNGS))
    if unknown or not rungs:
        raise LadderArgumentError(f"--rungs {args.rungs!r}: unknown rung(s) {unknown}; the rungs are {', '.join(RUNGS)}")
    extra = list(args.pytest_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    for opt in ("model", "prompts", "baseline"):
        path = getattr(args, opt)
        if path is not None and not Path(path).expanduser().exists():
            raise LadderArgumentError(f"--{opt} {path}: no such file or folder")
        setattr(args, opt, _absolute(path))
    try:  # a bad baseline fails before the rungs, not after them
        baseline = ladder_report.load(Path(args.baseline)) if args.baseline else None
    except (OSError, ValueError) as e:
        raise LadderArgumentError(f"--baseline {args.baseline}: {e}") from None
    from engine.formats import FORMATS

    if args.quant != "all" and args.quant not in FORMATS:
        raise LadderArgumentError(f"--quant {args.quant}: unknown format; known: {', '.join(sorted(FORMATS))}, all")
    formats = sorted(FORMATS) if args.quant == "all" else [args.quant]
    model_files = []  # the model under test, one file per format it runs in
    from ladder.run.resources import describe

    resources.phase = "convert"
    args.warming = start_warm_up(args)  # beside the conversion and the checksums
    t_convert = time.perf_counter()
    if args.model:  # resolve once: an HF folder is converted here, once per format, not by each worker
        from engine.model import checked_config
        from engine.modelfile import ModelFile

        # a .nanoqwen file runs in its own format; a folder is converted to each selected one
        one_file = not Path(args.model).is_dir()
        model_files = [args.model] if one_file else [str(resolve_model(args.model, q)) for q in formats]

        def check(path: str) -> str:
            with ModelFile(path) as mf:  # a malformed model is one typed error (exit 2), not red rungs
                if one_file and args.quant not in ("all", mf.quant):
                    raise LadderArgumentError(f"--model {args.model} is quantized as {mf.quant}; to test it as "
                                              f"{args.quant}, give its Hugging Face folder")
                checked_config(mf)
                return mf.quant

        # Each file's checksums are a whole read of it; the formats' files are read side by side (zlib's
        # crc32 lets go of the GIL): 1.5 s one after another for the 0.5B-size model's four, on one H200's
        # host. The first bad file, in format order, is the error.
        with ThreadPoolExecutor(len(model_files)) as pool:
            quants = list(pool.map(check, model_files))
        if one_file:
            formats = quants
    args.model_files = model_files  # the rungs' workers are sized to them (worker_count)
    t_convert = time.perf_counter() - t_convert  # resolving the model: its conversions where they are not cached
    if args.plant_fault:  # an unknown fault is the user's typo, not a red rung
        from ladder.checks.faults import parse

        try:
            parse(args.plant_fault)
        except ValueError as e:
            raise LadderArgumentError(f"--plant-fault {args.plant_fault}: {e}") from None
    if args.prompts and "graph" in rungs:  # a bad prompt file, or ids outside the model's vocab, before any rung
        from fixtures.prompts import PromptFileError, prompts_for_model

        try:
            prompts_for_model(model_files[0] if model_files else resolve_model(None), args.prompts)
        except PromptFileError as e:
            raise LadderArgumentError(f"--prompts: {e}") from None
    from engine.outpath import check_output_folder

    out = Path(args.report or f"reports/ladder-{datetime.datetime.now():%Y%m%d-%H%M%S}").expanduser().resolve()
    check_output_folder(out)
    out.mkdir(parents=True, exist_ok=True)

    launch_map = plan_launches(args, out)
    env = rung_environment()
    ran_on = ladder_report.environment(ROOT)  # the commit, versions and GPU: the report's, and the kept results' key
    from ladder.run import kept as kept_results

    results, started = {}, datetime.datetime.now().isoformat(timespec="seconds")
    failed = False
    broke = None  # the harness line (exit 3) once a rung's pytest judged nothing
    to_run = []  # (rung, its kept-results key or None), in order: the rungs not served from what is kept
    for i, rung in enumerate(rungs, 1):
        (out / f"{rung}.json").unlink(missing_ok=True)  # a stale file from an earlier run must not count as this one
        t0 = time.perf_counter()
        parts = kept_results.key(args, rung, extra, ROOT, ran_on["environment"]) if kept_results.keepable(args, rung) else None
        served = kept_results.serve(parts, out, rung) if parts else None
        if served:  # green before on the same sources, versions, device, model and options: shown, not rerun
            counts = served["data"].get("rungs", {}).get(rung, {})
            print(f"[{i}/{len(rungs)}] rung {rung}", flush=True)
            print(f"nanoqwen: rung {rung}: kept: {counts.get('passed', 0)} passed, {counts.get('skipped', 0)} skipped "
                  f"at {served['kept']} ({served['seconds']} s) on the same sources, versions, device, model and "
                  f"options; --fresh runs it again", flush=True)
            results[rung] = {**served["data"], "exit": 0, "seconds": time.perf_counter() - t0,
                             "kept": {"at": served["kept"], "seconds": served["seconds"], "key": parts["digest"]}}
        else:
            to_run.append((rung, parts))

    kept_keys = dict(to_run)

    def conclude_rung(rung: str, code: int, error_line: str | None, seconds: float) -> bool:
        """The rung's result judged, and kept where green; True when the later rungs must not run (a broken
        rung, or a red one without --keep-going)."""
        nonlocal failed, broke
        results[rung], broke = judge_rung(rung, code, error_line, seconds, out, args)
        code = results[rung]["exit"]
        ran = sum(results[rung].get("rungs", {}).get(rung, {}).values())
        parts = kept_keys[rung]
        if parts and code == 0 and ran > 0:
            kept_results.store(parts, out, rung, seconds)
        if broke:  # the later rungs would break the same way; not even --keep-going runs them
            failed = True  # the report must not read as passed
            return True
        if code != 0:
            failed = True
            if not args.keep_going:
                print(f"nanoqwen: rung {rung} is red; stopping (--keep-going runs the rest)", file=sys.stderr)
                return True
        return False

    end_warm_up(args.warming)  # the rungs' controllers find the kernel cache full
    plan, workers = plan_side_by_side(args, [r for r, _ in to_run], model_files)
    side_seconds = None
    if plan is not None:
        print(plan.line, flush=True)
        t0 = time.perf_counter()
        commands = [(r, rung_command(r, out, args, extra, plan.workers[r])) for r, _ in to_run]
        run_side_by_side(commands, env, out, rungs, resources, conclude_rung)
        side_seconds = time.perf_counter() - t0
    else:
        for rung, _ in to_run:
            print(f"[{rungs.index(rung) + 1}/{len(rungs)}] rung {rung}", flush=True)
            resources.phase = rung
            t0 = time.perf_counter()
            code, error_line = run_rung(rung_command(rung, out, args, extra, workers.get(rung)), env)
            if conclude_rung(rung, code, error_line, time.perf_counter() - t0):
                break
    resources.stop()
    if launch_map is not None:
        keep_launches(results, out, launch_map)
    meta = {"model": args.model or "default", "backends": [args.backend or "auto"], "formats": formats, "started": started,
            "plant_fault": args.plant_fault, "argv": sys.argv[1:], "shard": args.shard, "changed": args.changed,
            "model_files": model_files, "baseline": args.baseline, "resources": resources.record(model_files),
            "model_seconds": round(t_convert, 1),
            "seconds": round(time.perf_counter() - args.started_at, 1),  # the whole run, up to its report
            "side_by_side": None if side_seconds is None else {"rungs": [r for r, _ in to_run], "workers": plan.workers,
                                                               "seconds": round(side_seconds, 1)},
            # the commit of the checkout the rungs imported (ROOT), the library versions, the GPU
            **ran_on}
    # coverage is judged on a whole ladder: not on a subset of rungs, nor on a shard (its calls are partial)
    rep, failed = ladder_report.conclude(results, meta, out, failed, baseline,
                                         require_coverage=args.coverage and len(rungs) == len(RUNGS) and not args.shard)
    print_table(rep, args.coverage)
    if side_seconds is not None:
        added = sum(results[r]["seconds"] for r, _ in to_run if r in results)
        print(f"rungs: side by side in {side_seconds:.1f} s of wall time (one after another, their seconds add up "
              f"to {added:.1f} s)")
    print(f"model: resolved in {t_convert:.1f} s (conversions included); machine: {describe(meta['resources'])}")
    print(f"ladder: {meta['seconds']:.1f} s of wall time, from the start to the report")
    print(f"report: {out}/report.md, report.json, junit-*.xml")
    if broke:  # last, where it is seen: a broken harness is not a red rung, whatever the report judged
        print(broke, file=sys.stderr)
        return HARNESS_BROKE
    return RED if failed else GREEN


def judge_rung(rung: str, code: int, error_line: str | None, seconds: float, out: Path, args) -> tuple[dict, str | None]:
    """A finished rung's result for the report (its JSON, exit status and seconds) and, where its pytest
    judged nothing, the harness line (exit 3); the lines a user needs about it printed."""
    rung_json = out / f"{rung}.json"
    data = json.loads(rung_json.read_text()) if rung_json.exists() else {}
    ran = sum(data.get("rungs", {}).get(rung, {}).values()) if data else 0
    broke = None
    if args.shard and data and ran == 0 and code in (0, NO_TEST):
        code = 0  # this shard holds none of the rung's tests; `ladder merge` fails a rung empty in every shard
    elif args.changed and data and ran == 0 and code in (0, NO_TEST):
        print(f"nanoqwen: rung {rung}: no case of it launches the code changed since {args.changed}")
        code = 0
    elif code in PYTEST_BROKE:  # pytest's collection errors are on stdout; the JUnit file holds them too
        detail = error_line or (collection_error(out / f"junit-{rung}.xml") if code == 2 else None)
        broke = harness_line(f"rung {rung}", f"pytest {PYTEST_BROKE[code]} (pytest exit {code})", detail)
    elif code in (0, NO_TEST) and ran == 0:  # pytest's "no tests collected", or a run that wrote no result
        what = "collected no test" + ("" if data else f" (no {rung_json.name} written)") + f" (pytest exit {code})"
        broke = harness_line(f"rung {rung}", what, error_line, tail="")
        code = NO_TEST
    elif ran == 0:  # tests failed, or pytest was killed, before any result was written: red, and said so
        print(f"nanoqwen: rung {rung}: pytest exit {code} and no result written", file=sys.stderr)
    return {**data, "exit": code, "seconds": seconds}, broke


def plan_side_by_side(args, rungs: list[str], model_files: list[str]):
    """(the side-by-side plan or None, each rung's `-n` where already chosen) for the rungs to run now
    (ladder/run/workers.py side_by_side); the lines that say what was chosen printed."""
    from ladder.run.workers import ModelSize, side_by_side

    running = running_backends(args)
    workers = {r: worker_count(args, r) for r in rungs if r != "unit"} if len(rungs) > 1 else {}
    try:
        plan, why = side_by_side(rungs, workers, ModelSize.of(model_files) if model_files and workers else None,
                                 running, os.cpu_count() or 1, args.workers)
    except ValueError as e:
        raise LadderArgumentError(str(e)) from None
    if why:
        print(why, flush=True)
    return plan, workers


def run_side_by_side(commands: list[tuple[str, list[str]]], env: dict, out: Path, rungs: list[str], resources,
                     conclude) -> None:
    """Every rung's pytest started at once (RungRun, each with its own watchdog); concluded in the ladder's
    order as each finishes: `conclude(rung, code, error_line, seconds)`, which returns True when the later
    rungs must not count (a red rung without --keep-going, a broken one); those are then stopped and left
    out of the report, as one after another they would not have run.

    The first rung's stdout is this process's, live; each later one's goes to a file in the report folder
    that is printed, under the rung's header, once the rungs before it have been concluded. Progress lines
    (stderr) come live from every rung; each names its rung or its format."""
    pending = [r for r, _ in commands]
    runs: dict[str, tuple[RungRun, float]] = {}
    files: dict[str, Path] = {}
    seconds: dict[str, float] = {}

    def header(rung: str, beside: bool) -> None:
        print(f"[{rungs.index(rung) + 1}/{len(rungs)}] rung {rung}" + (" (ran beside the rungs before it)" if beside else ""),
              flush=True)

    def stop_pending() -> None:
        for rung in pending:
            run = runs.get(rung)
            if run is not None:
                run[0].stop()
                run[0].tidy()
        pending.clear()

    try:
        with _signals_as_exceptions():
            header(pending[0], False)
            for i, (rung, cmd) in enumerate(commands):
                stdout = None
                if i:
                    files[rung] = out / f".stdout-{rung}.txt"
                    stdout = open(files[rung], "wb")
                try:  # a kept stdout: the rung's progress lines go to stderr too (ladder/plugin/summary.py)
                    runs[rung] = (RungRun(cmd, {**env, "NANOQWEN_RUNG_OUTPUT": "kept"} if i else env, rung, out,
                                          stdout=stdout), time.perf_counter())
                finally:
                    if stdout is not None:
                        stdout.close()  # the rung's pytest holds its own descriptor
            while pending:
                for rung in pending:
                    run, t0 = runs[rung]
                    if rung not in seconds and run.poll() is not None:
                        seconds[rung] = time.perf_counter() - t0
                resources.phase = "+".join(r for r in pending if r not in seconds) or pending[0]
                head = pending[0]
                if head not in seconds:
                    time.sleep(WATCH_SECONDS)
                    continue
                pending.pop(0)
                code, error_line = runs[head][0].finish()
                if head in files:
                    header(head, True)
                    sys.stdout.flush()
                    with open(files[head], "rb") as f:
                        sys.stdout.buffer.write(f.read())
                    sys.stdout.flush()
                if conclude(head, code, error_line, seconds[head]):
                    stop_pending()
    except BaseException:  # Ctrl-C, SIGTERM: stop every rung, their workers too, before passing it on
        stop_pending()
        raise
    finally:
        for path in files.values():
            path.unlink(missing_ok=True)


def plan_launches(args, out: Path) -> Path | None:
    """The rungs' launch-map flags (ladder/changes/launches.py), set on `args.launch_flags`; returns the kept map's
    file when this run records one. The map is recorded where that costs nothing (CUDA launches; NumPy on
    Python 3.12+), with --record-launches, and when --changed finds none to read. With --changed REV
    the rungs run only the cases that launch kernel code changed since REV."""
    from kernels import backend_needs_device
    from ladder.changes import launches

    backends = selected_backends(args)
    # a device backend's launches report themselves (kernels/base.py observe_launches): free to record
    free = launches.recording_is_free() or all(backend_needs_device(b) for b in backends)
    record = args.record_launches or free
    path = launches.map_file(args.backend or "all", f"{args.model}|{args.prompts}|{args.quant}")
    args.launch_flags = []
    if args.changed:
        try:
            patterns, what = launches.changed_patterns(args.changed)
        except launches.ChangeError as e:
            raise LadderArgumentError(f"--changed {args.changed}: {e}") from None
        known = launches.load_map(path)
        if patterns is None:
            print(f"--changed {args.changed}: {what[0]} changed, outside the kernels: every case runs")
        elif known is None:
            record = True
            print(f"--changed {args.changed}: no launch map for this backend and model yet: every case runs, "
                  f"and this run records one")
        else:
            launches.write_selection(out / "launching.json", patterns, known)
            chosen = len(launches.select(known, patterns))
            print(f"--changed {args.changed}: {len(what)} kernel function(s) changed "
                  f"({', '.join(what[:4])}{', ...' if len(what) > 4 else ''}); {chosen} of {len(known)} known cases "
                  f"launch them, and cases the map does not know run too")
            args.launch_flags += ["--launching", str(out / "launching.json")]
    if record and not args.plant_fault:
        args.launch_flags.append("--record-launches")
        return path
    return None


def keep_launches(results: dict, out: Path, path: Path) -> None:
    """The rungs' launch maps into the report folder (launches.json) and the kept map of this backend and model."""
    from ladder.changes import launches

    cases = {n: u for r in results.values() for n, u in r.pop("launches", {}).items()}
    for r in results.values():
        r.pop("case_seconds", None)  # mutate's timeouts read it from the rung JSON; the report need not
    if cases:
        (out / "launches.json").write_text(json.dumps(cases, indent=0))
        launches.keep_map(path, cases)


def cmd_merge(args) -> int:
    """`nanoqwen ladder merge REPORT... [--report OUT] [--baseline DIR] [--coverage]`: one report from
    the report folders of the shards of one run (ladder/run/merge.py). Its own parser (register_merge): a
    run's option given to a merge is a usage error, one line, exit 2."""
    from ladder.run import report as ladder_report
    from ladder.run.merge import ShardError, merge_reports

    folders = args.reports
    missing = [f for f in folders if not Path(f).expanduser().is_dir()]
    if missing:
        raise LadderArgumentError(f"ladder merge: {missing[0]}: no such folder")
    baseline = None
    if args.baseline:
        try:
            baseline = ladder_report.load(Path(args.baseline).expanduser())
        except (OSError, ValueError) as e:
            raise LadderArgumentError(f"--baseline {args.baseline}: {e}") from None
    from engine.outpath import check_output_folder

    out = Path(args.report or f"reports/ladder-merged-{datetime.datetime.now():%Y%m%d-%H%M%S}").expanduser().resolve()
    check_output_folder(out)
    broke = broken_shard(folders)  # before merging: a broken shard may lack the very files a merge needs
    if broke:
        print(broke, file=sys.stderr)
        return HARNESS_BROKE
    try:
        rep, failed = merge_reports(folders, out, baseline=baseline, coverage=args.coverage)
    except ShardError as e:
        raise LadderArgumentError(str(e)) from None
    print(f"merged {rep['meta']['shards']} report(s): {', '.join(rep['meta']['merged_from'])}")
    print_table(rep, args.coverage)
    print(f"report: {out}/report.md, report.json, junit-*.xml")
    empty = [rung for rung, r in rep["rungs"].items() if r.get("exit") == NO_TEST]
    if empty:  # each shard held none of its tests, which each shard's run took for green
        print(harness_line(f"ladder merge: rung {empty[0]}", "collected no test in any shard", tail=""), file=sys.stderr)
        return HARNESS_BROKE
    return RED if failed else GREEN


def print_table(rep: dict, show_coverage: bool) -> None:
    print()
    print(f"{'rung':<7}{'exit':>5}{'passed':>8}{'failed':>8}{'skipped':>9}{'seconds':>9}")
    for rung, r in rep["rungs"].items():
        print(f"{rung:<7}{r['exit']:>5}{r.get('passed', 0):>8}{r.get('failed', 0):>8}{r.get('skipped', 0):>9}"
              f"{r['seconds']:>9.1f}" + (f"  kept from {r['kept']['at']}" if r.get("kept") else ""))
    from ladder.run.report import NO_FORMAT, failure_view, op_key

    # one row per (rung, backend, format, op): a format's op that fails must not hide behind another's
    ops = sorted(rep["ops"], key=lambda o: tuple(str(x) for x in op_key(o)))
    if ops:
        print(f"\n{'rung':<7}{'backend':<10}{'format':<18}{'op':<22}{'worst / floor':>14}")
        for o in ops:
            m = o["multiple"]
            print(f"{o['rung']:<7}{str(o['backend']):<10}{o.get('format') or NO_FORMAT:<18}{o['op']:<22}"
                  f"{'exact' if m == 0 else f'{m:.2f}x':>14}" + ("" if o.get("passed", True) else "  FAILED"))
    if show_coverage:
        print("\ncoverage (rungs that called each op):")
        for b, ops in rep["coverage"].items():
            for op, rungs in ops.items():
                print(f"  {b:<8}{op:<22}{', '.join(rungs) if rungs else 'NO RUNG CALLS IT (a finding)'}")
    for r in rep.get("regressions", []):
        print(f"REGRESSION {r}")
    failures = [failure_view(f) for f in rep.get("failures", [])]
    for f in failures[:5]:
        where = "/".join(str(x) for x in (f["backend"], f["format"] or NO_FORMAT) if f["rung"])
        print(f"FAILED {f['test']}" + (f" [{where}]" if where else "") + (f": {f['message'][0]}" if f["message"] else ""))
    if len(failures) > 5:
        print(f"... and {len(failures) - 5} more failures (report.md lists them with their messages)")
    if rep.get("next"):
        print("\nnext:")
        for cmd in rep["next"]:
            print(f"  {cmd}")


def register(sub) -> None:
    from kernels import backend_names  # the registry: a new backend needs no edit here

    lad = sub.add_parser("ladder", help="run the unit, layer and graph rungs in order and write a report",
                         description="Run the unit, layer and graph rungs in order, each as its own pytest "
                                     "process, and write a report folder. Arguments after `--` go to every "
                                     "rung's pytest (e.g. `-- -k rmsnorm`). `nanoqwen ladder merge REPORT...` "
                                     "joins the report folders of a run's shards (its own --help).",
                         epilog="Exit status (also of `nanoqwen ladder merge`): 0 green; 1 a rung is red (tests "
                                "failed, a --baseline regression, --coverage, the near-tie flip rule); 2 bad input, "
                                "refused before any rung; 3 the harness broke, not a kernel: a rung's pytest ended "
                                "in a usage error, an internal error, a collection error or interruption, or "
                                "collected no test (one line says which; it stops the ladder even under "
                                "--keep-going, and wins over red).")
    lad.add_argument("--model", help=".nanoqwen file or Hugging Face folder (default: the embedded default model)")
    lad.add_argument("--prompts", help="graph-rung prompts (JSON lines with 'id' and 'ids' or 'text'); default: "
                                       "the default prompt set, re-tokenized or drawn for a model of another vocab")
    lad.add_argument("--quant", default="all", metavar="FORMAT|all",
                     help="quantization formats to run every rung in (default: all; docs/FORMAT.md)")
    lad.add_argument("--backend", choices=[*backend_names(), "all"],
                     help="default: every registered backend; one this machine cannot run skips with its reason")
    lad.add_argument("--require-backend", choices=backend_names(),
                     help="a backend that must run (skip = failure; where it cannot run at all, the command "
                          "stops at once, exit 2)")
    lad.add_argument("--rungs", default=",".join(RUNGS), help="comma-separated subset, in order (default: all)")
    lad.add_argument("--keep-going", action="store_true", help="run every rung even after a red one")
    lad.add_argument("--fresh", action="store_true",
                     help="run the unit rung even where a green result of the same sources, versions, device, "
                          "model and options is kept (docs/LADDER.md, Kept results)")
    lad.add_argument("--report", help="report folder (default: reports/ladder-TIMESTAMP under the current folder)")
    lad.add_argument("--baseline", help="an earlier report folder: flag ops that regressed or newly fail")
    lad.add_argument("--coverage", action="store_true", help="list each backend's ops and the rungs that called them")
    lad.add_argument("--plant-fault", help="plant a fault from ladder/checks/faults.py (the run must go red)")
    lad.add_argument("--hypothesis-profile", choices=["ci", "nightly"], help="Hypothesis profile (default ci)")
    lad.add_argument("--new-tokens", type=int_at_least(1, "a positive integer"), help="graph rung: tokens generated per prompt "
                                                              "(default: past the next page boundary)")
    lad.add_argument("--skip-determinism", action="store_true",
                     help="graph rung: skip the three-run determinism test (slow machines)")
    lad.add_argument("--shard", metavar="I/N", help="run shard I of N of every rung (a stable hash of each test's id; "
                                                     "`nanoqwen ladder merge R1 ... RN` joins the shards' report folders)")
    lad.add_argument("--changed", metavar="REV", help="run only the cases that launch kernel code changed since git "
                     "revision REV (the launch map a full run keeps; a change outside kernels/ runs everything)")
    lad.add_argument("--record-launches", action="store_true",
                     help="record which kernel code each case launches, where that is not already on (NumPy before "
                          "Python 3.12, which it slows by about half)")
    lad.add_argument("-n", "--workers", default="auto", help="pytest-xdist workers per rung ('0' for none)")
    lad.add_argument("pytest_args", nargs="*", metavar="-- PYTEST ARGS",
                     help="extra arguments for every rung's pytest, after `--`")
    lad.set_defaults(func=cmd_ladder)


def register_merge(sub) -> None:
    """`nanoqwen ladder merge`: the command line turns those two words into this parser's name."""
    m = sub.add_parser("ladder-merge", prog="nanoqwen ladder merge",
                       help="`nanoqwen ladder merge REPORT...`: join the report folders of a run's shards "
                            "(--shard I/N) into one report",
                       description="Join the report folders of the shards of one run (`nanoqwen ladder --shard "
                                   "I/N`) into one report folder, judged as a run is (docs/LADDER.md, \"Several "
                                   "GPUs and several machines\").",
                       epilog="Exit status: as nanoqwen ladder's; 3 when a shard's rung broke, or a rung is "
                              "empty in every shard.")
    m.add_argument("reports", nargs="+", metavar="REPORT", help="the shards' report folders, in any order")
    m.add_argument("--report", help="the merged report folder (default: reports/ladder-merged-TIMESTAMP under "
                                    "the current folder)")
    m.add_argument("--baseline", help="an earlier report folder: flag ops that regressed or newly fail")
    m.add_argument("--coverage", action="store_true", help="list each backend's ops and the rungs that called them")
    m.set_defaults(func=cmd_merge)
