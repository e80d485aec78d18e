#include "tensor/cpu/pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "tensor/cpu/dnnl_context.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/device_check.h"
#include "tensor/cuda/dnn_ops.h"

namespace distgrad::tensor::kernels {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;

// The NCHW geometry both implementations work from.
struct Geometry {
  int64_t planes, inH, inW, outH, outW;
  Pool2dParams p;
  // Right/bottom padding oneDNN needs so that its floor formula reproduces our output size; larger than
  // the left padding only in ceil mode.
  int64_t padBottom() const { return std::max<int64_t>(0, (outH - 1) * p.strideH + p.kernelH - inH - p.padH); }
  int64_t padRight() const { return std::max<int64_t>(0, (outW - 1) * p.strideW + p.kernelW - inW - p.padW); }
};

Geometry geometryOf(const Shape& x, const Pool2dParams& p) {
  DG_ASSERT(x.size() == 4, "pooling expects NCHW");
  return Geometry{x[0] * x[1], x[2], x[3], pooledLength(x[2], p.kernelH, p.strideH, p.padH, p.ceilMode),
                  pooledLength(x[3], p.kernelW, p.strideW, p.padW, p.ceilMode), p};
}

// Our loops parallelise over N*C planes when the process allows more than one thread.
int loopThreads(int64_t planes) {
  int t = numThreads();
  return planes > 1 ? t : 1;
}

// ---------------------------------------------------------------- loops (any float type)

template <typename T>
void maxPoolLoops(const T* in, T* out, int64_t* argmax, const Geometry& g) {
  const int threads = loopThreads(g.planes);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    const T* src = in + plane * g.inH * g.inW;
    T* dst = out + plane * g.outH * g.outW;
    int64_t* arg = argmax ? argmax + plane * g.outH * g.outW : nullptr;
    for (int64_t oh = 0; oh < g.outH; ++oh) {
      const int64_t h0 = std::max<int64_t>(oh * g.p.strideH - g.p.padH, 0);
      const int64_t h1 = std::min(oh * g.p.strideH - g.p.padH + g.p.kernelH, g.inH);
      for (int64_t ow = 0; ow < g.outW; ++ow) {
        const int64_t w0 = std::max<int64_t>(ow * g.p.strideW - g.p.padW, 0);
        const int64_t w1 = std::min(ow * g.p.strideW - g.p.padW + g.p.kernelW, g.inW);
        T best = -std::numeric_limits<T>::infinity();
        int64_t bestAt = h0 * g.inW + w0;
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t w = w0; w < w1; ++w) {
            const T v = src[h * g.inW + w];
            // NaN wins and sticks (nothing compares greater than it), as in PyTorch.
            if (v > best || std::isnan(v)) {
              best = v;
              bestAt = h * g.inW + w;
            }
          }
        }
        dst[oh * g.outW + ow] = best;
        if (arg) arg[oh * g.outW + ow] = bestAt;
      }
    }
  }
}

template <typename T>
void maxPoolBackwardLoops(const T* gradOut, const int64_t* argmax, T* gradIn, const Geometry& g) {
  const int threads = loopThreads(g.planes);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    const T* go = gradOut + plane * g.outH * g.outW;
    const int64_t* arg = argmax + plane * g.outH * g.outW;
    T* gi = gradIn + plane * g.inH * g.inW;
    std::fill(gi, gi + g.inH * g.inW, T(0));
    for (int64_t i = 0; i < g.outH * g.outW; ++i) gi[arg[i]] += go[i];
  }
}

// One average-pooling window: the clipped input range and PyTorch's count_include_pad divisor (padding
// counts, the ceil-mode overhang beyond the padding does not).
struct AvgWindow {
  int64_t h0, h1, w0, w1;
  int64_t divisor;
};

inline AvgWindow avgWindow(const Geometry& g, int64_t oh, int64_t ow) {
  int64_t h0 = oh * g.p.strideH - g.p.padH;
  int64_t w0 = ow * g.p.strideW - g.p.padW;
  int64_t h1 = std::min(h0 + g.p.kernelH, g.inH + g.p.padH);
  int64_t w1 = std::min(w0 + g.p.kernelW, g.inW + g.p.padW);
  const int64_t divisor = (h1 - h0) * (w1 - w0);
  return {std::max<int64_t>(h0, 0), std::min(h1, g.inH), std::max<int64_t>(w0, 0), std::min(w1, g.inW), divisor};
}

