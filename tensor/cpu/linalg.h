// Raw (non-differentiable) linear-algebra kernels: GEMM, numpy-style batched matmul and the fully
// connected layer, with the products their backward formulas need.
//
// float32 runs on oneDNN's dnnl_sgemm (the JIT GEMM oneDNN's own matmul and inner-product primitives use);
// float64 runs on plain reference loops, which back the float64 gradchecks and serve as the reference the
// float32 path is tested against. Operands are strided views: a matrix whose last two dims have strides
// (ld, 1) or (1, ld) is passed to the GEMM as-is (transposed or not), so transposes never copy; only views
// that are neither are copied. Batch dims of size >1 that are laid out contiguously with the rows (or, for
// a batch-reducing product, with the inner dim) are folded into one larger GEMM instead of a loop of small
// ones. The autograd layer (autograd/ops/linalg.cpp) validates arguments and records backward; the kernels
// validate too, so they are safe to call directly.
// Thread-safety: all functions are reentrant; oneDNN uses this process's kernel thread count
// (tensor::setNumThreads).
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

// Row-major C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C, op = transpose when trans* is set
// (A is then stored k x m). Leading dimensions are in elements. beta == 0 ignores C's old contents (NaNs
// included), as BLAS does.
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

// The shape numpy.matmul gives for operands of these shapes (1-D operands get a dim prepended/appended and
// removed again; batch dims broadcast). Throws ValueError naming `op` and both shapes when they do not fit.
Shape matmulShape(const Shape& a, const Shape& b, const char* op = "matmul");

// numpy.matmul on float32/float64 tensors of the same dtype.
Tensor matmul(const Tensor& a, const Tensor& b);

// The general batched product behind matmul and its backward: a [..., n, k] x b [..., k, m] -> [..., n, m]
// where a and b are given with the same rank (>= 2) and their batch dims broadcast against each other.
// `outBatch` is the batch shape of the result (same rank as the operands' batch dims); a dim that is 1 in
// `outBatch` but larger in the broadcast batch is summed over, which is how the gradient of a broadcast
// operand is reduced without materialising the per-batch products. transA/transB use the operands' last two
// dims swapped (a view, no copy).
Tensor batchedMatmul(const Tensor& a, bool transA, const Tensor& b, bool transB, const Shape& outBatch);

// x [..., in] * weight[out, in]^T + bias[out] (bias may be undefined) -> [..., out].
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);
// Gradients of linear for gradOut [..., out]: input [..., in], weight [out, in], bias [out].
Tensor linearBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape);
Tensor linearBackwardWeight(const Tensor& gradOut, const Tensor& input);
Tensor linearBackwardBias(const Tensor& gradOut);

}  // namespace distgrad::tensor::kernels
