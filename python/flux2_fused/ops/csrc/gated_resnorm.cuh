// Fused gated residual + LayerNorm (no affine) + adaLN modulation, bit-exact to PyTorch eager.
//
// Eager computes, per row of D elements (docs/numerics.md derives it):
//   y   = T(T(gate * update) + residual)              two aten elementwise ops, fp32 math, T roundings
//   n   = layer_norm(y)                               aten's vectorized_layer_norm_kernel<T, float>
//   out = T(T(n * T(scale + 1)) + shift)              three aten elementwise ops
// and this kernel reproduces each rounding and aten's Welford reduction order exactly: 128 "aten
// threads" per row, thread t owning the 4-element vectors t, t + 128, ...; a Welford push per element
// in vector order; a shuffle-down tree over each warp; then (w0 + w2), (w1 + w3), and their sum.
// Every floating-point op is written with an explicit-rounding intrinsic so that no compiler
// contraction can change a bit; the module must be built without --use_fast_math. The elementwise
// steps run as packed T-pair instructions where that is provably the same (argued below): at these
// byte counts the kernel was issue-bound, and packed math halves its instructions (the README's
// kernel table has the measurements).
//
// One block of 128 threads handles one row. The row's elements live in registers between the
// reduction and the output, so the kernel moves exactly: read residual + update, write residual_out
// (optional) + out; gate/scale/shift rows are L2-resident broadcasts.
#pragma once

#include "common.cuh"

namespace flux2_fused {

constexpr int kThreads = 128;  // aten: block (32, 4), one row per block
constexpr int kWarps = kThreads / 32;

// ---- packed T-pair math ----
// Elem<T>::add and ::mul round the exact sum or product of two T values to T once; eager rounds it
// to fp32 first and then to T. For T = bf16 or fp16 (p = 8 or 11 significant bits) the two always
// agree, NaN payloads aside, so the kernel may use the packed T instructions:
// - sum: the fp32 sum is exact while the exponents differ by at most 23 - p (a carry can add one
//   bit, so a gap of 24 - p may already round); past that the smaller addend is below 2^(p - 23) of
//   the larger, inside half a T ulp (2^(-p-1)) as 2p < 22, and both roundings return the larger
//   addend.
// - product: at most 2p significant bits, exact in fp32 except below 2^-126 (bf16 only). There a
//   double rounding could differ only if the fp32 result sat exactly on a T rounding midpoint (an
//   odd multiple of 2^-134) while the exact product did not; a product of two 8-bit significands
//   is at most 255^2 = 65025 units of its last place, too few bits for that (docs/numerics.md).
// - overflow: T's overflow threshold is an fp32 value, and fp32 rounding cannot cross it.
// Checked on the GPU with every bf16 bit pattern class: subnormal products, scale near -1, random
// bits including NaN and Inf in all five inputs (test/ops/gated_resnorm/test_kernel_gpu.py).
// Elem<T>::add and ::mul (common.cuh) are the packed instructions argued for above.
template <typename T>
using Packed4 = Packed<T, 2>;  // four elements, 8 bytes: the unit aten's vectorized kernel and ours load

// Row pointers are pre-offset by the thread's first vector, so the j-th vector sits at a
// compile-time offset (j * 128 vectors) and every load and store uses one base register.
template <typename T>
__device__ __forceinline__ Packed4<T> load_stream(const uint2* base, int j) {
  // Read-once rows: evict-first, so they do not displace the L2-resident modulation rows.
  const uint2 raw = __ldcs(base + j * kThreads);
  return *reinterpret_cast<const Packed4<T>*>(&raw);
}

template <typename T>
__device__ __forceinline__ Packed4<T> load_cached(const uint2* base, int j) {
  const uint2 raw = __ldg(base + j * kThreads);
  return *reinterpret_cast<const Packed4<T>*>(&raw);
}

template <typename T>
__device__ __forceinline__ void store(uint2* base, int j, const Packed4<T>& v) {
  base[j * kThreads] = *reinterpret_cast<const uint2*>(&v);
}

template <typename T>
__device__ __forceinline__ const uint2* thread_base(const T* row) {
  return reinterpret_cast<const uint2*>(row) + threadIdx.x;
}

// ---- aten's Welford (WelfordDataLN, cuWelfordOnlineSum, cuWelfordCombine), op for op ----
struct Welford {
  float mean, m2, count;
};

// Push of the k-th element (0-based) of this thread: count k -> k + 1, so 1 / (k + 1) is a
// compile-time constant once the caller's loops are unrolled (IEEE division, folded exactly).
__device__ __forceinline__ void welford_push(Welford& w, float x, float rcp_count) {
  const float d = __fsub_rn(x, w.mean);
  w.count = __fadd_rn(w.count, 1.0f);
  w.mean = __fmaf_rn(d, rcp_count, w.mean);
  w.m2 = __fmaf_rn(d, __fsub_rn(x, w.mean), w.m2);
}

// cuWelfordCombine(dataB = self, dataA = other).
__device__ __forceinline__ Welford welford_combine(const Welford& self, const Welford& other) {
  const float count = __fadd_rn(other.count, self.count);
  if (!(self.count > -other.count)) return {0.0f, 0.0f, count};
  const float coef = __frcp_rn(count);
  const float delta = __fsub_rn(self.mean, other.mean);
  const float n_other = __fmul_rn(other.count, coef);
  const float n_self = __fmul_rn(self.count, coef);
  const float mean = __fmaf_rn(other.mean, n_other, __fmul_rn(n_self, self.mean));
  const float m2 = __fmaf_rn(n_self, __fmul_rn(other.count, __fmul_rn(delta, delta)),
                             __fadd_rn(other.m2, self.m2));
  return {mean, m2, count};
}

__device__ __forceinline__ Welford warp_reduce(Welford w) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Welford other;
    other.mean = __shfl_down_sync(0xffffffffu, w.mean, offset);
    other.m2 = __shfl_down_sync(0xffffffffu, w.m2, offset);
    other.count = __shfl_down_sync(0xffffffffu, w.count, offset);
    w = welford_combine(w, other);
  }
  return w;
}

