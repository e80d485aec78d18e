// Internal to models/: the fused CUDA kernels behind the optimizers (SGD, Adam/AdamW), gradient clipping,
// the gradient aggregator's weighted average and BatchNorm's batch counter. The entry points take raw device
// pointers plus the device index; callers (models/optim/*.cpp, models/nn/batch_norm.cpp) validate tensors,
// devices and dtypes first, so these only check CUDA's return codes. Every kernel runs on the calling
// thread's current stream of `device` (tensor/cuda/runtime.h, Stream::current), never on a private stream
// and never with a device-wide sync: work queued by the caller before (a backward pass on that stream) is
// ordered before the update, work queued after sees the updated values. Only readDeviceDouble blocks the
// host (it waits for the current stream, not the device).
//
// This header includes no CUDA headers. With DG_WITH_CUDA off, models/cuda_kernels_fallback.cpp defines
// every entry point to throw ValueError ("built without CUDA"); the callers never reach them then, because
// no tensor can live on a CUDA device in such a build.
//
// Element counts are int64 and the kernels use grid-stride loops with 64-bit indices, so tensors of more
// than 2^31 elements work; n == 0 launches nothing. The templates exist for float and double.
// Thread-safety: stateless; concurrent calls on distinct data are safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace distgrad::models::detail {

// PyTorch's SGD, fused (models/optim/sgd.h has the formula). buf == nullptr means no momentum; firstStep
// initialises buf with the decayed gradient (no dampening on the first step, as in PyTorch).
struct SgdStepArgs {
  double learningRate = 0;
  double weightDecay = 0;
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;
  bool firstStep = false;
};
template <typename T>
void sgdStepCuda(int device, T* param, const T* grad, T* momentumBuffer, int64_t n, const SgdStepArgs& args);

// Adam/AdamW, fused (models/optim/adam.h). vmax == nullptr unless amsgrad.
struct AdamStepArgs {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double l2 = 0;                      // Adam's weight decay (added to the gradient); 0 for AdamW
  double decay = 1;                   // AdamW's decoupled decay factor 1 - lr * weightDecay; 1 for Adam
  double stepSize = 0;                // lr / (1 - beta1^t)
  double invBiasCorrection2Sqrt = 1;  // 1 / sqrt(1 - beta2^t)
};
template <typename T>
void adamStepCuda(int device, T* param, const T* grad, T* expAvg, T* expAvgSq, T* maxExpAvgSq, int64_t n,
                  const AdamStepArgs& args);

// *accumulator += sum_i double(x[i])^2, with `accumulator` one double in device memory of `device`. The
// partial sums meet through atomicAdd, so the last bits depend on block scheduling (the CPU path sums in
// order): compare with a relative tolerance, not bit for bit.
template <typename T>
void addSumOfSquaresCuda(int device, const T* x, int64_t n, double* accumulator);
// Copies one double from device memory to the host on the current stream and waits for that stream.
double readDeviceDouble(int device, const double* value);
// x[i] *= T(factor).
template <typename T>
void scaleCuda(int device, T* x, int64_t n, double factor);
// acc[i] += T(factor) * src[i] (the same rounding as the CPU loop of weightedAverage).
template <typename T>
void axpyCuda(int device, T* acc, const T* src, int64_t n, double factor);
// acc[i] = max(acc[i], src[i]).
void maxInt64Cuda(int device, int64_t* acc, const int64_t* src, int64_t n);
// ++*value (one int64 in device memory): BatchNorm's num_batches_tracked without a host round trip.
void incrementInt64Cuda(int device, int64_t* value);
// Sets nbytes bytes at ptr to zero on the current stream (lazily created optimizer state).
void zeroBytesCuda(int device, void* ptr, size_t nbytes);

}  // namespace distgrad::models::detail
