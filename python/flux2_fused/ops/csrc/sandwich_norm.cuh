// Z-Image's sandwich-norm sites, bit-exact to PyTorch eager running diffusers' `RMSNorm` module: the
// gated update of the stream by the norm of a block's output, then the norm of the new stream (times
// the next modulation's scale) that the next projection reads, in one launch.
//
// Per row of D elements (docs/numerics.md, 14), with rms(v; g) diffusers' RMSNorm with weight g:
//   var = mean(RN(v_k^2))       aten's mean reduction of the fp32 squares (one warp a row, below)
//   r   = rsqrtf(RN(var + float(eps)))
//   rms = T(RN(g_k * T(RN(v_k * r))))                 x * r in fp32, to T, times the weight in T
//   stream = T(RN(x_k + t_k)),  t_k = T(RN(gate_k * rms(u; g_u)_k)) (t_k = rms(u; g_u)_k without gate)
//   out    = T(RN(rms(stream; g)_k * scale_k))          (rms(stream; g)_k without scale)
// with either half optional: no update (the stream is x: a block's first norm), or no out (the
// block's last update, which the next block's first norm reads). The quantizing form (kQuant) writes,
// in place of out, torchao's per-row float8 of it for the float8 Linears that read it
// (float8_quant.cuh, docs/numerics.md 15): out's values stay in registers while the block reduces
// their amax, then go out as e4m3fn bytes with the row's scale.
//
// aten's mean over the contiguous fp32 squares of a [rows, D] tensor with D a multiple of 128 in
// (128, 4096) runs one warp a row (reduce_kernel, block (32, 16)): lane l reads float4 vectors at
// elements 4 (l + 32 j) for j = 0, 1, ..., D / 128 - 1 in order, into four accumulators (one a
// vector element, each starting at 0), combines them ((a0 + a1) + a2) + a3, then the warp adds
// with shuffle-down offsets 16, 8, 4, 2, 1, and lane 0's sum times the factor
// float(rows) / float(rows * D) is the mean. Every fp32 op is an explicit-rounding intrinsic; the
// module is built without fast math.
//
// This kernel gives a row to a block of kWarps warps, each owning a contiguous run of the vectors j
// in aten's lane layout (lane l of every warp holds aten's lane l), so all of a row's loads go out
// at once with few registers a thread. The 128 accumulator chains (a lane's four elements) run
// through the warps in order: warp 0 adds its vectors' squares to zeros, hands the partial sums to
// warp 1 through shared memory, which adds its own in order, and so on; the last warp combines and
// reduces them as aten's warp does. Every add of aten's reduction happens on the same operands in
// the same order; only where each one runs differs.
#pragma once

#include "common.cuh"
#include "float8_quant.cuh"

namespace flux2_fused {
namespace sandwich_norm {

constexpr int kWarps = 4;      // warps a row (a block)
constexpr int kMaxVecs = 31;   // D / 128 up to 31: aten keeps the row in one warp below 4096
constexpr int kMaxOwned = (kMaxVecs + kWarps - 1) / kWarps;  // vectors a lane holds, at most

template <typename T>
using Quad = Packed<T, 2>;     // four elements, 8 bytes: a lane's vector j of the row

template <typename T>
struct Params {
  const T* x;              // [rows, D] contiguous
  const T* update;         // [rows, D] contiguous, or null: no update
  T* stream;               // [rows, D]: x + gate * rms(update), written where update is given
  T* out;                  // [rows, D]: rms(stream) (* scale), or null: no next norm or (kQuant) q
  uint8_t* q;              // the quantizing form's out: [rows, D] e4m3fn bytes
  float* q_scale;          // ... and its scale a row, [rows]
  const T* weight;         // [D]: the next norm's weight (with out)
  const T* update_weight;  // [D]: the update's norm's weight (with update)
  const T* gate;           // [B or 1, D] rows, or null
  const T* scale;          // [B or 1, D] rows, or null
  int64_t rows;
  int64_t tokens;          // rows a batch element, for the gate's and scale's row
  int64_t gate_batch;      // elements between two batch elements' gate rows (0: shared)
  int64_t scale_batch;
  int32_t hidden;
  int32_t vecs;            // D / 128
  float eps;
  float factor;            // aten's mean factor, float(rows) / float(rows * D)
};

template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const T* p) {
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
  return *reinterpret_cast<const Quad<T>*>(&raw);
}

// Outputs are stored streaming (evict first): nothing in this launch reads them again.
template <typename T>
__device__ __forceinline__ void store_quad(T* p, const Quad<T>& q) {
  __stcs(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(&q));
}

// The squares of the four elements of a vector added into a lane's accumulators, in aten's order.
template <typename T>
__device__ __forceinline__ void add_squares(float (&acc)[4], const Quad<T>& v) {
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(v.get(i), v.get(i)));
}

// rsqrt(mean + eps) of the row whose squares the block holds (`v[k]` is vector first + k of this
// lane), every add in aten's order: the chains run through the warps in turn (`chain` carries each
// lane's four partial sums from one warp to the next), then the last warp combines a lane's four
// accumulators in order and reduces over the lanes with aten's shuffle-down tree; lane 0's sum times
// the factor is the mean. Every thread of the block gets the result (through `result`).
template <typename T>
__device__ __forceinline__ float row_rsqrt(const Quad<T> (&v)[kMaxOwned], int owned, int warp, int lane,
                                           float4* chain, float* result, float factor, float eps) {
  constexpr unsigned kAll = 0xffffffffu;
#pragma unroll 1
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (w > 0) {
        const float4 c = chain[lane];
        acc[0] = c.x, acc[1] = c.y, acc[2] = c.z, acc[3] = c.w;
      }
#pragma unroll
      for (int k = 0; k < kMaxOwned; ++k) {
        if (k < owned) add_squares<T>(acc, v[k]);
      }
      if (w + 1 < kWarps) {
        chain[lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      } else {
        float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), acc[2]), acc[3]);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) s = __fadd_rn(s, __shfl_down_sync(kAll, s, offset));
        if (lane == 0) *result = rsqrtf(__fadd_rn(__fmul_rn(s, factor), eps));
      }
    }
    __syncthreads();
  }
  const float r = *result;
  __syncthreads();  // `chain` and `result` are free for the next reduction
  return r;
}

