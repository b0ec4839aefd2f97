// torchao's dynamic float8 activation quantization (Float8DynamicActivationFloat8WeightConfig, the
// torch path: PerRow and PerTensor, e4m3fn), bit-exact to torchao 0.18 running eager PyTorch:
//   amax  = max |x| over the row (or the tensor), in T: exact, NaN if any element is NaN
//   scale = float(T(RN(float(amax) * RN(1 / 448))))    aten divides by the Python scalar 448 as a
//                                                      product with its float reciprocal, rounded to T
//   q     = e4m3fn(clamp(RN(float(x) / scale), -448, 448))   IEEE division; clamp keeps NaN; c10's
//                                                      round-to-nearest-even conversion
// (docs/numerics.md, 15). kWarpsPerRow warps hold a row in registers, at most kVecs vectors of 8
// elements a thread (6 for rows up to 12288, which leaves five blocks an SM; 12 up to 24576), so a
// block of 8 warps works on 8, 4, 2 or 1 rows at once with all of their loads in flight: the amax
// of the row, then its elements quantized. Rows with a normal scale take the short path (a
// corrected reciprocal, the hardware's e4m3 conversion); others c10's arithmetic as written.
// For a whole-tensor scale, |x| is first reduced into words (the first launch's grid-stride max, one
// word a block, or the words the kernel that wrote x left, one a row: rowwise.cuh's joint rows), and
// every block of the second launch reduces those words again (the order of a max does not matter: no
// atomics, no word to zero before), then streams x to q with the one scale.
//
// The amax is taken on the magnitude bits of T (sign cleared): they order as |x| does, with every NaN
// above +Inf, so an integer max is NaN-propagating as aten's amax is.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "common.cuh"

namespace flux2_fused {
namespace float8_quant {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxVecs = 12;  // 8-element vectors a thread holds: K up to 256 x 12 x 8 = 24576
constexpr int kFewVecs = 6;   // ... for rows up to 256 x 6 x 8 = 12288: fewer registers, more blocks an SM
constexpr int kStreamVecs = 4;  // vectors a thread of the whole-tensor launch has in flight
constexpr int kStreamBlocks = 8;  // its blocks an SM (a grid-stride loop over the tensor)
constexpr float kE4m3Max = 448.0f;

template <typename T>
using Oct = Packed<T, 4>;  // eight elements, 16 bytes

template <typename T>
struct Params {
  const T* x;                // [rows, K] contiguous
  uint8_t* q;                // [rows, K] e4m3fn bytes
  float* scale;              // [rows] (a row's scale), or [1] (the tensor's)
  const unsigned int* amax;  // the tensor's |x| bits reduced into words (the whole-tensor launch)
  int32_t amax_words;        // how many
  int64_t rows;
  int32_t cols;              // K, a multiple of 8
};

// The block's max of each thread's m (every thread gets it).
__device__ __forceinline__ unsigned int block_max(unsigned int m) {
  __shared__ unsigned int warp_max[kThreads / 32];
  __shared__ unsigned int result;
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    unsigned int w = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    w = __reduce_max_sync(0xffffffffu, w);
    if (threadIdx.x == 0) result = w;
  }
  __syncthreads();
  return result;
}

// The scale of an amax (T magnitude bits): aten's `amax / 448` in T, as float.
template <typename T>
__device__ __forceinline__ float scale_of(unsigned int amax_bits) {
  typename Elem<T>::Pair p;
  *reinterpret_cast<unsigned int*>(&p) = amax_bits;
  return Elem<T>::round(__fmul_rn(Elem<T>::lo(p), 1.0f / kE4m3Max));
}

// c10's float -> e4m3fn conversion (fp8e4m3fn_from_fp32_value): round to nearest even, magnitudes
// from 480 up (and NaN) to 0x7f, the sign or-ed in.
__device__ __forceinline__ uint8_t to_e4m3fn(float f) {
  constexpr unsigned int kFp8Max = 1087u << 20;     // 480.0f
  constexpr unsigned int kDenormMask = 141u << 23;  // 2^14
  unsigned int bits = __float_as_uint(f);
  const unsigned int sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= kFp8Max) {
    result = 0x7f;
  } else if (bits < (121u << 23)) {  // below e4m3's smallest normal (2^-6): a denormal or zero
    bits = __float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(kDenormMask)));
    result = static_cast<uint8_t>(bits - kDenormMask);
  } else {
    const unsigned int mant_odd = (bits >> 20) & 1u;
    bits += ((unsigned int)(7 - 127) << 23) + 0x7ffffu;
    bits += mant_odd;
    result = static_cast<uint8_t>(bits >> 20);
  }
  return result | static_cast<uint8_t>(sign >> 24);
}

