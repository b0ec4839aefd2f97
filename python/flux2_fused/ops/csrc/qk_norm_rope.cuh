// Attention prologue: per-head RMSNorm (with weight) then interleaved RoPE of q and k, bit-exact to
// PyTorch eager, and in a double block the text + image concatenation of v, in one launch.
//
// Eager computes, per head row of 128 elements x of q or k (docs/numerics.md derives it):
//   s   = sum of x_j^2, lane l of one warp owning x[4l..4l+3]: s = fma(x, x, s) in element order, then
//         a shuffle-down tree over the 32 lanes (aten's vectorized_layer_norm_kernel in rms mode)
//   r   = rsqrtf(RN(RN(s / 128) + float(eps)))   (s / 128 computed as RN(s * 2^-7): the same value)
//   y_j = T(RN(g_j * RN(r * x_j)))                                 the RMSNorm output, rounded to T
//   out = T(RN(RN(y_j * cos_j) + RN(rot_j * sin_j)))               RoPE: three fp32 aten ops, then .to(T)
// with rot_2i = -y_2i+1, rot_2i+1 = y_2i. Every fp32 op is an explicit-rounding intrinsic; the module
// is built without --use_fast_math (IEEE division, rsqrtf as aten calls it, no flush-to-zero). v's rows
// are copied unchanged (torch.cat moves bits).
//
// The rotation is the host's (kRotation): diffusers' RoPE is the three rounded aten ops above
// (kAten); ComfyUI rotates a pair with its 2x2 matrix (f00 f01; f10 f11) = (cos -sin; sin cos), the
// tables holding cos_2i = f00, sin_2i = -f01, sin_2i+1 = f10, cos_2i+1 = f11 (exact negations), as
//   kAddcmul (torch, ComfyUI's own `_apply_rope1`): out = fma(f01, y_2i+1, RN(f00 * y_2i)), alike for f1.
//   kKitchen (comfy-kitchen's CUDA kernel, built with fast math): out = fma.ftz(f00, y_2i,
//            mul.ftz(f01, y_2i+1)): subnormal inputs and results flushed to signed zero.
// Both are written with the PTX instructions of that arithmetic; docs/numerics.md (12) derives them.
//   kComplex (Qwen-Image's and Z-Image's `view_as_complex(x.float()) * freqs`, c10::complex's product
//            as nvcc contracts it): out_2i = fma(y_2i, c, -RN(y_2i+1 * s)), out_2i+1 = fma(y_2i, s,
//            RN(y_2i+1 * c)), with (c, s) = (cos_2i, sin_2i), the frequency's real and imaginary parts.
//
// The norm is the host's too (kNorm): aten's fused RMSNorm above (kFusedNorm), or diffusers' own
// `RMSNorm` module (kMeanNorm: `x.float().pow(2).mean(-1)`, `x * rsqrt(var + eps)`, rounded to T, then
// times the weight), which differs in two places: aten's thread sums its four squares as the rounded
// squares RN(x_j^2), added left to right (the mean's vectorized reduce: one accumulator a vector
// element, combined in order), the same shuffle tree, and the product with r is rounded to T before
// the weight multiplies it, so y_j = T(RN(g_j * T(RN(r * x_j)))).
//
// The upcast mode (kUpcast: FLUX.3's `norm(x.float())` with an fp32 weight, RoPE on the fp32 result,
// one `.to(T)`) differs in two places only: g is float, and y_j = RN(g_j * RN(r * x_j)) stays in fp32,
// so T is rounded once, at out. s and r are the same: aten's float instantiation of the norm kernel
// has the same lanes, vector width (4), sum, division and rsqrtf, and x widened to fp32 is exact.
//
// One block of 64 threads handles one token: q's, k's (and v's) head rows of that token, with the
// token's cos/sin row loaded once into registers for q and k together. A head row is 256 bytes, so
// half a warp covers it with one 16-byte load a lane: lane m of a half owns elements 8m..8m+7, i.e.
// aten's threads 2m and 2m+1, and keeps their two partial sums apart. aten's shuffle tree (offsets
// 16, 8, 4, 2 over its threads, then 1) is run on both sums at once: its offset 16 adds lane m + 8's
// first sum to lane m's (m < 8) and lane m's second sum to lane m + 8's, one exchange for both (IEEE
// addition commutes, so which side adds does not change a bit); lanes 0-7 then hold the even
// threads' tree and lanes 8-15 the odd threads', and each offset 8, 4, 2 of aten's is one shuffle of
// offset 4, 2, 1 within each eight lanes, for both trees; its last step (offset 1) adds lane 8's
// result to lane 0's. Six shuffles a row pair instead of nine: the shuffle unit issues a warp's
// shuffle a cycle, a quarter of the rate of the float adds around it. The unit of work of a warp is
// a pair of head rows of one tensor (its halves take heads 2i and 2i+1), so which tensor a warp works
// on, and whether it runs the norm's shuffles, is uniform across the warp; the token's units (q's
// pairs, then k's, then v's) are dealt to the token's warps in turn (its block's two, or those of
// the few blocks it takes where a grid of one block a token would not fill the GPU: `parts_for`),
// kRowsInFlight of them a round, the next round loaded while one is computed. Each output is a
// contiguous [B, S, H, 128] tensor; its rows come from up to two input segments (text, then image
// rows of a double block), each with its own strides and (q, k) RMSNorm weight.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace flux2_fused {
namespace qk_norm_rope {

constexpr int kHeadDim = 128;
constexpr int kThreads = 64;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsInFlight = 4;  // units (row pairs) a warp loads in one round
// Ten blocks of two warps an SM: the register cap (96) that ptxas meets without spilling with two
// rounds of four units in registers (the one computed and the next, loaded meanwhile), i.e.
// 10 x 2 warps x 4-8 units x 512 bytes = 40-80 KB of loads in flight an SM, and each warp takes half
// the token, so the token's fixed work (its index, tables and weights) is done by two warps instead
// of four. Outputs are stored streaming (evict first): nothing in this launch reads them again.
// On the H200 (FLUX.2's 4608-token double block, klein's single block, FLUX.3's fp32 prologue,
// Qwen-Image's), prefetching the next round and streaming stores together took 3-6% off one round
// at a time with plain stores at 12 blocks; more units a round (6 at 10 blocks, 12 at 6) or fewer
// (3 at 12 or 14 blocks, spilling) were slower. Earlier, four units at 12 blocks beat four warps a
// block at (3 units, 7 blocks), which beat (6, 5), (4, 6), (3, 6), (2, 8), (3, 8) and (2, 9).
// Staging the token in shared memory (cp.async, or TMA bulk copies, also double-buffered across
// tokens by persistent blocks) was 3-12% slower: the loads go out no faster, and the block waits
// for all of them before it computes any. A grid of the resident blocks, each an even share of all
// tokens' row pairs (no partial wave), was 17-26% slower: its per-pair cursor adds instructions to
// a kernel that is 60% issue-busy, and each new token waits on its tables (docs/measurements.md).
constexpr int kMinBlocks = 10;
constexpr int kTensors = 3;       // q, k, v
constexpr int kMaxParts = 16;     // blocks a token at most (the launch's `parts`)

// A host's RoPE arithmetic (see the header comment); the Python layer names them "aten", "addcmul"
// and "kitchen".
enum Rotation : int { kAten = 0, kAddcmul = 1, kKitchen = 2, kComplex = 3 };
// A host's q/k norm; the Python layer names them "fused" (aten's rms_norm) and "mean" (diffusers').
enum Norm : int { kFusedNorm = 0, kMeanNorm = 1 };
constexpr int kV = 2;             // v's index: rows copied, not normalized

template <typename T>
using Oct = Packed<T, 4>;  // eight elements, 16 bytes: one lane's share of a head row

template <typename T>
struct Rows {
  const T* x;             // [B, rows, H, 128]: heads dense, any row and batch stride
  int64_t batch_stride;   // elements; 0 when B == 1
  int64_t row_stride;
};

// The RMSNorm weight's type: T (FLUX.2: the norm computed on T rows, its output rounded to T) or, in
// the upcast mode (FLUX.3), float (the norm on the rows widened to fp32, its output kept in fp32).
template <typename T, bool kUpcast>
using Weight = std::conditional_t<kUpcast, float, T>;

template <typename T, bool kUpcast>
struct Params {
  Rows<T> in[kTensors][2];   // [q, k, v][text, image]; one segment: [t][1] repeats [t][0]
  const Weight<T, kUpcast>* weight[2][2];  // [q, k][segment]: [128] each
  T* out[kTensors];          // [B, S, H, 128] each, contiguous; out[kV] unused when tensors == 2
  const float* cos;          // [S, 128] or [B, S, 128], contiguous
  const float* sin;
  int64_t table_batch;       // elements between two batches' tables: 0 where they share one
  int64_t tokens;            // S = rows of both segments
  int64_t split;             // tokens < split come from segment 0
  int32_t heads;
  int32_t tensors;           // 2: q and k; 3: v's rows copied too
  float eps;
};

// The units of one token: q's row pairs, then k's, then (tensors == 3) v's; with H odd a tensor's last
// pair has one head. The kernel deals them and the launch sizes its grid by them, from this one count.
__host__ __device__ inline int units_of(int tensors, int heads) { return tensors * ((heads + 1) / 2); }

// A token's units are dealt to the warps of `parts` blocks (the grid's y: part blockIdx.y): one
// block a token where the grid fills a wave of resident blocks, as many as a wave holds (up to one
// round a warp) where it would not. On the H200 (FLUX.3's fp32 prologue, 24 heads, CUDA-graph
// medians): 512 tokens 7.06 us in one block a token, 6.50 in two, 7.28 in three; 1024 tokens (a
// wave and a fraction in two) 9.52 us in one, 10.75 in two: a block past the wave repeats the
// token's fixed work (its index, tables and weights) without hiding more of the loads' latency.
// Each unit's arithmetic is the same wherever it runs.
inline int parts_for(int64_t blocks, int units, int resident) {
  const int rounds = (units + kWarps * kRowsInFlight - 1) / (kWarps * kRowsInFlight);
  const int64_t fit = resident / blocks;  // grids of this size a wave of resident blocks holds
  const int64_t parts = fit < rounds ? fit : rounds;
  return parts <= 1 ? 1 : static_cast<int>(parts < kMaxParts ? parts : kMaxParts);
}

template <typename T>
__device__ __forceinline__ Oct<T> load_oct(const T* p) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));  // read once: evict first
  return *reinterpret_cast<const Oct<T>*>(&raw);
}

