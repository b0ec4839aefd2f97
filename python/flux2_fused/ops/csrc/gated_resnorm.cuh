// Fused gated residual + LayerNorm (no affine) + adaLN modulation, bit-exact to PyTorch eager.
//
// Eager computes, per row of D elements (docs/numerics.md derives it):
//   y   = T(T(gate * update) + residual)              two aten elementwise ops, fp32 math, T roundings
//   y   = T(T(gate * T(update + update2)) + residual) FLUX.3's two-term update: three ops (numerics 3.6)
//   n   = layer_norm(y)                               aten's vectorized_layer_norm_kernel<T, float>
//   out = T(T(n * T(scale + 1)) + shift)              three aten elementwise ops
//   out = T(shift + n * T(scale + 1))                 with `addcmul`: ComfyUI's apply_mod, aten's
//                                                     addcmul (fp32 math, one rounding to T)
// and this kernel reproduces each rounding and aten's Welford reduction order exactly: 128 "aten
// threads" per row, thread t owning the 4-element vectors t, t + 128, ...; a Welford push per element
// in vector order; a shuffle-down tree over each warp; then (w0 + w2), (w1 + w3), and their sum.
// Every floating-point op is written with an explicit-rounding intrinsic so that no compiler
// contraction can change a bit; the module must be built without --use_fast_math. The elementwise
// steps run as packed T-pair instructions where that is provably the same (argued below): at these
// byte counts the kernel was issue-bound, and packed math halves its instructions (the kernel table
// in docs/measurements.md has the measurements).
//
// One block of 128 threads handles one row. The row's elements live in registers between the
// reduction and the output, so the kernel moves exactly: read residual + update (+ update2), write
// residual_out (optional) + out. The quantizing form (kQuant) writes, in place of out, torchao's
// per-row float8 of it (float8_quant.cuh): the modulated row stays in registers while the block
// reduces its amax, then goes out as e4m3fn bytes with the row's scale (docs/numerics.md, 15). Modulation rows (gate, scale, shift) are either one row a batch or
// one for all, broadcast over tokens (FLUX.1/FLUX.2: L2-resident, read through the read-only cache),
// or one row per token (FLUX.3: read once, streamed like the residual). Per-token rows may come with
// a word from uniform_rows.cuh that is 0 where every row of each batch equals the batch's first: the
// kernel then reads that first row for every token, from cache. Which row a token reads is only an
// address: the arithmetic of a row never depends on where its modulation came from.
#pragma once

#include "common.cuh"
#include "float8_quant.cuh"

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

