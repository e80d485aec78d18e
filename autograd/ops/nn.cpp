// Differentiable neural-network ops of autograd/ops.h other than conv2d (autograd/ops/conv.cpp): pooling,
// batch norm, softmax family, losses, dropout and embedding. Each op validates its arguments, calls the raw
// kernels in tensor/cpu/ and records its backward formula.
#include <cmath>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/cpu/batch_norm.h"
#include "tensor/cpu/nn_kernels.h"
#include "tensor/cpu/pool.h"

namespace distgrad {
namespace kernels = tensor::kernels;
using tensor::shapeStr;

namespace {

void checkDefined(const Tensor& t, const char* op, const char* name) {
  DG_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
}

void checkFloat(const Tensor& t, const char* op, const char* name) {
  DG_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64, op, ": ", name,
           " must be float32 or float64, got ", dtypeName(t.dtype()));
}

void checkNchw(const Tensor& x, const char* op) {
  checkDefined(x, op, "x");
  DG_CHECK(x.dim() == 4, op, ": expected x of rank 4 [N, C, H, W], got shape ", shapeStr(x.shape()));
  checkFloat(x, op, "x");
}

kernels::Pool2dParams poolParams(const Tensor& x, const Pool2dOptions& o, const char* op) {
  kernels::Pool2dParams p;
  p.kernelH = o.kernel[0];
  p.kernelW = o.kernel[1];
  DG_CHECK(p.kernelH > 0 && p.kernelW > 0, op, ": kernel must be positive, got [", p.kernelH, ", ", p.kernelW, "]");
  DG_CHECK(o.stride[0] >= 0 && o.stride[1] >= 0, op, ": stride must be >= 0 (0 = kernel size), got [",
           o.stride[0], ", ", o.stride[1], "]");
  p.strideH = o.stride[0] == 0 ? p.kernelH : o.stride[0];
  p.strideW = o.stride[1] == 0 ? p.kernelW : o.stride[1];
  p.padH = o.padding[0];
  p.padW = o.padding[1];
  // PyTorch's rule too: with more padding a window could lie entirely in the padding.
  DG_CHECK(p.padH >= 0 && p.padW >= 0 && 2 * p.padH <= p.kernelH && 2 * p.padW <= p.kernelW, op,
           ": padding must be >= 0 and at most half the kernel, got padding [", p.padH, ", ", p.padW,
           "] for kernel [", p.kernelH, ", ", p.kernelW, "]");
  p.ceilMode = o.ceilMode;
  const int64_t outH = kernels::pooledLength(x.size(2), p.kernelH, p.strideH, p.padH, p.ceilMode);
  const int64_t outW = kernels::pooledLength(x.size(3), p.kernelW, p.strideW, p.padW, p.ceilMode);
  DG_CHECK(outH >= 1 && outW >= 1, op, ": input ", shapeStr(x.shape()), " is too small for kernel [", p.kernelH,
           ", ", p.kernelW, "] with padding [", p.padH, ", ", p.padW, "] (output would be ", outH, "x", outW, ")");
  return p;
}

kernels::LossReduction toKernel(Reduction r) {
  switch (r) {
    case Reduction::kNone: return kernels::LossReduction::kNone;
    case Reduction::kMean: return kernels::LossReduction::kMean;
    case Reduction::kSum: return kernels::LossReduction::kSum;
  }
  DG_CHECK(false, "unknown Reduction value ", static_cast<int>(r));
  return kernels::LossReduction::kMean;
}

// Shared checks of crossEntropy/nllLoss: input [N, C] floating point, targets int64 [N].
void checkClassification(const Tensor& input, const Tensor& targets, const char* op, const char* inputName) {
  checkDefined(input, op, inputName);
  checkDefined(targets, op, "targets");
  DG_CHECK(input.dim() == 2, op, ": expected ", inputName, " of rank 2 [N, C], got shape ", shapeStr(input.shape()));
  checkFloat(input, op, inputName);
  DG_CHECK(targets.dtype() == DType::kInt64, op, ": targets must be int64 class indices, got ",
           dtypeName(targets.dtype()));
  DG_CHECK(targets.device() == input.device(), op, ": targets are on ", targets.device().str(), " but ", inputName,
           " is on ", input.device().str());
  DG_CHECK(targets.dim() == 1 && targets.size(0) == input.size(0), op, ": expected targets of shape [",
           input.size(0), "] to match ", inputName, " ", shapeStr(input.shape()), ", got ", shapeStr(targets.shape()));
  DG_CHECK(input.size(1) >= 1, op, ": ", inputName, " has no classes (shape ", shapeStr(input.shape()), ")");
}

}  // namespace