// rms(v)_k for the four elements of one vector: x * r in fp32 rounded to T, times the weight in T.
template <typename T>
__device__ __forceinline__ float normed(float v, float r, float g) {
  return Elem<T>::round(__fmul_rn(g, Elem<T>::round(__fmul_rn(v, r))));
}

// The quantizing form's epilogue: the row's out values (this lane's vectors) quantized as torchao
// quantizes out per row, bytes at out's offsets.
template <typename T>
__device__ __forceinline__ void quantize_row(const Params<T>& p, const Quad<T> (&o)[kMaxOwned], int owned,
                                             int64_t row, int64_t base) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  __trap();  // float8 GEMMs need sm_89: the guards never launch it on an older GPU
#else
  unsigned int m = 0;
#pragma unroll
  for (int k = 0; k < kMaxOwned; ++k) {
    if (k < owned) m = max(m, float8_quant::packed_max<T, 2>(o[k]));
  }
  const float8_quant::Divisor d = float8_quant::row_divisor<T, kWarps>(m, p.q_scale + row);
#pragma unroll
  for (int k = 0; k < kMaxOwned; ++k) {
    if (k < owned) {
      unsigned int bytes[1];
      float8_quant::quantize_packed<T, 2>(o[k], d, bytes);
      __stcs(reinterpret_cast<unsigned int*>(p.q + base + 128 * k), bytes[0]);
    }
  }
#endif
}

template <typename T, bool kQuant>
__global__ void __launch_bounds__(kWarps * 32) sandwich_norm_kernel(const Params<T> p) {
  __shared__ float4 chain[32];
  __shared__ float result;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const int per_warp = (p.vecs + kWarps - 1) / kWarps;
  const int first = warp * per_warp;  // this warp's vectors: first, first + 1, ..., first + owned - 1
  const int owned = max(0, min(per_warp, p.vecs - first));
  const int64_t batch = row / p.tokens;
  const int64_t base = row * p.hidden + 4 * (lane + 32 * first);
  const int64_t lane_base = 4 * (lane + 32 * first);  // into the [D] weights
  const T* gate = p.gate == nullptr ? nullptr : p.gate + batch * p.gate_batch + lane_base;
  const T* scale = p.scale == nullptr ? nullptr : p.scale + batch * p.scale_batch + lane_base;
  Quad<T> v[kMaxOwned];  // the row's stream, vector first + k
  if (p.update != nullptr) {
    Quad<T> u[kMaxOwned];
#pragma unroll
    for (int k = 0; k < kMaxOwned; ++k) {
      if (k < owned) {
        u[k] = load_quad(p.update + base + 128 * k);
        v[k] = load_quad(p.x + base + 128 * k);
      }
    }
    const float r = row_rsqrt<T>(u, owned, warp, lane, chain, &result, p.factor, p.eps);
#pragma unroll
    for (int k = 0; k < kMaxOwned; ++k) {
      if (k < owned) {
        const Quad<T> g = load_quad(p.update_weight + lane_base + 128 * k);
        const Quad<T> gk = gate == nullptr ? Quad<T>{} : load_quad(gate + 128 * k);
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float t = normed<T>(u[k].get(i), r, g.get(i));
          if (gate != nullptr) t = Elem<T>::round(__fmul_rn(gk.get(i), t));
          s[i] = __fadd_rn(v[k].get(i), t);
        }
        v[k].p[0] = Elem<T>::pack(s[0], s[1]);
        v[k].p[1] = Elem<T>::pack(s[2], s[3]);
        store_quad(p.stream + base + 128 * k, v[k]);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kMaxOwned; ++k) {
      if (k < owned) v[k] = load_quad(p.x + base + 128 * k);
    }
  }
  if (!kQuant && p.out == nullptr) return;  // the whole block: no barrier follows
  const float r = row_rsqrt<T>(v, owned, warp, lane, chain, &result, p.factor, p.eps);
  Quad<T> outs[kQuant ? kMaxOwned : 1];  // the quantizing form's values, held for the row's amax
#pragma unroll
  for (int k = 0; k < kMaxOwned; ++k) {
    if (k < owned) {
      const Quad<T> g = load_quad(p.weight + lane_base + 128 * k);
      const Quad<T> sk = scale == nullptr ? Quad<T>{} : load_quad(scale + 128 * k);
      float o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        o[i] = normed<T>(v[k].get(i), r, g.get(i));
        if (scale != nullptr) o[i] = __fmul_rn(o[i], sk.get(i));
      }
      Quad<T>& result_quad = outs[kQuant ? k : 0];
      result_quad.p[0] = Elem<T>::pack(o[0], o[1]);
      result_quad.p[1] = Elem<T>::pack(o[2], o[3]);
      if constexpr (!kQuant) store_quad(p.out + base + 128 * k, result_quad);
    }
  }
  if constexpr (kQuant) quantize_row<T>(p, outs, owned, row, base);
}

}  // namespace sandwich_norm
}  // namespace flux2_fused
