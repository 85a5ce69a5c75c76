"""The run's random streams: every seed the simulator uses is derived from the run seed, a stream tag
and integer keys (:func:`derive_seed`), so distinct uses never share a generator and a run is a pure
function of its config. A client's local training in a round draws from :func:`client_seed`."""

from __future__ import annotations

import numpy as np

# stream tags for derived seeds (distinct streams never share a generator)
STREAM_CLIENT, STREAM_SAMPLING, STREAM_HETERO, STREAM_INIT, STREAM_SUBSET = 1, 2, 3, 4, 5


def derive_seed(seed: int, stream: int, *keys: int) -> int:
    """A 63-bit seed from (seed, stream, keys...) via numpy's SeedSequence (stable across versions)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(stream)] + [int(k) for k in keys])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def client_seed(seed: int, rnd: int, client_id: int) -> int:
    """The seed of client ``client_id``'s local training in round ``rnd``."""
    return derive_seed(seed, STREAM_CLIENT, rnd, client_id)
