// Tensor-level CUDA ops for pooling (max, adaptive average; average pooling lives in cudnn_ops.cpp), batch
// norm, losses, dropout and embedding: argument plumbing around the kernels of dnn_kernels.cu. The
// contracts are the CPU kernels' (tensor/cpu/pool.h, batch_norm.h, nn_kernels.h).
// Compiled, untested on hardware in the session that wrote it (no GPU was available).
#ifdef DG_WITH_CUDA

#include "tensor/cuda/dnn_ops.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <limits>
#include <memory>

#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/dnn_common.h"
#include "tensor/cuda/dnn_kernels.h"
#include "tensor/cuda/library_handles.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda {

namespace dnn_detail {

Tensor contiguousOnDevice(const Tensor& t) { return t.isContiguous() ? t : kernels::contiguous(t); }

Tensor emptyOn(const Shape& shape, DType dtype, int device) {
  return Tensor::empty(shape, dtype, Device::cuda(device));
}

Tensor zerosOn(const Shape& shape, DType dtype, int device, cudaStream_t stream) {
  Tensor t = emptyOn(shape, dtype, device);
  if (t.nbytes() > 0) DG_CUDA_CHECK(cudaMemsetAsync(t.rawData(), 0, t.nbytes(), stream));
  return t;
}

void requireFloatOperand(const Tensor& t, const char* op, const char* what) {
  DG_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64, op, ": ", what,
           " must be float32 or float64 on CUDA, got ", dtypeName(t.dtype()), " on ", t.device().str());
}

void checkIndicesInRange(const Tensor& indices, int64_t limit, cudaStream_t stream, const char* op,
                         const char* indexWord, const char* rangeText) {
  const int64_t n = indices.numel();
  if (n == 0) return;
  const int device = deviceOf(indices);
  Tensor flag = workspaceTensor(device, sizeof(unsigned long long));
  auto* firstBad = static_cast<unsigned long long*>(flag.rawData());
  launchFindOutOfRange(indices.data<int64_t>(), n, limit, firstBad, stream);
  unsigned long long bad = 0;
  DG_CUDA_CHECK(cudaMemcpyAsync(&bad, firstBad, sizeof(bad), cudaMemcpyDeviceToHost, stream));
  DG_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (bad == std::numeric_limits<unsigned long long>::max()) return;
  int64_t value = 0;
  DG_CUDA_CHECK(cudaMemcpyAsync(&value, indices.data<int64_t>() + bad, sizeof(value), cudaMemcpyDeviceToHost, stream));
  DG_CUDA_CHECK(cudaStreamSynchronize(stream));
  DG_CHECK(false, op, ": ", indexWord, " ", value, " at position ", bad, " is out of range for ", limit, " ", rangeText,
           " (expected 0..", limit - 1, ")");
}

}  // namespace dnn_detail

namespace dnn {

using dnn_detail::contiguousOnDevice;
using dnn_detail::deviceOf;
using dnn_detail::emptyOn;
using dnn_detail::requireFloatOperand;
using dnn_detail::zerosOn;

namespace {

cudaStream_t currentStream(int device) { return rawStream(Stream::current(device)); }

dnn_detail::PoolGeometry poolGeometry(const Shape& in, int64_t outH, int64_t outW, const kernels::Pool2dParams& p) {
  dnn_detail::PoolGeometry g;
  g.planes = in[0] * in[1];
  g.inH = in[2];
  g.inW = in[3];
  g.outH = outH;
  g.outW = outW;
  g.kernelH = p.kernelH;
  g.kernelW = p.kernelW;
  g.strideH = p.strideH;
  g.strideW = p.strideW;
  g.padH = p.padH;
  g.padW = p.padW;
  return g;
}

dnn_detail::PoolGeometry pooledGeometry(const Shape& in, const kernels::Pool2dParams& p) {
  return poolGeometry(in, kernels::pooledLength(in[2], p.kernelH, p.strideH, p.padH, p.ceilMode),
                      kernels::pooledLength(in[3], p.kernelW, p.strideW, p.padW, p.ceilMode), p);
}

template <typename T>
T* ptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.rawData()) : nullptr;
}

}  // namespace

// ---------------------------------------------------------------- pooling

