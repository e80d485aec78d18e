#include "tensor/cpu/batch_norm.h"

#include <oneapi/dnnl/dnnl.hpp>

#include <cmath>
#include <unordered_map>

#include "tensor/cpu/dnnl_context.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/device_check.h"
#include "tensor/cuda/dnn_ops.h"

namespace distgrad::tensor::kernels {
namespace {

using dnnl::memory;

// x [N, C, rest...] seen as N rows of C channels of `inner` contiguous elements.
struct Layout {
  int64_t batch, channels, inner;
  int64_t perChannel() const { return batch * inner; }
};

Layout layoutOf(const Shape& x) {
  DG_ASSERT(x.size() >= 2, "batch norm expects [N, C, ...]");
  int64_t inner = 1;
  for (size_t d = 2; d < x.size(); ++d) inner *= x[d];
  return {x[0], x[1], inner};
}

int channelThreads(int64_t channels) { return channels > 1 ? numThreads() : 1; }

// ---------------------------------------------------------------- loops (any float type)

// Per-row partial sums in T (vectorised), accumulated across rows in double: float32 stays accurate for
// the ~10^5 elements per channel of a ResNet batch. Two passes (mean, then squared deviations) avoid the
// cancellation of sum(x^2) - n*mean^2.
// TODO(perf): a single pass with a per-channel shift (Welford-style) would save one read of x.
template <typename T>
void statsLoops(const T* x, const Layout& l, T* mean, T* var) {
  const int threads = channelThreads(l.channels);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t c = 0; c < l.channels; ++c) {
    double sum = 0;
    for (int64_t n = 0; n < l.batch; ++n) {
      const T* row = x + (n * l.channels + c) * l.inner;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < l.inner; ++i) s += row[i];
      sum += s;
    }
    const T m = static_cast<T>(sum / static_cast<double>(l.perChannel()));
    double squares = 0;
    for (int64_t n = 0; n < l.batch; ++n) {
      const T* row = x + (n * l.channels + c) * l.inner;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < l.inner; ++i) {
        const T d = row[i] - m;
        s += d * d;
      }
      squares += s;
    }
    mean[c] = m;
    var[c] = static_cast<T>(squares / static_cast<double>(l.perChannel()));
  }
}

// y = (x - mean) / sqrt(var + eps) * weight + bias, folded into one multiply-add per element.
template <typename T>
void normalizeLoops(const T* x, const Layout& l, const T* mean, const T* var, const T* weight, const T* bias,
                    double eps, T* y) {
  const int threads = channelThreads(l.channels);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t c = 0; c < l.channels; ++c) {
    const double invStd = 1.0 / std::sqrt(static_cast<double>(var[c]) + eps);
    const double scale = (weight ? static_cast<double>(weight[c]) : 1.0) * invStd;
    const T scaleT = static_cast<T>(scale);
    const T shiftT = static_cast<T>((bias ? static_cast<double>(bias[c]) : 0.0) - static_cast<double>(mean[c]) * scale);
    for (int64_t n = 0; n < l.batch; ++n) {
      const int64_t base = (n * l.channels + c) * l.inner;
      const T* in = x + base;
      T* out = y + base;
      for (int64_t i = 0; i < l.inner; ++i) out[i] = in[i] * scaleT + shiftT;
    }
  }
}

template <typename T>
void backwardLoops(const T* g, const T* x, const Layout& l, const T* mean, const T* var, const T* weight,
                   double eps, bool training, T* gradX, T* gradWeight, T* gradBias) {
  const int threads = channelThreads(l.channels);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t c = 0; c < l.channels; ++c) {
    const T m = mean[c];
    double sumG = 0, sumGX = 0;  // sum(g), sum(g * (x - mean))
    for (int64_t n = 0; n < l.batch; ++n) {
      const int64_t base = (n * l.channels + c) * l.inner;
      const T* gr = g + base;
      const T* xr = x + base;
      T sg = 0, sgx = 0;
#pragma omp simd reduction(+ : sg, sgx)
      for (int64_t i = 0; i < l.inner; ++i) {
        sg += gr[i];
        sgx += gr[i] * (xr[i] - m);
      }
      sumG += sg;
      sumGX += sgx;
    }
    const double invStd = 1.0 / std::sqrt(static_cast<double>(var[c]) + eps);
    if (gradWeight) gradWeight[c] = static_cast<T>(sumGX * invStd);
    if (gradBias) gradBias[c] = static_cast<T>(sumG);
    if (!gradX) continue;
    const double k = (weight ? static_cast<double>(weight[c]) : 1.0) * invStd;
    // training: dx = k * (g - mean(g) - (x - mean) * mean(g * (x - mean)) / (var + eps)); the batch
    // statistics depend on x. eval: the statistics are constants, dx = k * g.
    const double count = static_cast<double>(l.perChannel());
    const T kT = static_cast<T>(k);
    const T a = training ? static_cast<T>(sumG / count) : T(0);
    const T b = training ? static_cast<T>(sumGX * invStd * invStd / count) : T(0);
    for (int64_t n = 0; n < l.batch; ++n) {
      const int64_t base = (n * l.channels + c) * l.inner;
      const T* gr = g + base;
      const T* xr = x + base;
      T* out = gradX + base;
      for (int64_t i = 0; i < l.inner; ++i) out[i] = kT * (gr[i] - a - (xr[i] - m) * b);
    }
  }
}

