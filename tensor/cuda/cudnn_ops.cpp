// cuDNN-backed CUDA ops: 2-D convolution (forward, backward data, backward filter, bias), softmax and
// log-softmax, and average pooling where cuDNN's window grid matches ours.
//
// API choice (cuDNN 9.x here): the legacy descriptor API (cudnnConvolutionForward & co. in cudnn_cnn.h,
// cudnnSoftmaxForward/Backward and cudnnPoolingForward in cudnn_ops.h). cuDNN 9 still ships and supports
// it, with CUDNN_DEPRECATED markers that only warn when CUDNN_WARN_DEPRECATED is defined; the replacement
// (the graph/backend API, cudnn_graph.h) needs an operation graph, engine heuristics and execution plans per
// shape, which is what the header-only cudnn-frontend library wraps, and that library is not available
// here. Moving to the graph API is TODO(cleanup) once cudnn-frontend is a dependency.
//
// Algorithms: per shape, by default cudnnGet*Algorithm_v7 heuristics (no benchmarking pass, so the first
// call of a shape costs microseconds), or with ConvAlgorithmSearch::kBenchmark (math_mode.h, like
// torch.backends.cudnn.benchmark) cudnnFind*AlgorithmEx, which times every algorithm on the call's own
// operands; either way the first candidate that succeeded, fits kMaxConvWorkspaceBytes and honours the
// requested math mode is kept. Choices are cached per thread keyed by (device, dtype, shapes, parameters, math
// mode), so a training loop pays the query once per layer. Workspaces are CUDA Tensors from the allocator,
// alive for the call.
// Compiled, untested on hardware in the session that wrote it (no GPU was available).
#ifdef DG_WITH_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <sstream>
#include <string>
#include <unordered_map>

#include "tensor/cuda/dnn_common.h"
#include "tensor/cuda/dnn_kernels.h"
#include "tensor/cuda/dnn_ops.h"
#include "tensor/cuda/library_handles.h"
#include "tensor/cuda/math_mode.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda::dnn {

using dnn_detail::contiguousOnDevice;
using dnn_detail::deviceOf;
using dnn_detail::emptyOn;
using dnn_detail::requireFloatOperand;

namespace {

// Algorithms needing more scratch than this are skipped (heuristics list cheaper alternatives).
constexpr size_t kMaxConvWorkspaceBytes = size_t{1} << 30;

cudnnDataType_t cudnnType(DType dtype, const char* op) {
  switch (dtype) {
    case DType::kFloat32: return CUDNN_DATA_FLOAT;
    case DType::kFloat64: return CUDNN_DATA_DOUBLE;
    default: break;
  }
  DG_CHECK(false, op, ": cuDNN path supports float32 and float64, got ", dtypeName(dtype));
  return CUDNN_DATA_FLOAT;
}

int toInt(int64_t v, const char* op, const char* what) {
  DG_CHECK(v >= 0 && v <= INT_MAX, op, ": ", what, " ", v, " exceeds cuDNN's 32-bit dimension limit");
  return static_cast<int>(v);
}

// RAII wrappers of the descriptors (STYLE.md: every C handle is owned).
class TensorDesc {
 public:
  TensorDesc() { DG_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc_)); }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(desc_); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  // A packed NCHW tensor.
  void set4d(DType dtype, int64_t n, int64_t c, int64_t h, int64_t w, const char* op) {
    // Packed strides are 32-bit in the legacy API, so the whole tensor must fit too.
    DG_CHECK(n * c * h * w <= INT_MAX, op, ": a tensor of ", n * c * h * w,
             " elements exceeds cuDNN's 32-bit indexing (at most ", INT_MAX, ")");
    DG_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc_, CUDNN_TENSOR_NCHW, cudnnType(dtype, op), toInt(n, op, "N"),
                                              toInt(c, op, "C"), toInt(h, op, "H"), toInt(w, op, "W")));
  }
  cudnnTensorDescriptor_t get() const { return desc_; }

 private:
  cudnnTensorDescriptor_t desc_ = nullptr;
};

class FilterDesc {
 public:
  FilterDesc() { DG_CUDNN_CHECK(cudnnCreateFilterDescriptor(&desc_)); }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(desc_); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
  void set(DType dtype, const Shape& w, const char* op) {
    DG_CUDNN_CHECK(cudnnSetFilter4dDescriptor(desc_, cudnnType(dtype, op), CUDNN_TENSOR_NCHW, toInt(w[0], op, "O"),
                                              toInt(w[1], op, "C/groups"), toInt(w[2], op, "kH"),
                                              toInt(w[3], op, "kW")));
  }
  cudnnFilterDescriptor_t get() const { return desc_; }