// This lane's place in tensor t's row of the token: field by field (a run-time index into the
// parameter struct would copy it to local memory).
template <typename T>
__device__ __forceinline__ const T* row_of(const Rows<T> (&in)[2], bool second, int64_t b, int64_t seg_row) {
  const T* x = second ? in[1].x : in[0].x;
  const int64_t batch_stride = second ? in[1].batch_stride : in[0].batch_stride;
  const int64_t row_stride = second ? in[1].row_stride : in[0].row_stride;
  return x + b * batch_stride + seg_row * row_stride;
}

// Word i (0..3, a constant once unrolled) of a 16-byte vector.
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

__device__ __forceinline__ float mul_ftz(float a, float b) {
  float r;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float fma_ftz(float a, float b, float c) {
  float r;
  asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}

// One rotated pair (y0, y1) = (y_2i, y_2i+1) with its table entries c0, s0 (channel 2i) and c1, s1
// (channel 2i+1), in the host's arithmetic.
template <int kRotation>
__device__ __forceinline__ float2 rotate(float y0, float y1, float c0, float s0, float c1, float s1) {
  if constexpr (kRotation == kAten) {
    return make_float2(__fadd_rn(__fmul_rn(y0, c0), __fmul_rn(-y1, s0)),
                       __fadd_rn(__fmul_rn(y1, c1), __fmul_rn(y0, s1)));
  } else if constexpr (kRotation == kAddcmul) {
    return make_float2(__fmaf_rn(-s0, y1, __fmul_rn(c0, y0)), __fmaf_rn(c1, y1, __fmul_rn(s1, y0)));
  } else if constexpr (kRotation == kKitchen) {
    return make_float2(fma_ftz(c0, y0, mul_ftz(-s0, y1)), fma_ftz(s1, y0, mul_ftz(c1, y1)));
  } else {
    // (y0 + i y1) * (c0 + i s0): channel 2i's entries for both outputs (the tables repeat them).
    static_assert(kRotation == kComplex, "unknown rotation");
    return make_float2(__fmaf_rn(y0, c0, -__fmul_rn(y1, s0)), __fmaf_rn(y0, s0, __fmul_rn(y1, c0)));
  }
}

template <typename T, bool kUpcast, int kRotation, int kNorm>
__global__ void __launch_bounds__(kThreads, kMinBlocks) qk_norm_rope_kernel(const Params<T, kUpcast> p) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 15;            // lane within the half-warp: elements 8 lane .. + 7
  const int odd = (threadIdx.x >> 4) & 1;       // which half of its warp: head 2i + odd of a pair
  // This warp's place among the token's dealers: warp w of part y deals units w + kWarps y, then
  // every dealers-th after.
  const int dealer = (threadIdx.x >> 5) + kWarps * int(blockIdx.y);
  const int dealers = kWarps * int(gridDim.y);
  const int64_t token_index = blockIdx.x;       // b * S + s
  const int64_t b = token_index / p.tokens;
  const int64_t s = token_index - b * p.tokens;
  const bool second = s >= p.split;
  const int64_t seg_row = second ? s - p.split : s;
  const int64_t out_offset = token_index * int64_t(p.heads) * kHeadDim + 8 * lane;
  const T* src_q = row_of(p.in[0], second, b, seg_row) + 8 * lane;
  const T* src_k = row_of(p.in[1], second, b, seg_row) + 8 * lane;
  const T* src_v = row_of(p.in[kV], second, b, seg_row) + 8 * lane;

  // This lane's channels 8 lane .. + 7 of the token's tables and of the segment's q and k weights.
  const int64_t table_row = b * p.table_batch + s * kHeadDim + 8 * lane;
  const float4* cos4 = reinterpret_cast<const float4*>(p.cos + table_row);
  const float4* sin4 = reinterpret_cast<const float4*>(p.sin + table_row);
  const float4 ca = __ldg(cos4), cb = __ldg(cos4 + 1), sa = __ldg(sin4), sb = __ldg(sin4 + 1);
  const float c[8] = {ca.x, ca.y, ca.z, ca.w, cb.x, cb.y, cb.z, cb.w};
  const float sn[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
  // A lane's eight weights are one 16-byte vector of T, or two of floats in the upcast mode.
  constexpr int kWeightVecs = sizeof(Weight<T, kUpcast>) * 8 / sizeof(uint4);
  const uint4* wq = reinterpret_cast<const uint4*>((second ? p.weight[0][1] : p.weight[0][0]) + 8 * lane);
  const uint4* wk = reinterpret_cast<const uint4*>((second ? p.weight[1][1] : p.weight[1][0]) + 8 * lane);
  uint4 gq[kWeightVecs], gk[kWeightVecs];
#pragma unroll
  for (int i = 0; i < kWeightVecs; ++i) {
    gq[i] = __ldg(wq + i);
    gk[i] = __ldg(wk + i);
  }

  // Unit u: tensor t = u / pairs, heads 2 (u - t pairs) + {0, 1}. With H odd the odd half of a
  // tensor's last pair is one head past the end: it runs the shuffles on zeros and stores nothing.
  const int pairs = (p.heads + 1) >> 1;
  const int units = units_of(p.tensors, p.heads);
  // Round `first` (a warp's units first, first + dealers, ...) into xs: each lane's 16 bytes of its head.
  auto load_round = [&](int first, Oct<T>* xs) {
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int unit = first + dealers * u;
      const int t = (unit >= pairs) + (unit >= 2 * pairs);
      const int h = 2 * (unit - t * pairs) + odd;
      if (unit < units && h < p.heads) {
        const T* src = t == 0 ? src_q : (t == 1 ? src_k : src_v);
        xs[u] = load_oct<T>(src + int64_t(h) * kHeadDim);
      } else {  // a head past the end (H odd) takes part in the shuffles as zeros
        xs[u] = Oct<T>{};
      }
    }
  };
  // The next round is loaded while this one is computed.
  Oct<T> next[kRowsInFlight];
  load_round(dealer, next);
  for (int first = dealer; first < units; first += dealers * kRowsInFlight) {
    Oct<T> xs[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) xs[u] = next[u];
    if (first + dealers * kRowsInFlight < units) load_round(first + dealers * kRowsInFlight, next);
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int unit = first + dealers * u;
      if (unit >= units) break;  // uniform across the warp
      const int t = (unit >= pairs) + (unit >= 2 * pairs);
      const int h = 2 * (unit - t * pairs) + odd;
      T* dst = (t == 0 ? p.out[0] : (t == 1 ? p.out[1] : p.out[kV])) + out_offset + int64_t(h) * kHeadDim;
      if (t == kV) {  // uniform across the warp: v's rows, moved as they are
        if (h < p.heads) __stcs(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(&xs[u]));
        continue;
      }
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = xs[u].get(i);
      // aten's threads 2 lane and 2 lane + 1: sums of squares in element order, an fma each (the
      // fused norm, as compiled) or the rounded squares added (the mean's accumulators, combined).
      float s0, s1;
      if constexpr (kNorm == kMeanNorm) {
        s0 = __fmul_rn(x[0], x[0]);
        s1 = __fmul_rn(x[4], x[4]);
#pragma unroll
        for (int i = 1; i < 4; ++i) {
          s0 = __fadd_rn(s0, __fmul_rn(x[i], x[i]));
          s1 = __fadd_rn(s1, __fmul_rn(x[i + 4], x[i + 4]));
        }
      } else {
        s0 = 0.0f;
        s1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) s0 = __fmaf_rn(x[i], x[i], s0);
#pragma unroll
        for (int i = 4; i < 8; ++i) s1 = __fmaf_rn(x[i], x[i], s1);
      }
      // aten's offset 16 for both partials in one exchange: lanes 0-7 finish s0's sums, lanes 8-15
      // s1's (IEEE addition commutes); then offsets 4, 2, 1 within each eight serve both trees.
      const bool upper = lane >= 8;
      float w = __fadd_rn(upper ? s1 : s0, __shfl_xor_sync(kAll, upper ? s0 : s1, 8, 16));
#pragma unroll
      for (int offset = 4; offset > 0; offset >>= 1) w = __fadd_rn(w, __shfl_down_sync(kAll, w, offset, 8));
      const float sum = __fadd_rn(__shfl_sync(kAll, w, 0, 16), __shfl_sync(kAll, w, 8, 16));
      if (h >= p.heads) continue;
      // aten divides by 128; a product with 2^-7 is the same exact value, so it rounds alike
      // (subnormal results included), in one instruction instead of a division's sequence.
      const float rstd = rsqrtf(__fadd_rn(__fmul_rn(sum, 1.0f / kHeadDim), p.eps));
      // q's or k's weight, word by word (selecting a whole struct would put it on the stack).
      const bool is_q = t == 0;
      float y[8];
      if constexpr (kUpcast) {
        // The fp32 RMSNorm output, not rounded: eager's RoPE reads it as it is.
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float g = __uint_as_float(is_q ? word(gq[i / 4], i % 4) : word(gk[i / 4], i % 4));
          y[i] = __fmul_rn(g, __fmul_rn(rstd, x[i]));
        }
      } else {
        // RMSNorm output rounded to T, then RoPE on the rounded values.
        const uint4 graw = make_uint4(is_q ? gq[0].x : gk[0].x, is_q ? gq[0].y : gk[0].y,
                                      is_q ? gq[0].z : gk[0].z, is_q ? gq[0].w : gk[0].w);
        const Oct<T> gv = *reinterpret_cast<const Oct<T>*>(&graw);
        // Rounded to T two at a time (one packed conversion), then read back as floats.
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          float a = __fmul_rn(rstd, x[i]), b = __fmul_rn(rstd, x[i + 1]);
          if constexpr (kNorm == kMeanNorm) {  // diffusers rounds x * r to T before the weight
            const auto normed = Elem<T>::pack(a, b);
            a = Elem<T>::lo(normed);
            b = Elem<T>::hi(normed);
          }
          const auto pair = Elem<T>::pack(__fmul_rn(gv.get(i), a), __fmul_rn(gv.get(i + 1), b));
          y[i] = Elem<T>::lo(pair);
          y[i + 1] = Elem<T>::hi(pair);
        }
      }
      Oct<T> result;
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const float2 out = rotate<kRotation>(y[i], y[i + 1], c[i], sn[i], c[i + 1], sn[i + 1]);
        result.p[i >> 1] = Elem<T>::pack(out.x, out.y);
      }
      __stcs(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(&result));
    }
  }
}

}  // namespace qk_norm_rope
}  // namespace flux2_fused
