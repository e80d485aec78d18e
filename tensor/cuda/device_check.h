// Device routing for the raw kernels of tensor/cpu/ (linalg, conv, pool, batch norm, nn kernels): each
// entry point asks `onCuda` whether its operands live on a CUDA device and, if so, hands them to the CUDA
// implementation in tensor/cuda/dnn_ops.h. Mixed placements are a caller error named here once for all
// ops. No CUDA headers; usable in builds without CUDA (no CUDA tensor can exist there, so the answer is
// always false).
// Thread-safety: stateless.
#pragma once

#include <initializer_list>
#include <utility>

#include "tensor/tensor.h"

namespace distgrad::tensor::cuda {

// An operand and the name errors use for it.
using NamedOperand = std::pair<const char*, const Tensor*>;

// True when the defined operands are all on one CUDA device, false when all are on the CPU (or none is
// defined); throws ValueError naming `op`, two disagreeing operands and their devices otherwise, and
// naming `op` and the device when that device is not usable (no GPU, or a build without CUDA).
bool onCuda(const char* op, std::initializer_list<NamedOperand> operands);

}  // namespace distgrad::tensor::cuda
