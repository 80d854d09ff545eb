"""The references' results, computed once per machine and kept: the graph rung's bounds and the HF
simulation's greedy runs (ladder/judges/tokens.py `derive_bounds`, `reference_greedy_batch`), and the layer rung's HF
decoder-layer outputs (reference/hf.py `hf_block_outputs`).

All are pure functions of their inputs and all cost more than the engine's own checks. The HF
simulation's greedy runs of the 100 prompts of one format of the default model take about 9 s of one CPU
thread batched (27 to 31 s a prompt at a time), against 4 s for the engine's eager and graph runs of them
on an H200. At the 0.5B shape on an H200 a prompt at a time took 0.8 s, with four workers sharing the GPU.
Measuring a model's bounds adds a plain forward on each floor prompt: seconds on the default model,
minutes at the 0.5B shape on a CPU. Importing transformers for a layer rung's first block costs 3.6 s
of a CI core. And every pytest-xdist worker, later run, shard, bisect step and mutant asks for the same
ones.

So they are kept under the nanoqwen cache folder, keyed by everything they depend on: the model's
fingerprint (its format, config and tensor checksums) or, for a block, the digest of its weights and
input; the sources that compute or judge them (reference/, fixtures/dequantized.py, engine/formats/,
ladder/judges/tokens.py, ladder/judges/tolerances.py); the versions of numpy, torch and transformers; and per item
its prompts' token ids and the number of new tokens. A changed input is a new key, never a stale file;
the engine and the kernels are not in the key (a mutant or a planted fault changes what is checked,
not what it is checked against).

- Bounds (`graph-bounds/KEY.json`): the first worker to need them measures them while holding a lock file
  (its process id and host inside); the others wait for its result, and later runs read it. A lock whose
  process is gone (a killed run) is taken over at once.
- Full forwards (`graph-references/MODEL_KEY/full-IDS_KEY.npz`, float32 logits): the HF simulation's
  forward over a token sequence without its cache, from one position on, against which the graph rung
  holds the simulation's own cached runs (`full_forward`); the judging is done again each time.
- Reference runs (`graph-references/MODEL_KEY/PROMPT_KEY.npz`, tokens and float32 logits): computed
  together, all the prompts of a model a run asks for in one batched run (`get_many`), by one process at
  a time holding `graph-references/.MODEL_KEY.lock`; a worker that needs the same prompts waits and reads
  them. Block outputs (`layer-references/KEY.npz`), and a seeded synthetic block's quantized tensors with
  its references' outputs (`kept_synthetic_block`): no lock; two processes that compute the same item
  write the same values, and the later replace wins. The most recently used
  models' folders, and block files, are kept up to KEPT_BYTES each.

Every file is written to a temporary name and renamed into place. `NANOQWEN_FRESH_REFERENCES=1`
computes and writes everything again without reading what is kept (to check the cache itself).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from ladder.judges.tokens import GraphBounds, Reference

STALE_LOCK_SECONDS = 3600.0  # a lock from another host older than this belongs to a worker that died
KEPT_BYTES = 8 << 30  # kept per kind, newest first (a 152k vocab: ~1 GB of reference runs for 100 prompts, per format)
# A block of more weights (the 7B shape: 233 M) runs on the GPU in milliseconds, and hashing it costs more.
# Below it (the 0.5B shape: 14.9 M, the 1.5B: 46.8 M) a kept block saves its worker the torch and
# transformers import on a second run, seconds against the digest's fraction of one.
BLOCK_KEPT_BELOW = 50_000_000
_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
SOURCES = (_HERE / "tokens.py", _HERE / "tolerances.py", *sorted((_REPO / "reference").glob("*.py")),
           _REPO / "fixtures" / "dequantized.py", *sorted((_REPO / "engine" / "formats").glob("*.py")))


def missing_library() -> str | None:
    """The first of torch and transformers (the references' libraries) that is not installed, found without
    importing either: a rung whose results are kept never imports them. None when both are there."""
    import importlib.util

    return next((d for d in ("torch", "transformers") if importlib.util.find_spec(d) is None), None)


def _fresh() -> bool:
    return os.environ.get("NANOQWEN_FRESH_REFERENCES", "") not in ("", "0")


@lru_cache(maxsize=None)
def _sources_and_versions() -> str:
    """The digest of SOURCES and of the numeric libraries' versions (read from their metadata: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    for f in SOURCES:
        h.update(f.name.encode() + f.read_bytes())
    for dist in ("numpy", "torch", "transformers"):
        try:
            h.update(f"{dist}=={version(dist)}".encode())
        except PackageNotFoundError:
            h.update(f"{dist} missing".encode())
    return h.hexdigest()


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([_sources_and_versions(), *parts]).encode()).hexdigest()[:24]


def bounds_key(model_path, floor_prompts, new_tokens) -> str:
    from fixtures.golden import model_fingerprint

    return _key("bounds", model_fingerprint(model_path), [(p.id, list(p.ids)) for p in floor_prompts], new_tokens)