// Max pooling runs on our kernel rather than cudnnPoolingForward: the saved state is the argmax (the
// contract of MaxPool2dSaved), so backward needs neither x nor y (cuDNN's backward wants both, doubling
// what autograd keeps alive), ties and NaNs resolve exactly as on the CPU, ceil mode is supported, and the
// backward is a deterministic gather. PyTorch makes the same choice for max_pool2d on CUDA.
kernels::MaxPool2dResult maxPool2d(const Tensor& x, const kernels::Pool2dParams& params, bool forBackward) {
  requireFloatOperand(x, "maxPool2d", "x");
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  const dnn_detail::PoolGeometry g = pooledGeometry(in.shape(), params);
  kernels::MaxPool2dResult r;
  r.output = emptyOn({in.shape()[0], in.shape()[1], g.outH, g.outW}, in.dtype(), device);
  Tensor argmax;
  if (forBackward) argmax = emptyOn(r.output.shape(), DType::kInt64, device);
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(in.dtype(), "maxPool2d", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchMaxPool2d<T>(ptr<T>(in), ptr<T>(r.output), ptr<int64_t>(argmax), g, stream);
  });
  if (forBackward) {
    auto saved = std::make_shared<kernels::MaxPool2dSaved>();
    saved->inputShape = in.shape();
    saved->params = params;
    saved->dtype = in.dtype();
    saved->argmax = argmax;
    r.saved = std::move(saved);
  }
  return r;
}

Tensor maxPool2dBackward(const Tensor& gradOutput, const kernels::MaxPool2dSaved& saved) {
  DG_CHECK(saved.argmax.defined() && saved.argmax.device() == gradOutput.device(),
           "maxPool2d backward: the saved argmax is not on ", gradOutput.device().str(),
           " (the forward ran on another device)");
  const int device = deviceOf(gradOutput);
  DeviceGuard guard(device);
  Tensor g = contiguousOnDevice(gradOutput);
  DG_CHECK(g.dtype() == saved.dtype, "maxPool2d backward: gradient dtype ", dtypeName(g.dtype()),
           " does not match the forward's ", dtypeName(saved.dtype));
  const dnn_detail::PoolGeometry geo = pooledGeometry(saved.inputShape, saved.params);
  Tensor dx = emptyOn(saved.inputShape, saved.dtype, device);
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(saved.dtype, "maxPool2d backward", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchMaxPool2dBackward<T>(ptr<T>(g), ptr<int64_t>(saved.argmax), ptr<T>(dx), geo, stream);
  });
  return dx;
}

Tensor adaptiveAvgPool2d(const Tensor& x, int64_t outH, int64_t outW) {
  requireFloatOperand(x, "adaptiveAvgPool2d", "x");
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  const dnn_detail::PoolGeometry g = poolGeometry(in.shape(), outH, outW, {});
  Tensor out = emptyOn({in.shape()[0], in.shape()[1], outH, outW}, in.dtype(), device);
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(in.dtype(), "adaptiveAvgPool2d", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchAdaptiveAvgPool2d<T>(ptr<T>(in), ptr<T>(out), g, stream);
  });
  return out;
}

Tensor adaptiveAvgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape) {
  const int device = deviceOf(gradOutput);
  DeviceGuard guard(device);
  Tensor g = contiguousOnDevice(gradOutput);
  DG_CHECK(g.dim() == 4 && inputShape.size() == 4, "adaptiveAvgPool2d backward: expected rank-4 shapes, got ",
           shapeStr(g.shape()), " and ", shapeStr(inputShape));
  const dnn_detail::PoolGeometry geo = poolGeometry(inputShape, g.shape()[2], g.shape()[3], {});
  Tensor dx = emptyOn(inputShape, g.dtype(), device);
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(g.dtype(), "adaptiveAvgPool2d backward", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchAdaptiveAvgPool2dBackward<T>(ptr<T>(g), ptr<T>(dx), geo, stream);
  });
  return dx;
}

// ---------------------------------------------------------------- batch norm
//
// Our kernels rather than cudnnBatchNormalization*: cuDNN 9 marks that family deprecated, it reports the
// saved *inverse standard deviation* where our contract returns the biased variance (recovering it as
// 1/invstd^2 - eps loses float32 precision for small variances), it has no backward for eval mode
// (constant statistics), and it needs scale/shift buffers where ours may be undefined.