// One element: RN(x / scale), clamped to +-448 (NaN stays NaN), to e4m3fn. Any scale, any x.
__device__ __forceinline__ uint8_t quantize(float x, float scale) {
  float v = __fdiv_rn(x, scale);
  if (!isnan(v)) v = fminf(fmaxf(v, -kE4m3Max), kE4m3Max);
  return to_e4m3fn(v);
}

// A row's divisor. Where its scale is a normal float in [2^-100, 2^100] (every row whose amax is
// finite and not tiny), `quantize_pair` may take the short path: every x of the row is finite with
// |x| <= amax, so each quotient is finite, within +-450 where the scale is a normal T and larger
// where it is an fp16 subnormal, which rounds coarsely (docs/numerics.md, 15).
struct Divisor {
  float scale;
  float reciprocal;  // RN(1 / scale)
  bool fast;
};

__device__ __forceinline__ Divisor divisor_of(float scale) {
  return {scale, __frcp_rn(scale), scale >= 0x1p-100f && scale <= 0x1p100f};
}

// A row's divisor where a block of kBlockWarps warps holds the row, from each thread's max of its
// values' magnitude bits: the block's max (each warp's by __reduce_max_sync, then every thread takes
// the max of the warps' words after one barrier: a max in another grouping, the same value), its
// scale stored at *scale by thread 0. Every thread of the block must call it.
template <typename T, int kBlockWarps>
__device__ __forceinline__ Divisor row_divisor(unsigned int m, float* scale) {
  __shared__ unsigned int warp_max[kBlockWarps];
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kBlockWarps; ++w) m = max(m, warp_max[w]);
  const float s = scale_of<T>(m);
  if (threadIdx.x == 0) *scale = s;
  return divisor_of(s);
}

// Two elements of a row on the short path: x / scale correctly rounded by Markstein's correction of
// x * RN(1 / scale) (exact remainder by FMA, one corrected product) with x's sign put back (a -0
// quotient comes out of the correction as +0; the scale is positive, so the quotient's sign is x's),
// then the hardware's round-to-nearest-even conversion, which equals c10's for finite values within
// +-448 and, saturating (satfinite), gives +-448 for every finite value past it, as eager's clamp
// then c10's conversion do: the clamp is the conversion's own. Byte 0 is a.
__device__ __forceinline__ unsigned int quantize_pair(float a, float b, const Divisor& d) {
  float v[2] = {a, b};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float q = __fmul_rn(v[i], d.reciprocal);
    const float rem = __fmaf_rn(-q, d.scale, v[i]);
    v[i] = copysignf(__fmaf_rn(rem, d.reciprocal, q), v[i]);
  }
  return __nv_cvt_float2_to_fp8x2(make_float2(v[0], v[1]), __NV_SATFINITE, __NV_E4M3);
}

// 2 * kPairs elements of a row (kPairs even), as as many e4m3fn bytes in order, four to a word.
template <typename T, int kPairs>
__device__ __forceinline__ void quantize_packed(const Packed<T, kPairs>& v, const Divisor& d,
                                                unsigned int (&out)[kPairs / 2]) {
#pragma unroll
  for (int w = 0; w < kPairs / 2; ++w) {
    if (d.fast) {
      out[w] = quantize_pair(v.get(4 * w), v.get(4 * w + 1), d) |
               (quantize_pair(v.get(4 * w + 2), v.get(4 * w + 3), d) << 16);
    } else {
      out[w] = 0u;
#pragma unroll
      for (int e = 0; e < 4; ++e) out[w] |= static_cast<unsigned int>(quantize(v.get(4 * w + e), d.scale)) << (8 * e);
    }
  }
}

// Eight elements quantized by d into q[i] (a streaming store: nothing reads them in this launch).
template <typename T>
__device__ __forceinline__ void store_oct(uint2* q, int64_t i, const Oct<T>& v, const Divisor& d) {
  unsigned int bytes[2];
  quantize_packed<T, 4>(v, d, bytes);
  __stcs(q + i, make_uint2(bytes[0], bytes[1]));
}

// The largest magnitude of a packed group's elements, as T's magnitude bits (`vector_max`).
template <typename T, int kPairs>
__device__ __forceinline__ unsigned int packed_max(const Packed<T, kPairs>& v) {
  const unsigned int* bits = reinterpret_cast<const unsigned int*>(&v);
  unsigned int m = 0;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) m = __vmaxu2(m, bits[i] & 0x7fff7fffu);
  return max(m & 0xffffu, m >> 16);
}