 private:
  cudnnFilterDescriptor_t desc_ = nullptr;
};

class ConvDesc {
 public:
  ConvDesc() { DG_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&desc_)); }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(desc_); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
  void set(const kernels::Conv2dParams& p, DType dtype, cudnnMathType_t math, const char* op) {
    DG_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        desc_, toInt(p.padding[0], op, "padding"), toInt(p.padding[1], op, "padding"), toInt(p.stride[0], op, "stride"),
        toInt(p.stride[1], op, "stride"), toInt(p.dilation[0], op, "dilation"), toInt(p.dilation[1], op, "dilation"),
        CUDNN_CROSS_CORRELATION, cudnnType(dtype, op)));
    DG_CUDNN_CHECK(cudnnSetConvolutionGroupCount(desc_, toInt(p.groups, op, "groups")));
    DG_CUDNN_CHECK(cudnnSetConvolutionMathType(desc_, math));
  }
  void setMath(cudnnMathType_t math) { DG_CUDNN_CHECK(cudnnSetConvolutionMathType(desc_, math)); }
  cudnnConvolutionDescriptor_t get() const { return desc_; }

 private:
  cudnnConvolutionDescriptor_t desc_ = nullptr;
};

class PoolingDesc {
 public:
  PoolingDesc() { DG_CUDNN_CHECK(cudnnCreatePoolingDescriptor(&desc_)); }
  ~PoolingDesc() { cudnnDestroyPoolingDescriptor(desc_); }
  PoolingDesc(const PoolingDesc&) = delete;
  PoolingDesc& operator=(const PoolingDesc&) = delete;
  cudnnPoolingDescriptor_t get() const { return desc_; }

 private:
  cudnnPoolingDescriptor_t desc_ = nullptr;
};

// alpha = 1, beta = 0 (or 1) in the precision cuDNN expects for the data type: double for float64 data,
// float otherwise.
struct Scalars {
  float f[2] = {1.f, 0.f};
  double d[2] = {1.0, 0.0};
  bool isDouble = false;
  Scalars(DType dtype, double beta) : isDouble(dtype == DType::kFloat64) {
    f[1] = static_cast<float>(beta);
    d[1] = beta;
  }
  const void* alpha() const { return isDouble ? static_cast<const void*>(&d[0]) : &f[0]; }
  const void* beta() const { return isDouble ? static_cast<const void*>(&d[1]) : &f[1]; }
};

// ---------------------------------------------------------------- convolution: descriptors + algorithm cache

enum class ConvPass { kForward, kBackwardData, kBackwardFilter };

struct AlgoChoice {
  int algo = 0;  // the pass's cudnn*Algo_t
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  size_t workspaceBytes = 0;
};

thread_local std::unordered_map<std::string, AlgoChoice> tAlgoCache;

// What a convolution is: shapes, parameters, dtype, math mode, device.
struct ConvSetup {
  int device = 0;
  DType dtype = DType::kFloat32;
  Shape x, w, y;
  kernels::Conv2dParams params;
  TensorDesc xDesc, yDesc;
  FilterDesc wDesc;
  ConvDesc convDesc;
  cudnnMathType_t requestedMath = CUDNN_FMA_MATH;

  ConvSetup(int dev, DType dt, const Shape& xs, const Shape& ws, const kernels::Conv2dParams& p, const char* op)
      : device(dev), dtype(dt), x(xs), w(ws), params(p) {
    y = kernels::conv2dOutputShape(x, w, params, op);
    // float64 has no reduced-precision path; float32 follows the process-wide conv math mode.
    requestedMath =
        (dtype == DType::kFloat32 && convMathMode() == MathMode::kTf32) ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    xDesc.set4d(dtype, x[0], x[1], x[2], x[3], op);
    yDesc.set4d(dtype, y[0], y[1], y[2], y[3], op);
    wDesc.set(dtype, w, op);
    convDesc.set(params, dtype, requestedMath, op);
  }

