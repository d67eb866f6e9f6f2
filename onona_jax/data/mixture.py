"""Weighted mixtures of data sources (`data.mixture`) and which source fills each slot of every
global batch (`Plan`).

`--config.data.mixture=web:gs://bucket/web:0.7,code:/data/code:0.3`: named sources, each a
prepared data dir (local or a bucket) and a positive weight; the weights are relative shares
(normalised to sum 1). "" (the default): the run reads data.dir alone, a mixture of one.

The plan of global batch b, a function of the seed, the weights and b alone:

- Composition. Source s gets floor(w_s·G) of the G slots, and one of the r = G − Σ_s floor(w_s·G)
  extra slots in a fraction frac(w_s·G) of the batches: the fractional parts are laid end to
  end on [0, r), and s gets its extra slot in batch b when one of the points u_b, u_b + 1, …,
  u_b + r − 1 falls in its part, u_b = frac(φ + b·(golden ratio − 1)) (φ from the seed), a
  low-discrepancy sequence. So in every batch |count_s − w_s·G| < 1 (the stated bound), and
  over B batches a source's slots stay within a few of w_s·G·B (tests/integration/test_mixture.py measures
  it over 1,000 steps). Exact: the shares are fractions of the weights as written, the offsets
  integers modulo 2**32.
- Windows. Each source walks its own fixed permutation of its windows (mixed by grain's index
  shuffle, data/pipeline.py), epoch after epoch; batch b takes the next count_s of them.
- Slot order. With several sources the G slots are shuffled per batch (a seeded hash of the
  slot's global index), so every process's share and micro-batch holds about the mixture, not
  one source. A single source keeps the slots in order: exactly the batches of a run without
  a mixture.

A source's position (windows consumed) before batch b is its counts summed over the batches
before b, so without a weight change the iterator's state is the step alone; the state also
records each position (`Plan(origin=, positions=)`), so that a resume that changes the
weights continues every source where it stopped, with the new composition from there on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import threading
from fractions import Fraction

import numpy as np

EXAMPLE = "--config.data.mixture=web:gs://bucket/web:0.7,code:/data/code:0.3"
_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")
_ONE = 1 << 32  # the offsets u_b in units of 2**-32
_GOLDEN = 2654435769  # (golden ratio − 1)·2**32, rounded: the offsets' step
_BLOCK = 1024  # batches per cached running total of the positions


@dataclasses.dataclass(frozen=True)
class Entry:
    """One source of `data.mixture`: its name, its data dir and its (relative) weight."""

    name: str
    data_dir: str
    weight: Fraction


def parse(text: str) -> list[Entry]:
    """`name:dir:weight,...` -> the entries ([] for ""). The name is what precedes the first
    ':', the weight what follows the last, so a bucket URL (gs://...) is a dir like any other.
    A malformed entry, a bad name, a weight that is not a positive number or a name given twice
    is a ValueError naming it and the fix."""
    entries: list[Entry] = []
    for item in filter(None, (s.strip() for s in str(text or "").split(","))):
        name, _, rest = item.partition(":")
        data_dir, _, weight = rest.rpartition(":")
        name, data_dir, weight = name.strip(), data_dir.strip(), weight.strip()
        if not name or not data_dir or not weight or data_dir.startswith("//"):
            raise ValueError(f"data.mixture entry {item!r} is not name:dir:weight; give each source as its name, its "
                             f"prepared data dir and its weight, e.g. {EXAMPLE}")
        if not _NAME.match(name):
            raise ValueError(f"data.mixture source name {name!r} may hold only letters, digits, '_', '.' and '-' (it "
                             "names the source's metrics, tokens/<name> and val_loss/<name>); rename it")
        try:
            share = Fraction(weight)  # exact: "0.7" is 7/10
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"data.mixture source {name!r} has weight {weight!r}, not a number; give a positive "
                             f"number, e.g. {EXAMPLE}") from None
        if share <= 0:
            raise ValueError(f"data.mixture source {name!r} has weight {weight}; a weight must be positive (the "
                             "weights are relative shares, normalised to sum 1): give it a positive weight, or leave "
                             "the source out")
        if any(e.name == name for e in entries):
            raise ValueError(f"data.mixture names source {name!r} twice; give each source one entry and a name of "
                             "its own")
        entries.append(Entry(name, data_dir, share))
    return entries


def shares(weights) -> list[Fraction]:
    """The weights normalised to sum 1."""
    total = sum(weights, Fraction(0))
    return [Fraction(w) / total for w in weights]


def _hash(*parts) -> int:
    """A 64-bit integer of `parts`, the same on every host and version."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def source_seed(seed: int, name: str, sources: int) -> int:
    """The seed of a source's window permutation: the data seed itself for a run of one source
    (its batches are those of a run without a mixture), else one of its name, so a source's
    order does not depend on the other sources."""
    return seed if sources == 1 else _hash(seed, "source", name) % 2**32


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64: a fixed, well-spread hash."""
    x = x.astype(np.uint64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Plan:
    """Which source fills each slot of global batch b, and at which position of its walk
    (module docstring). `weights`: the sources' relative weights, in the sources' order;
    `origin`, `positions`: each source's position before batch `origin` (a resume's saved
    state; default: batch 0, all at 0)."""

    def __init__(self, weights, global_batch: int, seed: int, origin: int = 0, positions=None):
        quotas = [s * global_batch for s in shares(weights)]
        self.sources, self.global_batch, self.origin = len(quotas), global_batch, origin
        self.base = np.array([math.floor(q) for q in quotas], np.int64)
        # The fractional parts end to end, their ends scaled to 2**32 and rounded up: source s
        # has an extra slot when an offset point lies in [bounds[s], bounds[s + 1]).
        ends = np.cumsum([Fraction(0)] + [q - math.floor(q) for q in quotas])
        self.bounds = np.array([math.ceil(e * _ONE) for e in ends], np.int64)
        self.phase = _hash(seed, "mixture phase") % _ONE
        self.order_key = np.uint64(_hash(seed, "slot order"))
        start = np.zeros(self.sources, np.int64) if positions is None else np.asarray(positions, np.int64)
        self._totals = [start]  # positions before batch origin + k·_BLOCK
        self._lock = threading.Lock()  # grain's read threads ask for batches at once

    def counts(self, batches) -> np.ndarray:
        """int64 [len(batches), sources]: each source's slots in each of `batches`."""
        u = (self.phase + np.asarray(batches, np.int64) * _GOLDEN) % _ONE
        # ceil((bound − u) / 2**32): how many of the points u, u + 1, ... lie below each bound.
        below = -((u[:, None] - self.bounds[None, :]) // _ONE)
        return self.base + np.diff(below, axis=1)

    def positions(self, batch: int) -> np.ndarray:
        """int64 [sources]: the windows each source gave to the batches before `batch`."""
        if batch < self.origin:
            raise ValueError(f"batch {batch} lies before the plan's first batch {self.origin}")
        k = (batch - self.origin) // _BLOCK
        with self._lock:
            while len(self._totals) <= k:
                at = self.origin + (len(self._totals) - 1) * _BLOCK
                self._totals.append(self._totals[-1] + self.counts(np.arange(at, at + _BLOCK)).sum(0))
            total = self._totals[k]
        return total + self.counts(np.arange(self.origin + k * _BLOCK, batch)).sum(0)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, position) of each of global batch b's slots, int64 [global_batch] each."""
        counts = self.counts([b])[0]
        source = np.repeat(np.arange(self.sources), counts)
        first = np.cumsum(counts) - counts  # each source's first slot
        position = self.positions(b)[source] + np.arange(self.global_batch) - first[source]
        if self.sources > 1:
            slots = np.uint64(b) * np.uint64(self.global_batch) + np.arange(self.global_batch, dtype=np.uint64)
            order = np.argsort(_mix(slots + self.order_key), kind="stable")
            source, position = source[order], position[order]
        return source, position