template <typename T>
T* ptrOrNull(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

// ---------------------------------------------------------------- oneDNN (float32)

memory::desc dataDesc(const Layout& l) {
  return memory::desc({l.batch, l.channels, l.inner, 1}, memory::data_type::f32, memory::format_tag::nchw);
}
memory::desc channelDesc(const Layout& l) {
  return memory::desc({l.channels}, memory::data_type::f32, memory::format_tag::a);
}

dnnl::normalization_flags flagsFor(bool scale, bool shift, bool globalStats) {
  auto flags = dnnl::normalization_flags::none;
  if (scale) flags |= dnnl::normalization_flags::use_scale;
  if (shift) flags |= dnnl::normalization_flags::use_shift;
  if (globalStats) flags |= dnnl::normalization_flags::use_global_stats;
  return flags;
}

memory wrap(const memory::desc& md, const Tensor& t) { return memory(md, dnnlEngine(), t.rawData()); }

// kAuto means loops: on plain NCHW memory oneDNN 2.6 only offers its generic ncsp_bnorm, which measured 3-6x
// slower than these loops on ResNet-18 shapes at batch 32 (see batch_norm.h).
bool useOneDnn(CpuImpl impl, DType dtype) { return dtype == DType::kFloat32 && impl == CpuImpl::kOneDnn; }

bool isEmpty(const Shape& s) {
  for (int64_t d : s) {
    if (d == 0) return true;
  }
  return false;
}

}  // namespace

BatchNormTrainResult batchNormTrain(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                    CpuImpl impl) {
  if (cuda::onCuda("batchNorm", {{"x", &x}, {"weight", &weight}, {"bias", &bias}}))
    return cuda::dnn::batchNormTrain(x, weight, bias, eps);
  const DType dtype = x.dtype();
  Tensor in = contiguousAs(x, dtype);
  Tensor w = contiguousAs(weight, dtype);
  Tensor b = contiguousAs(bias, dtype);
  const Layout l = layoutOf(in.shape());
  BatchNormTrainResult r{Tensor::empty(in.shape(), dtype), Tensor::empty({l.channels}, dtype),
                         Tensor::empty({l.channels}, dtype)};
  DG_ASSERT(l.perChannel() > 0, "batch norm statistics over zero elements");
  if (useOneDnn(impl, dtype)) {
    const memory::desc data = dataDesc(l);
    const memory::desc chan = channelDesc(l);
    dnnl::batch_normalization_forward::desc desc(dnnl::prop_kind::forward_training, data, static_cast<float>(eps),
                                                 flagsFor(w.defined(), b.defined(), false));
    dnnl::batch_normalization_forward::primitive_desc pd(desc, dnnlEngine());
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, wrap(data, in)},
                                         {DNNL_ARG_DST, wrap(data, r.output)},
                                         {DNNL_ARG_MEAN, wrap(pd.mean_desc(), r.mean)},
                                         {DNNL_ARG_VARIANCE, wrap(pd.variance_desc(), r.var)}};
    if (w.defined()) args.emplace(DNNL_ARG_SCALE, wrap(chan, w));
    if (b.defined()) args.emplace(DNNL_ARG_SHIFT, wrap(chan, b));
    dnnl::stream& stream = dnnlStream();
    dnnl::batch_normalization_forward(pd).execute(stream, args);
    stream.wait();
    return r;
  }
  dispatchFloat(dtype, "batchNorm", [&](auto zero) {
    using T = decltype(zero);
    statsLoops<T>(in.data<T>(), l, r.mean.data<T>(), r.var.data<T>());
    normalizeLoops<T>(in.data<T>(), l, r.mean.data<T>(), r.var.data<T>(), ptrOrNull<T>(w), ptrOrNull<T>(b), eps,
                      r.output.data<T>());
  });
  return r;
}