// ---------------------------------------------------------------- pooling

Tensor maxPool2d(const Tensor& x, const Pool2dOptions& options) {
  checkNchw(x, "maxPool2d");
  const kernels::Pool2dParams p = poolParams(x, options, "maxPool2d");
  const bool record = autograd::anyRequiresGrad({x});
  kernels::MaxPool2dResult r = kernels::maxPool2d(x, p, record);
  if (!record) return r.output;
  return autograd::recordOp("MaxPool2dBackward", {x}, r.output,
                            [saved = r.saved](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{kernels::maxPool2dBackward(g[0], *saved)};
                            });
}

Tensor avgPool2d(const Tensor& x, const Pool2dOptions& options) {
  checkNchw(x, "avgPool2d");
  const kernels::Pool2dParams p = poolParams(x, options, "avgPool2d");
  Tensor out = kernels::avgPool2d(x, p);
  if (!autograd::anyRequiresGrad({x})) return out;  // no closure to build
  return autograd::recordOp("AvgPool2dBackward", {x}, out,
                            [p, shape = x.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{kernels::avgPool2dBackward(g[0], shape, p)};
                            });
}

Tensor adaptiveAvgPool2d(const Tensor& x, Pair outputSize) {
  checkNchw(x, "adaptiveAvgPool2d");
  DG_CHECK(outputSize[0] >= 1 && outputSize[1] >= 1, "adaptiveAvgPool2d: output size must be positive, got [",
           outputSize[0], ", ", outputSize[1], "]");
  DG_CHECK(x.size(2) >= 1 && x.size(3) >= 1, "adaptiveAvgPool2d: input ", shapeStr(x.shape()),
           " has an empty spatial dim");
  Tensor out = kernels::adaptiveAvgPool2d(x, outputSize[0], outputSize[1]);
  if (!autograd::anyRequiresGrad({x})) return out;  // no closure to build
  return autograd::recordOp("AdaptiveAvgPool2dBackward", {x}, out,
                            [shape = x.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{kernels::adaptiveAvgPool2dBackward(g[0], shape)};
                            });
}

// ---------------------------------------------------------------- batch norm