  std::string key(ConvPass pass) const {
    std::ostringstream k;
    k << static_cast<int>(pass) << '|' << device << '|' << static_cast<int>(dtype) << '|' << shapeStr(x) << shapeStr(w)
      << '|' << params.stride[0] << ',' << params.stride[1] << ',' << params.padding[0] << ',' << params.padding[1]
      << ',' << params.dilation[0] << ',' << params.dilation[1] << ',' << params.groups << '|'
      << static_cast<int>(requestedMath) << '|' << static_cast<int>(convAlgorithmSearch());
    return k.str();
  }

  // A candidate is acceptable when it ran in the heuristics, fits the workspace limit and, in exact fp32
  // mode, does not use tensor-op math (which on Ampere+ means TF32 inputs).
  template <typename Perf>
  bool acceptable(const Perf& p) const {
    if (p.status != CUDNN_STATUS_SUCCESS || p.memory > kMaxConvWorkspaceBytes) return false;
    return requestedMath != CUDNN_FMA_MATH || p.mathType == CUDNN_FMA_MATH;
  }

  // `in0`, `in1`, `out` are the pass's operands (forward: x, w, y; backward data: w, dy, dx; backward
  // filter: x, dy, dw); benchmark search runs the candidates on them (out is overwritten).
  AlgoChoice choose(ConvPass pass, cudnnHandle_t handle, const void* in0, const void* in1, void* out, const char* op) {
    const std::string k = key(pass);
    if (auto it = tAlgoCache.find(k); it != tAlgoCache.end()) return it->second;
    AlgoChoice choice;
    bool found = false;
    constexpr int kMaxCandidates = 16;
    int returned = 0;
    auto pick = [&](const auto* perf) {
      for (int i = 0; i < returned && !found; ++i) {
        if (!acceptable(perf[i])) continue;
        choice.algo = static_cast<int>(perf[i].algo);
        choice.math = perf[i].mathType;
        choice.workspaceBytes = perf[i].memory;
        found = true;
      }
    };
    if (convAlgorithmSearch() == ConvAlgorithmSearch::kBenchmark) {
      // cudnnFind*Ex times every algorithm on the real operands with one scratch buffer: as large as the
      // limit allows, but at most half the free memory so the search itself cannot exhaust the device.
      size_t freeBytes = 0, totalBytes = 0;
      DG_CUDA_CHECK(cudaMemGetInfo(&freeBytes, &totalBytes));
      const size_t scratchBytes = std::min(kMaxConvWorkspaceBytes, freeBytes / 2);
      Tensor scratch = workspaceTensor(device, scratchBytes);
      void* ws = scratch.rawData();
      switch (pass) {
        case ConvPass::kForward: {
          cudnnConvolutionFwdAlgoPerf_t perf[kMaxCandidates];
          DG_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(handle, xDesc.get(), in0, wDesc.get(), in1,
                                                                convDesc.get(), yDesc.get(), out, kMaxCandidates,
                                                                &returned, perf, ws, scratchBytes));
          pick(perf);
          break;
        }
        case ConvPass::kBackwardData: {
          cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxCandidates];
          DG_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(handle, wDesc.get(), in0, yDesc.get(), in1,
                                                                     convDesc.get(), xDesc.get(), out, kMaxCandidates,
                                                                     &returned, perf, ws, scratchBytes));
          pick(perf);
          break;
        }
        case ConvPass::kBackwardFilter: {
          cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxCandidates];
          DG_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(handle, xDesc.get(), in0, yDesc.get(), in1,
                                                                       convDesc.get(), wDesc.get(), out, kMaxCandidates,
                                                                       &returned, perf, ws, scratchBytes));
          pick(perf);
          break;
        }
      }
    } else {
      switch (pass) {
        case ConvPass::kForward: {
          cudnnConvolutionFwdAlgoPerf_t perf[kMaxCandidates];
          DG_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, xDesc.get(), wDesc.get(), convDesc.get(),
                                                                yDesc.get(), kMaxCandidates, &returned, perf));
          pick(perf);
          break;
        }
        case ConvPass::kBackwardData: {
          cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxCandidates];
          DG_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, wDesc.get(), yDesc.get(), convDesc.get(),
                                                                     xDesc.get(), kMaxCandidates, &returned, perf));
          pick(perf);
          break;
        }
        case ConvPass::kBackwardFilter: {
          cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxCandidates];
          DG_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, xDesc.get(), yDesc.get(), convDesc.get(),
                                                                       wDesc.get(), kMaxCandidates, &returned, perf));
          pick(perf);
          break;
        }
      }
    }
    DG_CHECK(found, op, ": cuDNN offers no algorithm for x ", shapeStr(x), ", weight ", shapeStr(w), " (", returned,
             " candidates, none usable in math mode ", mathModeName(convMathMode()), " within ",
             kMaxConvWorkspaceBytes >> 20, " MiB of workspace)");
    tAlgoCache.emplace(k, choice);
    return choice;
  }
};

