"""The backends a run requires, and the refusal of a run that requires one this machine cannot run.

A backend is required by `--require-backend NAME` (pytest and `nanoqwen ladder` alike), or, for every
registered backend that needs an accelerator (cuda), by NANOQWEN_REQUIRE_GPU=1 in the environment (the
nightly GPU job sets it). Inside a run a required backend's skip is a failure (ladder/plugin/__init__.py); but
when the backend cannot run here at all, every one of its tests would fail one by one (a GPU run on a
machine without a GPU took over 25 minutes to say so), so the run is refused before anything starts:
the pytest plugin in the controller, before collection and before any pytest-xdist worker starts
(exit status 2), and `nanoqwen ladder` before its first rung (exit status 2). Both say it in one line,
`refusal` below, naming the backend, what required it and why it cannot run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

ENV = "NANOQWEN_REQUIRE_GPU"


def required_backends(options: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """backend -> what requires it (`--require-backend NAME`, or NANOQWEN_REQUIRE_GPU=1), from the
    `--require-backend` values given and the environment (default: this process's)."""
    from kernels import backend_names, backend_needs_device

    environ = os.environ if environ is None else environ
    req = {name: f"--require-backend {name}" for name in options if name}
    if environ.get(ENV) == "1":
        for name in backend_names():
            if backend_needs_device(name):
                req.setdefault(name, f"{ENV}=1")
    return req


def refusal(required: Mapping[str, str], selected: Iterable[str]) -> str | None:
    """The one-line reason to refuse a run (without the `nanoqwen: error: ` prefix) when a required
    backend among `selected` cannot run on this machine; None when every one can. A required backend
    the run does not select is not judged here (the plugin's usage error about the selection says it)."""
    from kernels import backend_available

    selected = set(selected)
    for name, source in required.items():
        if name not in selected:
            continue
        ok, why = backend_available(name)
        if not ok:
            return f"{source}, but the {name} backend is not available on this machine: {why}"
    return None