namespace {

dnn_detail::ChannelGeometry channelGeometry(const Tensor& x) {
  dnn_detail::ChannelGeometry g;
  g.outer = x.shape()[0];
  g.channels = x.shape()[1];
  g.inner = 1;
  for (int64_t d = 2; d < x.dim(); ++d) g.inner *= x.shape()[d];
  return g;
}

Tensor channelParam(const Tensor& t, DType dtype, const char* op, const char* what) {
  if (!t.defined()) return t;
  DG_CHECK(t.dtype() == dtype, op, ": ", what, " is ", dtypeName(t.dtype()), " but x is ", dtypeName(dtype));
  return contiguousOnDevice(t);
}

}  // namespace

kernels::BatchNormTrainResult batchNormTrain(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const char* op = "batchNorm";
  requireFloatOperand(x, op, "x");
  DG_CHECK(x.dim() >= 2, op, ": expected x of rank >= 2 [N, C, ...], got ", shapeStr(x.shape()));
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  Tensor w = channelParam(weight, in.dtype(), op, "weight");
  Tensor b = channelParam(bias, in.dtype(), op, "bias");
  const dnn_detail::ChannelGeometry g = channelGeometry(in);
  kernels::BatchNormTrainResult r;
  r.output = emptyOn(in.shape(), in.dtype(), device);
  r.mean = emptyOn({g.channels}, in.dtype(), device);
  r.var = emptyOn({g.channels}, in.dtype(), device);
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(in.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchBatchNormStats<T>(ptr<T>(in), ptr<T>(r.mean), ptr<T>(r.var), g, stream);
    dnn_detail::launchBatchNormApply<T>(ptr<T>(in), ptr<T>(r.mean), ptr<T>(r.var), ptr<T>(w), ptr<T>(b), eps,
                                        ptr<T>(r.output), g, stream);
  });
  return r;
}

Tensor batchNormEval(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean, const Tensor& var,
                     double eps) {
  const char* op = "batchNorm";
  requireFloatOperand(x, op, "x");
  DG_CHECK(x.dim() >= 2, op, ": expected x of rank >= 2 [N, C, ...], got ", shapeStr(x.shape()));
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  Tensor w = channelParam(weight, in.dtype(), op, "weight");
  Tensor b = channelParam(bias, in.dtype(), op, "bias");
  Tensor m = channelParam(mean, in.dtype(), op, "running mean");
  Tensor v = channelParam(var, in.dtype(), op, "running var");
  DG_CHECK(m.defined() && v.defined(), op, ": eval mode needs the running mean and variance");
  const dnn_detail::ChannelGeometry g = channelGeometry(in);
  Tensor out = emptyOn(in.shape(), in.dtype(), device);
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(in.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchBatchNormApply<T>(ptr<T>(in), ptr<T>(m), ptr<T>(v), ptr<T>(w), ptr<T>(b), eps, ptr<T>(out), g,
                                        stream);
  });
  return out;
}

kernels::BatchNormGrads batchNormBackward(const Tensor& gradOutput, const Tensor& x, const Tensor& weight,
                                          const Tensor& mean, const Tensor& var, double eps, bool training,
                                          std::array<bool, 3> need) {
  const char* op = "batchNorm backward";
  kernels::BatchNormGrads r;
  if (!need[0] && !need[1] && !need[2]) return r;
  requireFloatOperand(x, op, "x");
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  Tensor g = channelParam(gradOutput, in.dtype(), op, "gradient");
  Tensor w = channelParam(weight, in.dtype(), op, "weight");
  Tensor m = channelParam(mean, in.dtype(), op, "mean");
  Tensor v = channelParam(var, in.dtype(), op, "var");
  const dnn_detail::ChannelGeometry geo = channelGeometry(in);
  const cudaStream_t stream = currentStream(device);
  // sums[0..C) = sum(g), sums[C..2C) = sum(g * xhat)
  Tensor sums = emptyOn({2 * geo.channels}, DType::kFloat64, device);
  double* sumG = ptr<double>(sums);
  double* sumGXhat = sumG + geo.channels;
  dispatchFloat(in.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchBatchNormGradSums<T>(ptr<T>(g), ptr<T>(in), ptr<T>(m), ptr<T>(v), eps, sumG, sumGXhat, geo,
                                           stream);
    if (need[0]) {
      r.x = emptyOn(in.shape(), in.dtype(), device);
      dnn_detail::launchBatchNormInputGrad<T>(ptr<T>(g), ptr<T>(in), ptr<T>(m), ptr<T>(v), ptr<T>(w), eps, sumG,
                                              sumGXhat, training, ptr<T>(r.x), geo, stream);
    }
    if (need[1]) {
      r.weight = emptyOn({geo.channels}, in.dtype(), device);
      dnn_detail::launchCastFromDouble<T>(sumGXhat, ptr<T>(r.weight), geo.channels, stream);
    }
    if (need[2]) {
      r.bias = emptyOn({geo.channels}, in.dtype(), device);
      dnn_detail::launchCastFromDouble<T>(sumG, ptr<T>(r.bias), geo.channels, stream);
    }
  });
  return r;
}