void requireConvOperands(const Tensor& x, const Tensor& weight, const char* op) {
  requireFloatOperand(x, op, "x");
  DG_CHECK(weight.dtype() == x.dtype(), op, ": weight is ", dtypeName(weight.dtype()), " but x is ",
           dtypeName(x.dtype()));
}

Tensor biasGrad(const Tensor& gradOut, cudnnHandle_t handle, const char* op) {
  const int device = deviceOf(gradOut);
  Tensor g = contiguousOnDevice(gradOut);
  const Shape& s = g.shape();
  Tensor db = emptyOn({s[1]}, g.dtype(), device);
  TensorDesc gDesc, bDesc;
  gDesc.set4d(g.dtype(), s[0], s[1], s[2], s[3], op);
  bDesc.set4d(g.dtype(), 1, s[1], 1, 1, op);
  Scalars k(g.dtype(), 0.0);
  if (g.numel() == 0) {
    DG_CUDA_CHECK(cudaMemsetAsync(db.rawData(), 0, db.nbytes(), rawStream(Stream::current(device))));
    return db;
  }
  DG_CUDNN_CHECK(
      cudnnConvolutionBackwardBias(handle, k.alpha(), gDesc.get(), g.rawData(), k.beta(), bDesc.get(), db.rawData()));
  return db;
}

}  // namespace

size_t convAlgorithmCacheSize() { return tAlgoCache.size(); }

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const kernels::Conv2dParams& params) {
  const char* op = "conv2d";
  requireConvOperands(x, weight, op);
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor xc = contiguousOnDevice(x);
  Tensor wc = contiguousOnDevice(weight);
  ConvSetup setup(device, xc.dtype(), xc.shape(), wc.shape(), params, op);
  Tensor y = emptyOn(setup.y, xc.dtype(), device);
  const Stream stream = Stream::current(device);
  if (y.numel() == 0) return y;
  cudnnHandle_t handle = cudnnHandle(stream);
  if (xc.numel() == 0 || wc.numel() == 0) {  // an empty contraction: the output is just the bias (or 0)
    DG_CUDA_CHECK(cudaMemsetAsync(y.rawData(), 0, y.nbytes(), rawStream(stream)));
  } else {
    const AlgoChoice choice = setup.choose(ConvPass::kForward, handle, xc.rawData(), wc.rawData(), y.rawData(), op);
    setup.convDesc.setMath(choice.math);
    Tensor workspace = workspaceTensor(device, choice.workspaceBytes);
    Scalars k(xc.dtype(), 0.0);
    DG_CUDNN_CHECK(cudnnConvolutionForward(handle, k.alpha(), setup.xDesc.get(), xc.rawData(), setup.wDesc.get(),
                                           wc.rawData(), setup.convDesc.get(),
                                           static_cast<cudnnConvolutionFwdAlgo_t>(choice.algo), workspace.rawData(),
                                           choice.workspaceBytes, k.beta(), setup.yDesc.get(), y.rawData()));
  }
  if (bias.defined()) {
    DG_CHECK(bias.dtype() == xc.dtype() && bias.numel() == setup.y[1], op, ": bias must be ", dtypeName(xc.dtype()),
             " [", setup.y[1], "], got ", dtypeName(bias.dtype()), " ", shapeStr(bias.shape()));
    Tensor bc = contiguousOnDevice(bias);
    TensorDesc bDesc;
    bDesc.set4d(xc.dtype(), 1, setup.y[1], 1, 1, op);
    Scalars k(xc.dtype(), 1.0);  // y = 1 * bias (broadcast) + 1 * y
    DG_CUDNN_CHECK(
        cudnnAddTensor(handle, k.alpha(), bDesc.get(), bc.rawData(), k.beta(), setup.yDesc.get(), y.rawData()));
  }
  return y;
}

