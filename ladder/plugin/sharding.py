"""Which shard a case belongs to: `--shard I/N` runs shard I of N of every rung, on each of N machines.

A test belongs to shard `crc32(nodeid) % N + 1`: a stable hash of the pytest node id (the path under
the project root, the test name and its parameters), so the split is the same on every machine and
every night, needs no coordination, and spreads every rung, format and backend over the shards (the
graph rung's prompts too). The plugin deselects the other shards' tests after collection; the rung's
JSON records the shard. `nanoqwen ladder merge` joins the shards' reports (ladder/run/merge.py).
"""

from __future__ import annotations

import re
import zlib

from engine.errors import NanoqwenError


class ShardError(NanoqwenError):
    """A --shard value or a set of shard reports that cannot be used (one line, exit 2)."""


def parse_shard(spec: str) -> tuple[int, int]:
    """"I/N" -> (I, N) with 1 <= I <= N."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec or "")
    if not m:
        raise ShardError(f"--shard {spec!r}: expected I/N, e.g. 2/4 (shard I of N, counted from 1)")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 1 <= i <= n:
        raise ShardError(f"--shard {spec}: I must be between 1 and N (N >= 1)")
    return i, n


def shard_of(nodeid: str, count: int) -> int:
    """The shard (1-based) a test belongs to: a stable hash of its node id."""
    return zlib.crc32(nodeid.replace("\\", "/").encode()) % count + 1


def select(items: list, index: int, count: int) -> tuple[list, list]:
    """(kept, deselected) items of shard `index` of `count`."""
    kept, dropped = [], []
    for item in items:
        (kept if shard_of(item.nodeid, count) == index else dropped).append(item)
    return kept, dropped