Tensor batchNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& runningMean,
                 const Tensor& runningVar, bool training, double momentum, double eps) {
  const char* op = "batchNorm";
  checkDefined(x, op, "x");
  DG_CHECK(x.dim() >= 2, op, ": expected x of shape [N, C] or [N, C, H, W], got ", shapeStr(x.shape()));
  checkFloat(x, op, "x");
  const int64_t channels = x.size(1);
  auto checkChannelTensor = [&](const Tensor& t, const char* name) {
    if (!t.defined()) return;
    DG_CHECK(t.shape() == Shape{channels}, op, ": ", name, " must have shape [", channels, "] (the channels of x ",
             shapeStr(x.shape()), "), got ", shapeStr(t.shape()));
    DG_CHECK(t.dtype() == x.dtype(), op, ": ", name, " is ", dtypeName(t.dtype()), " but x is ",
             dtypeName(x.dtype()));
  };
  checkChannelTensor(weight, "weight");
  checkChannelTensor(bias, "bias");
  checkChannelTensor(runningMean, "runningMean");
  checkChannelTensor(runningVar, "runningVar");
  DG_CHECK(eps >= 0 && std::isfinite(eps), op, ": eps must be finite and >= 0, got ", eps);
  DG_CHECK(momentum >= 0 && momentum <= 1, op, ": momentum must be in [0, 1], got ", momentum);
  const int64_t perChannel = x.numel() / std::max<int64_t>(channels, 1);

  if (training) {
    DG_CHECK(perChannel > 1, op, ": training needs more than one value per channel, got input ",
             shapeStr(x.shape()));
    kernels::BatchNormTrainResult r = kernels::batchNormTrain(x, weight, bias, eps);
    kernels::updateRunningStats(runningMean, runningVar, r.mean, r.var, perChannel, momentum);
    return autograd::recordOp(
        "BatchNormBackward", {x, weight, bias}, r.output,
        [sx = x.detach(), sw = weight.defined() ? weight.detach() : Tensor(), mean = r.mean, var = r.var, eps](
            const std::vector<Tensor>& g, const autograd::Node& self) {
          auto grads = kernels::batchNormBackward(
              g[0], sx, sw, mean, var, eps, true,
              {self.needsInputGrad(0), self.needsInputGrad(1), self.needsInputGrad(2)});
          return std::vector<Tensor>{grads.x, grads.weight, grads.bias};
        });
  }

  DG_CHECK(runningMean.defined() && runningVar.defined(), op,
           ": eval mode (training = false) needs runningMean and runningVar");
  Tensor out = kernels::batchNormEval(x, weight, bias, runningMean, runningVar, eps);
  if (!autograd::anyRequiresGrad({x, weight, bias})) return out;
  // The running statistics are constants of this node; a copy keeps a later training step (which updates
  // them in place) from changing the gradient.
  return autograd::recordOp(
      "BatchNormBackward", {x, weight, bias}, out,
      [sx = x.detach(), sw = weight.defined() ? weight.detach() : Tensor(), mean = runningMean.cloneData(),
       var = runningVar.cloneData(), eps](const std::vector<Tensor>& g, const autograd::Node& self) {
        auto grads = kernels::batchNormBackward(g[0], sx, sw, mean, var, eps, false,
                                                {self.needsInputGrad(0), self.needsInputGrad(1),
                                                 self.needsInputGrad(2)});
        return std::vector<Tensor>{grads.x, grads.weight, grads.bias};
      });
}

// ---------------------------------------------------------------- softmax family

Tensor softmax(const Tensor& x, int64_t dim) {
  checkDefined(x, "softmax", "x");
  checkFloat(x, "softmax", "x");
  const int64_t d = tensor::wrapDim(dim, x.dim(), "softmax");
  Tensor out = kernels::softmax(x, d);
  if (!autograd::anyRequiresGrad({x})) return out;  // no closure to build
  return autograd::recordOp("SoftmaxBackward", {x}, out,
                            [y = out.detach(), d](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{kernels::softmaxBackward(g[0], y, d)};
                            });
}

Tensor logSoftmax(const Tensor& x, int64_t dim) {
  checkDefined(x, "logSoftmax", "x");
  checkFloat(x, "logSoftmax", "x");
  const int64_t d = tensor::wrapDim(dim, x.dim(), "logSoftmax");
  Tensor out = kernels::logSoftmax(x, d);
  if (!autograd::anyRequiresGrad({x})) return out;  // no closure to build
  return autograd::recordOp("LogSoftmaxBackward", {x}, out,
                            [y = out.detach(), d](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{kernels::logSoftmaxBackward(g[0], y, d)};
                            });
}

// ---------------------------------------------------------------- losses

Tensor crossEntropy(const Tensor& logits, const Tensor& targets, Reduction reduction) {
  checkClassification(logits, targets, "crossEntropy", "logits");
  const kernels::LossReduction r = toKernel(reduction);
  kernels::CrossEntropyResult res = kernels::crossEntropy(logits, targets, r);
  if (!autograd::anyRequiresGrad({logits})) return res.loss;  // no closure to build
  return autograd::recordOp(
      "CrossEntropyBackward", {logits}, res.loss,
      [x = logits.detach(), t = targets.detach(), saved = kernels::CrossEntropyResult{Tensor(), res.rowMax, res.logSum},
       r](const std::vector<Tensor>& g, const autograd::Node&) {
        return std::vector<Tensor>{kernels::crossEntropyBackward(g[0], x, t, saved, r)};
      });
}

