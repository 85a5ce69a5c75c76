"""FedAWARE (Zeng et al., "On the Power of Adaptive Weighted Aggregation"), per
docs/specs/fedaware.md.

The server keeps an exponential moving average ("momentum") m_i of every client's update, for all
N clients (stale rows kept for non-participants), and steps along the minimum-norm point of their
convex hull:

    m_i   <- (1 - alpha) m_i + alpha U_i            for the round's participants i        (M)
    lam   =  argmin_{lam in simplex} || sum_i lam_i m~_i ||^2                               (Q)
    new   =  x + server_lr * sum_i c_i m_i,   c_i = lam_i / ||m_i|| (normalize) or lam_i     (U)

Sign: fedkernels updates are U_i = local - global = -g_i (the paper's pseudo-gradient), so the
table M stores the momenta of the *updates* (-m_i of the paper) and the step is ``x + ...``; the
Gram matrix, lam and the projection are unchanged by that sign.

Options (spec §3): see ``options.py`` beside this file, which also holds the momentum table's storage
(default the global model's dtype and device; bf16 or host on request) and the ELUD statistic.

Hot path per round: the EMA on the k participant rows (in place when the round's ids are a run lo..hi-1
in order, e.g. every client; a gather / scatter of the rows otherwise), one ``ops.gram(M, rows=participants)``
([k, N], fp64) to refresh rows and columns of the cached N x N Gram, the min-norm solve on the cached N x N
matrix (host, fp64; the normalisation s_i s_j with s_i = 1 / ||m_i|| is made by ``ops.min_norm(scale=)``
in its one symmetrising pass, not by the caller), and one ``ops.weighted_sum`` over the support rows of M.
ELUD (logged): up to ELUD_GRAM_MAX_K participants from their k x k Gram (the pass that screens U), above it
from two O(kd) sums in the momentum pass (``options.EludSums``). No K x d temporaries.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from ... import ops
from .. import tables
from ..base import AggResult, Aggregator, RoundInput, id_tensor, register, table_passes
from ..parts import ServerMomentum, momentum_attr
from .options import ELUD_GRAM_MAX_K, EludSums, check_num_clients, check_options, elud, new_table, table_weighted_sum

ZERO_REL = 1e-12  # q <= ZERO_REL * max_i G_ii: the origin is in the hull (zero_direction)


def aware_scale(G_tilde: torch.Tensor, d: torch.Tensor) -> float:
    """<G~, d> / <d, d> (0 when d = 0): the AWARE extension steps along d by this much."""
    dd = ops.sqnorm(d)
    return ops.dot(G_tilde, d) / dd if dd > 0 else 0.0


def aware_project(G_tilde: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The AWARE extension: (<G~, d> / <d, d>) d (zero when d = 0). Sign-invariant in d."""
    return d * aware_scale(G_tilde, d)


def _default_solver(*args, **kw):
    return ops.min_norm(*args, **kw)


