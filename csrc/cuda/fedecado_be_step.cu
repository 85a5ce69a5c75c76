// fedecado_be_step: one fused FedECADO backward-Euler attempt on the GPU (fedecado.md §5.3(a));
// same maths as csrc/cpu/fedecado_be_step.cpp. Per coordinate j (c = dt / L):
//   r_i  = Icur_i + c (xc0 + theta_new_i U_i + inv_g_i Ik_i),   acc = sum_i inv_a_i r_i
//   x'   = (xc + dt S_off + dt acc) * inv_den,   I'_i = (r_i - c x') inv_a_i
//   dsum = sum_i I'_i - sum_i Icur_i,   e_i = (dth_i U_i + inv_g_i Icur_i) - inv_g_i I'_i - (x' - xc)
// (the LTE terms use the stored, rounded x' and I'). 1-D grid-stride over d, one coordinate per
// thread per iteration, the K clients in index order (coalesced row reads). The r_i and
// q_i = dth_i U_i + inv_g_i Icur_i of the thread's column are kept between the two client loops:
// in register arrays for K <= 32 (template KMAX), in 2K private shared-memory slots per thread for
// larger K (blocks of 256..32 threads, be::smem_threads: up to K ~ 440 in fp64 / ~880 in fp32 on
// sm_90), so every input element is read once: 16 (K + 1) d bytes in fp32. Only beyond that the
// second client loop recomputes them (3 K d more reads). Arithmetic in float for fp32, double for
// fp64 (the CPU op computes in double for both); coefficients are float64 on the device, rounded
// to the arithmetic type.
// LTE maxima: per-thread max of |dsum| and |e_i| (NaN -> +inf), warp shuffles, a block max in shared
// memory, scaled by dt/2 (dt/(2L)) in float64 and combined with atomicMax on the bit patterns of
// these non-negative doubles (monotone in the value; max is order-independent, so the result is
// deterministic). The launcher clears lte[2] first (cudaMemsetAsync).
// Host-tested (fedecado_be_step.cuh, tests/test_fedecado_be_step.py's host cases): the per-element update of all three
// paths and their slot layout and column split, against the float64 reference and the CPU op.
// Only a GPU run checks (tests/test_fedecado_be_step.py's cuda cases): the launch and dynamic shared memory, the block max
// and atomicMax of the LTE, bitwise repeatability.
#include "common.cuh"
#include "fedecado_be_step.cuh"