Tensor batchNormEval(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& mean,
                     const Tensor& var, double eps, CpuImpl impl) {
  if (cuda::onCuda("batchNorm",
                   {{"x", &x}, {"weight", &weight}, {"bias", &bias}, {"running mean", &mean}, {"running var", &var}}))
    return cuda::dnn::batchNormEval(x, weight, bias, mean, var, eps);
  const DType dtype = x.dtype();
  Tensor in = contiguousAs(x, dtype);
  Tensor w = contiguousAs(weight, dtype);
  Tensor b = contiguousAs(bias, dtype);
  Tensor m = contiguousAs(mean, dtype);
  Tensor v = contiguousAs(var, dtype);
  const Layout l = layoutOf(in.shape());
  Tensor out = Tensor::empty(in.shape(), dtype);
  if (isEmpty(in.shape())) return out;
  if (useOneDnn(impl, dtype)) {
    const memory::desc data = dataDesc(l);
    const memory::desc chan = channelDesc(l);
    dnnl::batch_normalization_forward::desc desc(dnnl::prop_kind::forward_inference, data, static_cast<float>(eps),
                                                 flagsFor(w.defined(), b.defined(), true));
    dnnl::batch_normalization_forward::primitive_desc pd(desc, dnnlEngine());
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, wrap(data, in)},
                                         {DNNL_ARG_DST, wrap(data, out)},
                                         {DNNL_ARG_MEAN, wrap(pd.mean_desc(), m)},
                                         {DNNL_ARG_VARIANCE, wrap(pd.variance_desc(), v)}};
    if (w.defined()) args.emplace(DNNL_ARG_SCALE, wrap(chan, w));
    if (b.defined()) args.emplace(DNNL_ARG_SHIFT, wrap(chan, b));
    dnnl::stream& stream = dnnlStream();
    dnnl::batch_normalization_forward(pd).execute(stream, args);
    stream.wait();
    return out;
  }
  dispatchFloat(dtype, "batchNorm", [&](auto zero) {
    using T = decltype(zero);
    normalizeLoops<T>(in.data<T>(), l, m.data<T>(), v.data<T>(), ptrOrNull<T>(w), ptrOrNull<T>(b), eps,
                      out.data<T>());
  });
  return out;
}