BOUNDS, REFERENCES, BLOCKS = "graph-bounds", "graph-references", "layer-references"  # the kinds kept


def kept_root(kind: str) -> Path:
    """The folder of one kind of kept result under the nanoqwen cache folder."""
    from engine.resolve import cache_root

    return cache_root() / kind


def _abandoned(lock: Path) -> bool:
    """A lock whose measuring process is gone (killed, say): its process id on this host no longer runs,
    or, for a lock from another host sharing the cache folder, it is older than STALE_LOCK_SECONDS."""
    try:
        pid, _, host = lock.read_text().partition(" ")
        age = time.time() - lock.stat().st_mtime
    except (FileNotFoundError, ValueError):
        return False
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return age > STALE_LOCK_SECONDS


@contextlib.contextmanager
def held(lock: Path, poll: float = 0.5):
    """Hold the lock file `lock` (its process id and host inside) for the block, waiting while another
    process holds it; a lock whose process is gone (`_abandoned`) is taken over at once."""
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            if _abandoned(lock):
                lock.unlink(missing_ok=True)
            else:
                time.sleep(poll)
    try:
        os.write(fd, f"{os.getpid()} {socket.gethostname()}".encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)


def load_or_derive(key: str, derive: Callable[[], GraphBounds], poll: float = 0.5) -> GraphBounds:
    """The kept bounds of `key`, else derive them (one process at a time: the others wait) and keep them."""
    folder = kept_root(BOUNDS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.json"
    if path.exists() and not _fresh():
        return GraphBounds.from_record(json.loads(path.read_text()))
    with held(folder / f"{key}.lock", poll):
        if path.exists() and not _fresh():  # kept by the process that held the lock while we waited
            return GraphBounds.from_record(json.loads(path.read_text()))
        bounds = derive()
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(bounds.record()))
        os.replace(tmp, path)
        return bounds


class KeptReferences:
    """The reference runs of one model kept on this machine: `get(ids, n_new, run)` returns the kept run
    of those prompt ids and new tokens, else calls `run()`, keeps its result and returns it."""

    def __init__(self, model_path):
        from fixtures.golden import model_fingerprint

        self.folder = kept_root(REFERENCES) / _key("references", model_fingerprint(model_path))
        self._used = False

    def _path(self, ids, n_new: int) -> Path:
        return self.folder / (hashlib.sha256(json.dumps([list(map(int, ids)), int(n_new)]).encode()).hexdigest()[:24]
                              + ".npz")

    def _kept(self, ids, n_new: int) -> Reference | None:
        kept = _read(self._path(ids, n_new), "prompt_len", "tokens", "logits")
        if kept is None:
            return None
        self._mark_used()
        return Reference(int(kept[0]), kept[1], kept[2])

    def get(self, ids, n_new: int, run: Callable[[], Reference]) -> Reference:
        ref = self._kept(ids, n_new)
        if ref is None:
            ref = run()
            self._keep(self._path(ids, n_new), ref)
        return ref

    def get_many(self, items, run: Callable[[list], list[Reference]], poll: float = 0.5) -> list[Reference]:
        """The runs of `items` ((ids, n_new) pairs): the kept ones read, the others computed together by
        `run(missing items)` and kept. One process computes a model's runs at a time, holding a lock file
        beside its folder: a worker that needs the same prompts waits, then reads what the first kept
        (pytest-xdist workers that share a format's prompts compute them once, in one batch)."""
        found = [self._kept(ids, n) for ids, n in items]
        if all(r is not None for r in found):
            return found
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        with held(self.folder.parent / f".{self.folder.name}.lock", poll):  # a dot name: pruning passes it by
            missing = [i for i, r in enumerate(found) if r is None]
            for i in missing:  # kept by the process that held the lock while we waited
                found[i] = self._kept(*items[i])
            missing = [i for i in missing if found[i] is None]
            if missing:
                for i, ref in zip(missing, run([items[i] for i in missing])):
                    self._keep(self._path(*items[i]), ref)
                    found[i] = ref
        return found

    def full_forward(self, ids, start: int, run: Callable[[], np.ndarray]) -> np.ndarray:
        """The float32 logits of the simulation's full forward (no cache) over `ids`, positions `start` on:
        kept, else `run()` (which computes exactly those) and keep it."""
        path = self.folder / ("full-" + hashlib.sha256(json.dumps(["full", list(map(int, ids)), int(start)]).encode())
                              .hexdigest()[:24] + ".npz")
        kept = _read(path, "logits")
        if kept is not None:
            self._mark_used()
            return kept[0]
        logits = np.asarray(run(), dtype=np.float32)
        self._keep_arrays(path, logits=logits)
        return logits

    def _mark_used(self) -> None:
        """The folder's time says when its model was last used (read or written): pruning goes by it."""
        if not self._used:
            try:
                os.utime(self.folder)
                self._used = True
            except FileNotFoundError:
                pass

    def _keep(self, path: Path, ref: Reference) -> None:
        self._keep_arrays(path, prompt_len=np.int64(ref.prompt_len), tokens=np.asarray(ref.tokens, dtype=np.int64),
                          logits=np.asarray(ref.logits, dtype=np.float32))

    def _keep_arrays(self, path: Path, **arrays) -> None:
        new = not self.folder.exists()
        for attempt in (1, 2):  # a second time if another process pruned the folder away in between
            self.folder.mkdir(parents=True, exist_ok=True)
            try:
                _write(path, **arrays)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        self._used = False
        self._mark_used()
        if new:
            _prune(self.folder.parent, KEPT_BYTES)


