// Internal to the CUDA backend: launchers of the hand-written kernels in dnn_kernels.cu (pooling, batch
// norm, losses, dropout, embedding) on raw device pointers. dnn_ops.cpp wraps them with the Tensor-level
// contracts of tensor/cpu/*.h. Every launcher enqueues on `stream`, checks cudaGetLastError() after the
// launch, uses grid-stride loops with int64 indices (any numel, including 0 and > 2^31) and expects
// contiguous row-major buffers. Templates are instantiated for float and double.
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace distgrad::tensor::cuda::dnn_detail {

struct PoolGeometry {
  int64_t planes = 0;  // N * C
  int64_t inH = 0, inW = 0, outH = 0, outW = 0;
  int64_t kernelH = 1, kernelW = 1, strideH = 1, strideW = 1, padH = 0, padW = 0;
};

template <typename T>
void launchMaxPool2d(const T* x, T* y, int64_t* argmax, const PoolGeometry& g, cudaStream_t stream);
template <typename T>
void launchMaxPool2dBackward(const T* gradOut, const int64_t* argmax, T* gradIn, const PoolGeometry& g,
                             cudaStream_t stream);
// PyTorch's count_include_pad average (the ceil-mode overhang beyond the padding is not counted).
template <typename T>
void launchAvgPool2d(const T* x, T* y, const PoolGeometry& g, cudaStream_t stream);
template <typename T>
void launchAvgPool2dBackward(const T* gradOut, T* gradIn, const PoolGeometry& g, cudaStream_t stream);
// Adaptive average: kernel/stride/pad fields unused.
template <typename T>
void launchAdaptiveAvgPool2d(const T* x, T* y, const PoolGeometry& g, cudaStream_t stream);
template <typename T>
void launchAdaptiveAvgPool2dBackward(const T* gradOut, T* gradIn, const PoolGeometry& g, cudaStream_t stream);

// Batch norm over x [outer, channels, inner] (outer = N, inner = prod of the spatial dims).
struct ChannelGeometry {
  int64_t outer = 0, channels = 0, inner = 0;
};
// Per-channel batch mean and biased variance (two passes, double accumulation).
template <typename T>
void launchBatchNormStats(const T* x, T* mean, T* var, const ChannelGeometry& g, cudaStream_t stream);
// y = (x - mean) / sqrt(var + eps) * weight + bias; weight/bias may be null (1 and 0).
template <typename T>
void launchBatchNormApply(const T* x, const T* mean, const T* var, const T* weight, const T* bias, double eps, T* y,
                          const ChannelGeometry& g, cudaStream_t stream);
// Per-channel sums: sumG = sum(g), sumGXhat = sum(g * (x - mean) / sqrt(var + eps)) (double accumulation).
template <typename T>
void launchBatchNormGradSums(const T* gradOut, const T* x, const T* mean, const T* var, double eps, double* sumG,
                             double* sumGXhat, const ChannelGeometry& g, cudaStream_t stream);
// dx from the sums; training subtracts the mean terms (the statistics depend on x), eval does not.
template <typename T>
void launchBatchNormInputGrad(const T* gradOut, const T* x, const T* mean, const T* var, const T* weight, double eps,
                              const double* sumG, const double* sumGXhat, bool training, T* gradIn,
                              const ChannelGeometry& g, cudaStream_t stream);
// out[c] = (T) src[c] for the weight/bias gradients.
template <typename T>
void launchCastFromDouble(const double* src, T* out, int64_t n, cudaStream_t stream);
// running = (1 - momentum) * running + momentum * batch * factor, element-wise over n values.
template <typename T>
void launchBlendRunning(T* running, const T* batch, int64_t n, double momentum, double factor, cudaStream_t stream);

// Index validation: *firstBad (initialised by the launcher to UINT64_MAX) becomes the smallest position
// i with indices[i] outside [0, limit).
void launchFindOutOfRange(const int64_t* indices, int64_t n, int64_t limit, unsigned long long* firstBad,
                          cudaStream_t stream);

// Loss coefficient read on the device: per-sample g[i] when perSample, else g[0] * scale.
template <typename T>
void launchCrossEntropy(const T* logits, const int64_t* targets, int64_t n, int64_t classes, T* loss, T* rowMax,
                        T* logSum, cudaStream_t stream);
template <typename T>
void launchCrossEntropyBackward(const T* gradOut, bool perSample, T scale, const T* logits, const int64_t* targets,
                                const T* rowMax, const T* logSum, int64_t n, int64_t classes, T* gradIn,
                                cudaStream_t stream);
template <typename T>
void launchNllLoss(const T* logProbs, const int64_t* targets, int64_t n, int64_t classes, T* loss, cudaStream_t stream);
// gradIn must be zeroed by the caller.
template <typename T>
void launchNllLossBackward(const T* gradOut, bool perSample, T scale, const int64_t* targets, int64_t n,
                           int64_t classes, T* gradIn, cudaStream_t stream);
// out[0] = scale * sum(values[0..n)) in double, in one fixed order (deterministic). `workspace` holds at least
// reduceWorkspaceDoubles() doubles.
int64_t reduceWorkspaceDoubles();
template <typename T>
void launchSumScaled(const T* values, int64_t n, double scale, T* out, double* workspace, cudaStream_t stream);
// Same for sum((a - b)^2).
template <typename T>
void launchSumSquaredDiffScaled(const T* a, const T* b, int64_t n, double scale, T* out, double* workspace,
                                cudaStream_t stream);
template <typename T>
void launchSquaredDiff(const T* a, const T* b, int64_t n, T* out, cudaStream_t stream);
// gradA = 2 * (a - b) * coef (coef per element when perElement, else g[0] * scale); gradB = -gradA (null to skip).
template <typename T>
void launchMseBackward(const T* gradOut, bool perElement, T scale, const T* a, const T* b, int64_t n, T* gradA,
                       T* gradB, cudaStream_t stream);

// Philox4x32-10 counter-based mask: element i is dropped when its uniform draw is < p.
template <typename T>
void launchDropout(const T* x, int64_t n, double p, uint64_t seed, T* out, T* mask, cudaStream_t stream);

// out[i, :] = weight[indices[i], :]
template <typename T>
void launchEmbedding(const T* weight, const int64_t* indices, int64_t count, int64_t dim, T* out, cudaStream_t stream);
// gradWeight (zeroed by the caller) [indices[i], :] += gradOut[i, :] with atomics.
template <typename T>
void launchEmbeddingBackward(const T* gradOut, const int64_t* indices, int64_t count, int64_t dim, T* gradWeight,
                             cudaStream_t stream);

}  // namespace distgrad::tensor::cuda::dnn_detail
