// tvm-ffi entry point of the attention-prologue kernel: thin shape/dtype plumbing over qk_norm_rope.cuh.
// The Python layer (flux2_fused/ops/qk_norm_rope/) validates every input and decides when the kernel
// may run; the checks here only stop a misuse from touching the wrong memory. A single-segment call
// passes None for the second segment.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <cuda_runtime.h>

#include "entry.cuh"
#include "qk_norm_rope.cuh"

namespace flux2_fused {
namespace qk_norm_rope {
namespace {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

template <typename T>
Segment<T> make_segment(const TensorView& x, const TensorView& weight, int64_t batch, int64_t heads,
                        DLDevice dev) {
  TVM_FFI_ICHECK(x.ndim() == 4 && x.size(0) == batch && x.size(2) == heads && x.size(3) == kHeadDim &&
                 x.stride(3) == 1 && (heads == 1 || x.stride(2) == kHeadDim))
      << "x must be [B, S, H, 128] with dense heads";
  TVM_FFI_ICHECK(weight.ndim() == 1 && weight.size(0) == kHeadDim && weight.stride(0) == 1)
      << "weight must be a dense [128] vector";
  check_device(x, dev);
  check_device(weight, dev);
  return Segment<T>{data<const T>(x), data<const T>(weight), batch == 1 ? 0 : x.stride(0), x.stride(1)};
}

template <typename T>
void run(TensorView out, TensorView x0, TensorView w0, Optional<TensorView> x1, Optional<TensorView> w1,
         TensorView cos, TensorView sin, double eps) {
  TVM_FFI_ICHECK(out.ndim() == 4 && out.size(3) == kHeadDim) << "out must be [B, S, H, 128]";
  const int64_t batch = out.size(0), tokens = out.size(1), heads = out.size(2);
  const DLDevice dev = out.device();
  TVM_FFI_ICHECK(x1.has_value() == w1.has_value()) << "the second segment needs x and weight";
  Params<T> p{};
  p.seg[0] = make_segment<T>(x0, w0, batch, heads, dev);
  p.seg[1] = x1.has_value() ? make_segment<T>(*x1, *w1, batch, heads, dev) : p.seg[0];
  p.split = x1.has_value() ? x0.size(1) : tokens;
  TVM_FFI_ICHECK(p.split + (x1.has_value() ? (*x1).size(1) : 0) == tokens) << "segment rows must sum to S";
  for (const TensorView* t : {&cos, &sin}) {
    TVM_FFI_ICHECK(t->ndim() == 2 && t->size(0) == tokens && t->size(1) == kHeadDim && t->stride(1) == 1 &&
                   t->stride(0) == kHeadDim && t->dtype().code == kDLFloat && t->dtype().bits == 32)
        << "cos and sin must be contiguous float32 [S, 128]";
    check_device(*t, dev);
  }
  p.cos = data<const float>(cos);
  p.sin = data<const float>(sin);
  p.out = data<T>(out);
  p.tokens = tokens;
  p.heads = static_cast<int32_t>(heads);
  p.eps = static_cast<float>(eps);
  const int64_t blocks = batch * tokens;
  if (blocks == 0 || heads == 0) return;
  TVM_FFI_ICHECK(blocks < (int64_t{1} << 31)) << "too many tokens for one launch";
  tvm::ffi::CUDADeviceGuard device_guard(dev.device_id);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
  qk_norm_rope_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << "qk_norm_rope launch failed: " << cudaGetErrorString(err);
}

void qk_norm_rope(TensorView out, TensorView x0, TensorView w0, Optional<TensorView> x1,
                  Optional<TensorView> w1, TensorView cos, TensorView sin, double eps) {
  const DLDataType dt = out.dtype();
  if (dt.code == kDLBfloat && dt.bits == 16) {
    run<__nv_bfloat16>(out, x0, w0, x1, w1, cos, sin, eps);
  } else if (dt.code == kDLFloat && dt.bits == 16) {
    run<__half>(out, x0, w0, x1, w1, cos, sin, eps);
  } else {
    TVM_FFI_THROW(TypeError) << "qk_norm_rope supports bfloat16 and float16 only";
  }
}

}  // namespace
}  // namespace qk_norm_rope
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(qk_norm_rope, flux2_fused::qk_norm_rope::qk_norm_rope);
