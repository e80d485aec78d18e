// Device routing for the raw kernels of tensor/cpu/ and tensor/random.h: each entry point asks whether its
// operands live on a CUDA device and, if so, hands them to the CUDA implementation (tensor_kernels.h,
// dnn_ops.h). Mixed placements are a caller error named here once for all ops. No CUDA headers; usable in
// builds without CUDA (a CUDA device is then never usable, which is the error).
// Thread-safety: stateless.
#pragma once

#include <initializer_list>

#include "tensor/tensor.h"

namespace distgrad::tensor::cuda {

// One operand of an op, named for error messages ("first operand", "condition", ...).
struct Operand {
  const char* what;
  const Tensor* tensor;
};

// The device every defined operand lives on (CPU when none is defined). Operands on different devices are
// a ValueError naming `op`, both operands and both devices; so is a CUDA device that is not usable (no
// GPU, no driver, built without CUDA).
Device deviceOf(const char* op, std::initializer_list<Operand> operands);

// True when the defined operands are all on one usable CUDA device (the routing test at the entry points).
inline bool onCuda(const char* op, std::initializer_list<Operand> operands) {
  return deviceOf(op, operands).isCuda();
}

}  // namespace distgrad::tensor::cuda