void updateRunningStats(const Tensor& runningMean, const Tensor& runningVar, const Tensor& batchMean,
                        const Tensor& batchVar, int64_t count, double momentum) {
  const char* op = "batchNorm running statistics";
  const double bessel = count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
  auto blend = [&](const Tensor& running, const Tensor& batch, double factor, const char* what) {
    if (!running.defined()) return;
    DG_CHECK(running.isContiguous() && running.dtype() == batch.dtype() && running.numel() == batch.numel(), op, ": ",
             what, " must be a contiguous ", dtypeName(batch.dtype()), " tensor of ", batch.numel(),
             " elements on CUDA, got ", dtypeName(running.dtype()), " ", shapeStr(running.shape()));
    const int device = deviceOf(running);
    DeviceGuard guard(device);
    Tensor b = contiguousOnDevice(batch);
    const cudaStream_t stream = currentStream(device);
    dispatchFloat(b.dtype(), op, [&](auto tag) {
      using T = decltype(tag);
      dnn_detail::launchBlendRunning<T>(ptr<T>(running), ptr<T>(b), b.numel(), momentum, factor, stream);
    });
  };
  blend(runningMean, batchMean, 1.0, "running mean");
  blend(runningVar, batchVar, bessel, "running var");
}

// ---------------------------------------------------------------- losses

namespace {

Tensor reduceLosses(const Tensor& perSample, kernels::LossReduction reduction, cudaStream_t stream) {
  if (reduction == kernels::LossReduction::kNone) return perSample;
  const int device = deviceOf(perSample);
  const int64_t n = perSample.numel();
  Tensor out = emptyOn({}, perSample.dtype(), device);
  Tensor workspace =
      workspaceTensor(device, sizeof(double) * static_cast<size_t>(dnn_detail::reduceWorkspaceDoubles()));
  // kMean over zero samples is 0 * inf = NaN, the CPU's 0 / 0.
  const double scale = reduction == kernels::LossReduction::kMean ? 1.0 / static_cast<double>(n) : 1.0;
  dispatchFloat(perSample.dtype(), "loss reduction", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchSumScaled<T>(ptr<T>(perSample), n, scale, ptr<T>(out), ptr<double>(workspace), stream);
  });
  return out;
}

template <typename T>
T coefScale(kernels::LossReduction reduction, int64_t count) {
  return reduction == kernels::LossReduction::kMean ? T(1) / static_cast<T>(count) : T(1);
}

}  // namespace

kernels::CrossEntropyResult crossEntropy(const Tensor& logits, const Tensor& targets, kernels::LossReduction reduction,
                                         const char* op) {
  requireFloatOperand(logits, op, "logits");
  const int device = deviceOf(logits);
  DeviceGuard guard(device);
  Tensor x = contiguousOnDevice(logits);
  Tensor t = contiguousOnDevice(targets);
  const int64_t n = x.shape()[0], classes = x.shape()[1];
  const cudaStream_t stream = currentStream(device);
  dnn_detail::checkIndicesInRange(t, classes, stream, op, "target", "classes");
  kernels::CrossEntropyResult r{emptyOn({n}, x.dtype(), device), emptyOn({n}, x.dtype(), device),
                                emptyOn({n}, x.dtype(), device)};
  dispatchFloat(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchCrossEntropy<T>(ptr<T>(x), ptr<int64_t>(t), n, classes, ptr<T>(r.loss), ptr<T>(r.rowMax),
                                      ptr<T>(r.logSum), stream);
  });
  r.loss = reduceLosses(r.loss, reduction, stream);
  return r;
}