// A modulation row: one shared by every row of a batch (broadcast over tokens, or per-token rows
// proven equal: `shared`) stays cached; where rows differ (kRowMod: per token, read by a single block
// once) it is streamed like the residual.
template <typename T, bool kRowMod>
__device__ __forceinline__ Packed4<T> load_modulation(const uint2* base, int j, bool shared) {
  if (kRowMod && !shared) return load_stream<T>(base, j);
  return load_cached<T>(base, j);
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
// Rows of a [B, T, D] / [T, D] view (unit inner stride): row (b, t) starts at data + b * batch_stride +
// t * row_stride. A stride is 0 along an axis the rows are broadcast over: batch_stride 0 for one
// batch or rows shared by every batch, row_stride 0 for a modulation row shared by every token.
template <typename T>
struct Rows {
  const T* data;
  int64_t batch_stride, row_stride;
  __device__ __forceinline__ const T* at(int64_t batch, int64_t tok) const {
    return data + batch * batch_stride + tok * row_stride;
  }
  // A row broadcast over tokens (row_stride is 0 there: the per-token term is not even computed).
  __device__ __forceinline__ const T* at(int64_t batch) const { return data + batch * batch_stride; }
};

// Input rows come from up to two segments (rows [0, split) of each batch from seg[0], the rest from
// seg[1]), so a stream concat can be materialized straight into its buffer in the same launch. Each
// segment has its own modulation rows, indexed by the segment's token: a modulation shared by both
// segments is passed to both, the second one's pointer advanced by `split` rows where it is per token.
// Without kRowMod (one modulation row a batch for every row of the launch) scale and shift are read
// from seg[0], straight from the kernel parameters: the address then needs no segment, which keeps
// the registers (and the code) of FLUX.1/FLUX.2's launches as they were.
template <typename T>
struct Segment {
  Rows<T> residual;  // [B, rows, D]
  Rows<T> update;    // same shape as residual (unused without the gated add)
  Rows<T> update2;   // same shape as residual (unused without the two-term update)
  Rows<T> gate;      // modulation rows: one a batch or one for all, one a token or one for all tokens
  Rows<T> scale;
  Rows<T> shift;
  // Per-token rows' uniform_rows words (gate's; scale's and shift's), or nullptr: 0 where every row
  // of each batch is the batch's first (read with kRowMod only).
  const int* gate_differs;
  const int* mod_differs;
};

template <typename T>
struct Params {
  Segment<T> seg[2];
  int64_t rows;            // B * T, < 2**31
  int64_t split;           // tokens < split come from seg[0]
  int64_t rows_per_batch;  // T (tokens)
  T* out;                  // [B, T, D] contiguous
  T* residual_out;         // [B, T, D] contiguous, or nullptr to skip writing it
  uint8_t* q;              // the quantizing form's out: [B, T, D] e4m3fn bytes, contiguous
  float* q_scale;          // ... and its scale a row, [B * T]
  int32_t dim;             // D, a multiple of 4
  float eps;
};

// Where one row's inputs live: its batch, its token within its segment, and the segment.
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
  __device__ __forceinline__ const T* stream(const Rows<T>& rows) const { return rows.at(batch, seg_tok); }
  // kRowMod: modulation rows differ within a batch (per token, or per segment; the host sets it);
  // otherwise every row_stride is 0 and the address is computed exactly as for FLUX.2's rows.
  // `shared`: per-token rows proven equal to the batch's first (`shares`), which is read instead.
  template <bool kRowMod>
  __device__ __forceinline__ const T* modulation(const Rows<T>& rows, bool shared) const {
    if constexpr (kRowMod) {
      return shared ? rows.at(batch) : rows.at(batch, seg_tok);
    } else {
      return rows.at(batch);
    }
  }
};

// Whether per-token rows with this uniform_rows word are all their batch's first row (its word is 0).
template <bool kRowMod>
__device__ __forceinline__ bool shares(const int* differs) {
  return kRowMod && differs != nullptr && __ldg(differs) == 0;
}

// The quantizing form's output: the row's amax (a max of T magnitude bits, NaN above everything, as
// float8_quant's), its scale (`row_divisor`: one barrier), and its values as e4m3fn bytes, four a
// thread's vector.
template <typename T, int kVecs>
__device__ __forceinline__ void quantize(const Params<T>& p, const Packed4<T> (&o)[kVecs], int owned, int64_t row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  __trap();  // float8 GEMMs need sm_89: the guards never launch it on an older GPU, and no code is built
#else
  unsigned int m = 0;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j < owned) m = max(m, float8_quant::packed_max<T, 2>(o[j]));
  }
  const float8_quant::Divisor d = float8_quant::row_divisor<T, kWarps>(m, p.q_scale + row);
  unsigned int* q = reinterpret_cast<unsigned int*>(p.q + row * p.dim) + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j < owned) {
      unsigned int bytes[1];
      float8_quant::quantize_packed<T, 2>(o[j], d, bytes);
      __stcs(q + j * kThreads, bytes[0]);  // nothing reads them in this launch
    }
  }
#endif
}