Tensor conv2dBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape,
                           const kernels::Conv2dParams& params) {
  const char* op = "conv2d backward (input)";
  requireConvOperands(gradOut, weight, op);
  const int device = deviceOf(gradOut);
  DeviceGuard guard(device);
  Tensor g = contiguousOnDevice(gradOut);
  Tensor wc = contiguousOnDevice(weight);
  ConvSetup setup(device, g.dtype(), inputShape, wc.shape(), params, op);
  DG_CHECK(setup.y == g.shape(), op, ": gradient shape ", shapeStr(g.shape()), " is not the output shape ",
           shapeStr(setup.y));
  const Stream stream = Stream::current(device);
  Tensor dx = emptyOn(inputShape, g.dtype(), device);
  if (dx.numel() == 0) return dx;
  if (g.numel() == 0 || wc.numel() == 0) {
    DG_CUDA_CHECK(cudaMemsetAsync(dx.rawData(), 0, dx.nbytes(), rawStream(stream)));
    return dx;
  }
  cudnnHandle_t handle = cudnnHandle(stream);
  const AlgoChoice choice = setup.choose(ConvPass::kBackwardData, handle, wc.rawData(), g.rawData(), dx.rawData(), op);
  setup.convDesc.setMath(choice.math);
  Tensor workspace = workspaceTensor(device, choice.workspaceBytes);
  Scalars k(g.dtype(), 0.0);
  DG_CUDNN_CHECK(cudnnConvolutionBackwardData(
      handle, k.alpha(), setup.wDesc.get(), wc.rawData(), setup.yDesc.get(), g.rawData(), setup.convDesc.get(),
      static_cast<cudnnConvolutionBwdDataAlgo_t>(choice.algo), workspace.rawData(), choice.workspaceBytes, k.beta(),
      setup.xDesc.get(), dx.rawData()));
  return dx;
}

std::pair<Tensor, Tensor> conv2dBackwardWeight(const Tensor& gradOut, const Tensor& x, const Shape& weightShape,
                                               const kernels::Conv2dParams& params, bool withBias) {
  const char* op = "conv2d backward (weight)";
  requireConvOperands(x, gradOut, op);
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor g = contiguousOnDevice(gradOut);
  Tensor xc = contiguousOnDevice(x);
  ConvSetup setup(device, xc.dtype(), xc.shape(), weightShape, params, op);
  DG_CHECK(setup.y == g.shape(), op, ": gradient shape ", shapeStr(g.shape()), " is not the output shape ",
           shapeStr(setup.y));
  const Stream stream = Stream::current(device);
  cudnnHandle_t handle = cudnnHandle(stream);
  Tensor dw = emptyOn(weightShape, xc.dtype(), device);
  if (dw.numel() > 0) {
    if (g.numel() == 0 || xc.numel() == 0) {
      DG_CUDA_CHECK(cudaMemsetAsync(dw.rawData(), 0, dw.nbytes(), rawStream(stream)));
    } else {
      const AlgoChoice choice =
          setup.choose(ConvPass::kBackwardFilter, handle, xc.rawData(), g.rawData(), dw.rawData(), op);
      setup.convDesc.setMath(choice.math);
      Tensor workspace = workspaceTensor(device, choice.workspaceBytes);
      Scalars k(xc.dtype(), 0.0);
      DG_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
          handle, k.alpha(), setup.xDesc.get(), xc.rawData(), setup.yDesc.get(), g.rawData(), setup.convDesc.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(choice.algo), workspace.rawData(), choice.workspaceBytes,
          k.beta(), setup.wDesc.get(), dw.rawData()));
    }
  }
  Tensor db = withBias ? biasGrad(g, handle, op) : Tensor();
  return {dw, db};
}

Tensor conv2dBackwardBias(const Tensor& gradOut) {
  const char* op = "conv2d backward (bias)";
  requireFloatOperand(gradOut, op, "gradient");
  DG_CHECK(gradOut.dim() == 4, op, ": expected a rank-4 gradient, got ", shapeStr(gradOut.shape()));
  const int device = deviceOf(gradOut);
  DeviceGuard guard(device);
  return biasGrad(gradOut, cudnnHandle(Stream::current(device)), op);
}

