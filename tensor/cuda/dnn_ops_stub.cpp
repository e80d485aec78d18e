// Builds without CUDA: every entry of tensor/cuda/dnn_ops.h is a clear error. (No CUDA tensor can be made in
// such a build, so the routing in tensor/cpu/ never gets here; the stubs keep the link complete.)
#ifndef DG_WITH_CUDA

#include "tensor/cuda/dnn_ops.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda::dnn {

namespace {
[[noreturn]] void noCuda(const char* op) {
  throw ValueError(
      detail::concatMessage(op, ": CUDA operands, but distgrad was built without CUDA (DG_WITH_CUDA=OFF)"));
}
}  // namespace

Tensor batchedMatmul(const Tensor&, bool, const Tensor&, bool, const Shape&) { noCuda("batchedMatmul"); }
Tensor linear(const Tensor&, const Tensor&, const Tensor&) { noCuda("linear"); }
Tensor linearBackwardInput(const Tensor&, const Tensor&, const Shape&) { noCuda("linear backward"); }
Tensor linearBackwardWeight(const Tensor&, const Tensor&) { noCuda("linear backward"); }
Tensor linearBackwardBias(const Tensor&) { noCuda("linear backward"); }
void gemm(int, bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float,
          float*, int64_t) {
  noCuda("gemm");
}
void gemm(int, bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t, const double*, int64_t, double,
          double*, int64_t) {
  noCuda("gemm");
}

Tensor conv2d(const Tensor&, const Tensor&, const Tensor&, const kernels::Conv2dParams&) { noCuda("conv2d"); }
kernels::Conv2dGrads conv2dBackward(const Tensor&, const Tensor&, const Tensor&, const kernels::Conv2dParams&, bool,
                                    bool, bool) {
  noCuda("conv2d backward");
}
Tensor conv2dBackwardInput(const Tensor&, const Tensor&, const Shape&, const kernels::Conv2dParams&) {
  noCuda("conv2d backward (input)");
}
std::pair<Tensor, Tensor> conv2dBackwardWeight(const Tensor&, const Tensor&, const Shape&, const kernels::Conv2dParams&,
                                               bool) {
  noCuda("conv2d backward (weight)");
}
Tensor conv2dBackwardBias(const Tensor&) { noCuda("conv2d backward (bias)"); }
size_t convAlgorithmCacheSize() { return 0; }

kernels::MaxPool2dResult maxPool2d(const Tensor&, const kernels::Pool2dParams&, bool) { noCuda("maxPool2d"); }
Tensor maxPool2dBackward(const Tensor&, const kernels::MaxPool2dSaved&) { noCuda("maxPool2d backward"); }
Tensor avgPool2d(const Tensor&, const kernels::Pool2dParams&) { noCuda("avgPool2d"); }
Tensor avgPool2dBackward(const Tensor&, const Shape&, const kernels::Pool2dParams&) { noCuda("avgPool2d backward"); }
Tensor adaptiveAvgPool2d(const Tensor&, int64_t, int64_t) { noCuda("adaptiveAvgPool2d"); }
Tensor adaptiveAvgPool2dBackward(const Tensor&, const Shape&) { noCuda("adaptiveAvgPool2d backward"); }

kernels::BatchNormTrainResult batchNormTrain(const Tensor&, const Tensor&, const Tensor&, double) {
  noCuda("batchNorm");
}
Tensor batchNormEval(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) {
  noCuda("batchNorm");
}
kernels::BatchNormGrads batchNormBackward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                          double, bool, std::array<bool, 3>) {
  noCuda("batchNorm backward");
}
void updateRunningStats(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double) {
  noCuda("batchNorm running statistics");
}

Tensor softmax(const Tensor&, int64_t) { noCuda("softmax"); }
Tensor logSoftmax(const Tensor&, int64_t) { noCuda("logSoftmax"); }
Tensor softmaxBackward(const Tensor&, const Tensor&, int64_t) { noCuda("softmax backward"); }
Tensor logSoftmaxBackward(const Tensor&, const Tensor&, int64_t) { noCuda("logSoftmax backward"); }
kernels::CrossEntropyResult crossEntropy(const Tensor&, const Tensor&, kernels::LossReduction, const char* op) {
  noCuda(op);
}
Tensor crossEntropyBackward(const Tensor&, const Tensor&, const Tensor&, const kernels::CrossEntropyResult&,
                            kernels::LossReduction) {
  noCuda("crossEntropy backward");
}
Tensor nllLoss(const Tensor&, const Tensor&, kernels::LossReduction, const char* op) { noCuda(op); }
Tensor nllLossBackward(const Tensor&, const Tensor&, const Shape&, DType, kernels::LossReduction) {
  noCuda("nllLoss backward");
}
Tensor mseLoss(const Tensor&, const Tensor&, kernels::LossReduction) { noCuda("mseLoss"); }
kernels::MseLossGrads mseLossBackward(const Tensor&, const Tensor&, const Tensor&, kernels::LossReduction, bool, bool) {
  noCuda("mseLoss backward");
}
kernels::DropoutResult dropout(const Tensor&, double, Generator&) { noCuda("dropout"); }
Tensor dropoutBackward(const Tensor&, const Tensor&) { noCuda("dropout backward"); }
Tensor embedding(const Tensor&, const Tensor&) { noCuda("embedding"); }
Tensor embeddingBackward(const Tensor&, const Tensor&, const Shape&) { noCuda("embedding backward"); }

}  // namespace distgrad::tensor::cuda::dnn

#endif  // !DG_WITH_CUDA