// Step 4 of the kernel: the row's normalized values modulated and stored. kAddcmul is ComfyUI's
// `apply_mod`, aten's addcmul(shift, n, T(scale + 1)): the product of two T values and the sum in
// fp32, one rounding to T (docs/numerics.md, 3.7); otherwise diffusers' `n * (1 + scale) + shift`,
// each op rounded to T (packed T-pair math, argued above). kQuant: the values (each rounded to T as
// out would hold it) are quantized (`quantize`, above) instead of stored.
template <typename T, int kVecs, bool kRowMod, bool kAddcmul, bool kQuant>
__device__ __forceinline__ void modulate(const Params<T>& p, const RowRef<T>& ref, const Packed4<T> (&y)[kVecs],
                                         int owned, float mean, float rstd, int64_t row, bool shared) {
  using V = Elem<T>;
  const Segment<T>& mod = kRowMod ? *ref.seg : p.seg[0];
  const uint2* scale = thread_base(ref.template modulation<kRowMod>(mod.scale, shared));
  const uint2* shift = thread_base(ref.template modulation<kRowMod>(mod.shift, shared));
  uint2* out = kQuant ? nullptr : const_cast<uint2*>(thread_base(p.out + row * p.dim));
  Packed4<T> o[kQuant ? kVecs : 1];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j < owned) {
      const Packed4<T> sc = load_modulation<T, kRowMod>(scale, j, shared);
      const Packed4<T> sh = load_modulation<T, kRowMod>(shift, j, shared);
      Packed4<T>& oj = o[kQuant ? j : 0];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float n0 = __fmul_rn(rstd, __fsub_rn(y[j].get(2 * h), mean));
        const float n1 = __fmul_rn(rstd, __fsub_rn(y[j].get(2 * h + 1), mean));
        const auto s1 = V::add(sc.p[h], V::ones());
        const auto n = V::pack(n0, n1);
        if constexpr (kAddcmul) {
          oj.p[h] = V::pack(__fadd_rn(V::lo(sh.p[h]), __fmul_rn(V::lo(n), V::lo(s1))),
                            __fadd_rn(V::hi(sh.p[h]), __fmul_rn(V::hi(n), V::hi(s1))));
        } else {
          oj.p[h] = V::add(V::mul(n, s1), sh.p[h]);
        }
      }
      if constexpr (!kQuant) store(out, j, oj);
    }
  }
  if constexpr (kQuant) quantize<T, kVecs>(p, o, owned, row);
}

