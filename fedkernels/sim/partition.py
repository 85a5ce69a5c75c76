"""Client partitions of a labelled dataset: IID, label shards, Dirichlet label skew.

``partition(labels, num_clients, scheme, seed, **kw)`` returns one sorted int64 index array per
client: disjoint, together covering every sample (except where a scheme documents drops). Every
scheme draws from its own ``numpy.random.Generator(PCG64(seed))``, independent of torch and of the
training seed, so the same seed gives the same partition for every method.

Schemes
-------
``iid``            shuffle, cut into ``num_clients`` near-equal parts.
``shards``         the McMahan et al. (2017) / Kuramoto-FedAvg *text* version: sort by label, cut
                   into ``num_clients * shards_per_client`` equal shards, deal ``shards_per_client``
                   random shards to every client. FedAWARE's ``pathological`` option is
                   ``shards`` with 100 clients x 2 shards.
``label_shards``   the Kuramoto-FedAvg *code* version (LG-FedAvg ``noniid``): every label is cut
                   into ``s*K/C`` shards; a shuffled multiset of labels (each label ``s*K/C`` times)
                   is dealt ``s`` per client. Every client has at most ``s`` distinct labels and
                   the same amount of data. Needs ``s*K`` divisible by ``C``.
``natural``        the dataset's own owners: client k gets the samples whose owner id is k
                   (``owners``, one int per sample, ids 0..U-1; e.g. ``train.meta["client_ids"]``
                   of the FedProx ``synthetic`` data, which the simulator passes). Needs
                   ``num_clients == U``; no randomness.
``dirichlet``      label skew by a Dirichlet(alpha) draw, two conventions:

  * ``convention="per_class"`` (default): for every class, proportions over the clients
    ~ Dir(alpha * 1_K); the class's samples are cut by them. This is FedLab ``hetero_dir_partition``
    (Yurochkin et al. 2019; often attributed to Hsu et al.), used by FedAWARE, GC-Fed, FedECADO and
    FedPGVC. ``balance=True`` (FedLab's cap, default) gives proportion 0 to clients already holding
    >= N/K samples. The whole draw is repeated until every client has >= ``min_size`` samples (at
    most ``max_retries`` draws). Client sizes are unbalanced.
  * ``convention="per_client"``: every client's label mix q_k ~ Dir(alpha * p) with p the class
    prior (``prior="empirical"``, as in Hsu et al. 2019) or uniform; client sizes are fixed
    (``sizes``, default equal). Samples are drawn without replacement; when a class runs out its
    mass moves to the classes that remain.

Unreachable minimum: if ``min_size * K > N`` no partition can reach it; otherwise small alpha can
make it unlikely. In both cases the function warns (``warnings.warn``), keeps the draw with the
largest minimum, and tops up every client below ``min_size`` with samples moved from the largest
clients (as far as N allows; GC-Fed's "move one sample from the largest client into each empty one"
is ``min_size=1``). It always terminates after at most ``max_retries`` draws.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence

import numpy as np

__all__ = ["partition", "SCHEMES", "label_histograms", "partition_stats", "partition_report", "check_partition"]

SCHEMES = ("iid", "shards", "label_shards", "dirichlet", "natural")


def _labels_np(labels) -> np.ndarray:
    if hasattr(labels, "detach"):  # torch tensor
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels: expected a 1-D array, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.equal(np.mod(y, 1), 0)):
            raise ValueError("labels: expected integer class labels")
        y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise ValueError("labels: expected non-negative class labels")
    return y.astype(np.int64, copy=False)


def _finish(parts: Sequence[np.ndarray]) -> List[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


# ------------------------------------------------------------------------------------------------
def _iid(y, K, rng):
    perm = rng.permutation(len(y))
    return np.array_split(perm, K)


def _shards(y, K, rng, shards_per_client):
    s = int(shards_per_client)
    if s < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}")
    n_shards = K * s
    if n_shards > len(y):
        raise ValueError(f"{K} clients x {s} shards = {n_shards} shards > {len(y)} samples")
    # random order inside each label, then a stable sort by label
    perm = rng.permutation(len(y))
    order = perm[np.argsort(y[perm], kind="stable")]
    shards = np.array_split(order, n_shards)
    deal = rng.permutation(n_shards)
    return [np.concatenate([shards[j] for j in deal[k * s : (k + 1) * s]]) for k in range(K)]


def _label_shards(y, K, rng, shards_per_client, num_classes):
    s = int(shards_per_client)
    if s < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}")
    C = num_classes
    if (s * K) % C != 0:
        raise ValueError(
            f"label_shards needs shards_per_client * num_clients ({s}*{K}) divisible "
            f"by the number of classes ({C}); use scheme='shards' otherwise"
        )
    per_class = s * K // C
    pools = []
    for c in range(C):
        idx = rng.permutation(np.flatnonzero(y == c))
        if len(idx) < per_class:
            raise ValueError(f"class {c} has {len(idx)} samples, fewer than its {per_class} shards")
        pieces = np.array_split(idx, per_class)
        pools.append([pieces[i] for i in rng.permutation(per_class)])
    deal = rng.permutation(np.repeat(np.arange(C), per_class)).reshape(K, s)
    return [np.concatenate([pools[c].pop() for c in deal[k]]) for k in range(K)]


def _dirichlet_per_class_once(y, K, rng, alpha, num_classes, balance):
    n = len(y)
    batches: List[List[np.ndarray]] = [[] for _ in range(K)]
    sizes = np.zeros(K, dtype=np.int64)
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(y == c))
        p = rng.dirichlet(np.full(K, alpha))
        if balance:
            p = p * (sizes < n / K)
        tot = p.sum()
        p = p / tot if tot > 0 else np.full(K, 1.0 / K)
        cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
        for k, piece in enumerate(np.split(idx, cuts)):
            if len(piece):
                batches[k].append(piece)
                sizes[k] += len(piece)
    return [np.concatenate(b) if b else np.zeros(0, dtype=np.int64) for b in batches]


def _top_up(parts: List[np.ndarray], min_size: int, rng) -> List[np.ndarray]:
    """Moves samples from the largest clients into those below min_size (as far as N allows)."""
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    n = sum(len(p) for p in parts)
    target = min(min_size, n // len(parts))
    while True:
        sizes = np.array([len(p) for p in parts])
        small = int(np.argmin(sizes))
        if sizes[small] >= target:
            return parts
        big = int(np.argmax(sizes))
        if sizes[big] <= target:
            return parts
        give = min(target - sizes[small], sizes[big] - target)
        pick = rng.choice(sizes[big], size=give, replace=False)
        keep = np.ones(sizes[big], dtype=bool)
        keep[pick] = False
        parts[small] = np.concatenate([parts[small], parts[big][pick]])
        parts[big] = parts[big][keep]


def _dirichlet_per_class(y, K, rng, alpha, num_classes, min_size, max_retries, balance):
    n = len(y)
    if min_size * K > n:
        warnings.warn(
            f"dirichlet: min_size={min_size} x {K} clients > {n} samples is unreachable; "
            f"topping clients up to {n // K} samples instead",
            RuntimeWarning,
            stacklevel=3,
        )
        parts = _dirichlet_per_class_once(y, K, rng, alpha, num_classes, balance)
        return _top_up(parts, min_size, rng)
    best, best_min = None, -1
    for _ in range(max(1, int(max_retries))):
        parts = _dirichlet_per_class_once(y, K, rng, alpha, num_classes, balance)
        m = min(len(p) for p in parts)
        if m >= min_size:
            return parts
        if m > best_min:
            best, best_min = parts, m
    warnings.warn(
        f"dirichlet: alpha={alpha} gave no draw with every client >= min_size={min_size} in "
        f"{max_retries} draws (best minimum {best_min}); moving samples from the largest "
        f"clients into the small ones",
        RuntimeWarning,
        stacklevel=3,
    )
    return _top_up(best, min_size, rng)


def _dirichlet_per_client(y, K, rng, alpha, num_classes, sizes, prior, min_size):
    n = len(y)
    if sizes is None:
        sizes = np.full(K, n // K, dtype=np.int64)
        sizes[: n - sizes.sum()] += 1
    else:
        sizes = np.asarray(sizes, dtype=np.int64)
        if sizes.shape != (K,) or (sizes < 0).any():
            raise ValueError(f"sizes: expected {K} non-negative client sizes, got {sizes}")
        if sizes.sum() > n:
            raise ValueError(f"sizes: sum {int(sizes.sum())} exceeds the {n} samples")
    if sizes.min() < min_size:
        warnings.warn(
            f"dirichlet(per_client): client sizes are fixed and the smallest is "
            f"{int(sizes.min())} < min_size={min_size}",
            RuntimeWarning,
            stacklevel=3,
        )
    counts = np.bincount(y, minlength=num_classes).astype(np.int64)
    if prior == "empirical":
        base = counts / counts.sum()
    elif prior == "uniform":
        base = np.full(num_classes, 1.0 / num_classes)
    else:
        raise ValueError(f"prior must be 'empirical' or 'uniform', got {prior!r}")
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in range(num_classes)]
    ptr = np.zeros(num_classes, dtype=np.int64)
    remaining = counts.copy()
    conc = alpha * base
    present = conc > 0
    parts = []
    for k in range(K):
        q = np.zeros(num_classes)
        q[present] = rng.dirichlet(conc[present])
        need = int(sizes[k])
        take = np.zeros(num_classes, dtype=np.int64)
        while need > 0:
            avail = remaining - take
            w = q * (avail > 0)
            if w.sum() <= 0:  # the client's classes ran out: move its mass to what remains
                w = avail.astype(np.float64)
            draw = rng.multinomial(need, w / w.sum())
            draw = np.minimum(draw, avail)
            take += draw
            need -= int(draw.sum())
        idx = []
        for c in np.flatnonzero(take):
            idx.append(np.asarray(pools[c][ptr[c] : ptr[c] + take[c]], dtype=np.int64))
            ptr[c] += take[c]
        remaining -= take
        parts.append(np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64))
    return parts


def _natural(n, K, owners):
    if owners is None:
        raise ValueError(
            "scheme 'natural' needs owners (one owner id per sample, e.g. the "
            "dataset's meta['client_ids']); this dataset has none"
        )
    if hasattr(owners, "detach"):
        owners = owners.detach().cpu().numpy()
    o = np.asarray(owners)
    if o.ndim != 1 or len(o) != n:
        raise ValueError(f"owners: expected a 1-D array of {n} owner ids (one per sample), got shape {o.shape}")
    if o.size and (not np.issubdtype(o.dtype, np.integer) or o.min() < 0):
        raise ValueError("owners: expected non-negative integer owner ids")
    users = int(o.max()) + 1 if o.size else 0
    if users != K:
        raise ValueError(
            f"num_clients={K} but the data has {users} owners (ids 0..{users - 1}); "
            f"scheme 'natural' needs num_clients == the number of users"
        )
    o = o.astype(np.int64, copy=False)
    order = np.argsort(o, kind="stable")
    return np.split(order, np.cumsum(np.bincount(o, minlength=K))[:-1])


# ------------------------------------------------------------------------------------------------
def partition(
    labels,
    num_clients: int,
    scheme: str = "iid",
    seed: int = 0,
    *,
    num_classes: Optional[int] = None,
    shards_per_client: int = 2,
    alpha: float = 0.5,
    convention: str = "per_class",
    min_size: int = 0,
    max_retries: int = 1000,
    balance: bool = True,
    sizes=None,
    prior: str = "empirical",
    owners=None,
) -> List[np.ndarray]:
    """Splits the sample indices of ``labels`` among ``num_clients`` clients.

    scheme: "iid" | "shards" | "label_shards" | "dirichlet" | "natural" (see the module docstring).
    seed: seeds this function's own numpy Generator (independent of training randomness).
    shards_per_client: s for "shards" / "label_shards".
    alpha, convention ("per_class" | "per_client"), min_size, max_retries, balance (per_class cap),
    sizes and prior (per_client): for "dirichlet".
    owners: for "natural", the owner id (0..num_clients-1) of every sample.
    Returns a list of ``num_clients`` sorted int64 index arrays.
    """
    y = _labels_np(labels)
    K = int(num_clients)
    if K < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if len(y) == 0:
        raise ValueError("labels: empty")
    C = int(num_classes) if num_classes is not None else int(y.max()) + 1
    if y.max() >= C:
        raise ValueError(f"labels: found label {int(y.max())} >= num_classes={C}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    rng = np.random.Generator(np.random.PCG64(seed))
    scheme = scheme.lower()
    if scheme == "iid":
        parts = _iid(y, K, rng)
    elif scheme in ("shards", "pathological"):
        parts = _shards(y, K, rng, shards_per_client)
    elif scheme == "label_shards":
        parts = _label_shards(y, K, rng, shards_per_client, C)
    elif scheme == "natural":
        parts = _natural(len(y), K, owners)
    elif scheme in ("dirichlet", "dir", "hetero_dir"):
        if not alpha > 0 or not np.isfinite(alpha):
            raise ValueError(f"alpha must be a positive finite number, got {alpha}")
        if convention == "per_class":
            parts = _dirichlet_per_class(y, K, rng, float(alpha), C, int(min_size), int(max_retries), bool(balance))
        elif convention == "per_client":
            parts = _dirichlet_per_client(y, K, rng, float(alpha), C, sizes, prior, int(min_size))
        else:
            raise ValueError(f"convention must be 'per_class' or 'per_client', got {convention!r}")
    else:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    return _finish(parts)


def check_partition(parts: Sequence[np.ndarray], n: int, allow_drop: bool = False) -> None:
    """Raises ValueError unless ``parts`` are disjoint index sets within [0, n) (covering it)."""
    allidx = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0)
    if allidx.size and (allidx.min() < 0 or allidx.max() >= n):
        raise ValueError("partition: index out of range")
    if np.unique(allidx).size != allidx.size:
        raise ValueError("partition: clients share samples")
    if not allow_drop and allidx.size != n:
        raise ValueError(f"partition: covers {allidx.size} of {n} samples")


def label_histograms(labels, parts: Sequence[np.ndarray], num_classes: Optional[int] = None) -> np.ndarray:
    """[K, C] int64 matrix: row k counts client k's samples per class."""
    y = _labels_np(labels)
    C = int(num_classes) if num_classes is not None else int(y.max()) + 1
    out = np.zeros((len(parts), C), dtype=np.int64)
    for k, p in enumerate(parts):
        if len(p):
            out[k] = np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=C)[:C]
    return out


