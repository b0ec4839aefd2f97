// Whether every row of a [B, S, W] tensor equals its batch's first row, bit for bit.
//
// FLUX.3 computes its per-token modulation as a Linear of a time embedding expanded over the tokens:
// a [B, S, 3D] tensor whose rows came out of cuBLAS from identical inputs, and are identical in every
// run measured, but which nothing guarantees to be (a GEMM may reduce some output tiles in another
// order than others). Every block of a mode stack reads the same tensor, three rows of D a token.
// This kernel proves, on the data itself, that each batch's rows are all its first row: one word,
// left 0 where they are and set to 1 where any row differs by any bit (so -0.0 and +0.0 differ, and
// two NaNs agree only with equal payloads). gated_resnorm then reads the first row of the batch for
// every token, from cache, where the word is 0: the same bytes at another address.
//
// One block of 256 threads compares one row with its batch's first, 16 bytes a load; the first row
// is read through the read-only cache (every row of the batch reads it) and the others streamed.
// A thread issues all its loads of a pass (kVecs vectors of each row: FLUX.3's 9216-wide rows in one
// pass) before it compares any: a loop that compared as it loaded kept two of them in flight, and
// a block waited on three round trips to memory instead of one.
#pragma once

#include <cstdint>

namespace flux2_fused {
namespace uniform_rows {

constexpr int kThreads = 256;
constexpr int kVecs = 5;  // 16-byte vectors of each row a thread has in flight: 1280 a pass
// Four blocks an SM (60 registers): with no minimum ptxas keeps 40 registers by comparing each pair
// of vectors as it arrives, two loads in flight a thread instead of ten.
constexpr int kMinBlocks = 4;

struct Params {
  const uint4* data;                  // the first row of the first batch, 16-byte aligned
  int64_t batch_stride, row_stride;   // in 16-byte units
  int32_t rows;                       // S, the rows of a batch
  int32_t width;                      // W in 16-byte units
  int* differs;                       // zeroed before the launch; 1 where any row differs
};

__global__ void __launch_bounds__(kThreads, kMinBlocks) uniform_rows_kernel(const Params p) {
  const uint32_t batch = blockIdx.x / uint32_t(p.rows);
  const uint32_t row = blockIdx.x - batch * uint32_t(p.rows);
  if (row == 0) return;  // the batch's first row is the one the others are compared with
  const uint4* first = p.data + batch * p.batch_stride;
  const uint4* mine = first + row * p.row_stride;
  uint32_t differ = 0;
  for (int base = threadIdx.x; base < p.width; base += kThreads * kVecs) {
    uint4 a[kVecs], b[kVecs];
    // Past the row's end a thread reloads its last vector (unconditional loads: ptxas keeps
    // predicated ones in order with the compares) and ignores the result.
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = min(base + k * kThreads, p.width - 1);
      a[k] = __ldg(first + i);
      b[k] = __ldcs(mine + i);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const uint32_t d = (a[k].x ^ b[k].x) | (a[k].y ^ b[k].y) | (a[k].z ^ b[k].z) | (a[k].w ^ b[k].w);
      differ |= base + k * kThreads < p.width ? d : 0;
    }
  }
  // Every block that finds a difference writes the same 1: no atomics needed.
  if (__syncthreads_or(differ != 0) && threadIdx.x == 0) *p.differs = 1;
}

}  // namespace uniform_rows
}  // namespace flux2_fused