kernels::Conv2dGrads conv2dBackward(const Tensor& gradOut, const Tensor& x, const Tensor& weight,
                                    const kernels::Conv2dParams& params, bool needInput, bool needWeight,
                                    bool needBias) {
  kernels::Conv2dGrads r;
  if (needInput) r.input = dnn::conv2dBackwardInput(gradOut, weight, x.shape(), params);
  if (needWeight) {
    auto [dw, db] = dnn::conv2dBackwardWeight(gradOut, x, weight.shape(), params, needBias);
    r.weight = dw;
    r.bias = db;
  } else if (needBias) {
    r.bias = dnn::conv2dBackwardBias(gradOut);
  }
  return r;
}

// ---------------------------------------------------------------- softmax

namespace {

// x seen as [outer, size, inner, 1] around `dim`: cuDNN's CHANNEL mode normalises over dim 1 for every
// (n, h, w), which is exactly a softmax along `dim`.
void setSoftmaxDesc(TensorDesc& desc, const Tensor& t, int64_t dim, const char* op) {
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= t.shape()[d];
  for (int64_t d = dim + 1; d < t.dim(); ++d) inner *= t.shape()[d];
  desc.set4d(t.dtype(), outer, t.shape()[dim], inner, 1, op);
}

Tensor softmaxForward(const Tensor& x, int64_t dim, cudnnSoftmaxAlgorithm_t algo, const char* op) {
  requireFloatOperand(x, op, "x");
  DG_CHECK(dim >= 0 && dim < std::max<int64_t>(x.dim(), 1), op, ": dim ", dim, " out of range for shape ",
           shapeStr(x.shape()));
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  Tensor y = emptyOn(in.shape(), in.dtype(), device);
  if (in.numel() == 0) return y;
  // A 0-dim tensor is one row of one element.
  Tensor view = in.dim() == 0 ? Tensor::fromStorage(in.storage(), {1}, {1}, in.offset(), in.dtype()) : in;
  TensorDesc desc;
  setSoftmaxDesc(desc, view, view.dim() == 0 ? 0 : dim, op);
  Scalars k(in.dtype(), 0.0);
  DG_CUDNN_CHECK(cudnnSoftmaxForward(cudnnHandle(Stream::current(device)), algo, CUDNN_SOFTMAX_MODE_CHANNEL, k.alpha(),
                                     desc.get(), in.rawData(), k.beta(), desc.get(), y.rawData()));
  return y;
}

Tensor softmaxBackwardImpl(const Tensor& gradOutput, const Tensor& output, int64_t dim, cudnnSoftmaxAlgorithm_t algo,
                           const char* op) {
  const int device = deviceOf(output);
  DeviceGuard guard(device);
  Tensor y = contiguousOnDevice(output);
  Tensor g = contiguousOnDevice(gradOutput);
  DG_CHECK(g.shape() == y.shape() && g.dtype() == y.dtype(), op, ": gradient ", dtypeName(g.dtype()), " ",
           shapeStr(g.shape()), " does not match the output ", dtypeName(y.dtype()), " ", shapeStr(y.shape()));
  Tensor dx = emptyOn(y.shape(), y.dtype(), device);
  if (y.numel() == 0) return dx;
  Tensor view = y.dim() == 0 ? Tensor::fromStorage(y.storage(), {1}, {1}, y.offset(), y.dtype()) : y;
  TensorDesc desc;
  setSoftmaxDesc(desc, view, view.dim() == 0 ? 0 : dim, op);
  Scalars k(y.dtype(), 0.0);
  // cuDNN's LOG backward computes g - exp(y) * sum(g) from the log-softmax output, ACCURATE computes
  // y * (g - sum(g * y)): the same formulas as the CPU kernels.
  DG_CUDNN_CHECK(cudnnSoftmaxBackward(cudnnHandle(Stream::current(device)), algo, CUDNN_SOFTMAX_MODE_CHANNEL, k.alpha(),
                                      desc.get(), y.rawData(), desc.get(), g.rawData(), k.beta(), desc.get(),
                                      dx.rawData()));
  return dx;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmaxForward(x, dim, CUDNN_SOFTMAX_ACCURATE, "softmax"); }
Tensor logSoftmax(const Tensor& x, int64_t dim) { return softmaxForward(x, dim, CUDNN_SOFTMAX_LOG, "logSoftmax"); }
Tensor softmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim) {
  return softmaxBackwardImpl(gradOutput, output, dim, CUDNN_SOFTMAX_ACCURATE, "softmax backward");
}
Tensor logSoftmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim) {
  return softmaxBackwardImpl(gradOutput, output, dim, CUDNN_SOFTMAX_LOG, "logSoftmax backward");
}

