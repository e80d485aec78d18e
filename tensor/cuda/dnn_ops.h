// The CUDA implementations behind the raw kernels of tensor/cpu/linalg.h, conv.h, pool.h, batch_norm.h and
// nn_kernels.h. Those entry points route CUDA operands here (tensor/cuda/device_check.h), so callers and
// autograd use the same kernels:: functions on every device; these functions take the same arguments and
// keep the same contracts (shapes, dtypes, reductions, error messages), with every operand on one CUDA
// device and results allocated on it.
//
// What runs where (the reasons are in docs/cuda.md and next to each implementation):
//   GEMMs (matmul, batchedMatmul, linear*): cuBLASLt, falling back to cublasGemmStridedBatchedEx when Lt
//     offers no algorithm; float32 honours matmulMathMode() (tensor/cuda/math_mode.h). blas_linalg.cpp.
//   conv2d forward / backward data / filter / bias: cuDNN (legacy convolution API, still in cuDNN 9's
//     cudnn_cnn.h), algorithms from cudnnFind*AlgorithmEx cached per shape; convMathMode(). cudnn_ops.cpp.
//   softmax / logSoftmax forward and backward: cudnnSoftmaxForward/Backward. cudnn_ops.cpp.
//   average pooling: cudnnPoolingForward/Backward where cuDNN's window grid equals PyTorch's, else the
//     .cu kernels; max and adaptive-average pooling, batch norm, losses, dropout, embedding: .cu kernels
//     (dnn_kernels.cu).
// Everything is submitted to Stream::current(device) of the calling thread; nothing synchronises the
// device. The kernels that read indices (losses, embedding) validate them on the device and wait for that
// stream once to report a bad index as a ValueError (like the CPU kernels).
// Without CUDA (DG_WITH_CUDA off) every function throws ValueError ("built without CUDA").
// Thread-safety: reentrant; library handles and algorithm caches are per thread.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <utility>

#include "tensor/cpu/batch_norm.h"
#include "tensor/cpu/conv.h"
#include "tensor/cpu/nn_kernels.h"
#include "tensor/cpu/pool.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::cuda::dnn {

// ---- linalg.h
Tensor batchedMatmul(const Tensor& a, bool transA, const Tensor& b, bool transB, const Shape& outBatch);
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);
Tensor linearBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape);
Tensor linearBackwardWeight(const Tensor& gradOut, const Tensor& input);
Tensor linearBackwardBias(const Tensor& gradOut);
// Row-major C = alpha op(A) op(B) + beta C on device pointers of `device` (the raw gemm of linalg.h;
// used by the benchmark). float32 honours matmulMathMode().
void gemm(int device, bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(int device, bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

// ---- conv.h
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const kernels::Conv2dParams& params);
kernels::Conv2dGrads conv2dBackward(const Tensor& gradOut, const Tensor& x, const Tensor& weight,
                                    const kernels::Conv2dParams& params, bool needInput, bool needWeight,
                                    bool needBias);
Tensor conv2dBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape,
                           const kernels::Conv2dParams& params);
std::pair<Tensor, Tensor> conv2dBackwardWeight(const Tensor& gradOut, const Tensor& x, const Shape& weightShape,
                                               const kernels::Conv2dParams& params, bool withBias);
Tensor conv2dBackwardBias(const Tensor& gradOut);
// Number of cached convolution algorithm choices of the calling thread (tests).
size_t convAlgorithmCacheSize();

// ---- pool.h
kernels::MaxPool2dResult maxPool2d(const Tensor& x, const kernels::Pool2dParams& params, bool forBackward);
Tensor maxPool2dBackward(const Tensor& gradOutput, const kernels::MaxPool2dSaved& saved);
Tensor avgPool2d(const Tensor& x, const kernels::Pool2dParams& params);
Tensor avgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape, const kernels::Pool2dParams& params);
Tensor adaptiveAvgPool2d(const Tensor& x, int64_t outH, int64_t outW);
Tensor adaptiveAvgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape);

// ---- batch_norm.h
kernels::BatchNormTrainResult batchNormTrain(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
Tensor batchNormEval(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean, const Tensor& var,
                     double eps);
kernels::BatchNormGrads batchNormBackward(const Tensor& gradOutput, const Tensor& x, const Tensor& weight,
                                          const Tensor& mean, const Tensor& var, double eps, bool training,
                                          std::array<bool, 3> need);
void updateRunningStats(const Tensor& runningMean, const Tensor& runningVar, const Tensor& batchMean,
                        const Tensor& batchVar, int64_t count, double momentum);

// ---- nn_kernels.h
Tensor softmax(const Tensor& x, int64_t dim);
Tensor logSoftmax(const Tensor& x, int64_t dim);
Tensor softmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim);
Tensor logSoftmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim);
kernels::CrossEntropyResult crossEntropy(const Tensor& logits, const Tensor& targets, kernels::LossReduction reduction,
                                         const char* op);
Tensor crossEntropyBackward(const Tensor& gradOutput, const Tensor& logits, const Tensor& targets,
                            const kernels::CrossEntropyResult& forward, kernels::LossReduction reduction);
Tensor nllLoss(const Tensor& logProbs, const Tensor& targets, kernels::LossReduction reduction, const char* op);
Tensor nllLossBackward(const Tensor& gradOutput, const Tensor& targets, const Shape& inputShape, DType dtype,
                       kernels::LossReduction reduction);
Tensor mseLoss(const Tensor& input, const Tensor& target, kernels::LossReduction reduction);
kernels::MseLossGrads mseLossBackward(const Tensor& gradOutput, const Tensor& input, const Tensor& target,
                                      kernels::LossReduction reduction, bool needInput, bool needTarget);
// The mask comes from a counter-based Philox stream on the device: one 64-bit seed drawn from `gen` per call,
// so a seeded Generator reproduces the CUDA mask (it differs from the CPU mask of the same seed).
kernels::DropoutResult dropout(const Tensor& x, double p, Generator& gen);
Tensor dropoutBackward(const Tensor& gradOutput, const Tensor& mask);
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor embeddingBackward(const Tensor& gradOutput, const Tensor& indices, const Shape& weightShape);

}  // namespace distgrad::tensor::cuda::dnn