Tensor nllLoss(const Tensor& logProbs, const Tensor& targets, Reduction reduction) {
  checkClassification(logProbs, targets, "nllLoss", "logProbs");
  const kernels::LossReduction r = toKernel(reduction);
  Tensor loss = kernels::nllLoss(logProbs, targets, r);
  if (!autograd::anyRequiresGrad({logProbs})) return loss;  // no closure to build
  return autograd::recordOp(
      "NllLossBackward", {logProbs}, loss,
      [t = targets.detach(), shape = logProbs.shape(), dtype = logProbs.dtype(), r](const std::vector<Tensor>& g,
                                                                                   const autograd::Node&) {
        return std::vector<Tensor>{kernels::nllLossBackward(g[0], t, shape, dtype, r)};
      });
}

Tensor mseLoss(const Tensor& input, const Tensor& target, Reduction reduction) {
  checkDefined(input, "mseLoss", "input");
  checkDefined(target, "mseLoss", "target");
  checkFloat(input, "mseLoss", "input");
  checkFloat(target, "mseLoss", "target");
  DG_CHECK(input.shape() == target.shape(), "mseLoss: input shape ", shapeStr(input.shape()),
           " does not match target shape ", shapeStr(target.shape()));
  DG_CHECK(input.dtype() == target.dtype(), "mseLoss: input is ", dtypeName(input.dtype()), " but target is ",
           dtypeName(target.dtype()));
  const kernels::LossReduction r = toKernel(reduction);
  Tensor loss = kernels::mseLoss(input, target, r);
  if (!autograd::anyRequiresGrad({input, target})) return loss;  // no closure to build
  return autograd::recordOp(
      "MseLossBackward", {input, target}, loss,
      [x = input.detach(), y = target.detach(), r](const std::vector<Tensor>& g, const autograd::Node& self) {
        auto grads = kernels::mseLossBackward(g[0], x, y, r, self.needsInputGrad(0), self.needsInputGrad(1));
        return std::vector<Tensor>{grads.input, grads.target};
      });
}

// ---------------------------------------------------------------- dropout and embedding

Tensor dropout(const Tensor& x, double p, bool training, tensor::Generator& gen) {
  checkDefined(x, "dropout", "x");
  checkFloat(x, "dropout", "x");
  DG_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got ", p);
  // Identity: the caller's tensor itself, so no copy and no extra graph node.
  if (!training || p == 0.0) return x;
  kernels::DropoutResult r = kernels::dropout(x, p, gen);
  if (!autograd::anyRequiresGrad({x})) return r.output;  // no closure to build
  return autograd::recordOp("DropoutBackward", {x}, r.output,
                            [mask = r.mask](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{kernels::dropoutBackward(g[0], mask)};
                            });
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  checkDefined(weight, "embedding", "weight");
  checkDefined(indices, "embedding", "indices");
  DG_CHECK(weight.dim() == 2, "embedding: expected weight of rank 2 [V, D], got shape ", shapeStr(weight.shape()));
  checkFloat(weight, "embedding", "weight");
  DG_CHECK(indices.dtype() == DType::kInt64, "embedding: indices must be int64, got ", dtypeName(indices.dtype()));
  DG_CHECK(indices.device() == weight.device(), "embedding: indices are on ", indices.device().str(),
           " but weight is on ", weight.device().str());
  Tensor out = kernels::embedding(weight, indices);
  if (!autograd::anyRequiresGrad({weight})) return out;  // no closure to build
  return autograd::recordOp(
      "EmbeddingBackward", {weight}, out,
      [idx = indices.detach(), shape = weight.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
        return std::vector<Tensor>{kernels::embeddingBackward(g[0], idx, shape)};
      });
}

}  // namespace distgrad
