// tvm-ffi entry point of the SwiGLU kernel: the row-wise launch (rowwise.cuh) of swiglu.cuh's kernel,
// x's rows holding both operands, or a and b as two tensors (x and `b`). The Python layer (flux2_fused/ops/swiglu/) validates every input
// and decides when the kernel may run.
#include <tvm/ffi/function.h>

#include "swiglu.cuh"

namespace flux2_fused {
namespace swiglu {
namespace {

void swiglu(tvm::ffi::TensorView out, tvm::ffi::TensorView x, tvm::ffi::Optional<tvm::ffi::TensorView> b) {
  rowwise::dispatch(out, x, b, /*operands=*/2, "swiglu", swiglu_kernel<__nv_bfloat16>, swiglu_kernel<__half>);
}

}  // namespace
}  // namespace swiglu
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(swiglu, flux2_fused::swiglu::swiglu);
