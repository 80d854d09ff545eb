"""The decode step as a captured CUDA graph (a backend with `supports_graphs`: the cuda one), and
`capture`, the one capture helper the engine, the layer rung (ladder/checks/blockrun.py) and the bench use.

    model = engine.load(path, backend="cuda")
    model.enable_cuda_graph()          # Model.step / decode_step now replay one graph per token
    logits = model.decode_step(seq, token_id)

`capture(fn, stream)` runs `fn` once eagerly on `stream` (compiles, allocates every scratch buffer, so
nothing is allocated inside the capture), then captures a second run; it returns a `Graph` whose
`launch()` queues one replay on that stream. An `fn` that cannot be captured (one that copies to the
host, say) raises GraphCaptureError.

What DecodeGraph captures: `Model.forward_step` for one token (embed, every decoder block, final norm,
lm_head), the same function the eager step runs, and the argmax into `model._next`, so the next token
id stays on the device. What is not: the host-side page allocation (`seq.reserve`) and the three input
copies into fixed device buffers (token id, position, page table), which run on the graph's stream
just before each replay. The kernels read the position and the page table from those buffers, so one
graph serves every position and page boundary.

The graph is captured again when what it baked in changes: the ops bound on the backend (the ladder
wraps one to plant a fault or capture activations; a wrapper is a different object), the backend's
settings (`launch_settings`: a GEMV variant, the attention split, pdl), the KV cache (`Model.use_cache`)
or the layer weights. `model.enable_cuda_graph(False)` keeps the graph for the next enable, so turning it
off and on costs no capture; the key decides whether a replay may reuse it. The eager warm-up of
`capture` runs on the same inputs as the captured run (idempotent: it writes the same K/V slot and
logits). Turn the graph off with `model.enable_cuda_graph(False)` for a wrapper that cannot be captured.

Three ways to drive it:
- `step(seq, ids)`: one token from the host, returns the device logits after a synchronize (what
  `Model.step` uses on this path; a caller that reads the logits copies them to the host).
- `tokens(seq, first_id, n)`: the token source `Model.generate`'s loop reads on this path (a generator).
  Pages for all n steps are reserved and the page table copied once; then per token: replay the graph,
  `decode_advance` (the picked token becomes the next input, the position moves on, on the device),
  and an asynchronous 4-byte copy of the token into pinned host memory. Token i is yielded only after
  step i + 1 is queued, so the GPU always has the next step waiting; logits never leave the device.
  A consumer that stops early (a stop token) leaves one wasted step queued, whose K/V slot lies past
  the sequence's length; closing the generator waits for it and sets the sequence's length.
- `forced(seq, fed, out)`: `Model.forced_logits`' steps (teacher forcing). The given tokens go up once;
  per token: `decode_advance` from them, a replay, and a device copy of the logits into a row of `out`,
  all queued; one synchronize at the end.
"""

from __future__ import annotations

import numpy as np

# Every backend op the decode step calls; a change to any of them invalidates the graph.
DECODE_OPS = ("embed", "rmsnorm", "qkv_proj", "rope_kv_write", "attention_decode", "o_proj_residual",
              "gate_up_silu", "down_residual", "o_proj_residual_rmsnorm", "down_residual_rmsnorm", "lm_head", "argmax")


class GraphCaptureError(RuntimeError):
    """A function (the decode step, a block, a bench loop) could not be captured as a CUDA graph."""


class Graph:
    """A captured CUDA graph and the stream it replays on."""

    def __init__(self, graph, stream):
        self.graph, self.stream = graph, stream

    def launch(self) -> None:
        """Queue one replay on the graph's stream (asynchronous)."""
        self.graph.launch(self.stream)


def capture(fn, stream, what: str = "the function", hint: str = "") -> Graph:
    """`fn()` run once eagerly on `stream` (compiles, allocates scratch), then captured on it: a Graph."""
    with stream:
        fn()  # eager warm-up on the same inputs: nothing is allocated inside the capture
        stream.synchronize()
        try:
            stream.begin_capture()
            fn()
            graph = stream.end_capture()
        except Exception as e:
            if stream.is_capturing():
                try:
                    stream.end_capture()
                except Exception:
                    pass  # the capture is already invalid; ending it only discards it
            raise GraphCaptureError(f"could not capture {what} as a CUDA graph ({type(e).__name__}: {e})"
                                    + (f"; {hint}" if hint else "")) from e
    return Graph(graph, stream)