template <typename T>
void avgPoolLoops(const T* in, T* out, const Geometry& g) {
  const int threads = loopThreads(g.planes);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    const T* src = in + plane * g.inH * g.inW;
    T* dst = out + plane * g.outH * g.outW;
    for (int64_t oh = 0; oh < g.outH; ++oh) {
      for (int64_t ow = 0; ow < g.outW; ++ow) {
        const AvgWindow win = avgWindow(g, oh, ow);
        T sum = 0;
        for (int64_t h = win.h0; h < win.h1; ++h) {
          for (int64_t w = win.w0; w < win.w1; ++w) sum += src[h * g.inW + w];
        }
        dst[oh * g.outW + ow] = sum / static_cast<T>(win.divisor);
      }
    }
  }
}

template <typename T>
void avgPoolBackwardLoops(const T* gradOut, T* gradIn, const Geometry& g) {
  const int threads = loopThreads(g.planes);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t plane = 0; plane < g.planes; ++plane) {
    const T* go = gradOut + plane * g.outH * g.outW;
    T* gi = gradIn + plane * g.inH * g.inW;
    std::fill(gi, gi + g.inH * g.inW, T(0));
    for (int64_t oh = 0; oh < g.outH; ++oh) {
      for (int64_t ow = 0; ow < g.outW; ++ow) {
        const AvgWindow win = avgWindow(g, oh, ow);
        const T share = go[oh * g.outW + ow] / static_cast<T>(win.divisor);
        for (int64_t h = win.h0; h < win.h1; ++h) {
          for (int64_t w = win.w0; w < win.w1; ++w) gi[h * g.inW + w] += share;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- oneDNN (float32)

struct DnnlPool {
  memory::desc src, dst;
  memory::dims strides, kernel, padL, padR;
};

DnnlPool dnnlPoolOf(const Shape& x, const Geometry& g) {
  const memory::dims srcDims{x[0], x[1], g.inH, g.inW};
  const memory::dims dstDims{x[0], x[1], g.outH, g.outW};
  return DnnlPool{memory::desc(srcDims, memory::data_type::f32, Tag::nchw),
                  memory::desc(dstDims, memory::data_type::f32, Tag::nchw),
                  {g.p.strideH, g.p.strideW},
                  {g.p.kernelH, g.p.kernelW},
                  {g.p.padH, g.p.padW},
                  {g.padBottom(), g.padRight()}};
}

dnnl::pooling_forward::primitive_desc forwardPdOf(const DnnlPool& d, dnnl::algorithm alg, bool training) {
  dnnl::pooling_forward::desc desc(training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference,
                                   alg, d.src, d.dst, d.strides, d.kernel, d.padL, d.padR);
  return dnnl::pooling_forward::primitive_desc(desc, dnnlEngine());
}

// oneDNN divides by the full kernel area; PyTorch stops counting at the padding. They agree unless a
// ceil-mode window overhangs the padding.
bool oneDnnMatchesAvgDivisor(const Geometry& g) { return g.padBottom() <= g.p.padH && g.padRight() <= g.p.padW; }

// kAuto means oneDNN for float32 (measured faster, see pool.h); should oneDNN reject a geometry under kAuto,
// the loops take over, since they handle every valid case.
bool useOneDnn(CpuImpl impl, DType dtype) {
  if (dtype != DType::kFloat32) return false;
  return impl != CpuImpl::kLoops;
}

Tensor emptyOutput(const Shape& x, const Geometry& g, DType dtype) {
  return Tensor::empty({x[0], x[1], g.outH, g.outW}, dtype);
}

bool isEmpty(const Shape& s) {
  for (int64_t d : s) {
    if (d == 0) return true;
  }
  return false;
}

}  // namespace

int64_t pooledLength(int64_t in, int64_t kernel, int64_t stride, int64_t pad, bool ceilMode) {
  const int64_t span = in + 2 * pad - kernel;
  int64_t out = (ceilMode ? (span + stride - 1) / stride : span / stride) + 1;
  if (ceilMode && (out - 1) * stride >= in + pad) --out;
  return out;
}

// ---------------------------------------------------------------- max pooling

MaxPool2dResult maxPool2d(const Tensor& x, const Pool2dParams& params, bool forBackward, CpuImpl impl) {
  if (cuda::onCuda("maxPool2d", {{"x", &x}})) return cuda::dnn::maxPool2d(x, params, forBackward);
  const DType dtype = x.dtype();
  Tensor in = contiguousAs(x, dtype);
  const Geometry g = geometryOf(in.shape(), params);
  Tensor out = emptyOutput(in.shape(), g, dtype);
  auto saved = forBackward ? std::make_shared<MaxPool2dSaved>() : nullptr;
  if (saved) {
    saved->inputShape = in.shape();
    saved->params = params;
    saved->dtype = dtype;
  }
  if (isEmpty(in.shape()) || out.numel() == 0) {
    if (saved) saved->argmax = Tensor::zeros(out.shape(), DType::kInt64);
    return {out, saved};
  }
  if (useOneDnn(impl, dtype)) {
    try {
      const DnnlPool d = dnnlPoolOf(in.shape(), g);
      auto pd = forwardPdOf(d, dnnl::algorithm::pooling_max, forBackward);
      memory src(d.src, dnnlEngine(), in.rawData());
      memory dst(d.dst, dnnlEngine(), out.rawData());
      std::unordered_map<int, memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}};
      memory workspace;
      if (saved) {
        workspace = memory(pd.workspace_desc(), dnnlEngine());
        args.emplace(DNNL_ARG_WORKSPACE, workspace);
      }
      dnnl::stream& stream = dnnlStream();
      dnnl::pooling_forward(pd).execute(stream, args);
      stream.wait();
      if (saved) {
        saved->forwardPd = pd;
        saved->workspace = workspace;
      }
      return {out, saved};
    } catch (const dnnl::error&) {
      if (impl == CpuImpl::kOneDnn) throw;  // asked for oneDNN explicitly (tests): don't hide the failure
    }
  }
  Tensor argmax = saved ? Tensor::empty(out.shape(), DType::kInt64) : Tensor();
  dispatchFloat(dtype, "maxPool2d", [&](auto zero) {
    using T = decltype(zero);
    maxPoolLoops<T>(in.data<T>(), out.data<T>(), saved ? argmax.data<int64_t>() : nullptr, g);
  });
  if (saved) saved->argmax = argmax;
  return {out, saved};
}

Tensor maxPool2dBackward(const Tensor& gradOutput, const MaxPool2dSaved& saved) {
  if (cuda::onCuda("maxPool2d backward", {{"gradOutput", &gradOutput}, {"argmax", &saved.argmax}}))
    return cuda::dnn::maxPool2dBackward(gradOutput, saved);
  const Geometry g = geometryOf(saved.inputShape, saved.params);
  Tensor go = contiguousAs(gradOutput, saved.dtype);
  DG_ASSERT(go.shape() == (Shape{saved.inputShape[0], saved.inputShape[1], g.outH, g.outW}),
            "maxPool2dBackward: gradient shape ", shapeStr(go.shape()));
  if (isEmpty(saved.inputShape) || go.numel() == 0) return Tensor::zeros(saved.inputShape, saved.dtype);
  Tensor gradIn = Tensor::empty(saved.inputShape, saved.dtype);
  if (saved.usesOneDnn()) {
    const DnnlPool d = dnnlPoolOf(saved.inputShape, g);
    dnnl::pooling_backward::desc desc(dnnl::algorithm::pooling_max, d.src, d.dst, d.strides, d.kernel, d.padL,
                                      d.padR);
    dnnl::pooling_backward::primitive_desc pd(desc, dnnlEngine(), saved.forwardPd);
    memory diffDst(d.dst, dnnlEngine(), go.rawData());
    memory diffSrc(d.src, dnnlEngine(), gradIn.rawData());
    dnnl::stream& stream = dnnlStream();
    dnnl::pooling_backward(pd).execute(
        stream, {{DNNL_ARG_DIFF_DST, diffDst}, {DNNL_ARG_DIFF_SRC, diffSrc}, {DNNL_ARG_WORKSPACE, saved.workspace}});
    stream.wait();
    return gradIn;
  }
  dispatchFloat(saved.dtype, "maxPool2dBackward", [&](auto zero) {
    using T = decltype(zero);
    maxPoolBackwardLoops<T>(go.data<T>(), saved.argmax.data<int64_t>(), gradIn.data<T>(), g);
  });
  return gradIn;
}

// ---------------------------------------------------------------- average pooling

Tensor avgPool2d(const Tensor& x, const Pool2dParams& params, CpuImpl impl) {
  if (cuda::onCuda("avgPool2d", {{"x", &x}})) return cuda::dnn::avgPool2d(x, params);
  const DType dtype = x.dtype();
  Tensor in = contiguousAs(x, dtype);
  const Geometry g = geometryOf(in.shape(), params);
  Tensor out = emptyOutput(in.shape(), g, dtype);
  if (isEmpty(in.shape()) || out.numel() == 0) return out;
  if (useOneDnn(impl, dtype) && oneDnnMatchesAvgDivisor(g)) {
    try {
      const DnnlPool d = dnnlPoolOf(in.shape(), g);
      auto pd = forwardPdOf(d, dnnl::algorithm::pooling_avg_include_padding, false);
      memory src(d.src, dnnlEngine(), in.rawData());
      memory dst(d.dst, dnnlEngine(), out.rawData());
      dnnl::stream& stream = dnnlStream();
      dnnl::pooling_forward(pd).execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}});
      stream.wait();
      return out;
    } catch (const dnnl::error&) {
      if (impl == CpuImpl::kOneDnn) throw;
    }
  }
  dispatchFloat(dtype, "avgPool2d", [&](auto zero) {
    using T = decltype(zero);
    avgPoolLoops<T>(in.data<T>(), out.data<T>(), g);
  });
  return out;
}