// ---------------------------------------------------------------- average pooling

namespace {

dnn_detail::PoolGeometry avgGeometry(const Shape& in, const kernels::Pool2dParams& p) {
  dnn_detail::PoolGeometry g;
  g.planes = in[0] * in[1];
  g.inH = in[2];
  g.inW = in[3];
  g.outH = kernels::pooledLength(in[2], p.kernelH, p.strideH, p.padH, p.ceilMode);
  g.outW = kernels::pooledLength(in[3], p.kernelW, p.strideW, p.padW, p.ceilMode);
  g.kernelH = p.kernelH;
  g.kernelW = p.kernelW;
  g.strideH = p.strideH;
  g.strideW = p.strideW;
  g.padH = p.padH;
  g.padW = p.padW;
  return g;
}

// cuDNN's grid is the floor-mode one, and with it every window lies inside the padded input, so cuDNN's
// COUNT_INCLUDE_PADDING divisor (the full kernel area) is PyTorch's. Ceil mode adds windows cuDNN cannot
// produce; cuDNN also wants 32-bit sizes.
bool cudnnFitsAvgPool(const Shape& in, const dnn_detail::PoolGeometry& g) {
  if (kernels::pooledLength(in[2], g.kernelH, g.strideH, g.padH, false) != g.outH) return false;
  if (kernels::pooledLength(in[3], g.kernelW, g.strideW, g.padW, false) != g.outW) return false;
  for (int64_t d : in) {
    if (d > INT_MAX) return false;
  }
  return numelOf(in) < (int64_t{1} << 31);
}

}  // namespace

Tensor avgPool2d(const Tensor& x, const kernels::Pool2dParams& params) {
  const char* op = "avgPool2d";
  requireFloatOperand(x, op, "x");
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  Tensor in = contiguousOnDevice(x);
  const dnn_detail::PoolGeometry g = avgGeometry(in.shape(), params);
  Tensor y = emptyOn({in.shape()[0], in.shape()[1], g.outH, g.outW}, in.dtype(), device);
  if (y.numel() == 0) return y;
  const Stream stream = Stream::current(device);
  if (cudnnFitsAvgPool(in.shape(), g)) {
    PoolingDesc pool;
    DG_CUDNN_CHECK(cudnnSetPooling2dDescriptor(
        pool.get(), CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING, CUDNN_PROPAGATE_NAN, toInt(g.kernelH, op, "kernel"),
        toInt(g.kernelW, op, "kernel"), toInt(g.padH, op, "padding"), toInt(g.padW, op, "padding"),
        toInt(g.strideH, op, "stride"), toInt(g.strideW, op, "stride")));
    TensorDesc xDesc, yDesc;
    xDesc.set4d(in.dtype(), in.shape()[0], in.shape()[1], g.inH, g.inW, op);
    yDesc.set4d(in.dtype(), in.shape()[0], in.shape()[1], g.outH, g.outW, op);
    Scalars k(in.dtype(), 0.0);
    DG_CUDNN_CHECK(cudnnPoolingForward(cudnnHandle(stream), pool.get(), k.alpha(), xDesc.get(), in.rawData(), k.beta(),
                                       yDesc.get(), y.rawData()));
    return y;
  }
  dispatchFloat(in.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchAvgPool2d<T>(static_cast<const T*>(in.rawData()), static_cast<T*>(y.rawData()), g,
                                   rawStream(stream));
  });
  return y;
}

// Always our gather kernel: cudnnPoolingBackward wants the forward's x and y, which this entry point (like
// the CPU one) does not get, and the gather is deterministic.
Tensor avgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape, const kernels::Pool2dParams& params) {
  const int device = deviceOf(gradOutput);
  DeviceGuard guard(device);
  Tensor g = contiguousOnDevice(gradOutput);
  const dnn_detail::PoolGeometry geo = avgGeometry(inputShape, params);
  Tensor dx = emptyOn(inputShape, g.dtype(), device);
  dispatchFloat(g.dtype(), "avgPool2d backward", [&](auto tag) {
    using T = decltype(tag);
    dnn_detail::launchAvgPool2dBackward<T>(static_cast<const T*>(g.rawData()), static_cast<T*>(dx.rawData()), geo,
                                           rawStream(Stream::current(device)));
  });
  return dx;
}

}  // namespace distgrad::tensor::cuda::dnn

#endif  // DG_WITH_CUDA
