// Host harness commands of fedecado_be_step (csrc/cuda/fedecado_be_step.cuh), driven by tests/test_fedecado_be_step.py.
// Protocol: see harness.h; one line in, one line out:
//   bestep A path nt K d has_s c dt inv_den coef[4K] xc[d] Icur[K*d] xc0[d] U[K*d] Ik[K*d] S[d if has_s]
//                                        -> x'[d] I'[K*d] max|dsum| max|e|: be_step_kernel emulated (path 0 registers,
//                                           1 shared-memory slots, 2 recompute; nt threads, 3 blocks grid-stride)
//   besmem K acc_bytes budget              -> nt bytes (be::smem_threads / smem_bytes)
#include "harness.h"

#include "fedecado_be_step.cuh"

// ---- fedecado_be_step emulation ------------------------------------------------------------------------
template <typename A>
static bool bestep_emulate(int path, int nt, long long K, long long d, bool has_s, double c_, double dt_,
                           double inv_den_, const std::vector<double>& coef, const std::vector<double>& xc,
                           const std::vector<double>& Icur, const std::vector<double>& xc0, const std::vector<double>& U,
                           const std::vector<double>& Ik, const std::vector<double>& S, std::vector<double>& xo,
                           std::vector<double>& Io, double& mc_out, double& me_out) {
  const A c = (A)c_, dt = (A)dt_, inv_den = (A)inv_den_;
  auto thn = [&](long long i) { return (A)coef[i]; };
  auto dth = [&](long long i) { return (A)coef[K + i]; };
  auto ig = [&](long long i) { return (A)coef[2 * K + i]; };
  auto ia = [&](long long i) { return (A)coef[3 * K + i]; };
  const long long grid = 3;
  std::vector<int> hits(d, 0);
  std::vector<A> slots(path == 1 ? be::smem_bytes(K, sizeof(A), nt) / sizeof(A) : 0);
  std::vector<int> owner(slots.size(), -1);
  bool ok = true;
  A mc = A(0), me = A(0);
  for (long long b = 0; b < grid; ++b)
    for (int tid = 0; tid < nt; ++tid)
      for (long long j = be::first_col(b, tid, nt); j < d; j += be::col_step(grid, nt)) {
        ++hits[j];
        const A x0 = (A)xc0[j];
        std::vector<A> r(K), q(K);
        A acc = A(0), sI = A(0);
        auto client = [&](long long i, A& rv, A& qv, A& icv) {
          icv = (A)Icur[i * d + j];
          be::rhs(x0, (A)U[i * d + j], icv, (A)Ik[i * d + j], thn(i), dth(i), ig(i), c, rv, qv);
        };
        for (long long i = 0; i < K; ++i) {
          A rv, qv, icv;
          client(i, rv, qv, icv);
          if (path == 0) {
            r[i] = rv;
            q[i] = qv;
          } else if (path == 1) {
            for (int w = 0; w < 2; ++w) {
              const long long sl = be::slot(w, i, tid, K, nt);
              if (sl < 0 || sl >= (long long)slots.size() || (owner[sl] != -1 && owner[sl] != tid)) ok = false;
              else owner[sl] = tid;
            }
            if (ok) {
              slots[be::slot(0, i, tid, K, nt)] = rv;
              slots[be::slot(1, i, tid, K, nt)] = qv;
            }
          }
          acc += ia(i) * rv;
          sI += icv;
        }
        const A xcj = (A)xc[j];
        const A x = be::x_new(xcj, has_s, has_s ? (A)S[j] : A(0), dt, acc, inv_den);
        const A xs = x;  // the stored value: A is the data type here (float for fp32, double for fp64)
        xo[j] = (double)xs;
        const A dx = xs - xcj;
        A sIn = A(0);
        for (long long i = 0; i < K; ++i) {
          A rv, qv, icv;
          if (path == 0) {
            rv = r[i];
            qv = q[i];
          } else if (path == 1) {
            if (!ok) break;
            rv = slots[be::slot(0, i, tid, K, nt)];
            qv = slots[be::slot(1, i, tid, K, nt)];
          } else {
            client(i, rv, qv, icv);
          }
          const A In = be::flow(rv, c, x, ia(i));
          Io[i * d + j] = (double)In;
          sIn += In;
          me = std::fmax(me, be::err(qv, ig(i), In, dx));
        }
        mc = std::fmax(mc, be::abs_nan_inf(sIn - sI));
      }
  for (int h : hits) ok = ok && h == 1;
  mc_out = (double)mc;
  me_out = (double)me;
  return ok;
}

FK_HOST_COMMAND(besmem) {
  const long long K = ri(in), ab = ri(in), budget = ri(in);
  const int nt = be::smem_threads(K, (int)ab, (size_t)budget);
  std::printf("%d %lld\n", nt, nt ? (long long)be::smem_bytes(K, (int)ab, nt) : 0LL);
}

FK_HOST_COMMAND(bestep) {
  const int A = (int)ri(in), path = (int)ri(in), nt = (int)ri(in);
  const long long K = ri(in), d = ri(in);
  const int has_s = (int)ri(in);
  const double c = rd(in), dt = rd(in), inv_den = rd(in);
  std::vector<double> coef(4 * K), xc(d), Icur(K * d), xc0(d), U(K * d), Ik(K * d), S(has_s ? d : 0);
  for (auto* v : {&coef, &xc, &Icur, &xc0, &U, &Ik, &S})
    for (auto& x : *v) x = rd(in);
  std::vector<double> xo(d), Io(K * d);
  double mc = 0, me = 0;
  const bool ok = A == 4 ? bestep_emulate<float>(path, nt, K, d, has_s, c, dt, inv_den, coef, xc, Icur, xc0, U, Ik, S,
                                                 xo, Io, mc, me)
                         : bestep_emulate<double>(path, nt, K, d, has_s, c, dt, inv_den, coef, xc, Icur, xc0, U, Ik,
                                                  S, xo, Io, mc, me);
  if (!ok) {
    std::printf("ERR bestep coverage or slot ownership\n");
    std::fflush(stdout);
    return;
  }
  std::printf("ok");
  for (double v : xo) put(v);
  for (double v : Io) put(v);
  put(mc);
  put(me);
  std::printf("\n");
}
