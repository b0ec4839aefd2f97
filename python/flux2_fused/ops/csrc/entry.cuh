// Host-side helpers every tvm-ffi entry shares: typed data pointers, the same-device check, row strides.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

namespace flux2_fused {

// The tensor's first element, typed (byte_offset included).
template <typename T>
T* data(const tvm::ffi::TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

// A tensor on another device than the launch's would be read or written through a foreign pointer.
inline void check_device(const tvm::ffi::TensorView& t, DLDevice dev) {
  TVM_FFI_ICHECK(t.device().device_type == dev.device_type && t.device().device_id == dev.device_id)
      << "every tensor must be on the output's device";
}

// (batch stride, row stride) of a [B, S, C] or [S, C] view with unit inner stride.
inline void row_layout(const tvm::ffi::TensorView& t, int64_t* batch_stride, int64_t* row_stride) {
  TVM_FFI_ICHECK((t.ndim() == 2 || t.ndim() == 3) && t.stride(-1) == 1)
      << "x and out must be [B, S, C] or [S, C] views with unit inner stride";
  *row_stride = t.stride(-2);
  *batch_stride = t.ndim() == 3 ? t.stride(0) : 0;
}

}  // namespace flux2_fused
