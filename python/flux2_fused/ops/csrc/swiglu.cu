// tvm-ffi entry point of the SwiGLU kernel: thin shape/dtype plumbing over swiglu.cuh. The Python
// layer (flux2_fused/ops/swiglu/) validates every input and decides when the kernel may run; the
// checks here only stop a misuse from touching the wrong memory.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>

#include <cuda_runtime.h>

#include "entry.cuh"
#include "swiglu.cuh"

namespace flux2_fused {
namespace swiglu {
namespace {

using tvm::ffi::TensorView;

// (batch stride, row stride) of a [B, S, C] or [S, C] view with unit inner stride.
void row_layout(const TensorView& t, int64_t* batch_stride, int64_t* row_stride) {
  TVM_FFI_ICHECK((t.ndim() == 2 || t.ndim() == 3) && t.stride(-1) == 1)
      << "x and out must be [B, S, C] or [S, C] views with unit inner stride";
  *row_stride = t.stride(-2);
  *batch_stride = t.ndim() == 3 ? t.stride(0) : 0;
}

template <typename T>
void run(TensorView out, TensorView x) {
  TVM_FFI_ICHECK(out.ndim() == x.ndim() && out.size(-1) * 2 == x.size(-1)) << "out must be x's half width";
  for (int d = 0; d + 1 < x.ndim(); ++d) TVM_FFI_ICHECK(out.size(d) == x.size(d)) << "out and x rows differ";
  TVM_FFI_ICHECK(out.size(-1) % 4 == 0) << "H must be a multiple of 4";
  const DLDevice dev = out.device();
  check_device(x, dev);
  Params<T> p{};
  p.x = data<const T>(x);
  p.out = data<T>(out);
  row_layout(x, &p.x_batch_stride, &p.x_row_stride);
  row_layout(out, &p.out_batch_stride, &p.out_row_stride);
  p.rows_per_batch = x.size(-2);
  p.hidden = static_cast<int32_t>(out.size(-1));
  const int64_t rows = (x.ndim() == 3 ? x.size(0) : 1) * x.size(-2);
  if (rows == 0 || p.hidden == 0) return;
  TVM_FFI_ICHECK(rows < (int64_t{1} << 31)) << "too many rows for one launch";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  swiglu_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "swiglu launch failed: " << cudaGetErrorString(err);
}

void swiglu(TensorView out, TensorView x) {
  const DLDataType dt = out.dtype();
  TVM_FFI_ICHECK(x.dtype().code == dt.code && x.dtype().bits == dt.bits) << "x and out dtypes differ";
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run<__nv_bfloat16>(out, x);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run<__half>(out, x);
  } else {
    TVM_FFI_THROW(TypeError) << "swiglu supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace swiglu
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(swiglu, flux2_fused::swiglu::swiglu);
