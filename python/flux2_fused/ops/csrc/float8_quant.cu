// tvm-ffi entry point of the float8 quantization kernels: thin shape/dtype plumbing over
// float8_quant.cuh. The Python layer (flux2_fused/ops/float8_quant/) validates every input and
// decides when the kernels may run; the checks here only stop a misuse from touching the wrong memory.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <cuda_runtime.h>

#include <algorithm>

#include "entry.cuh"
#include "float8_quant.cuh"

namespace flux2_fused {
namespace float8_quant {
namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

template <typename T>
void run(TensorView q, TensorView scale, TensorView x, Optional<TensorView> amax, int64_t given) {
  const DLDevice dev = x.device();
  const bool tensor = amax.has_value();
  TVM_FFI_ICHECK(x.IsContiguous() && q.IsContiguous() && scale.IsContiguous()) << "tensors must be contiguous";
  TVM_FFI_ICHECK(q.numel() == x.numel() && q.dtype().bits == 8) << "q must be x's size in bytes";
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  TVM_FFI_ICHECK(cols % 8 == 0 && (tensor || cols <= 8 * kThreads * kMaxVecs))
      << "K must be a multiple of 8 (up to 24576 with a scale a row)";
  TVM_FFI_ICHECK(scale.dtype().code == kDLFloat && scale.dtype().bits == 32) << "scale must be float32";
  TVM_FFI_ICHECK(scale.numel() == (tensor ? 1 : rows)) << "one scale a row, or one";
  check_device(q, dev);
  check_device(scale, dev);
  Params<T> p{};
  p.x = data<const T>(x);
  p.q = data<uint8_t>(q);
  p.scale = data<float>(scale);
  p.rows = rows;
  p.cols = static_cast<int32_t>(cols);
  if (tensor) {
    const TensorView words = *amax;
    TVM_FFI_ICHECK(words.numel() >= std::max<int64_t>(given, 1) && words.dtype().bits == 32 && words.IsContiguous())
        << "amax must be 32-bit words, at least the given count";
    TVM_FFI_ICHECK(given >= 0 && given < (int64_t{1} << 31)) << "bad count of amax words";
    check_device(words, dev);
    p.amax = data<const unsigned int>(words);
    p.amax_words = static_cast<int32_t>(given);
  }
  if (rows == 0) return;
  TVM_FFI_ICHECK(rows < (int64_t{1} << 31)) << "too many rows for one launch";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  if (tensor) {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.device_id);
    const int64_t vectors = rows * (cols / 8);
    if (given == 0) {  // no kernel left the words: a first launch reduces |x| into one a block
      const int64_t blocks = std::min<int64_t>({(vectors + kThreads - 1) / kThreads, int64_t{4} * sms, (*amax).numel()});
      p.amax_words = static_cast<int32_t>(blocks);
      float8_quant_kernel_amax<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, data<unsigned int>(*amax));
    }
    const int64_t per_block = int64_t{kThreads} * kStreamVecs;
    const int64_t blocks = std::min<int64_t>((vectors + per_block - 1) / per_block, int64_t{kStreamBlocks} * sms);
    float8_quant_kernel_tensor<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  } else {
    const bool few = cols <= 8 * kThreads * kFewVecs;
    const int warps = warps_per_row(cols, few ? kFewVecs : kMaxVecs);
    const unsigned grid = static_cast<unsigned>((rows * warps + kWarps - 1) / kWarps);
    switch (few ? warps : 0) {
      case 1: float8_quant_kernel<T, 1, kFewVecs><<<grid, kThreads, 0, stream>>>(p); break;
      case 2: float8_quant_kernel<T, 2, kFewVecs><<<grid, kThreads, 0, stream>>>(p); break;
      case 4: float8_quant_kernel<T, 4, kFewVecs><<<grid, kThreads, 0, stream>>>(p); break;
      case 8: float8_quant_kernel<T, 8, kFewVecs><<<grid, kThreads, 0, stream>>>(p); break;
      default: float8_quant_kernel<T, 8, kMaxVecs><<<grid, kThreads, 0, stream>>>(p); break;
    }
  }
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "float8_quant launch failed: " << cudaGetErrorString(err);
}

// Outputs first: q (e4m3fn bytes of x's shape) and the scales (one a row, or one with amax), then x
// and, for a whole-tensor scale, the words its amax is reduced into: the first `given` of them as the
// kernel that wrote x left them (rowwise.cuh's joint rows), or with given = 0 any contents, at most
// one a block of a first launch used.
void float8_quant(TensorView q, TensorView scale, TensorView x, Optional<TensorView> amax, int64_t given) {
  const DLDataType dt = x.dtype();
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run<__nv_bfloat16>(q, scale, x, amax, given);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run<__half>(q, scale, x, amax, given);
  } else {
    TVM_FFI_THROW(TypeError) << "float8_quant supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace float8_quant
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(float8_quant, flux2_fused::float8_quant::float8_quant);
