// tvm-ffi entry point of the uniform-rows check: thin plumbing over uniform_rows.cuh. The Python
// layer (flux2_fused/ops/uniform_rows/) validates every input and decides when it may run; the checks
// here only stop a misuse from touching the wrong memory.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>

#include <cuda_runtime.h>

#include "entry.cuh"
#include "uniform_rows.cuh"

namespace flux2_fused {
namespace uniform_rows {
namespace {

using tvm::ffi::TensorView;

// differs: one int32 word; x: [B, S, W] or [S, W] rows with unit inner stride, their bytes, strides
// and start multiples of 16 bytes. The word is zeroed, then set where any row differs from its
// batch's first.
void uniform_rows(TensorView differs, TensorView x) {
  const DLDevice dev = x.device();
  check_device(differs, dev);
  TVM_FFI_ICHECK(differs.numel() == 1 && differs.dtype().code == kDLInt && differs.dtype().bits == 32)
      << "differs must be one int32 word";
  int64_t batch_stride = 0, row_stride = 0;
  row_layout(x, &batch_stride, &row_stride);
  const int64_t bytes = (x.dtype().bits / 8) * x.dtype().lanes;
  const int64_t batch = x.ndim() == 3 ? x.size(0) : 1;
  const int64_t rows = x.size(-2);
  const int64_t width = x.size(-1) * bytes;
  const auto start = reinterpret_cast<std::uintptr_t>(data<char>(x));
  TVM_FFI_ICHECK(bytes > 0 && width % 16 == 0 && (batch_stride * bytes) % 16 == 0 && (row_stride * bytes) % 16 == 0 &&
                 start % 16 == 0)
      << "x's rows, strides and start must be multiples of 16 bytes";
  TVM_FFI_ICHECK(batch * rows < (int64_t{1} << 31) && width / 16 < (int64_t{1} << 31)) << "x is too large";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  cudaError_t err = cudaMemsetAsync(data<int>(differs), 0, sizeof(int), stream);
  TVM_FFI_ICHECK(err == cudaSuccess) << "uniform_rows: " << cudaGetErrorString(err);
  if (batch * rows > batch && width > 0) {  // a batch of one row or none is its first row
    Params p{};
    p.data = reinterpret_cast<const uint4*>(start);
    p.batch_stride = batch_stride * bytes / 16;
    p.row_stride = row_stride * bytes / 16;
    p.rows = static_cast<int32_t>(rows);
    p.width = static_cast<int32_t>(width / 16);
    p.differs = data<int>(differs);
    uniform_rows_kernel<<<static_cast<unsigned>(batch * rows), kThreads, 0, stream>>>(p);
  }
  err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "uniform_rows launch failed: " << cudaGetErrorString(err);
}

}  // namespace
}  // namespace uniform_rows
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(uniform_rows, flux2_fused::uniform_rows::uniform_rows);