def kept_synthetic_block(recipe, compute: Callable[[], dict]) -> dict[str, np.ndarray]:
    """The arrays of a seeded synthetic block (its quantized tensors and its references' outputs, as
    `compute()` returns them), kept under layer-references by its recipe: `recipe` (shape, seed, format,
    case, input digest), the source that draws it (fixtures/tiny_model.py) and SOURCES, which hold the
    formats' quantizers and the references. The 7B shape's block is 233 M weights: drawing and quantizing
    it on the host took 5 to 18 s of a worker, and its HF reference imports torch, where reading it back
    takes a fraction of a second."""
    draw = hashlib.sha256((_REPO / "fixtures" / "tiny_model.py").read_bytes()).hexdigest()
    root = kept_root(BLOCKS)
    path = root / f"{_key('synthetic-block', recipe, draw)}.npz"
    kept = _read_all(path)
    if kept is not None:
        os.utime(path)  # used: pruning goes by it
        return kept
    arrays = compute()
    root.mkdir(parents=True, exist_ok=True)
    _write(path, **arrays)
    _prune(root, KEPT_BYTES)
    return arrays


def _read_all(path: Path) -> dict[str, np.ndarray] | None:
    """Every array of a kept file, by name; None when it is not kept yet, is broken (computed again and
    replaced), or NANOQWEN_FRESH_REFERENCES asks for everything again."""
    if _fresh():
        return None
    try:
        with np.load(path) as z:
            return {n: z[n] for n in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None


def _read(path: Path, *names: str) -> tuple | None:
    """The arrays `names` of a kept file (_read_all); None as there, or when one of them is missing."""
    kept = _read_all(path)
    if kept is None or any(n not in kept for n in names):
        return None
    return tuple(kept[n] for n in names)


def _write(path: Path, **arrays) -> None:
    """`arrays` into `path` through a temporary file renamed into place (a reader never sees half a file)."""
    tmp = path.parent / f".{path.stem}.{os.getpid()}.tmp.npz"
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _prune(root: Path, budget: int) -> None:
    """Keep the most recently used entries (folders or files) under `root` while their sizes add up to
    `budget` (the newest always), remove the others. Another process may be pruning too, or writing into
    one: whatever is already gone counts as empty."""
    def stat(p: Path, what: str) -> float:
        try:
            return getattr(p.stat(), what)
        except FileNotFoundError:
            return 0

    entries = sorted((p for p in root.iterdir() if not p.name.startswith(".")), key=lambda p: stat(p, "st_mtime"),
                     reverse=True)
    total = 0
    for i, entry in enumerate(entries):
        total += sum(stat(f, "st_size") for f in entry.glob("*")) if entry.is_dir() else stat(entry, "st_size")
        if i and total > budget:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def kept_block(config: dict, weights: dict, layer: int, x: np.ndarray, compute: Callable[[], tuple]) -> tuple:
    """The HF decoder layer's (output, k, v) for this block and input: kept, else `compute()` and keep it.
    A block of BLOCK_KEPT_BELOW weights or more is computed every time (on the GPU, faster than its digest)."""
    prefix = f"model.layers.{layer}."
    names = sorted(n for n in weights if n.startswith(prefix))
    if sum(weights[n].size for n in names) >= BLOCK_KEPT_BELOW:
        return compute()
    h = hashlib.sha256(json.dumps([config, layer, names, list(x.shape), str(x.dtype)], sort_keys=True).encode())
    for n in names:
        a = np.ascontiguousarray(weights[n])
        h.update(f"{n}{a.shape}{a.dtype}".encode() + a.tobytes())
    h.update(np.ascontiguousarray(x).tobytes())
    root = kept_root(BLOCKS)
    path = root / f"{_key('block', h.hexdigest())}.npz"
    kept = _read(path, "out", "k", "v")
    if kept is not None:
        os.utime(path)  # used: pruning goes by it
        return kept
    out = compute()
    root.mkdir(parents=True, exist_ok=True)
    _write(path, out=out[0], k=out[1], v=out[2])
    _prune(root, KEPT_BYTES)
    return out