// One block per row. All of the row's residual and update loads (and, up to 12 vectors a thread, the
// gate's) go out at once, straight into registers; the scale and shift rows are read after the
// reduction (from cache where every row of a batch reads the same ones). In measurements (docs/measurements.md
// lists them) this beat a persistent grid prefetching the next row (registers or cp.async into shared memory), staging the
// modulation through cp.async, L1 prefetches of the modulation rows, and bulk copies (TMA) of the
// streams into shared memory for more rows in flight per SM (notes in docs/measurements.md).
// kTerms: 0 for y = residual (the plain modulated LayerNorm), 1 for y = residual + gate * update, 2
// for y = residual + gate * (update + update2) (FLUX.3's blocks), each op rounded to T as eager does.
// kRowMod: modulation rows differ within a batch: per token, or per segment (streamed loads, an
// address from the row's segment and token), unless a uniform_rows word proves a segment's rows equal.
// kVecs: the most 4-element vectors one thread owns, ceil(D / 512) rounded up to an instantiated size.
// kFull: D == 512 kVecs, so every thread owns exactly kVecs vectors; the compiler then drops every
// bounds predicate and folds the Welford counts to constants.
// kAddcmul: ComfyUI's modulation rounding (`modulate`); instantiated only where ComfyUI's FLUX.2 needs
// it (one modulation row a batch, one-term updates, D <= 6144), so FLUX.2's and FLUX.3's kernels are
// the ones they were.
// kQuant: the quantizing form (out as torchao's per-row float8: `gated_resnorm_kernel_quantized`).
template <typename T, int kVecs, int kTerms, bool kRowMod, bool kFull, bool kAddcmul, bool kQuant>
__device__ __forceinline__ void gated_resnorm_row(const Params<T>& p) {
  using V = Elem<T>;
  static_assert(kTerms >= 0 && kTerms <= 2, "kTerms is 0 (plain), 1 or 2 (update + update2)");
  // Past 12 vectors a thread (8 with a second update), holding the gate too costs more occupancy than
  // its early load gains.
  constexpr bool kGateUpfront = kVecs <= (kTerms == 2 ? 8 : 12);
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  // This thread owns vectors tid + 128 j for j < owned (aten's per-thread order and tail counts).
  const int owned = kFull ? kVecs : (p.dim / 4 - tid + kThreads - 1) / kThreads;
  const RowRef<T> ref(p, row);
  // The words are read first, so that their wait overlaps the streams' loads.
  const bool gate_shared = kTerms > 0 && shares<kRowMod>(ref.seg->gate_differs);
  const bool mod_shared = shares<kRowMod>((kRowMod ? *ref.seg : p.seg[0]).mod_differs);

  // 1. y = T(residual + T(gate * update)), or with two updates
  //    y = T(residual + T(gate * T(update + update2))), or y = residual; write residual_out.
  Packed4<T> y[kVecs];
  const uint2* residual = thread_base(ref.stream(ref.seg->residual));
  if constexpr (kTerms > 0) {
    const uint2* update = thread_base(ref.stream(ref.seg->update));
    const uint2* update2 = kTerms == 2 ? thread_base(ref.stream(ref.seg->update2)) : nullptr;
    const uint2* gate = thread_base(ref.template modulation<kRowMod>(ref.seg->gate, gate_shared));
    Packed4<T> r[kVecs], u[kVecs], u2[kTerms == 2 ? kVecs : 1], g[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j < owned) {
        r[j] = load_stream<T>(residual, j);
        u[j] = load_stream<T>(update, j);
        if constexpr (kTerms == 2) u2[j] = load_stream<T>(update2, j);
        if constexpr (kGateUpfront) g[j] = load_modulation<T, kRowMod>(gate, j, gate_shared);
      }
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j < owned) {
        const Packed4<T> gj = kGateUpfront ? g[j] : load_modulation<T, kRowMod>(gate, j, gate_shared);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // update + update2 (eager's `attn_output + ff_output`) rounds to T before the gate reads it.
          typename V::Pair sum = u[j].p[h];
          if constexpr (kTerms == 2) sum = V::add(u[j].p[h], u2[j].p[h]);
          y[j].p[h] = V::add(r[j].p[h], V::mul(gj.p[h], sum));
        }
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

  // 4. n = T(rstd * (y - mean)); out = T(T(n * T(scale + 1)) + shift), or with kAddcmul
  //    out = T(shift + n * T(scale + 1)); kQuant: out quantized.
  modulate<T, kVecs, kRowMod, kAddcmul, kQuant>(p, ref, y, owned, mean, rstd, row, mod_shared);
}

template <typename T, int kVecs, int kTerms, bool kRowMod, bool kFull, bool kAddcmul>
__global__ void __launch_bounds__(kThreads) gated_resnorm_kernel(const Params<T> p) {
  gated_resnorm_row<T, kVecs, kTerms, kRowMod, kFull, kAddcmul, false>(p);
}

// The quantizing form, instantiated for D of 3072, 4096 or 6144 (kFull) and diffusers' rounding, for
// the sites whose norm only float8 Linears read: FLUX.1's and FLUX.2's (one modulation row a batch,
// no update or one) and FLUX.3's (rows per token or per segment, no update or a two-term one).
template <typename T, int kVecs, int kTerms, bool kRowMod>
__global__ void __launch_bounds__(kThreads) gated_resnorm_kernel_quantized(const Params<T> p) {
  gated_resnorm_row<T, kVecs, kTerms, kRowMod, true, false, true>(p);
}

}  // namespace flux2_fused