Tensor avgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape, const Pool2dParams& params,
                         CpuImpl impl) {
  if (cuda::onCuda("avgPool2d backward", {{"gradOutput", &gradOutput}}))
    return cuda::dnn::avgPool2dBackward(gradOutput, inputShape, params);
  const DType dtype = gradOutput.dtype();
  Tensor go = contiguousAs(gradOutput, dtype);
  const Geometry g = geometryOf(inputShape, params);
  if (isEmpty(inputShape) || go.numel() == 0) return Tensor::zeros(inputShape, dtype);
  Tensor gradIn = Tensor::empty(inputShape, dtype);
  if (useOneDnn(impl, dtype) && oneDnnMatchesAvgDivisor(g)) {
    try {
      const DnnlPool d = dnnlPoolOf(inputShape, g);
      auto fwd = forwardPdOf(d, dnnl::algorithm::pooling_avg_include_padding, true);
      dnnl::pooling_backward::desc desc(dnnl::algorithm::pooling_avg_include_padding, d.src, d.dst, d.strides,
                                        d.kernel, d.padL, d.padR);
      dnnl::pooling_backward::primitive_desc pd(desc, dnnlEngine(), fwd);
      memory diffDst(d.dst, dnnlEngine(), go.rawData());
      memory diffSrc(d.src, dnnlEngine(), gradIn.rawData());
      dnnl::stream& stream = dnnlStream();
      dnnl::pooling_backward(pd).execute(stream, {{DNNL_ARG_DIFF_DST, diffDst}, {DNNL_ARG_DIFF_SRC, diffSrc}});
      stream.wait();
      return gradIn;
    } catch (const dnnl::error&) {
      if (impl == CpuImpl::kOneDnn) throw;
    }
  }
  dispatchFloat(dtype, "avgPool2dBackward", [&](auto zero) {
    using T = decltype(zero);
    avgPoolBackwardLoops<T>(go.data<T>(), gradIn.data<T>(), g);
  });
  return gradIn;
}