Tensor crossEntropyBackward(const Tensor& gradOutput, const Tensor& logits, const Tensor& targets,
                            const kernels::CrossEntropyResult& forward, kernels::LossReduction reduction) {
  const int device = deviceOf(logits);
  DeviceGuard guard(device);
  Tensor x = contiguousOnDevice(logits);
  Tensor t = contiguousOnDevice(targets);
  Tensor rowMax = contiguousOnDevice(forward.rowMax);
  Tensor logSum = contiguousOnDevice(forward.logSum);
  Tensor g = contiguousOnDevice(gradOutput);
  const int64_t n = x.shape()[0], classes = x.shape()[1];
  Tensor dx = emptyOn(x.shape(), x.dtype(), device);
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(x.dtype(), "crossEntropy backward", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchCrossEntropyBackward<T>(ptr<T>(g), reduction == kernels::LossReduction::kNone,
                                              coefScale<T>(reduction, n), ptr<T>(x), ptr<int64_t>(t), ptr<T>(rowMax),
                                              ptr<T>(logSum), n, classes, ptr<T>(dx), stream);
  });
  return dx;
}

Tensor nllLoss(const Tensor& logProbs, const Tensor& targets, kernels::LossReduction reduction, const char* op) {
  requireFloatOperand(logProbs, op, "log-probabilities");
  const int device = deviceOf(logProbs);
  DeviceGuard guard(device);
  Tensor x = contiguousOnDevice(logProbs);
  Tensor t = contiguousOnDevice(targets);
  const int64_t n = x.shape()[0], classes = x.shape()[1];
  const cudaStream_t stream = currentStream(device);
  dnn_detail::checkIndicesInRange(t, classes, stream, op, "target", "classes");
  Tensor loss = emptyOn({n}, x.dtype(), device);
  dispatchFloat(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchNllLoss<T>(ptr<T>(x), ptr<int64_t>(t), n, classes, ptr<T>(loss), stream);
  });
  return reduceLosses(loss, reduction, stream);
}

Tensor nllLossBackward(const Tensor& gradOutput, const Tensor& targets, const Shape& inputShape, DType dtype,
                       kernels::LossReduction reduction) {
  const int device = deviceOf(targets);
  DeviceGuard guard(device);
  Tensor t = contiguousOnDevice(targets);
  Tensor g = contiguousOnDevice(gradOutput);
  DG_CHECK(g.dtype() == dtype, "nllLoss backward: gradient is ", dtypeName(g.dtype()), ", expected ", dtypeName(dtype));
  const cudaStream_t stream = currentStream(device);
  Tensor dx = zerosOn(inputShape, dtype, device, stream);
  const int64_t n = inputShape[0], classes = inputShape[1];
  dispatchFloat(dtype, "nllLoss backward", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchNllLossBackward<T>(ptr<T>(g), reduction == kernels::LossReduction::kNone,
                                         coefScale<T>(reduction, n), ptr<int64_t>(t), n, classes, ptr<T>(dx), stream);
  });
  return dx;
}

Tensor mseLoss(const Tensor& input, const Tensor& target, kernels::LossReduction reduction) {
  requireFloatOperand(input, "mseLoss", "input");
  const int device = deviceOf(input);
  DeviceGuard guard(device);
  Tensor x = contiguousOnDevice(input);
  Tensor y = contiguousOnDevice(target);
  DG_CHECK(y.dtype() == x.dtype(), "mseLoss: target is ", dtypeName(y.dtype()), " but input is ", dtypeName(x.dtype()));
  const int64_t n = x.numel();
  const cudaStream_t stream = currentStream(device);
  return dispatchFloat(x.dtype(), "mseLoss", [&](auto tag) {
    using T = decltype(tag);
    if (reduction == kernels::LossReduction::kNone) {
      Tensor out = emptyOn(x.shape(), x.dtype(), device);
      dnn_detail::launchSquaredDiff<T>(ptr<T>(x), ptr<T>(y), n, ptr<T>(out), stream);
      return out;
    }
    Tensor out = emptyOn({}, x.dtype(), device);
    Tensor workspace =
        workspaceTensor(device, sizeof(double) * static_cast<size_t>(dnn_detail::reduceWorkspaceDoubles()));
    const double scale = reduction == kernels::LossReduction::kMean ? 1.0 / static_cast<double>(n) : 1.0;
    dnn_detail::launchSumSquaredDiffScaled<T>(ptr<T>(x), ptr<T>(y), n, scale, ptr<T>(out), ptr<double>(workspace),
                                              stream);
    return out;
  });
}