namespace fedkernels {
namespace cuda {
namespace {

using namespace detail;

struct BeArgs {
  const void* xc;
  const void* Icur;
  int64_t ldi;
  const void* xc0;
  const void* U;
  int64_t ldu;
  const void* Ik;
  int64_t ldk;
  const void* S;  // nullptr: no S_off
  const double* coef;  // device [4K]: theta_new, theta_new - theta_old, inv_g, 1 / a
  int64_t K, d;
  double c, dt, inv_den, scale_c, scale_I;
  void* xo;
  void* Io;  // [K, d] contiguous
  double* lte;
};

template <typename A> __device__ __forceinline__ A warp_max(A x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Block max of (mc, me) -> scaled, atomicMax into lte[0], lte[1]. blockDim.x is a multiple of 32.
template <typename A>
__device__ void block_max_to_lte(A mc, A me, const BeArgs& p) {
  __shared__ A sc[32], se[32];
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, nw = blockDim.x / 32;
  mc = warp_max(mc);
  me = warp_max(me);
  if (lane == 0) {
    sc[w] = mc;
    se[w] = me;
  }
  __syncthreads();
  if (w == 0) {
    mc = lane < nw ? sc[lane] : A(0);
    me = lane < nw ? se[lane] : A(0);
    mc = warp_max(mc);
    me = warp_max(me);
    if (lane == 0) {
      const double vc = p.scale_c * static_cast<double>(mc), ve = p.scale_I * static_cast<double>(me);
      atomicMax(reinterpret_cast<unsigned long long*>(p.lte), static_cast<unsigned long long>(__double_as_longlong(vc)));
      atomicMax(reinterpret_cast<unsigned long long*>(p.lte + 1),
                static_cast<unsigned long long>(__double_as_longlong(ve)));
    }
  }
}

// PATH kReg: K <= KMAX, r_i / q_i in register arrays, coefficients in shared memory.
// PATH kSmem: r_i / q_i in 2K private shared-memory slots per thread (be::slot), coefficients
//   through the read-only cache; every input element is read once.
// PATH kRecompute: any K, the second client loop recomputes r_i / q_i (U and Icur read twice).
enum Path { kReg = 0, kSmem = 1, kRecompute = 2 };

template <typename T, int KMAX, int PATH>
__global__ void __launch_bounds__(256) be_step_kernel(const BeArgs p) {
  using A = typename Acc<T>::type;
  constexpr int KS = KMAX > 0 ? KMAX : 1;
  __shared__ A s_thn[KS], s_dth[KS], s_ig[KS], s_ia[KS];
  extern __shared__ __align__(16) unsigned char be_dyn[];
  A* slots = reinterpret_cast<A*>(be_dyn);
  const int64_t K = p.K, d = p.d;
  const int nt = blockDim.x, tid = threadIdx.x;
  if (PATH == kReg) {
    for (int i = tid; i < K; i += nt) {
      s_thn[i] = static_cast<A>(p.coef[i]);
      s_dth[i] = static_cast<A>(p.coef[K + i]);
      s_ig[i] = static_cast<A>(p.coef[2 * K + i]);
      s_ia[i] = static_cast<A>(p.coef[3 * K + i]);
    }
    __syncthreads();
  }
  auto thn = [&](int64_t i) { return PATH == kReg ? s_thn[i] : static_cast<A>(__ldg(p.coef + i)); };
  auto dth = [&](int64_t i) { return PATH == kReg ? s_dth[i] : static_cast<A>(__ldg(p.coef + K + i)); };
  auto ig = [&](int64_t i) { return PATH == kReg ? s_ig[i] : static_cast<A>(__ldg(p.coef + 2 * K + i)); };
  auto ia = [&](int64_t i) { return PATH == kReg ? s_ia[i] : static_cast<A>(__ldg(p.coef + 3 * K + i)); };
  const T* xc = static_cast<const T*>(p.xc);
  const T* Ic = static_cast<const T*>(p.Icur);
  const T* x0p = static_cast<const T*>(p.xc0);
  const T* U = static_cast<const T*>(p.U);
  const T* Ik = static_cast<const T*>(p.Ik);
  const T* S = static_cast<const T*>(p.S);
  T* xo = static_cast<T*>(p.xo);
  T* Io = static_cast<T*>(p.Io);
  const A c = static_cast<A>(p.c), dt = static_cast<A>(p.dt), inv_den = static_cast<A>(p.inv_den);
  A mc = A(0), me = A(0);
  const int64_t step = be::col_step(gridDim.x, nt);
  for (int64_t j = be::first_col(blockIdx.x, tid, nt); j < d; j += step) {
    const A x0 = static_cast<A>(to_float(x0p[j]));
    A r[KS], q[KS];
    A acc = A(0), sI = A(0);
    auto client = [&](int64_t i, A& rv, A& qv, A& icv) {
      const A u = static_cast<A>(to_float(U[i * p.ldu + j]));
      icv = static_cast<A>(to_float(Ic[i * p.ldi + j]));
      const A ik = static_cast<A>(to_float(Ik[i * p.ldk + j]));
      be::rhs(x0, u, icv, ik, thn(i), dth(i), ig(i), c, rv, qv);
    };
    if (PATH == kReg) {
#pragma unroll
      for (int i = 0; i < KS; ++i) {
        if (i < K) {
          A icv;
          client(i, r[i], q[i], icv);
          acc += ia(i) * r[i];
          sI += icv;
        }
      }
    } else {
#pragma unroll 4
      for (int64_t i = 0; i < K; ++i) {
        A rv, qv, icv;
        client(i, rv, qv, icv);
        if (PATH == kSmem) {
          slots[be::slot(0, i, tid, K, nt)] = rv;
          slots[be::slot(1, i, tid, K, nt)] = qv;
        }
        acc += ia(i) * rv;
        sI += icv;
      }
    }
    const A xcj = static_cast<A>(to_float(xc[j]));
    const A x = be::x_new(xcj, S != nullptr, S ? static_cast<A>(to_float(S[j])) : A(0), dt, acc, inv_den);
    const T xs = from_acc<T>(x);
    xo[j] = xs;
    const A dx = static_cast<A>(to_float(xs)) - xcj;
    A sIn = A(0);
    auto out = [&](int64_t i, A rv, A qv) {
      const T In = from_acc<T>(be::flow(rv, c, x, ia(i)));
      Io[i * d + j] = In;
      const A inv = static_cast<A>(to_float(In));
      sIn += inv;
      me = fmax(me, be::err(qv, ig(i), inv, dx));
    };
    if (PATH == kReg) {
#pragma unroll
      for (int i = 0; i < KS; ++i)
        if (i < K) out(i, r[i], q[i]);
    } else if (PATH == kSmem) {
#pragma unroll 4
      for (int64_t i = 0; i < K; ++i) out(i, slots[be::slot(0, i, tid, K, nt)], slots[be::slot(1, i, tid, K, nt)]);
    } else {
      for (int64_t i = 0; i < K; ++i) {
        A rv, qv, icv;
        client(i, rv, qv, icv);
        out(i, rv, qv);
      }
    }
    mc = fmax(mc, be::abs_nan_inf(sIn - sI));
  }
  block_max_to_lte<A>(mc, me, p);
}

size_t smem_budget() { return smem_optin(1024); }  // minus the static coefficient arrays

template <typename T>
cudaError_t launch(const BeArgs& p, cudaStream_t st) {
  using A = typename Acc<T>::type;
  int threads = 256;
  size_t smem = 0;
  int path = kReg;
  if (p.K > be::kRegK) {
    const int nt = be::smem_threads(p.K, (int)sizeof(A), smem_budget());
    path = nt > 0 ? kSmem : kRecompute;
    if (nt > 0) {
      threads = nt;
      smem = be::smem_bytes(p.K, (int)sizeof(A), nt);
    }
  }
  int64_t blocks = (p.d + threads - 1) / threads;
  const int64_t cap = (int64_t)num_sms() * (2048 / threads);
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  const unsigned g = (unsigned)blocks;
  if (p.K <= 4)
    be_step_kernel<T, 4, kReg><<<g, threads, 0, st>>>(p);
  else if (p.K <= 8)
    be_step_kernel<T, 8, kReg><<<g, threads, 0, st>>>(p);
  else if (p.K <= 16)
    be_step_kernel<T, 16, kReg><<<g, threads, 0, st>>>(p);
  else if (p.K <= be::kRegK)
    be_step_kernel<T, be::kRegK, kReg><<<g, threads, 0, st>>>(p);
  else if (path == kSmem) {
    if (smem > 48 * 1024) {
      const cudaError_t err =
          cudaFuncSetAttribute(be_step_kernel<T, 0, kSmem>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
      if (err != cudaSuccess) return err;
    }
    be_step_kernel<T, 0, kSmem><<<g, threads, smem, st>>>(p);
  } else {
    be_step_kernel<T, 0, kRecompute><<<g, threads, 0, st>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t fedecado_be_step(const void* xc, const void* Icur, int64_t ld_icur, const void* xc0, const void* U,
                             int64_t ld_u, const void* Ik, int64_t ld_ik, const void* S_off, const double* coef,
                             int64_t K, int64_t d, double c, double dt, double inv_den, double scale_c, double scale_I,
                             void* xc_out, void* I_out, double* lte, DType ty, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(lte, 0, 2 * sizeof(double), stream);
  if (err != cudaSuccess || d <= 0) return err;
  if (ty != DType::Float32 && ty != DType::Float64) return cudaErrorInvalidValue;
  BeArgs p{xc, Icur, ld_icur, xc0, U, ld_u, Ik, ld_ik, S_off, coef, K, d, c, dt, inv_den, scale_c, scale_I,
           xc_out, I_out, lte};
  return ty == DType::Float32 ? launch<float>(p, stream) : launch<double>(p, stream);
}

}  // namespace cuda
}  // namespace fedkernels
