"""The graph rung's HF simulation of one model in a pytest worker: built on first use, its greedy runs
and full forwards kept per machine (ladder/judges/reference_store.py), dropped when the worker moves to
another format.
The rung's fixtures (ladder/graph/test_graph.py) hold one per model."""

from __future__ import annotations

import os
import re
import sys

from engine.modelfile import ModelFile
from engine.progress import Progress, progress_bar
from fixtures.dequantized import dequantized_weights
from ladder.judges.reference_store import KeptReferences
from ladder.judges.tokens import reference_greedy_batch, tokens_to_generate

SMALL_MODEL_PARAMS = 100_000_000  # below this, the reference runs single-threaded (see ReferenceRuns)


class ReferenceRuns:
    """The HF simulation of one model, built on first use on the reference's device (reference/hf.py
    `model_device`: the GPU where torch sees one). Each prompt's greedy run is computed once on this
    machine and kept (ladder/judges/reference_store.py KeptReferences); the first one asked for brings the
    runs of every prompt `planned` (the run's prompts of this format and the floor prompts) that are not
    kept yet, computed together in batches (ladder/judges/tokens.py `reference_greedy_batch`): a prompt at
    a time, a small model's run was all per-step overhead, and four workers' runs took turns on the GPU.
    Building it and the runs print progress lines with the time left (engine/progress.py: through the
    ladder's progress folder, since a worker's stderr is captured)."""

    def __init__(self, model_path, new_tokens: int | None = None, planned=()):
        self.model_path = model_path
        self.new_tokens = new_tokens  # --new-tokens, else each prompt's new_tokens_for
        self.config = self.weights = None  # the dequantized weights, shared with the floor
        self._hf = None
        mf = ModelFile(model_path, verify_checksums=False)
        self._vocab = mf.config_dict["vocab_size"]
        self.label = f"{mf.quant}"
        self._kept = KeptReferences(model_path)
        self._runs = {}
        self._planned = list(planned)  # the prompts this process will ask for (Prompt objects), brought together
        self._broken: str | None = None  # why building the simulation failed (_building), until release()

    def dequantized(self) -> tuple[dict, dict]:
        """(config dict, HF name -> float32 weights): what the simulation and the floor's plain forward
        read; torch tensors on the GPU when the reference runs there (one copy, shared by both)."""
        if self.weights is None:
            from reference.hf import model_device

            bar = progress_bar(f"HF simulation [{self.label}]: dequantizing", unit="tensors")
            self.config, self.weights = self._building(
                "dequantizing its weights",
                lambda: dequantized_weights(self.model_path, device=model_device(), progress=bar))
        return self.config, self.weights

    def model(self):
        if self._hf is None:
            from reference.hf import hf_model

            config, weights = self.dequantized()
            self._hf = self._building("building the module", lambda: hf_model(config, weights))
            workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
            params = sum(w.numel() if hasattr(w, "numel") else w.size for w in weights.values())
            # A small model's ops are too short to split across threads (on a busy 2-core machine two
            # threads ran the default model's reference 8x slower than one); a large one shares the
            # cores among the xdist workers instead of oversubscribing them. (On a GPU: the launches' thread.)
            self._threads = 1 if params < SMALL_MODEL_PARAMS else max(1, (os.cpu_count() or 1) // workers)
        return self._hf

    def _building(self, what: str, build):
        """build(), once: a simulation that could not be built (out of memory, most often) fails every
        later case of this worker and format at once with the first failure's line, instead of each
        case spending seconds building it again (a 7B model's copy is 30 GB: 65 cases of one format once
        took 8 minutes to fail one by one). The partial copy is dropped first."""
        if self._broken is not None:
            raise ReferenceUnavailableError(self._broken)
        try:
            return build()
        except Exception as e:
            line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:300]
            oom = re.search(r"out ?of ?memory", f"{type(e).__name__} {line}", re.IGNORECASE)
            hint = " (the rung's workers hold more memory than this machine has: fewer of them with -n)" if oom else ""
            self._broken = (f"the HF simulation [{self.label}] could not be built on this worker ({what}): "
                            f"{type(e).__name__}: {line}{hint}; its later cases fail with this line")
            self._drop()
            raise

    def _drop(self) -> None:
        self._hf = None
        self.config = self.weights = None
        torch = sys.modules.get("torch")  # never imported for this: a run whose references are all kept has none
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the float32 copy goes back to the device, for the next format's

    def release(self) -> None:
        """Drop the HF simulation and its weights, keep the runs made (rebuilt if a new prompt needs it).
        A failure to build it is forgotten too: the next format's worker memory may allow it."""
        self._drop()
        self._broken = None

    def get(self, prompt):
        if prompt.id not in self._runs:
            wanted = [prompt, *(p for p in self._planned if p.id != prompt.id and p.id not in self._runs)]
            self._planned = []  # brought once; a prompt outside the plan (another -k) comes on its own
            for p in wanted:
                bad = [t for t in p.ids if t >= self._vocab]
                if bad:
                    raise ValueError(f"prompt {p.id!r} holds token id {bad[0]}, outside the model's vocab of "
                                     f"{self._vocab}: is --prompts meant for another model?")
            items = [(p.ids, tokens_to_generate(len(p.ids), self.new_tokens)) for p in wanted]
            for p, ref in zip(wanted, self._kept.get_many(items, self._run)):
                self._runs[p.id] = ref
        return self._runs[prompt.id]

    def full_logits(self, ids, start: int):
        """The float32 logits of the simulation's full forward (no KV cache) over `ids`, positions `start`
        on: computed once on this machine and kept with the model's runs (KeptReferences.full_forward)."""
        from reference.hf import hf_logits

        return self._kept.full_forward(ids, start, lambda: hf_logits(self.model(), list(ids))[start:])

    def _run(self, items):
        """The greedy runs of `items` ((ids, n_new) pairs), batched, with progress by batch."""
        hf = self.model()
        progress = Progress(f"HF simulation [{self.label}]", len(items), "prompts run")
        before = torch_threads(self._threads)
        try:
            with progress.working(f"{len(items)} prompts, batched"):
                return reference_greedy_batch(hf, [ids for ids, _ in items], [n for _, n in items], done=progress.step)
        finally:
            torch_threads(before)
            progress.finish()


class ReferenceUnavailableError(RuntimeError):
    """The HF simulation of this worker's format could not be built (ReferenceRuns._building)."""


def torch_threads(n: int) -> int:
    """Set torch's intra-op threads to `n`; the number before."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before