@register("fedaware")
class FedAWARE(Aggregator):
    """FedAWARE server aggregator (see module docstring for the options)."""

    state_attrs = ("M", "Gm", "seen", "n_examples", "lam_prev", "ext_momentum")

    option_ranges = {"max_iter": ">= 1"}

    def __init__(
        self,
        alpha: float = 0.5,
        normalize: bool = True,
        warmup: str = "explore",
        init: str = "ema_from_zero",
        method: str = "away",
        solver_init: str = "best_pair",
        max_iter: int = 1000,
        tol: float = 1e-6,
        tol_abs: float = 1e-12,
        warm_start: bool = False,
        code_compat: bool = False,
        zero_fallback: str = "zero",
        variant: str = "aware",
        extension: Optional[str] = None,
        ext_beta: float = 0.7,
        elud: bool = True,
        num_clients: Optional[int] = None,
        solver: Optional[Callable] = None,
        momentum_dtype: Optional[torch.dtype] = None,
        momentum_device=None,
        momentum_file: Optional[Union[str, os.PathLike]] = None,
        **kw,
    ):
        super().__init__(**kw)
        check_options(
            self.name,
            alpha,
            warmup,
            init,
            method,
            solver_init,
            max_iter,
            tol,
            tol_abs,
            zero_fallback,
            variant,
            extension,
            ext_beta,
            solver,
        )
        self.momentum_dtype, self.momentum_device = momentum_dtype, momentum_device
        self.momentum_file = tables.check_path(
            self.name, "momentum_file", momentum_file, momentum_device, "momentum_device"
        )
        self.table_version = 0  # completed momentum updates (a file table's marker)
        self._torn: Optional[str] = None  # why the table is half-updated (a failed momentum pass)
        self.alpha = float(alpha)
        self.normalize, self.warmup, self.init = bool(normalize), warmup, init
        self.method = "code_compat" if code_compat else method
        self.code_compat = bool(code_compat)
        self.solver_init, self.max_iter, self.tol, self.tol_abs = solver_init, max_iter, float(tol), float(tol_abs)
        self.warm_start, self.zero_fallback, self.variant = bool(warm_start), zero_fallback, variant
        self.extension, self.ext_beta, self.log_elud = extension, float(ext_beta), bool(elud)
        self.solver = solver if solver is not None else _default_solver
        if num_clients is not None:
            self.num_clients = check_num_clients(num_clients)
        self.M: Optional[torch.Tensor] = None  # [N, d] momenta of the updates
        self.Gm: Optional[torch.Tensor] = None  # [N, N] fp64 cache of M M^T (CPU)
        self.seen: Optional[torch.Tensor] = None  # [N] bool
        self.n_examples: Optional[torch.Tensor] = None  # [N] fp64: last reported sample count
        self.lam_prev: Optional[torch.Tensor] = None  # [N] fp64
        self._ext = ServerMomentum(self.ext_beta)  # the fedavgm extension's own momentum

    ext_momentum = momentum_attr("_ext")
    reads_beyond_weighted_sum = "the updates' Gram matrix and per-client momentum tables of their rows"
    dp_verdict = "its per-client momentum table and min-norm weights are computed from the un-noised updates"

    @property
    def screen_in_pass(self) -> bool:  # type: ignore[override]
        """With ``elud`` the first read of U screens the rows, before any state changes: the participants'
        Gram pass (RoundInput.gram) up to ELUD_GRAM_MAX_K of them, else the momentum pass's ``blocks`` (a
        finite_rows scan first). Without it the rows get their own finite_rows scan."""
        return self.log_elud

    def elud_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        """The screening pass that ELUD makes of U, as ``device="auto"`` weighs it (``Aggregator.passes``): the
        participants' Gram up to ELUD_GRAM_MAX_K of them (or K unknown), else a finite_rows read (the ELUD sums
        ride in the momentum pass); none without ``elud`` (the base class adds the finite_rows read then)."""
        if not self.log_elud:
            return ()
        return ("gram",) if K is None or K <= ELUD_GRAM_MAX_K else ("sum",)

    def setup(self, spec=None, num_clients=None, global_flat=None) -> None:
        n = self.num_clients if num_clients is None else check_num_clients(num_clients)
        if self.M is not None and n != self.M.size(0):
            raise ValueError(f"fedaware: the momentum table has N={self.M.size(0)} rows, setup got num_clients={n}")
        super().setup(spec, n, global_flat)

    # ---- state tables -------------------------------------------------------------------------------
    def _alloc(self, like: torch.Tensor) -> None:
        if self.num_clients is None:
            raise ValueError(
                "fedaware needs the number of clients N: pass num_clients=N to the constructor "
                "or call setup(num_clients=N) before the first round"
            )
        if self._torn is not None:
            raise RuntimeError(self._torn)
        N, d = self.num_clients, like.numel()
        self._like = (like.dtype, like.device)
        if self.M is None:
            if self.momentum_file is not None:
                self.M = tables.table_file(
                    self.momentum_file,
                    N,
                    d,
                    self.momentum_dtype or like.dtype,
                    exist_ok=False,
                    what="fedaware: momentum_file",
                )
                self.table_version = 0
                tables.updated(self.momentum_file, 0)
            else:
                self.M = new_table(N, like, self.momentum_dtype, self.momentum_device)
            self.Gm = torch.zeros(N, N, dtype=torch.float64)
            self.seen = torch.zeros(N, dtype=torch.bool)
            self.n_examples = torch.zeros(N, dtype=torch.float64)
        elif self.M.size(1) != d:
            raise ValueError(f"fedaware: global_flat has d={d} but the momentum table has d={self.M.size(1)}")

    @staticmethod
    def _row_span(idx: torch.Tensor) -> Optional[slice]:
        """rows lo..hi-1 when the round's ids are exactly that run, in order (every client in id order is
        0..N-1): their momenta are a slice of the table, updated in place; None otherwise."""
        k = idx.numel()
        if k == 0 or (k > 1 and not bool((idx[1:] - idx[:-1] == 1).all())):
            return None
        lo = int(idx[0])
        return slice(lo, lo + k)

    def _update_momenta(self, rin: RoundInput, sums: Optional[EludSums] = None) -> None:
        """(M) on the round's rows, block by block with U, and the Gram rows [k, N] of the new momenta; ELUD's
        sums (``sums``) from the same blocks of U."""
        M, a = self.M, self.alpha
        idx = id_tensor(rin.client_ids)
        first = ~self.seen.index_select(0, idx) if self.init == "first_update" else None
        new_j = old_j = None
        if first is not None and bool(first.any()):  # m_i := U_i at first participation
            new_j, old_j = first.nonzero().reshape(-1), (~first).nonzero().reshape(-1)
        span = self._row_span(idx) if new_j is None else None
        Gr = None
        path = self.momentum_file
        tables.updating(path, self.table_version + 1)
        done, at = 0, None  # columns [0, done) of the rows updated; ``at``: the block being written
        half = False  # the in-place update of block ``at`` has made (1 - a) m_i, not yet + a U_i
        try:
            for cols, Ub in rin.blocks(M.device):  # all of U (a tensor), or its column chunks (a source)
                if sums is not None:
                    sums.add(Ub)
                Mb, old, Uo = M[:, cols], idx, Ub
                at = cols
                if span is not None:  # m_i <- (1 - a) m_i + a U_i on a run of rows, in
                    Ms = Mb[span]  # place: the gather path's arithmetic, no k x d copy
                    half = True
                    Ms.mul_(1.0 - a)
                    Ms.add_(Ub, alpha=a)
                    half = False
                else:
                    if new_j is not None:
                        Mb.index_copy_(0, idx[new_j].to(M.device), Ub.index_select(0, new_j.to(M.device)).to(M.dtype))
                        old, Uo = idx[old_j], Ub.index_select(0, old_j.to(M.device))
                    if old.numel():  # m_i <- (1 - a) m_i + a U_i on the k rows:
                        i = old.to(M.device)  # gather, two in-place ops, scatter back
                        Mb.index_copy_(0, i, Mb.index_select(0, i).mul_(1.0 - a).add_(Uo, alpha=a))
                g = ops.gram(Mb, rows=idx)  # [k, N] fp64 (summed over the chunks)
                Gr = g if Gr is None else Gr.add_(g)
                done, at = M.size(1) if cols.stop is None else cols.stop, None
        except BaseException as e:
            if at is None and done == 0:  # failed before the first write: M is as it was
                tables.updated(path, self.table_version)
                raise
            self._torn = self._torn_message(rin, done, at, e, half)
            if isinstance(e, Exception):
                raise RuntimeError(self._torn) from e
            raise
        tables.updated(path, self.table_version + 1)
        self.table_version += 1
        self.seen.index_fill_(0, idx, True)
        self.n_examples.index_copy_(0, idx, rin.num_examples)
        self._gram_rows(idx, Gr.to("cpu"), in_order=span is not None)

    def _gram_rows(self, idx: torch.Tensor, Gr: torch.Tensor, in_order: bool = False) -> None:
        """The cached Gram's rows and columns of the round's clients: Gm[idx, :] = Gr, then Gm[:, idx] = Gr^T
        (on the participants' block the column write is the one kept), as copies of whole rows of Gr. When
        every client took part the column write covers all of Gm: Gm becomes Gr^T, Gr's rows in id order, as
        a transposed view (no N x N copy; 1.7 ms at N = 1000 for the index write it replaces); gram_matrix
        hands the solver the contiguous side."""
        Gm = self.Gm
        if idx.numel() < Gm.size(0):
            Gm.index_copy_(0, idx, Gr)
            Gm.T.index_copy_(0, idx, Gr)
        elif in_order or bool((idx[1:] > idx[:-1]).all()):  # (distinct ids in [0, N): sorted means 0..N-1)
            self.Gm = Gr.T
        else:
            self.Gm = Gr.index_select(0, torch.argsort(idx)).T

    def _torn_message(
        self, rin: RoundInput, done: int, at: Optional[slice], e: BaseException, half: bool = False
    ) -> str:
        d = self.M.size(1)
        where = (
            f"momentum_file {self.momentum_file!r} (its marker says 'updating')"
            if self.momentum_file
            else "the momentum table"
        )
        if at is None:  # between two blocks: the split is exact
            cols, split = f"at column {done}", f"in columns 0..{done - 1}, the old ones from column {done} on"
        else:
            a, b = at.start or 0, at.stop if at.stop is not None else d
            cols, split = (
                f"in columns {a}..{b - 1}",
                f"before column {a}, the old ones after column {b - 1}, "
                + (f"(1 - alpha) times the old ones in between" if half else "either in between"),
            )
        return (
            f"fedaware: the momentum update of round {self.round} failed {cols} of d={d} "
            f"({type(e).__name__}: {e}): in {where} the rows of clients {rin.client_ids} hold the new momenta "
            f"{split}; this aggregator refuses "
            "further rounds and state_dict (load a state_dict saved before this round"
            f"{' with a copy of the table file' if self.momentum_file else ''} to continue)"
        )

    # ---- state: a file table is referenced, not copied ---------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The declared state; a ``momentum_file`` table as a reference (path, shape, dtype, version)."""
        if self._torn is not None:
            raise RuntimeError(self._torn)
        return tables.state_dict(self, super().state_dict, "M", "momentum_file")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the state; a referenced table file is reopened after its size and marker are checked
        (version equal to the state's, update finished); an in-memory table loaded into an aggregator
        with ``momentum_file`` is written to that (new) file."""
        tables.load_state_dict(self, super().load_state_dict, state, "M", "momentum_file")
        self._torn = None

    def _active_gram(self, active: torch.Tensor) -> torch.Tensor:
        """The cached Gram over the active rows (every client active, ``active`` sorted: the cache itself,
        not two N x N copies). It may be a transposed view (the cache is one after a round of every client):
        only its values matter."""
        if active.numel() == self.Gm.size(0):
            return self.Gm
        return self.Gm.index_select(0, active).index_select(1, active)

    def _scale(self, G: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(nz, s): the momenta's norms ||m_i|| = sqrt(G_ii) (1 for a zero row) and the solver's row scale
        s = 1 / nz when ``normalize`` (None: raw momenta)."""
        norms = torch.diagonal(G).clamp_min(0).sqrt()
        if not self.normalize:
            return torch.ones_like(norms), None
        nz = norms.masked_fill_(norms == 0, 1.0)
        return nz, nz.reciprocal()

    @staticmethod
    def _scaled_sym(G: torch.Tensor, s: Optional[torch.Tensor]) -> torch.Tensor:
        """s_i s_j (G + G^T) / 2 (s None: (G + G^T) / 2): the matrix ``ops.min_norm(G, scale=s)`` solves on,
        with its bits (an exactly symmetric G, since s_i s_j = s_j s_i)."""
        S = G.add(G.T).mul_(0.5)
        return S if s is None else S.mul_(torch.outer(s, s))

    def gram_matrix(self, active: torch.Tensor):
        """(G, nz) over the active rows: the solver's Gram, s_i s_j (G + G^T) / 2 with s_i = 1 / ||m_i||
        when ``normalize`` (s = 1: raw), and the norms nz (1 for a zero row). The default solver
        (ops.min_norm) makes this matrix itself in its one symmetrising pass (``scale=``), with the same bits;
        this N x N form is what a custom ``solver`` gets (and what tests check the KKT conditions on)."""
        G = self._active_gram(active)
        nz, s = self._scale(G)
        return self._scaled_sym(G, s), nz

    def _solve(self, G: torch.Tensor, active: torch.Tensor, scale: Optional[torch.Tensor] = None):
        lam0 = None
        if self.warm_start and self.lam_prev is not None:
            l = self.lam_prev.index_select(0, active)
            if float(l.sum()) > 0:
                lam0 = l
        kw = {} if scale is None else {"scale": scale}
        lam, iters, gap = self.solver(
            G, self.max_iter, self.tol, method=self.method, init=self.solver_init, tol_abs=self.tol_abs, lam0=lam0, **kw
        )
        return torch.as_tensor(lam, dtype=torch.float64).cpu(), int(iters), float(gap)

    def _wsum_M(self, coef, base=None, alpha=1.0, rows=None, out=None):
        return table_weighted_sum(
            self.M, coef, getattr(self, "_like", (self.M.dtype, self.M.device)), base, alpha, rows, out
        )

    def _na_coef(self):
        act = torch.nonzero(self.seen).reshape(-1)
        n = self.n_examples.index_select(0, act)
        return act, n / n.sum()

    # ---- aggregation ------------------------------------------------------------------------------
    def aware_direction(self, info: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor, bool]:
        """The aware step's direction: the min-norm point lambda of the active momenta's Gram
        (normalised rows), as the support rows of M and their coefficients lambda_i / ||m_i||; logs
        lambda, q = lambda' G lambda, the gap and the iterations into ``info``. ``zero_dir``: q is
        numerically zero (the fallback applies)."""
        active = torch.nonzero(self.seen).reshape(-1) if self.warmup == "mask" else None
        act = torch.arange(self.num_clients) if active is None else active
        Graw = self._active_gram(act)
        nz, s = self._scale(Graw)
        if self.solver is _default_solver:  # ops.min_norm makes s_i s_j (G + G^T) / 2 in its one pass over G
            G = Graw.T if not Graw.is_contiguous() and Graw.T.is_contiguous() else Graw  # (same (G + G^T) / 2)
            lam, iters, gap = self._solve(G, act, scale=s)
        else:
            lam, iters, gap = self._solve(self._scaled_sym(Graw, s), act)
        # q = lam' S lam = w' G_SS w, w = s_S lam_S, over lam's support S (one gather of |S|^2 entries, not N^2;
        # lam' (G + G^T) / 2 lam = lam' G lam); zero_dir: q <= ZERO_REL max_i S_ii
        on = torch.nonzero(lam).reshape(-1)
        w = lam.index_select(0, on)
        if s is not None:
            w.mul_(s.index_select(0, on))
        Gc = Graw.T if not Graw.is_contiguous() else Graw  # (the same q from G^T)
        m = on.numel()
        G_SS = Gc.reshape(-1).index_select(0, (on[:, None] * Gc.size(1) + on).reshape(-1)).view(m, m)
        q = float(w @ (G_SS @ w))
        dg = torch.diagonal(Graw)
        zero_dir = not (q > ZERO_REL * float((dg if s is None else dg * s * s).max()))
        self.lam_prev = (
            lam if active is None else torch.zeros(self.num_clients, dtype=torch.float64).index_copy_(0, active, lam)
        )
        coef = lam / nz
        sup = torch.nonzero(coef).reshape(-1)
        rows, c = act.index_select(0, sup), coef.index_select(0, sup)
        info.update(
            lam=self.lam_prev.tolist(),
            support=rows.tolist(),
            coef=c.tolist(),
            q=q,
            gap=gap,
            iterations=iters,
            zero_direction=zero_dir,
            num_active=int(act.numel()),
        )
        return rows, c, zero_dir

    def update_passes(self, K: Optional[int] = None) -> Tuple[str, ...]:
        """ELUD's screening pass (:meth:`elud_passes`), the extension's base step, then the momenta: U into
        the K rows of M (read, written), their Gram against M, the step's sum over M."""
        return (
            self.elud_passes(K)
            + (("sum",) if self.extension is not None else ())
            + table_passes(self.momentum_device, self.momentum_file, "sum", "table", "table_gram", "table_sum")
        )

    def _aggregate(self, rin: RoundInput) -> AggResult:
        x = rin.global_flat
        self._alloc(x)
        dev = rin.device
        info: Dict[str, Any] = {}
        sums = None
        if self.log_elud:
            if rin.K <= ELUD_GRAM_MAX_K:  # the participants' Gram pass also screens U's rows (screen_in_pass)
                info["elud"], info["elud_sqrt"] = elud(rin.gram(host=True))  # G rides in the flags' host copy
            else:  # O(kd) sums in the momentum pass (its blocks screen the rows first)
                sums = EludSums(rin.K)
        # the base method's step G~ (AWARE extension) or the FedAvg step used while exploring
        p = rin.sample_weights()
        base_step = None
        if self.extension == "fedavgm":
            base_step = self._ext.step(rin, p, x)
        elif self.extension == "fedavg":
            base_step = rin.weighted_sum(p)
        self._update_momenta(rin, sums)
        if sums is not None:
            info["elud"], info["elud_sqrt"] = sums.result()
        exploring = self.warmup == "explore" and not bool(self.seen.all())
        info["phase"] = "explore" if exploring else "aware"
        if exploring:
            if base_step is not None:
                new = x.add(base_step, alpha=self.server_lr)
            else:
                new = rin.weighted_sum(p, base=x, alpha=self.server_lr)
            info.update(weights=p.tolist(), num_seen=int(self.seen.sum()))
            return AggResult(new, info)
        if self.variant == "na":
            act, coef = self._na_coef()
            new = self._wsum_M(coef, base=x, alpha=self.server_lr, rows=act, out=rin.take_out())
            info.update(support=act.tolist(), coef=coef.tolist())
            return AggResult(new, info)
        rows, c, zero_dir = self.aware_direction(info)
        if zero_dir:
            if self.zero_fallback == "na":
                act, cna = self._na_coef()
                new = self._wsum_M(cna, base=x, alpha=self.server_lr, rows=act, out=rin.take_out())
                info["fallback"] = "na"
            elif base_step is not None:
                new = x.add(base_step, alpha=self.server_lr)
                info["fallback"] = "base"
            else:
                new = x.clone()
                info["fallback"] = "zero step"
            return AggResult(new, info)
        if base_step is not None:
            d = self._wsum_M(c, rows=rows)
            scale = aware_scale(base_step, d)
            o = rin.take_out()
            step = self.server_lr * scale
            new = x.add(d, alpha=step) if o is None else torch.add(x, d, alpha=step, out=o)
            info["projection_scale"] = scale
            return AggResult(new, info)
        new = self._wsum_M(c, base=x, alpha=self.server_lr, rows=rows, out=rin.take_out())  # (into out, if given)
        return AggResult(new, info)
