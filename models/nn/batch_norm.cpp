#include "models/nn/batch_norm.h"

#include "autograd/ops.h"
#include "models/cuda_kernels.h"
#include "tensor/cuda/runtime.h"

namespace distgrad::models {

BatchNorm2d::BatchNorm2d(int64_t numFeatures, double momentum, double eps)
    : Module("BatchNorm2d"), numFeatures_(numFeatures), momentum_(momentum), eps_(eps) {
  DG_CHECK(numFeatures > 0, "BatchNorm2d: numFeatures must be > 0, got ", numFeatures);
  DG_CHECK(momentum >= 0 && momentum <= 1, "BatchNorm2d: momentum must be in [0, 1], got ", momentum);
  DG_CHECK(eps > 0, "BatchNorm2d: eps must be > 0, got ", eps);
  weight_ = Tensor::ones({numFeatures});
  bias_ = Tensor::zeros({numFeatures});
  runningMean_ = Tensor::zeros({numFeatures});
  runningVar_ = Tensor::ones({numFeatures});
  numBatchesTracked_ = Tensor::zeros({}, DType::kInt64);
  registerParameter("weight", weight_);
  registerParameter("bias", bias_);
  registerBuffer("running_mean", runningMean_);
  registerBuffer("running_var", runningVar_);
  registerBuffer("num_batches_tracked", numBatchesTracked_);
}

Tensor BatchNorm2d::forward(const Tensor& input) {
  DG_CHECK((input.dim() == 4 || input.dim() == 2) && input.size(1) == numFeatures_, "BatchNorm2d(",
           numFeatures_, "): expected input [N, ", numFeatures_, ", H, W] or [N, ", numFeatures_, "], got ",
           tensor::shapeStr(input.shape()));
  Tensor out = batchNorm(input, weight_, bias_, runningMean_, runningVar_, isTraining(), momentum_, eps_);
  if (isTraining()) {
    // The counter lives where the module does (Module::to moves it, as PyTorch does): on a GPU one tiny
    // kernel on the current stream bumps it, so a training step never waits for the device.
    if (numBatchesTracked_.device().isCuda()) {
      detail::incrementInt64Cuda(numBatchesTracked_.device().index, numBatchesTracked_.data<int64_t>());
    } else {
      ++numBatchesTracked_.data<int64_t>()[0];
    }
  }
  return out;
}

int64_t BatchNorm2d::numBatchesTracked() const {
  if (numBatchesTracked_.device().isCuda()) {
    // The increments were queued on this thread's current stream, which the host copy below (on the
    // device's default stream) is not ordered after when it is a non-blocking pool stream.
    tensor::cuda::Stream::current(numBatchesTracked_.device().index).synchronize();
    return numBatchesTracked_.to(Device::cpu()).data<int64_t>()[0];
  }
  return numBatchesTracked_.data<int64_t>()[0];
}

}  // namespace distgrad::models