BatchNormGrads batchNormBackward(const Tensor& gradOutput, const Tensor& x, const Tensor& weight,
                                 const Tensor& mean, const Tensor& var, double eps, bool training,
                                 std::array<bool, 3> need, CpuImpl impl) {
  if (cuda::onCuda("batchNorm backward",
                   {{"gradOutput", &gradOutput}, {"x", &x}, {"weight", &weight}, {"mean", &mean}, {"var", &var}}))
    return cuda::dnn::batchNormBackward(gradOutput, x, weight, mean, var, eps, training, need);
  const DType dtype = x.dtype();
  Tensor g = contiguousAs(gradOutput, dtype);
  Tensor in = contiguousAs(x, dtype);
  Tensor w = contiguousAs(weight, dtype);
  Tensor m = contiguousAs(mean, dtype);
  Tensor v = contiguousAs(var, dtype);
  const Layout l = layoutOf(in.shape());
  DG_ASSERT(!(need[1] && !w.defined()), "batchNormBackward: weight gradient requested for an undefined weight");
  BatchNormGrads r;
  if (need[0]) r.x = Tensor::empty(in.shape(), dtype);
  if (need[1]) r.weight = Tensor::empty({l.channels}, dtype);
  if (need[2]) r.bias = Tensor::empty({l.channels}, dtype);
  if (isEmpty(in.shape())) {
    for (Tensor* t : {&r.x, &r.weight, &r.bias}) {
      if (t->defined()) t->fill(0);
    }
    return r;
  }
  // oneDNN's backward covers training mode; eval mode's backward is one multiply per element (dx) plus two
  // channel sums, which the loops do in a single pass.
  if (training && useOneDnn(impl, dtype)) {
    const memory::desc data = dataDesc(l);
    const memory::desc chan = channelDesc(l);
    const bool scale = w.defined();
    // use_shift only matters when its gradient is wanted (the shift does not enter dx).
    const bool shift = need[2];
    // oneDNN (2.6, plain layout) has no backward_data with a scale: whenever a flag is set it runs the full
    // backward, and unwanted parameter gradients land in scratch buffers.
    const bool paramGrads = scale || shift;
    const auto flags = flagsFor(scale, shift, false);
    dnnl::batch_normalization_forward::desc fwdDesc(dnnl::prop_kind::forward_training, data,
                                                    static_cast<float>(eps), flags);
    dnnl::batch_normalization_forward::primitive_desc fwdPd(fwdDesc, dnnlEngine());
    dnnl::batch_normalization_backward::desc desc(
        paramGrads ? dnnl::prop_kind::backward : dnnl::prop_kind::backward_data, data, data,
        static_cast<float>(eps), flags);
    dnnl::batch_normalization_backward::primitive_desc pd(desc, dnnlEngine(), fwdPd);
    Tensor gx = r.x.defined() ? r.x : Tensor::empty(in.shape(), dtype);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, wrap(data, in)},
                                         {DNNL_ARG_DIFF_DST, wrap(data, g)},
                                         {DNNL_ARG_MEAN, wrap(pd.mean_desc(), m)},
                                         {DNNL_ARG_VARIANCE, wrap(pd.variance_desc(), v)},
                                         {DNNL_ARG_DIFF_SRC, wrap(data, gx)}};
    if (scale) args.emplace(DNNL_ARG_SCALE, wrap(chan, w));
    Tensor gw, gb;
    if (paramGrads && scale) {
      gw = r.weight.defined() ? r.weight : Tensor::empty({l.channels}, dtype);
      args.emplace(DNNL_ARG_DIFF_SCALE, wrap(chan, gw));
    }
    Tensor shiftInput;
    if (shift) {
      // oneDNN's backward asks for the shift although dx does not depend on it: any [C] buffer will do.
      shiftInput = Tensor::zeros({l.channels}, dtype);
      args.emplace(DNNL_ARG_SHIFT, wrap(chan, shiftInput));
    }
    if (paramGrads && shift) {
      gb = r.bias;
      args.emplace(DNNL_ARG_DIFF_SHIFT, wrap(chan, gb));
    }
    dnnl::stream& stream = dnnlStream();
    dnnl::batch_normalization_backward(pd).execute(stream, args);
    stream.wait();
    return r;
  }
  dispatchFloat(dtype, "batchNorm backward", [&](auto zero) {
    using T = decltype(zero);
    backwardLoops<T>(g.data<T>(), in.data<T>(), l, m.data<T>(), v.data<T>(), ptrOrNull<T>(w), eps, training,
                     ptrOrNull<T>(r.x), ptrOrNull<T>(r.weight), ptrOrNull<T>(r.bias));
  });
  return r;
}

void updateRunningStats(const Tensor& runningMean, const Tensor& runningVar, const Tensor& batchMean,
                        const Tensor& batchVar, int64_t count, double momentum) {
  if (cuda::onCuda("batchNorm running statistics",
                   {{"running mean", &runningMean},
                    {"running var", &runningVar},
                    {"batch mean", &batchMean},
                    {"batch var", &batchVar}}))
    return cuda::dnn::updateRunningStats(runningMean, runningVar, batchMean, batchVar, count, momentum);
  const double bessel = count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
  auto blend = [&](const Tensor& running, const Tensor& batch, double factor) {
    if (!running.defined()) return;
    std::vector<double> r = running.toVector<double>();
    std::vector<double> b = batch.toVector<double>();
    DG_ASSERT(r.size() == b.size(), "running statistics size mismatch");
    for (size_t i = 0; i < r.size(); ++i) r[i] = (1.0 - momentum) * r[i] + momentum * b[i] * factor;
    // copyFrom converts to the running tensor's dtype and handles strided buffers.
    running.detach().copyFrom(Tensor::fromVector(r, running.shape()));
  };
  blend(runningMean, batchMean, 1.0);
  blend(runningVar, batchVar, bessel);
}

}  // namespace distgrad::tensor::kernels
