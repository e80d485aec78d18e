// Raw kernels for the neural-network ops that are plain loops: softmax and log-softmax, the classification
// and regression losses, dropout and embedding lookup, forward and backward.
//
// All work on float32 and float64 (indices and targets are int64), make non-contiguous inputs contiguous
// first, and return fresh contiguous tensors. Softmax-style loops subtract the row maximum before
// exponentiating, so large logits never overflow. Kernels that read indices (targets, embedding rows)
// bounds-check them and throw ValueError naming the op and the bad value; other argument checks (ranks,
// dtypes, shapes) are the caller's (autograd/ops/nn.cpp).
// Thread-safety: reentrant; dropout mutates only the Generator it is given.
#pragma once

#include <cstdint>

#include "tensor/random.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

// ---- softmax family (along `dim`, already wrapped to [0, rank))
Tensor softmax(const Tensor& x, int64_t dim);
Tensor logSoftmax(const Tensor& x, int64_t dim);
// dx = y * (g - sum(g * y))
Tensor softmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim);
// dx = g - exp(y) * sum(g)
Tensor logSoftmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim);

// ---- losses over rows: input [N, C], targets int64 [N] in [0, C)
enum class LossReduction { kNone, kMean, kSum };

struct CrossEntropyResult {
  Tensor loss;    // [N] for kNone, else a scalar
  // What backward needs besides the logits: logsumexp(logits_n) = rowMax_n + logSum_n, kept apart so that
  // large logits keep float32 precision (x - rowMax is exact; rowMax + logSum would round).
  Tensor rowMax;  // [N]
  Tensor logSum;  // [N], log(sum(exp(logits_n - rowMax_n)))
};
// loss_n = logsumexp(logits_n) - logits_n[target_n]: logSoftmax and nllLoss fused (one pass, no [N,C]
// intermediate). `op` names the calling op in target errors.
CrossEntropyResult crossEntropy(const Tensor& logits, const Tensor& targets, LossReduction reduction,
                                const char* op = "crossEntropy");
// d/dlogits = coef_n * (softmax(logits_n) - onehot(target_n)), coef = gradOutput (/ N for kMean).
Tensor crossEntropyBackward(const Tensor& gradOutput, const Tensor& logits, const Tensor& targets,
                            const CrossEntropyResult& forward, LossReduction reduction);

// loss_n = -logProbs_n[target_n]
Tensor nllLoss(const Tensor& logProbs, const Tensor& targets, LossReduction reduction, const char* op = "nllLoss");
Tensor nllLossBackward(const Tensor& gradOutput, const Tensor& targets, const Shape& inputShape, DType dtype,
                       LossReduction reduction);

// ---- mean squared error: input and target of one shape
Tensor mseLoss(const Tensor& input, const Tensor& target, LossReduction reduction);
struct MseLossGrads {
  Tensor input, target;  // undefined unless requested; target's is the negation of input's
};
MseLossGrads mseLossBackward(const Tensor& gradOutput, const Tensor& input, const Tensor& target,
                             LossReduction reduction, bool needInput, bool needTarget);

// ---- dropout
struct DropoutResult {
  Tensor output;
  Tensor mask;  // x's dtype: 0 where dropped, 1/(1-p) where kept; backward is gradOutput * mask
};
// Inverted dropout, 0 <= p < 1: each element is dropped when gen.uniform01() < p (one draw per element in
// row-major order, so a seed reproduces the mask).
DropoutResult dropout(const Tensor& x, double p, Generator& gen);
Tensor dropoutBackward(const Tensor& gradOutput, const Tensor& mask);

// ---- embedding: weight [V, D], int64 indices of any shape -> [indices..., D]
Tensor embedding(const Tensor& weight, const Tensor& indices);
// Scatter-adds gradOutput's rows into a zero [V, D] gradient (repeated indices accumulate).
Tensor embeddingBackward(const Tensor& gradOutput, const Tensor& indices, const Shape& weightShape);

}  // namespace distgrad::tensor::kernels