def partition_stats(labels, parts: Sequence[np.ndarray], num_classes: Optional[int] = None) -> dict:
    """Summary numbers of a partition (JSON-friendly)."""
    H = label_histograms(labels, parts, num_classes)
    sizes = H.sum(1)
    glob = H.sum(0) / max(H.sum(), 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        local = H / np.maximum(sizes[:, None], 1)
    tv = 0.5 * np.abs(local - glob[None, :]).sum(1)  # total variation to the global label mix
    ncls = (H > 0).sum(1)
    return {
        "num_clients": int(len(parts)),
        "num_samples": int(sizes.sum()),
        "size_min": int(sizes.min()),
        "size_median": float(np.median(sizes)),
        "size_max": int(sizes.max()),
        "size_mean": float(sizes.mean()),
        "empty_clients": int((sizes == 0).sum()),
        "classes_per_client_mean": float(ncls.mean()),
        "classes_per_client_min": int(ncls.min()),
        "classes_per_client_max": int(ncls.max()),
        "label_tv_mean": float(tv[sizes > 0].mean()) if (sizes > 0).any() else 0.0,
    }


def partition_report(labels, parts: Sequence[np.ndarray], num_classes: Optional[int] = None, max_rows: int = 20) -> str:
    """A text table: per-client size, distinct classes and label histogram, then a summary."""
    H = label_histograms(labels, parts, num_classes)
    st = partition_stats(labels, parts, num_classes)
    K, C = H.shape
    w = max(4, len(str(int(H.max()) if H.size else 0)) + 1)
    lines = [f"client {'size':>7} {'#cls':>4} | " + "".join(f"{c:>{w}}" for c in range(C))]
    rows = range(K) if K <= max_rows else list(range(max_rows // 2)) + [-1] + list(range(K - max_rows // 2, K))
    for k in rows:
        if k == -1:
            lines.append(f"{'...':>6}")
            continue
        lines.append(
            f"{k:>6} {int(H[k].sum()):>7} {int((H[k] > 0).sum()):>4} | " + "".join(f"{int(v):>{w}}" for v in H[k])
        )
    lines.append(
        f"{st['num_clients']} clients, {st['num_samples']} samples; size min/median/max "
        f"{st['size_min']}/{st['size_median']:g}/{st['size_max']}, empty {st['empty_clients']}; "
        f"classes per client mean {st['classes_per_client_mean']:.2f} "
        f"(min {st['classes_per_client_min']}, max {st['classes_per_client_max']}); "
        f"mean TV distance to the global label mix {st['label_tv_mean']:.3f}"
    )
    return "\n".join(lines)
