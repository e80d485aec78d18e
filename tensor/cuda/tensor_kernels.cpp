// Built without CUDA: the tensor_kernels.h functions as clear errors, so every CUDA entry point links and
// fails with "built without CUDA".
#include "tensor/cuda/tensor_kernels.h"

#include "tensor/cuda/runtime.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda {

#ifndef DG_WITH_CUDA
namespace {
[[noreturn]] void noCuda(const char* op) {
  throw ValueError(detail::concatMessage(op, ": a CUDA operand, but distgrad was built without CUDA (DG_WITH_CUDA=OFF)"));
}
}  // namespace

Tensor binary(kernels::BinaryOp, const Tensor&, const Tensor&, const char* name) { noCuda(name); }
Tensor unary(kernels::UnaryOp, const Tensor&, const char* name) { noCuda(name); }
Tensor addScalar(const Tensor&, double) { noCuda("add"); }
Tensor mulScalar(const Tensor&, double) { noCuda("mul"); }
Tensor powScalar(const Tensor&, double) { noCuda("pow"); }
Tensor clamp(const Tensor&, double, double) { noCuda("clamp"); }
Tensor where(const Tensor&, const Tensor&, const Tensor&) { noCuda("where"); }
Tensor pointwiseBackward(PointwiseBackward, const Tensor&, const Tensor&, double, double, const char* name) {
  noCuda(name);
}
void maxMinBackward(const Tensor&, const Tensor&, const Tensor&, bool isMax, Tensor*, Tensor*) {
  noCuda(isMax ? "maximum backward" : "minimum backward");
}
Tensor sumDims(const Tensor&, const std::vector<bool>&, bool) { noCuda("sum"); }
Tensor maxAll(const Tensor&) { noCuda("max"); }
void maxDim(const Tensor&, int64_t, bool, Tensor*, Tensor*, const char* op) { noCuda(op); }
Tensor maxDimBackward(const Tensor&, const Tensor&, const Shape&, int64_t, int64_t, int64_t) {
  noCuda("max backward");
}
void copyInto(const Tensor&, const Tensor&, const char* op) { noCuda(op); }
void copyConvert(const Tensor&, const Tensor&) { noCuda("Tensor::copyFrom"); }
void fill(const Tensor&, double) { noCuda("Tensor::fill"); }
Tensor cat(const std::vector<Tensor>&, const Shape&, int64_t, const char* op) { noCuda(op); }
Tensor uniform(const Shape&, double, double, uint64_t, DType, Device) { noCuda("uniform"); }
Tensor normal(const Shape&, double, double, uint64_t, DType, Device) { noCuda("normal"); }
#endif

}  // namespace distgrad::tensor::cuda
