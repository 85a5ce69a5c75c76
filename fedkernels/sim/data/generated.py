"""Generated datasets (numpy, deterministic given ``seed``; no files): FedProx Synthetic(alpha, beta)
and a Gaussian-mixture classification task. Flat float32 ``[N, F]`` rows, not normalised by
default (FedProx trains on the raw features); ``standardize=True`` standardises every feature with
the training set's mean and std.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from .base import TensorData, subsample

__all__ = ["generate_synthetic", "generate_gmm", "load_generated", "GENERATED"]


# ================================================================================================
def _int_opt(ds: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
        raise ValueError(f"{ds}: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _float_opt(ds: str, name: str, value, low: float, strict: bool) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    v = float(value) if ok else float("nan")
    if not (np.isfinite(v) and (v > low if strict else v >= low)):
        raise ValueError(f"{ds}: {name} must be a finite number {'>' if strict else '>='} {low}, got {value!r}")
    return v


def generate_synthetic(
    alpha: float = 1.0,
    beta: float = 1.0,
    num_users: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    iid: bool = False,
    train_fraction: float = 0.9,
    max_user_samples: Optional[int] = None,
):
    """FedProx's Synthetic(alpha, beta) generator (Li et al. 2020, §5.1; the authors'
    ``data/synthetic_*/generate_synthetic.py`` and ``synthetic_iid/generate_iid.py``), in numpy.

    Per user k: n_k = int(lognormal(4, 2)) + 50 samples (capped at ``max_user_samples`` if given);
    u_k ~ N(0, alpha^2), B_k ~ N(0, beta^2) (alpha, beta are standard deviations, as in the code);
    v_k ~ N(B_k, I); W_k ~ N(u_k, 1) [dim x C], b_k ~ N(u_k, 1) [C]; x ~ N(v_k, Sigma) with
    Sigma = diag(j^-1.2), j = 1..dim; y = argmax(softmax(x W_k + b_k)) = argmax(x W_k + b_k).
    ``iid=True`` is the code's synthetic_iid: v_k = 0 and one W, b ~ N(0, 1) shared by all users
    (alpha and beta unused). Each user's samples are shuffled and the first
    int(train_fraction * n_k) are its training part (FedProx: 0.9); the rest its test part.

    Returns ``(x_train, y_train, owner_train, x_test, y_test, owner_test)`` as numpy arrays
    (float64 features, int64 labels and owners), users in order 0..num_users-1.
    """
    ds = "synthetic"
    alpha = _float_opt(ds, "alpha", alpha, 0.0, strict=False)
    beta = _float_opt(ds, "beta", beta, 0.0, strict=False)
    U = _int_opt(ds, "num_users", num_users, 1)
    D = _int_opt(ds, "dim", dim, 1)
    C = _int_opt(ds, "num_classes", num_classes, 2)
    seed = _int_opt(ds, "seed", seed, 0)
    if not isinstance(iid, (bool, np.bool_)):
        raise ValueError(f"{ds}: iid must be true or false, got {iid!r}")
    tf = _float_opt(ds, "train_fraction", train_fraction, 0.0, strict=True)
    if not tf < 1.0:
        raise ValueError(f"{ds}: train_fraction must lie in (0, 1), got {train_fraction!r}")
    cap = None if max_user_samples is None else _int_opt(ds, "max_user_samples", max_user_samples, 2)

    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4.0, 2.0, U).astype(np.int64) + 50
    if cap is not None:
        sizes = np.minimum(sizes, cap)
    sd = np.arange(1, D + 1, dtype=np.float64) ** -0.6  # sqrt of diag(j^-1.2)
    if iid:
        mean_x = np.zeros((U, D))
        W_glob = rng.normal(0.0, 1.0, (D, C))
        b_glob = rng.normal(0.0, 1.0, C)
    else:
        mean_W = rng.normal(0.0, alpha, U)  # u_k (mean_b = mean_W)
        B = rng.normal(0.0, beta, U)
        mean_x = rng.normal(B[:, None], 1.0, (U, D))  # v_k
    out = ([], [], [], [], [], [])
    for k in range(U):
        if iid:
            W, b = W_glob, b_glob
        else:
            W = rng.normal(mean_W[k], 1.0, (D, C))
            b = rng.normal(mean_W[k], 1.0, C)
        n = int(sizes[k])
        x = mean_x[k] + rng.standard_normal((n, D)) * sd
        y = np.argmax(x @ W + b, axis=1).astype(np.int64)
        perm = rng.permutation(n)
        ntr = int(tf * n)
        tr, te = perm[:ntr], perm[ntr:]
        for j, a in enumerate(
            (x[tr], y[tr], np.full(len(tr), k, np.int64), x[te], y[te], np.full(len(te), k, np.int64))
        ):
            out[j].append(a)
    return tuple(np.concatenate(a) for a in out)


def generate_gmm(
    num_classes: int = 10,
    dim: int = 64,
    n_train: int = 6000,
    n_test: int = 2000,
    class_sep: float = 0.375,
    seed: int = 0,
):
    """Gaussian-mixture classification: class means mu_c ~ N(0, class_sep^2 I) [dim], labels
    balanced (n // C per class, the remainder to the first classes, then shuffled), and
    x = mu_y + N(0, I). Train and test come from the same means. The Bayes rule is linear (shared
    identity covariance), so multinomial logistic regression can reach it; ``class_sep=0.375`` with
    64 features and 10 classes gives 85-88% centralised test accuracy (seeds 0-2, 6000 + 2000
    samples, L2-regularised logistic regression; class_sep 0.3: 72-76%, 0.4: 88-91%).

    Returns ``(x_train, y_train, x_test, y_test)`` as numpy arrays (float64, int64).
    """
    ds = "gmm"
    C = _int_opt(ds, "num_classes", num_classes, 2)
    D = _int_opt(ds, "dim", dim, 1)
    ntr = _int_opt(ds, "n_train", n_train, C)
    nte = _int_opt(ds, "n_test", n_test, 1)
    sep = _float_opt(ds, "class_sep", class_sep, 0.0, strict=True)
    seed = _int_opt(ds, "seed", seed, 0)
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, sep, (C, D))

    def draw(n):
        y = rng.permutation(np.arange(n, dtype=np.int64) % C)
        return means[y] + rng.standard_normal((n, D)), y

    xtr, ytr = draw(ntr)
    xte, yte = draw(nte)
    return xtr, ytr, xte, yte


GENERATED = ("synthetic", "gmm")

_GEN_DEFAULTS = {
    "synthetic": dict(
        alpha=1.0,
        beta=1.0,
        num_users=30,
        dim=60,
        num_classes=10,
        seed=0,
        iid=False,
        train_fraction=0.9,
        max_user_samples=None,
        standardize=False,
    ),
    "gmm": dict(num_classes=10, dim=64, n_train=6000, n_test=2000, class_sep=0.375, seed=0, standardize=False),
}


def load_generated(
    key: str, options: dict, max_train, max_test, subsample_seed, normalize, dtype
) -> Tuple[TensorData, TensorData]:
    unknown = sorted(set(options) - set(_GEN_DEFAULTS[key]))
    if unknown:
        raise ValueError(
            f"{key}: unknown option(s) {', '.join(unknown)}; valid options: {', '.join(_GEN_DEFAULTS[key])}"
        )
    opts = dict(_GEN_DEFAULTS[key], **options)
    standardize = opts.pop("standardize")
    if not isinstance(standardize, (bool, np.bool_)):
        raise ValueError(f"{key}: standardize must be true or false, got {standardize!r}")
    if normalize not in (True, False, None):
        raise ValueError(
            f"{key}: normalize takes no (mean, std) pair for generated flat data; use the option standardize=True"
        )
    if key == "synthetic":
        xtr, ytr, otr, xte, yte, ote = generate_synthetic(**opts)
        src = (
            f"generated: FedProx Synthetic(alpha={opts['alpha']:g}, beta={opts['beta']:g}"
            f"{', iid' if opts['iid'] else ''}), {opts['num_users']} users, seed {opts['seed']}"
        )
    else:
        xtr, ytr, xte, yte = generate_gmm(**opts)
        otr = ote = None
        src = f"generated: Gaussian mixture, class_sep={opts['class_sep']:g}, seed {opts['seed']}"
    xtr, ytr, otr = subsample(xtr, ytr, otr, max_train, subsample_seed)
    xte, yte, ote = subsample(xte, yte, ote, max_test, subsample_seed)
    feat_mean = feat_std = None
    if standardize:
        feat_mean = xtr.mean(0)
        feat_std = np.maximum(xtr.std(0), 1e-12)
        xtr = (xtr - feat_mean) / feat_std
        xte = (xte - feat_mean) / feat_std
    num_classes = int(opts["num_classes"])
    meta = {"source": src, "generator": key, "options": dict(opts, standardize=bool(standardize))}
    if key == "synthetic":
        meta["num_users"] = int(opts["num_users"])
    if feat_mean is not None:
        meta["feature_mean"], meta["feature_std"] = feat_mean, feat_std

    def make(x, y, owners, split):
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype)
        m = dict(meta, split=split)
        if owners is not None:
            m["client_ids"] = np.asarray(owners, dtype=np.int64)
        return TensorData(
            x=xt,
            y=torch.from_numpy(np.asarray(y, dtype=np.int64)),
            num_classes=num_classes,
            name=key,
            input_shape=tuple(xt.shape[1:]),
            meta=m,
        )

    return make(xtr, ytr, otr, "train"), make(xte, yte, ote, "test")
