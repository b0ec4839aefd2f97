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
// block's last update, which the next block's first norm reads).
//
// aten's mean over the contiguous fp32 squares of a [rows, D] tensor with D a multiple of 128 in
// (128, 4096) runs one warp a row (reduce_kernel, block (32, 16)): lane l reads float4 vectors at
// elements 4 (l + 32 j) for j = 0, 1, ..., D / 128 - 1 in order, into four accumulators (one a
// vector element, each starting at 0), combines them ((a0 + a1) + a2) + a3, then the warp adds
// with shuffle-down offsets 16, 8, 4, 2, 1, and lane 0's sum times the factor
// float(rows) / float(rows * D) is the mean. This kernel runs the same warp a row with the same
// lane layout, so every add happens on the same operands in the same order. Every fp32 op is an
// explicit-rounding intrinsic; the module is built without fast math.
#pragma once

#include "common.cuh"

namespace flux2_fused {
namespace sandwich_norm {

constexpr int kWarps = 4;      // rows a block, one warp each
constexpr int kMaxVecs = 31;   // D / 128 up to 31: aten keeps the row in one warp below 4096

template <typename T>
using Quad = Packed<T, 2>;     // four elements, 8 bytes: a lane's vector j of the row

template <typename T>
struct Params {
  const T* x;              // [rows, D] contiguous
  const T* update;         // [rows, D] contiguous, or null: no update
  T* stream;               // [rows, D]: x + gate * rms(update), written where update is given
  T* out;                  // [rows, D]: rms(stream) (* scale), or null: no next norm
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

template <typename T>
__device__ __forceinline__ void store_quad(T* p, const Quad<T>& q) {
  *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(&q);
}

// The mean of the row's squares as aten's reduction gives it: the lane's four accumulators combined
// in order, the warp's shuffle-down tree, lane 0's sum times the factor (every lane gets it).
__device__ __forceinline__ float row_mean(const float (&acc)[4], float factor) {
  constexpr unsigned kAll = 0xffffffffu;
  float s = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), acc[2]), acc[3]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) s = __fadd_rn(s, __shfl_down_sync(kAll, s, offset));
  return __fmul_rn(__shfl_sync(kAll, s, 0), factor);
}

// rms(v)_k for the four elements of one vector: x * r in fp32 rounded to T, times the weight in T.
template <typename T>
__device__ __forceinline__ float normed(float v, float r, float g) {
  return Elem<T>::round(__fmul_rn(g, Elem<T>::round(__fmul_rn(v, r))));
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) sandwich_norm_kernel(const Params<T> p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= p.rows) return;  // a whole warp: the shuffles below stay full
  const int64_t batch = row / p.tokens;
  const int64_t base = row * p.hidden + 4 * lane;
  const T* gate = p.gate == nullptr ? nullptr : p.gate + batch * p.gate_batch + 4 * lane;
  const T* scale = p.scale == nullptr ? nullptr : p.scale + batch * p.scale_batch + 4 * lane;
  Quad<T> v[kMaxVecs];  // the row's stream, vector j at element 4 (lane + 32 j)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (p.update != nullptr) {
#pragma unroll
    for (int j = 0; j < kMaxVecs; ++j) {
      if (j < p.vecs) {
        v[j] = load_quad(p.update + base + 128 * j);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(v[j].get(i), v[j].get(i)));
      }
    }
    const float r = rsqrtf(__fadd_rn(row_mean(acc, p.factor), p.eps));
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxVecs; ++j) {
      if (j < p.vecs) {
        const Quad<T> x = load_quad(p.x + base + 128 * j);
        const Quad<T> g = load_quad(p.update_weight + 4 * lane + 128 * j);
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float t = normed<T>(v[j].get(i), r, g.get(i));
          if (gate != nullptr) t = Elem<T>::round(__fmul_rn(load_quad(gate + 128 * j).get(i), t));
          s[i] = __fadd_rn(x.get(i), t);
        }
        v[j].p[0] = Elem<T>::pack(s[0], s[1]);
        v[j].p[1] = Elem<T>::pack(s[2], s[3]);
        store_quad(p.stream + base + 128 * j, v[j]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(v[j].get(i), v[j].get(i)));
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kMaxVecs; ++j) {
      if (j < p.vecs) {
        v[j] = load_quad(p.x + base + 128 * j);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(v[j].get(i), v[j].get(i)));
      }
    }
  }
  if (p.out == nullptr) return;
  const float r = rsqrtf(__fadd_rn(row_mean(acc, p.factor), p.eps));
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    if (j < p.vecs) {
      const Quad<T> g = load_quad(p.weight + 4 * lane + 128 * j);
      float o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        o[i] = normed<T>(v[j].get(i), r, g.get(i));
        if (scale != nullptr) o[i] = __fmul_rn(o[i], load_quad(scale + 128 * j).get(i));
      }
      Quad<T> result;
      result.p[0] = Elem<T>::pack(o[0], o[1]);
      result.p[1] = Elem<T>::pack(o[2], o[3]);
      store_quad(p.out + base + 128 * j, result);
    }
  }
}

}  // namespace sandwich_norm
}  // namespace flux2_fused