class DecodeGraph:
    def __init__(self, model):
        if not getattr(model.backend, "supports_graphs", False):
            raise ValueError(f"backend {getattr(model.backend, 'name', model.backend)!r} cannot capture the decode "
                             "step as a graph (supports_graphs is False)")
        import cupy  # only on a graph-capable backend, which already imported it

        self._cp = cupy
        self.model = model
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.graph = None
        self._key = None
        self._page_table = None
        self.captures = 0  # how many times the step was captured (tests check invalidation with it)

    def _bindings(self):
        m = self.model
        be, cache = m.backend, m.cache
        return (tuple(getattr(be, name) for name in DECODE_OPS), be.launch_settings(),
                id(cache), tuple(a.data.ptr for a in (*cache.k, *cache.v)),
                tuple(id(w) for w in m.layers), id(m.embed_tokens), id(m.norm), id(m.lm_head))

    def _body(self):
        m = self.model
        m.forward_step(m._decode_ws, self._page_table, 1)
        m.backend.argmax(m._logits, m._next)

    def _capture(self):
        self.graph = None
        self.graph = capture(self._body, self.stream, what="the decode step",
                             hint="an op wrapper that copies to the host cannot be captured: call "
                                  "model.enable_cuda_graph(False) to run it eagerly")
        self.captures += 1

    def _prepare(self, seq, ids):
        """Inputs into the graph's fixed buffers (on self.stream), then (re)capture if needed."""
        cp, ws = self._cp, self.model._decode_ws
        # Prefill and page-table updates ran on the legacy default stream; this stream does not
        # synchronise with it implicitly (non-blocking), so wait for it explicitly.
        self.stream.wait_event(cp.cuda.Stream.null.record())
        if self._page_table is None or self._page_table.shape != seq.page_table.shape:
            self._page_table = cp.empty(seq.page_table.shape, dtype=np.int32)
        ws.ids[...] = cp.asarray(np.asarray(ids, dtype=np.int32))
        ws.positions[...] = cp.asarray(np.array([seq.length], dtype=np.int32))
        self._page_table[...] = seq.page_table
        key = self._bindings() + (self._page_table.data.ptr,)
        if self.graph is None or key != self._key:
            self._capture()
            self._key = key

    def forced(self, seq, fed: np.ndarray, out) -> None:
        """Model.forced_logits' steps on this graph: out[1 + i] <- the logits after fed[i], at position
        seq.length + i, for every i; the pages are reserved already. One input copy and (re)capture, then
        per token `decode_advance` (fed[i] becomes the input, the position moves on), a replay and a device
        copy of the logits, all queued on the graph's stream; one synchronize at the end."""
        cp, m = self._cp, self.model
        ws = m._decode_ws
        with self.stream:
            self._prepare(seq, fed[:1])
            fed_dev = cp.asarray(fed)
            for i in range(len(fed)):
                if i:
                    m.backend.decode_advance(fed_dev[i:i + 1], ws.ids, ws.positions)
                self.graph.launch()
                out[i + 1] = m._logits  # queued after the replay, before the next overwrites _logits
            self.stream.synchronize()
        seq.length += len(fed)

    def tokens(self, seq, first_id: int, n: int, events: list | None = None):
        """Yield the tokens of up to n decode steps from token first_id at position seq.length.

        `events`, when given, gets a CUDA event recorded after each step (the bench times steps with
        them). The consumer may stop early; closing the generator waits for the queued steps and sets
        seq.length to the position after the last token yielded."""
        cp, m = self._cp, self.model
        ws = m._decode_ws
        if n <= 0:
            return
        seq.reserve(n)
        host = cp.cuda.alloc_pinned_memory(4 * n)
        tokens = np.frombuffer(host, dtype=np.int32, count=n)
        done: list = []
        start, taken = seq.length, 0
        try:
            with self.stream:
                self._prepare(seq, [first_id])
            for i in range(n):
                with self.stream:  # entered per step: the stream is not current while the consumer runs
                    self.graph.launch()
                    m.backend.decode_advance(m._next, ws.ids, ws.positions)  # an op of docs/BACKEND.md
                    cp.cuda.runtime.memcpyAsync(tokens.ctypes.data + 4 * i, m._next.data.ptr, 4,
                                                cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
                    ev = self.stream.record()
                done.append(ev)
                if events is not None:
                    events.append(ev)
                if i >= 1:  # step i is queued: read step i - 1's token
                    done[i - 1].synchronize()
                    taken += 1
                    yield int(tokens[i - 1])
            done[n - 1].synchronize()
            taken += 1
            yield int(tokens[n - 1])
        finally:
            self.stream.synchronize()
            seq.length = start + taken

    def step(self, seq, ids: np.ndarray):
        """One token through the model at position seq.length; returns the device logits (fp32 [V])."""
        m = self.model
        seq.reserve(1)
        with self.stream:
            self._prepare(seq, ids)
            self.graph.launch()
            self.stream.synchronize()
        seq.length += 1
        return m._logits