// ---- kernel parameters ----
// Input rows come from up to two segments (rows [0, split) of each batch from seg[0], the rest from
// seg[1]), so a stream concat can be materialized straight into its buffer in the same launch.
template <typename T>
struct Segment {
  const T* residual;     // [B, rows, D], stride(-1) == 1
  const T* update;       // same shape as residual (unused without the gated add)
  const T* gate;         // one row of D a batch ([B, 1, D]) or one for all, broadcast over tokens
  int64_t residual_batch_stride, residual_row_stride;
  int64_t update_batch_stride, update_row_stride;
  int64_t gate_batch_stride;  // 0 when broadcast over the batch
};

template <typename T>
struct Params {
  Segment<T> seg[2];
  int64_t rows;            // B * T, < 2**31
  int64_t split;           // tokens < split come from seg[0]
  int64_t rows_per_batch;  // T (tokens)
  T* out;                  // [B, T, D] contiguous
  T* residual_out;         // [B, T, D] contiguous, or nullptr to skip writing it
  const T* scale;          // like gate: a row of D a batch, or one for all
  const T* shift;
  int64_t scale_batch_stride, shift_batch_stride;
  int32_t dim;    // D, a multiple of 4
  float eps;
};

// Where one row's inputs live: its batch, its token within the batch and its segment.
template <typename T>
struct RowRef {
  int64_t batch, seg_tok;
  const Segment<T>* seg;

  __device__ __forceinline__ RowRef(const Params<T>& p, int64_t row) {
    // 32-bit division: rows < 2**31 (checked on the host) and far cheaper than a 64-bit one.
    batch = static_cast<uint32_t>(row) / static_cast<uint32_t>(p.rows_per_batch);
    const int64_t tok = row - batch * p.rows_per_batch;
    const bool second = tok >= p.split;
    seg = &p.seg[second ? 1 : 0];
    seg_tok = second ? tok - p.split : tok;
  }
  __device__ __forceinline__ const T* residual() const {
    return seg->residual + batch * seg->residual_batch_stride + seg_tok * seg->residual_row_stride;
  }
  __device__ __forceinline__ const T* update() const {
    return seg->update + batch * seg->update_batch_stride + seg_tok * seg->update_row_stride;
  }
};