// ---------------------------------------------------------------- adaptive average pooling

namespace {
inline int64_t adaptiveStart(int64_t i, int64_t in, int64_t out) { return (i * in) / out; }
inline int64_t adaptiveEnd(int64_t i, int64_t in, int64_t out) { return ((i + 1) * in + out - 1) / out; }

template <typename T>
void adaptiveAvgLoops(const T* in, T* out, int64_t planes, int64_t inH, int64_t inW, int64_t outH, int64_t outW) {
  const int threads = loopThreads(planes);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t plane = 0; plane < planes; ++plane) {
    const T* src = in + plane * inH * inW;
    T* dst = out + plane * outH * outW;
    for (int64_t oh = 0; oh < outH; ++oh) {
      const int64_t h0 = adaptiveStart(oh, inH, outH), h1 = adaptiveEnd(oh, inH, outH);
      for (int64_t ow = 0; ow < outW; ++ow) {
        const int64_t w0 = adaptiveStart(ow, inW, outW), w1 = adaptiveEnd(ow, inW, outW);
        T sum = 0;
        for (int64_t h = h0; h < h1; ++h) {
          const T* row = src + h * inW;
          for (int64_t w = w0; w < w1; ++w) sum += row[w];
        }
        dst[oh * outW + ow] = sum / static_cast<T>((h1 - h0) * (w1 - w0));
      }
    }
  }
}

