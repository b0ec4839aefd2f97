// Element helpers every kernel shares: pairs of 16-bit floats (bf16, fp16) and packed vectors of them.
//
// Conversions to float are exact; `pack` and `round` round to nearest even, as aten's stores do.
// `add` and `mul` are the packed T-pair instructions, which round the exact result once: where a
// kernel may use them in place of eager's fp32-then-T steps is argued next to that use
// (gated_resnorm.cuh) and in docs/numerics.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace flux2_fused {

template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  // bf16 -> float is the 16 bits moved up over zeros: one shift or one mask.
  static __device__ __forceinline__ uint32_t bits(Pair p) { return *reinterpret_cast<const uint32_t*>(&p); }
  static __device__ __forceinline__ float lo(Pair p) { return __uint_as_float(bits(p) << 16); }
  static __device__ __forceinline__ float hi(Pair p) { return __uint_as_float(bits(p) & 0xffff0000u); }
  // Each element rounded to nearest even, as two __float2bfloat16_rn would, in one instruction.
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  // v rounded to bf16, as a float again (what the next fp32 op of eager reads).
  static __device__ __forceinline__ float round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
  static __device__ __forceinline__ Pair add(Pair a, Pair b) { return __hadd2_rn(a, b); }
  static __device__ __forceinline__ Pair mul(Pair a, Pair b) { return __hmul2_rn(a, b); }
  static __device__ __forceinline__ Pair ones() { return __float2bfloat162_rn(1.0f); }
};

template <>
struct Elem<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float lo(Pair p) { return __low2float(p); }
  static __device__ __forceinline__ float hi(Pair p) { return __high2float(p); }
  static __device__ __forceinline__ Pair pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float round(float v) { return __half2float(__float2half_rn(v)); }
  static __device__ __forceinline__ Pair add(Pair a, Pair b) { return __hadd2_rn(a, b); }
  static __device__ __forceinline__ Pair mul(Pair a, Pair b) { return __hmul2_rn(a, b); }
  static __device__ __forceinline__ Pair ones() { return __float2half2_rn(1.0f); }
};

// 2 * kPairs T values in one aligned register group: 8 bytes (kPairs = 2) or 16 bytes (4), the
// units the kernels load and store.
template <typename T, int kPairs>
struct alignas(4 * kPairs) Packed {
  typename Elem<T>::Pair p[kPairs];
  __device__ __forceinline__ float get(int i) const {
    return (i & 1) ? Elem<T>::hi(p[i >> 1]) : Elem<T>::lo(p[i >> 1]);
  }
};

}  // namespace flux2_fused
