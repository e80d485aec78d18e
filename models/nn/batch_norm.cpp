#include "models/nn/batch_norm.h"

#include "autograd/ops.h"

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
  if (isTraining()) ++numBatchesTracked_.data<int64_t>()[0];
  return out;
}

int64_t BatchNorm2d::numBatchesTracked() const { return numBatchesTracked_.data<int64_t>()[0]; }

}  // namespace distgrad::models