template <typename T>
void adaptiveAvgBackwardLoops(const T* gradOut, T* gradIn, int64_t planes, int64_t inH, int64_t inW, int64_t outH,
                              int64_t outW) {
  const int threads = loopThreads(planes);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t plane = 0; plane < planes; ++plane) {
    const T* go = gradOut + plane * outH * outW;
    T* gi = gradIn + plane * inH * inW;
    std::fill(gi, gi + inH * inW, T(0));
    for (int64_t oh = 0; oh < outH; ++oh) {
      const int64_t h0 = adaptiveStart(oh, inH, outH), h1 = adaptiveEnd(oh, inH, outH);
      for (int64_t ow = 0; ow < outW; ++ow) {
        const int64_t w0 = adaptiveStart(ow, inW, outW), w1 = adaptiveEnd(ow, inW, outW);
        const T share = go[oh * outW + ow] / static_cast<T>((h1 - h0) * (w1 - w0));
        for (int64_t h = h0; h < h1; ++h) {
          T* row = gi + h * inW;
          for (int64_t w = w0; w < w1; ++w) row[w] += share;
        }
      }
    }
  }
}
}  // namespace

Tensor adaptiveAvgPool2d(const Tensor& x, int64_t outH, int64_t outW) {
  if (cuda::onCuda("adaptiveAvgPool2d", {{"x", &x}})) return cuda::dnn::adaptiveAvgPool2d(x, outH, outW);
  const DType dtype = x.dtype();
  Tensor in = contiguousAs(x, dtype);
  const Shape& s = in.shape();
  Tensor out = Tensor::empty({s[0], s[1], outH, outW}, dtype);
  if (isEmpty(s) || out.numel() == 0) return out;
  dispatchFloat(dtype, "adaptiveAvgPool2d", [&](auto zero) {
    using T = decltype(zero);
    adaptiveAvgLoops<T>(in.data<T>(), out.data<T>(), s[0] * s[1], s[2], s[3], outH, outW);
  });
  return out;
}

Tensor adaptiveAvgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape) {
  if (cuda::onCuda("adaptiveAvgPool2d backward", {{"gradOutput", &gradOutput}}))
    return cuda::dnn::adaptiveAvgPool2dBackward(gradOutput, inputShape);
  const DType dtype = gradOutput.dtype();
  Tensor go = contiguousAs(gradOutput, dtype);
  if (isEmpty(inputShape) || go.numel() == 0) return Tensor::zeros(inputShape, dtype);
  Tensor gradIn = Tensor::empty(inputShape, dtype);
  dispatchFloat(dtype, "adaptiveAvgPool2dBackward", [&](auto zero) {
    using T = decltype(zero);
    adaptiveAvgBackwardLoops<T>(go.data<T>(), gradIn.data<T>(), inputShape[0] * inputShape[1], inputShape[2],
                                inputShape[3], go.shape()[2], go.shape()[3]);
  });
  return gradIn;
}

}  // namespace distgrad::tensor::kernels
