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
// One block of 128 threads handles one token: its warps share the token's cos/sin row (loaded once
// into registers). A head row is 256 bytes, so half a warp covers it with one 16-byte load a lane:
// lane m of a half owns elements 8m..8m+7, i.e. aten's threads 2m and 2m+1, and keeps their two
// partial sums apart, so aten's shuffle tree (offsets 16, 8, 4, 2 over its threads) becomes offsets
// 8, 4, 2, 1 over the half's lanes on each partial sum, and its last step (offset 1) the sum of the
// two. Each half-warp has all of its heads in flight at once (up to kRowsInFlight). The output is
// the joint [B, S, H, 128] tensor, contiguous; its rows come from up to two input segments (text,
// then image rows of a double block), each with its own strides and RMSNorm weight.
#pragma once

#include "common.cuh"

namespace flux2_fused {
namespace qk_norm_rope {

constexpr int kHeadDim = 128;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kHalves = 2 * kWarps;  // half-warps in a block, one head row each at a time
constexpr int kRowsInFlight = 6;      // head rows a half-warp loads before it computes

template <typename T>
using Oct = Packed<T, 4>;  // eight elements, 16 bytes: one lane's share of a head row

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
__device__ __forceinline__ Oct<T> load_oct(const T* p) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));  // read once: evict first
  return *reinterpret_cast<const Oct<T>*>(&raw);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(const Params<T> p) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 15;            // lane within the half-warp: elements 8 lane .. + 7
  const int half = threadIdx.x >> 4;            // half-warp index in the block
  const int64_t token_index = blockIdx.x;       // b * S + s
  const int64_t b = token_index / p.tokens;
  const int64_t s = token_index - b * p.tokens;
  const bool second = s >= p.split;
  // Field by field (a run-time index into the parameter struct would copy it to local memory).
  const T* x_base = second ? p.seg[1].x : p.seg[0].x;
  const T* weight = second ? p.seg[1].weight : p.seg[0].weight;
  const int64_t batch_stride = second ? p.seg[1].batch_stride : p.seg[0].batch_stride;
  const int64_t row_stride = second ? p.seg[1].row_stride : p.seg[0].row_stride;
  const int64_t seg_row = second ? s - p.split : s;
  const T* x_row = x_base + b * batch_stride + seg_row * row_stride + 8 * lane;
  T* out_row = p.out + token_index * int64_t(p.heads) * kHeadDim + 8 * lane;

  // This lane's channels 8 lane .. + 7 of the token's tables and of the segment's weight.
  const float4* cos4 = reinterpret_cast<const float4*>(p.cos + s * kHeadDim + 8 * lane);
  const float4* sin4 = reinterpret_cast<const float4*>(p.sin + s * kHeadDim + 8 * lane);
  const float4 ca = __ldg(cos4), cb = __ldg(cos4 + 1), sa = __ldg(sin4), sb = __ldg(sin4 + 1);
  const float c[8] = {ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w};
  const float sn[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
  const uint4 graw = __ldg(reinterpret_cast<const uint4*>(weight + 8 * lane));
  const Oct<T> gv = *reinterpret_cast<const Oct<T>*>(&graw);
  float g[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) g[i] = gv.get(i);

  // Loop bounds and breaks follow the warp's even half, so both halves run every shuffle together
  // (the odd half may be one head past the end; it then computes on zeros and stores nothing).
  const int even_half = half & ~1;
  for (int base = 0; base + even_half < p.heads; base += kHalves * kRowsInFlight) {
    Oct<T> xs[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int h = base + half + kHalves * u;
      if (h < p.heads) xs[u] = load_oct<T>(x_row + int64_t(h) * kHeadDim);
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (base + even_half + kHalves * u >= p.heads) break;  // uniform across the warp
      const int h = base + half + kHalves * u;
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = h < p.heads ? xs[u].get(i) : 0.0f;
      // aten's threads 2 lane and 2 lane + 1: sums of squares in element order (fma, as compiled).
      float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) s0 = __fmaf_rn(x[i], x[i], s0);
#pragma unroll
      for (int i = 4; i < 8; ++i) s1 = __fmaf_rn(x[i], x[i], s1);
#pragma unroll
      for (int offset = 8; offset > 0; offset >>= 1) {
        s0 = __fadd_rn(s0, __shfl_down_sync(kAll, s0, offset, 16));
        s1 = __fadd_rn(s1, __shfl_down_sync(kAll, s1, offset, 16));
      }
      const float sum = __shfl_sync(kAll, __fadd_rn(s0, s1), 0, 16);
      if (h >= p.heads) continue;
      const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(sum, float(kHeadDim)), p.eps));
      // RMSNorm output rounded to T, then RoPE on the rounded values.
      float y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = Elem<T>::round(__fmul_rn(g[i], __fmul_rn(rstd, x[i])));
      Oct<T> result;
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const float even = __fadd_rn(__fmul_rn(y[i], c[i]), __fmul_rn(-y[i + 1], sn[i]));
        const float odd = __fadd_rn(__fmul_rn(y[i + 1], c[i + 1]), __fmul_rn(y[i], sn[i + 1]));
        result.p[i >> 1] = Elem<T>::pack(even, odd);
      }
      *reinterpret_cast<uint4*>(out_row + int64_t(h) * kHeadDim) = *reinterpret_cast<const uint4*>(&result);
    }
  }
}

}  // namespace qk_norm_rope
}  // namespace flux2_fused