// One block per row. All of the row's residual and update loads (and, up to 12 vectors a thread, the
// gate's) go out at once, straight into registers; the scale and shift rows are read after the
// reduction, from cache (every row of a batch reads the same ones). In measurements (the README lists
// them) this beat a persistent grid prefetching the next row (registers or cp.async into shared memory), staging the
// modulation through cp.async, L1 prefetches of the modulation rows, and bulk copies (TMA) of the
// streams into shared memory for more rows in flight per SM (notes in the README).
// kGated: y = residual + gate * update (false: y = residual, the plain modulated LayerNorm).
// kVecs: the most 4-element vectors one thread owns, ceil(D / 512) rounded up to an instantiated size.
// kFull: D == 512 kVecs, so every thread owns exactly kVecs vectors; the compiler then drops every
// bounds predicate and folds the Welford counts to constants.
template <typename T, int kVecs, bool kGated, bool kFull>
__global__ void __launch_bounds__(kThreads) gated_resnorm_kernel(const Params<T> p) {
  using V = Elem<T>;
  // Past 12 vectors a thread, holding the gate too costs more occupancy than its early load gains.
  constexpr bool kGateUpfront = kVecs <= 12;
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  // This thread owns vectors tid + 128 j for j < owned (aten's per-thread order and tail counts).
  const int owned = kFull ? kVecs : (p.dim / 4 - tid + kThreads - 1) / kThreads;
  const RowRef<T> ref(p, row);

  // 1. y = T(residual + T(gate * update)) (or y = residual); write residual_out.
  Packed4<T> y[kVecs];
  const uint2* residual = thread_base(ref.residual());
  if constexpr (kGated) {
    const uint2* update = thread_base(ref.update());
    const uint2* gate = thread_base(ref.seg->gate + ref.batch * ref.seg->gate_batch_stride);
    Packed4<T> r[kVecs], u[kVecs], g[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j < owned) {
        r[j] = load_stream<T>(residual, j);
        u[j] = load_stream<T>(update, j);
        if constexpr (kGateUpfront) g[j] = load_cached<T>(gate, j);
      }
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j < owned) {
        const Packed4<T> gj = kGateUpfront ? g[j] : load_cached<T>(gate, j);
#pragma unroll
        for (int h = 0; h < 2; ++h) y[j].p[h] = V::add(r[j].p[h], V::mul(gj.p[h], u[j].p[h]));
      }
    }
    if (p.residual_out != nullptr) {
      uint2* residual_out = const_cast<uint2*>(thread_base(p.residual_out + row * p.dim));
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (j < owned) store(residual_out, j, y[j]);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j < owned) y[j] = load_stream<T>(residual, j);
    }
  }

  // 2. Per-thread Welford over this thread's elements, in aten's order.
  Welford w{0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j < owned) {
#pragma unroll
      for (int e = 0; e < 4; ++e) welford_push(w, y[j].get(e), 1.0f / static_cast<float>(4 * j + e + 1));
    }
  }

  // 3. Warp trees, then aten's cross-warp order: (w0 + w2), (w1 + w3), then their sum. Every thread
  // finishes the last two levels itself from shared memory, which saves two barriers.
  w = warp_reduce(w);
  __shared__ Welford partial[kWarps];
  if ((tid & 31) == 0) partial[tid >> 5] = w;
  __syncthreads();
  const Welford total =
      welford_combine(welford_combine(partial[0], partial[2]), welford_combine(partial[1], partial[3]));
  const float mean = total.mean;
  const float var = __fdiv_rn(total.m2, static_cast<float>(p.dim));
  const float rstd = rsqrtf(__fadd_rn(var, p.eps));

  // 4. n = T(rstd * (y - mean)); out = T(T(n * T(scale + 1)) + shift).
  const uint2* scale = thread_base(p.scale + ref.batch * p.scale_batch_stride);
  const uint2* shift = thread_base(p.shift + ref.batch * p.shift_batch_stride);
  uint2* out = const_cast<uint2*>(thread_base(p.out + row * p.dim));
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j < owned) {
      const Packed4<T> sc = load_cached<T>(scale, j);
      const Packed4<T> sh = load_cached<T>(shift, j);
      Packed4<T> o;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float n0 = __fmul_rn(rstd, __fsub_rn(y[j].get(2 * h), mean));
        const float n1 = __fmul_rn(rstd, __fsub_rn(y[j].get(2 * h + 1), mean));
        const auto s1 = V::add(sc.p[h], V::ones());
        o.p[h] = V::add(V::mul(V::pack(n0, n1), s1), sh.p[h]);
      }
      store(out, j, o);
    }
  }
}

}  // namespace flux2_fused
