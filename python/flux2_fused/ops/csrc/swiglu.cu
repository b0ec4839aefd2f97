// tvm-ffi entry points of the SwiGLU kernel: the row-wise launch (rowwise.cuh) of swiglu.cuh's kernel,
// x's rows holding both operands, or a and b as two tensors (x and `b`), into rows of T or (with a
// prefix's rows first where given) quantized for the next float8 Linear, or as joint rows with their
// amax words. The Python layer (flux2_fused/ops/swiglu/) validates every input
// and decides when the kernel may run.
#include <tvm/ffi/function.h>

#include "swiglu.cuh"

namespace flux2_fused {
namespace swiglu {
namespace {

void swiglu(tvm::ffi::TensorView out, tvm::ffi::TensorView x, tvm::ffi::Optional<tvm::ffi::TensorView> b) {
  rowwise::dispatch(out, x, b, /*operands=*/2, "swiglu", swiglu_kernel<__nv_bfloat16>, swiglu_kernel<__half>);
}

// The rows [prefix | swiglu(x)] as torchao's per-row float8: q bytes and a scale a row.
void swiglu_quantized(tvm::ffi::TensorView q, tvm::ffi::TensorView scale,
                      tvm::ffi::Optional<tvm::ffi::TensorView> prefix, tvm::ffi::TensorView x,
                      tvm::ffi::Optional<tvm::ffi::TensorView> b) {
  rowwise::dispatch_quantized(q, scale, prefix, x, b, /*operands=*/2, "swiglu", quantized_kernels<__nv_bfloat16>(),
                              quantized_kernels<__half>());
}

// The rows [prefix | swiglu(x)] into joint, and each one's amax word (a whole-tensor float8 scale's).
void swiglu_joint(tvm::ffi::TensorView joint, tvm::ffi::TensorView amax, tvm::ffi::Optional<tvm::ffi::TensorView> prefix,
                  tvm::ffi::TensorView x, tvm::ffi::Optional<tvm::ffi::TensorView> b) {
  rowwise::dispatch_joint(joint, amax, prefix, x, b, /*operands=*/2, "swiglu", swiglu_kernel_joint<__nv_bfloat16>,
                          swiglu_kernel_joint<__half>);
}

}  // namespace
}  // namespace swiglu
}  // namespace flux2_fused

TVM_FFI_DLL_EXPORT_TYPED_FUNC(swiglu, flux2_fused::swiglu::swiglu);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swiglu_quantized, flux2_fused::swiglu::swiglu_quantized);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(swiglu_joint, flux2_fused::swiglu::swiglu_joint);