// The tensor's amax, a word a block into words: a grid-stride max over 8-element vectors.
template <typename T>
__global__ void __launch_bounds__(kThreads) float8_quant_kernel_amax(const Params<T> p, unsigned int* words) {
  const int64_t vectors = p.rows * (p.cols / 8);
  unsigned int m = 0;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * kThreads) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p.x) + v);
    m = max(m, packed_max<T, 4>(*reinterpret_cast<const Oct<T>*>(&raw)));
  }
  m = block_max(m);
  if (threadIdx.x == 0) words[blockIdx.x] = m;
}

// The whole tensor with one scale: each block reduces the tensor's amax words (after issuing its
// first loads, so both wait together), then streams its share of x to q, kStreamVecs vectors a
// thread in flight.
template <typename T>
__global__ void __launch_bounds__(kThreads) float8_quant_kernel_tensor(const Params<T> p) {
  const int64_t vectors = p.rows * (p.cols / 8);
  const int64_t step = int64_t(kThreads) * kStreamVecs;
  const uint4* x = reinterpret_cast<const uint4*>(p.x);
  uint2* q = reinterpret_cast<uint2*>(p.q);
  Divisor d{};
  bool scaled = false;  // the same for every thread of the block
  for (int64_t base = int64_t(blockIdx.x) * step + threadIdx.x; base - threadIdx.x < vectors;
       base += int64_t(gridDim.x) * step) {
    Oct<T> v[kStreamVecs];
#pragma unroll
    for (int j = 0; j < kStreamVecs; ++j) {
      const int64_t i = base + j * kThreads;
      if (i < vectors) {
        const uint4 raw = __ldcs(x + i);
        v[j] = *reinterpret_cast<const Oct<T>*>(&raw);
      }
    }
    if (!scaled) {
      unsigned int m = 0;
      for (int i = threadIdx.x; i < p.amax_words; i += kThreads) m = max(m, p.amax[i]);
      const float scale = scale_of<T>(block_max(m));
      if (blockIdx.x == 0 && threadIdx.x == 0) p.scale[0] = scale;
      d = divisor_of(scale);
      scaled = true;
    }
#pragma unroll
    for (int j = 0; j < kStreamVecs; ++j) {
      const int64_t i = base + j * kThreads;
      if (i < vectors) store_oct(q, i, v[j], d);
    }
  }
}

// kWarpsPerRow warps a row, 8 / kWarpsPerRow rows a block, up to kVecs vectors a thread: each row's
// amax, its scale, its elements quantized.
template <typename T, int kWarpsPerRow, int kVecs>
__global__ void __launch_bounds__(kThreads, kVecs == kFewVecs ? 5 : 1) float8_quant_kernel(const Params<T> p) {
  constexpr int kRowThreads = 32 * kWarpsPerRow;
  __shared__ unsigned int warp_max[kWarps];
  const int warp = threadIdx.x >> 5;
  const int group = warp / kWarpsPerRow;            // the block's row this thread works on
  const int t = threadIdx.x - group * kRowThreads;  // its thread within the row
  const int64_t row = int64_t(blockIdx.x) * (kWarps / kWarpsPerRow) + group;
  const bool live = row < p.rows;  // a block's last rows may be past the end: no loads, no stores
  const int vectors = p.cols / 8;
  const uint4* x = reinterpret_cast<const uint4*>(p.x + row * p.cols);
  Oct<T> v[kVecs];
  unsigned int m = 0;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = t + j * kRowThreads;
    if (live && i < vectors) {
      const uint4 raw = __ldcs(x + i);
      v[j] = *reinterpret_cast<const Oct<T>*>(&raw);
      m = max(m, packed_max<T, 4>(v[j]));
    }
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if constexpr (kWarpsPerRow > 1) {
    if ((threadIdx.x & 31) == 0) warp_max[warp] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarpsPerRow; ++w) m = max(m, warp_max[group * kWarpsPerRow + w]);
  }
  if (!live) return;
  const float scale = scale_of<T>(m);
  if (t == 0) p.scale[row] = scale;
  const Divisor d = divisor_of(scale);
  uint2* q = reinterpret_cast<uint2*>(p.q + row * p.cols);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = t + j * kRowThreads;
    if (i < vectors) store_oct(q, i, v[j], d);
  }
}

// The warps a row takes: the fewest (1, 2, 4, 8) whose threads hold its K / 8 vectors in kVecs each.
inline int warps_per_row(int64_t cols, int vecs) {
  int warps = 1;
  while (warps < kWarps && cols / 8 > int64_t{32} * warps * vecs) warps *= 2;
  return warps;
}

}  // namespace float8_quant
}  // namespace flux2_fused
