// Batch-normalisation kernels: statistics over every dim but dim 1 of x [N,C,...], forward (batch or given
// statistics), backward, and the running-statistics update.
//
// Both dtypes run on per-channel loops (vectorised row sums with double accumulation across rows). The
// oneDNN batch_normalization primitives over plain NCHW memory (x [N,C,rest...] described as
// [N,C,prod(rest),1]) are kept behind CpuImpl::kOneDnn and tested against the loops, but oneDNN 2.6 only has
// its generic ncsp implementation for that layout, and it measured 3-6x slower, single-threaded, on ResNet-18
// shapes at batch 32 (e.g. [32,64,56,56] train forward 45 ms vs 15 ms, backward 47 ms vs 14 ms;
// [32,64,8,8] 0.68 ms vs 0.11 ms), so kAuto uses the loops. Statistics
// are reported as the batch mean and the *biased* variance (what normalisation uses); the running variance
// update applies Bessel's correction, as PyTorch does. weight/bias may be undefined (scale 1, shift 0).
// Callers (autograd/ops/nn.cpp) validate shapes and dtypes. Thread-safety: reentrant.
#pragma once

#include <array>
#include <cstdint>

#include "tensor/cpu/cpu_impl.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

struct BatchNormTrainResult {
  Tensor output;
  Tensor mean;  // [C], batch mean
  Tensor var;   // [C], batch variance divided by N*H*W (biased)
};

// Normalises with the batch's own statistics.
BatchNormTrainResult batchNormTrain(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                    CpuImpl impl = CpuImpl::kAuto);
// Normalises with given statistics (eval mode: the running mean and variance).
Tensor batchNormEval(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean,
                     const Tensor& var, double eps, CpuImpl impl = CpuImpl::kAuto);

struct BatchNormGrads {
  Tensor x, weight, bias;  // undefined where not requested
};

// Gradients of batchNormTrain (training = true: mean/var are the batch statistics it returned, and they
// depend on x) or of batchNormEval (training = false: mean/var are constants). need = {x, weight, bias}.
BatchNormGrads batchNormBackward(const Tensor& gradOutput, const Tensor& x, const Tensor& weight,
                                 const Tensor& mean, const Tensor& var, double eps, bool training,
                                 std::array<bool, 3> need, CpuImpl impl = CpuImpl::kAuto);

// running = (1 - momentum) * running + momentum * batch, with the batch variance made unbiased
// (times count / (count - 1)); count = elements per channel. In place; either running tensor may be
// undefined.
void updateRunningStats(const Tensor& runningMean, const Tensor& runningVar, const Tensor& batchMean,
                        const Tensor& batchVar, int64_t count, double momentum);

}  // namespace distgrad::tensor::kernels