kernels::MseLossGrads mseLossBackward(const Tensor& gradOutput, const Tensor& input, const Tensor& target,
                                      kernels::LossReduction reduction, bool needInput, bool needTarget) {
  kernels::MseLossGrads r;
  if (!needInput && !needTarget) return r;
  const int device = deviceOf(input);
  DeviceGuard guard(device);
  Tensor x = contiguousOnDevice(input);
  Tensor y = contiguousOnDevice(target);
  Tensor g = contiguousOnDevice(gradOutput);
  const int64_t n = x.numel();
  const cudaStream_t stream = currentStream(device);
  if (needInput) r.input = emptyOn(x.shape(), x.dtype(), device);
  if (needTarget) r.target = emptyOn(x.shape(), x.dtype(), device);
  dispatchFloat(x.dtype(), "mseLoss backward", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchMseBackward<T>(ptr<T>(g), reduction == kernels::LossReduction::kNone, coefScale<T>(reduction, n),
                                     ptr<T>(x), ptr<T>(y), n, ptr<T>(r.input), ptr<T>(r.target), stream);
  });
  return r;
}

// ---------------------------------------------------------------- dropout

kernels::DropoutResult dropout(const Tensor& x, double p, Generator& gen) {
  DG_CHECK(p >= 0.0 && p < 1.0, "dropout: probability must be in [0, 1), got ", p);
  requireFloatOperand(x, "dropout", "x");
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  kernels::DropoutResult r{emptyOn(in.shape(), in.dtype(), device), emptyOn(in.shape(), in.dtype(), device)};
  // One draw from the host generator per call seeds the device stream: reproducible under manualSeed, and
  // the host generator advances so consecutive calls get independent masks.
  const uint64_t seed = gen.nextU64();
  const cudaStream_t stream = currentStream(device);
  dispatchFloat(in.dtype(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchDropout<T>(ptr<T>(in), in.numel(), p, seed, ptr<T>(r.output), ptr<T>(r.mask), stream);
  });
  return r;
}

Tensor dropoutBackward(const Tensor& gradOutput, const Tensor& mask) {
  // gradOutput * mask is a plain element-wise product: the element-wise kernels' CUDA path does it.
  return kernels::binary(kernels::BinaryOp::kMul, gradOutput, mask, "dropout backward");
}

// ---------------------------------------------------------------- embedding

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  requireFloatOperand(weight, "embedding", "weight");
  const int device = deviceOf(weight);
  DeviceGuard guard(device);
  Tensor w = contiguousOnDevice(weight);
  Tensor idx = contiguousOnDevice(indices);
  const int64_t rows = w.shape()[0], dim = w.shape()[1];
  const cudaStream_t stream = currentStream(device);
  dnn_detail::checkIndicesInRange(idx, rows, stream, "embedding", "index", "rows of the weight");
  Shape outShape = idx.shape();
  outShape.push_back(dim);
  Tensor out = emptyOn(outShape, w.dtype(), device);
  dispatchFloat(w.dtype(), "embedding", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchEmbedding<T>(ptr<T>(w), ptr<int64_t>(idx), idx.numel(), dim, ptr<T>(out), stream);
  });
  return out;
}

// Atomics rather than sort + segmented sum: one pass, no temporary; the price is that float rounding of
// repeated indices depends on scheduling (not bitwise reproducible). TODO(perf): sort-based path for
// deterministic mode and for heavily repeated indices.
Tensor embeddingBackward(const Tensor& gradOutput, const Tensor& indices, const Shape& weightShape) {
  const int device = deviceOf(gradOutput);
  DeviceGuard guard(device);
  Tensor g = contiguousOnDevice(gradOutput);
  Tensor idx = contiguousOnDevice(indices);
  const cudaStream_t stream = currentStream(device);
  Tensor dw = zerosOn(weightShape, g.dtype(), device, stream);
  dispatchFloat(g.dtype(), "embedding backward", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchEmbeddingBackward<T>(ptr<T>(g), ptr<int64_t>(idx), idx.numel(), weightShape[1], ptr<T>(dw),
                                           stream);
  });
  return dw;
}

}  // namespace dnn
}  // namespace distgrad::tensor::cuda

#endif  // DG_WITH_CUDA
