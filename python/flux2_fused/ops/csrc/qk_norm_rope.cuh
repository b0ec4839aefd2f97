// Attention prologue: per-head RMSNorm (with weight) then interleaved RoPE, bit-exact to PyTorch eager.
//
// Eager computes, per head row of 128 elements x (docs/numerics.md derives it):
//   s   = sum of x_j^2, lane l of one warp owning x[4l..4l+3]: s = fma(x, x, s) in element order, then
//         a shuffle-down tree over the 32 lanes (aten's vectorized_layer_norm_kernel in rms mode)
//   r   = rsqrtf(RN(s / 128) + float(eps))
//   y_j = T(RN(g_j * RN(r * x_j)))                                 the RMSNorm output, rounded to T
//   out = T(RN(RN(y_j * cos_j) + RN(rot_j * sin_j)))               RoPE: three fp32 aten ops, then .to(T)
// with rot_2i = -y_2i+1, rot_2i+1 = y_2i. Every fp32 op is an explicit-rounding intrinsic; the module
// is built without --use_fast_math (IEEE division, rsqrtf as aten calls it, no flush-to-zero).
//
// One block of 128 threads handles one token: its four warps share the token's cos/sin row (loaded
// once into registers) and each warp normalizes and rotates heads warp, warp + 4, ... The output is
// the joint [B, S, H, 128] tensor, contiguous; its rows come from up to two input segments (text,
// then image rows of a double block), each with its own strides and RMSNorm weight.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace flux2_fused {
namespace qk_norm_rope {

constexpr int kHeadDim = 128;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // head rows a warp has in flight at once

template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float lo(Pair p) { return __low2float(p); }
  static __device__ __forceinline__ float hi(Pair p) { return __high2float(p); }
  static __device__ __forceinline__ Pair pack(float a, float b) {
    return __halves2bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
  }
  static __device__ __forceinline__ float round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
};

template <>
struct Elem<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float lo(Pair p) { return __low2float(p); }
  static __device__ __forceinline__ float hi(Pair p) { return __high2float(p); }
  static __device__ __forceinline__ Pair pack(float a, float b) {
    return __halves2half2(__float2half_rn(a), __float2half_rn(b));
  }
  static __device__ __forceinline__ float round(float v) { return __half2float(__float2half_rn(v)); }
};

// Four T values, 8 bytes: one lane's share of a head row.
template <typename T>
struct alignas(8) Quad {
  typename Elem<T>::Pair p[2];
  __device__ __forceinline__ float get(int i) const {
    return (i & 1) ? Elem<T>::hi(p[i >> 1]) : Elem<T>::lo(p[i >> 1]);
  }
};

template <typename T>
struct Segment {
  const T* x;             // [B, rows, H, 128]: heads dense, any row and batch stride
  const T* weight;        // [128]
  int64_t batch_stride;   // elements; 0 when B == 1
  int64_t row_stride;
};

template <typename T>
struct Params {
  Segment<T> seg[2];
  const float* cos;       // [S, 128], contiguous
  const float* sin;
  T* out;                 // [B, S, H, 128], contiguous
  int64_t tokens;         // S = rows of both segments
  int64_t split;          // tokens < split come from seg[0]
  int32_t heads;
  float eps;
};

template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const T* p) {
  const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));  // read once: evict first
  return *reinterpret_cast<const Quad<T>*>(&raw);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(const Params<T> p) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t token_index = blockIdx.x;  // b * S + s
  const int64_t b = token_index / p.tokens;
  const int64_t s = token_index - b * p.tokens;
  const bool second = s >= p.split;
  // Field by field (a run-time index into the parameter struct would copy it to local memory).
  const T* x_base = second ? p.seg[1].x : p.seg[0].x;
  const T* weight = second ? p.seg[1].weight : p.seg[0].weight;
  const int64_t batch_stride = second ? p.seg[1].batch_stride : p.seg[0].batch_stride;
  const int64_t row_stride = second ? p.seg[1].row_stride : p.seg[0].row_stride;
  const int64_t seg_row = second ? s - p.split : s;
  const T* x_row = x_base + b * batch_stride + seg_row * row_stride + 4 * lane;
  T* out_row = p.out + token_index * int64_t(p.heads) * kHeadDim + 4 * lane;

  // This lane's channels 4l..4l+3 of the token's tables and of the segment's weight.
  const float2* cos2 = reinterpret_cast<const float2*>(p.cos + s * kHeadDim + 4 * lane);
  const float2* sin2 = reinterpret_cast<const float2*>(p.sin + s * kHeadDim + 4 * lane);
  const float2 c01 = __ldg(cos2), c23 = __ldg(cos2 + 1), s01 = __ldg(sin2), s23 = __ldg(sin2 + 1);
  const float c[4] = {c01.x, c01.y, c23.x, c23.y};
  const float sn[4] = {s01.x, s01.y, s23.x, s23.y};
  const uint2 graw = __ldg(reinterpret_cast<const uint2*>(weight + 4 * lane));
  const Quad<T> gq = *reinterpret_cast<const Quad<T>*>(&graw);
  float g[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) g[i] = gq.get(i);

  for (int h0 = warp; h0 < p.heads; h0 += kWarps * kUnroll) {
    Quad<T> xs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int h = h0 + kWarps * u;
      if (h < p.heads) xs[u] = load_quad<T>(x_row + int64_t(h) * kHeadDim);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int h = h0 + kWarps * u;
      if (h >= p.heads) continue;  // uniform across the warp: the shuffles below see all 32 lanes
      float x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = xs[u].get(i);
      // Sum of squares in aten's order: fma per element, then the shuffle-down tree.
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) sum = __fmaf_rn(x[i], x[i], sum);
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        sum = __fadd_rn(sum, __shfl_down_sync(0xffffffffu, sum, offset));
      }
      sum = __shfl_sync(0xffffffffu, sum, 0);
      const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(sum, float(kHeadDim)), p.eps));
      // RMSNorm output rounded to T, then RoPE on the rounded values.
      float y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) y[i] = Elem<T>::round(__fmul_rn(g[i], __fmul_rn(rstd, x[i])));
      float o[4];
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        o[i] = __fadd_rn(__fmul_rn(y[i], c[i]), __fmul_rn(-y[i + 1], sn[i]));
        o[i + 1] = __fadd_rn(__fmul_rn(y[i + 1], c[i + 1]), __fmul_rn(y[i], sn[i + 1]));
      }
      Quad<T> result;
      result.p[0] = Elem<T>::pack(o[0], o[1]);
      result.p[1] = Elem<T>::pack(o[2], o[3]);
      *reinterpret_cast<uint2*>(out_row + int64_t(h) * kHeadDim) = *reinterpret_cast<const uint2*>(&result);
    }
  }
}

}  // namespace qk_norm_rope
}  // namespace flux2_fused
