#include "tensor/cpu/nn_kernels.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/device_check.h"
#include "tensor/cuda/dnn_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace distgrad::tensor::kernels {
namespace {

// x seen as [outer, size, inner] around the softmax dim.
struct Around {
  int64_t outer = 1, size = 1, inner = 1;
};

Around aroundDim(const Shape& shape, int64_t dim) {
  Around a;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (d < dim) a.outer *= shape[d];
    else if (d == dim) a.size = shape[d];
    else a.inner *= shape[d];
  }
  return a;
}

// ---------------------------------------------------------------- softmax family

// Rows along the dim are contiguous (inner == 1): the common [batch, classes] case.
template <typename T, bool kLog>
void softmaxRows(const T* x, T* y, int64_t rows, int64_t size) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * size;
    T* out = y + r * size;
    T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < size; ++i) m = std::max(m, in[i]);
    // An all -inf row has no finite maximum; subtracting 0 keeps it NaN-free up to the 0/0 PyTorch has too.
    if (std::isinf(m)) m = m > 0 ? m : T(0);
    T sum = 0;
    for (int64_t i = 0; i < size; ++i) {
      const T e = std::exp(in[i] - m);
      if constexpr (!kLog) out[i] = e;
      sum += e;
    }
    if constexpr (kLog) {
      // (x - max) is exact; adding log(sum) to max first would round away small differences of large logits.
      const T logSum = std::log(sum);
      for (int64_t i = 0; i < size; ++i) out[i] = (in[i] - m) - logSum;
    } else {
      const T inv = T(1) / sum;
      for (int64_t i = 0; i < size; ++i) out[i] *= inv;
    }
  }
}

// Softmax over a strided dim (inner > 1): each step along the dim is a contiguous vector of `inner`
// independent columns, so the loops vectorise across columns.
template <typename T, bool kLog>
void softmaxColumns(const T* x, T* y, const Around& a) {
  std::vector<T> maxv(static_cast<size_t>(a.inner)), sum(static_cast<size_t>(a.inner));
  for (int64_t o = 0; o < a.outer; ++o) {
    const T* in = x + o * a.size * a.inner;
    T* out = y + o * a.size * a.inner;
    std::fill(maxv.begin(), maxv.end(), -std::numeric_limits<T>::infinity());
    std::fill(sum.begin(), sum.end(), T(0));
    for (int64_t k = 0; k < a.size; ++k) {
      const T* row = in + k * a.inner;
      for (int64_t i = 0; i < a.inner; ++i) maxv[i] = std::max(maxv[i], row[i]);
    }
    for (int64_t i = 0; i < a.inner; ++i) {
      if (std::isinf(maxv[i]) && maxv[i] < 0) maxv[i] = 0;
    }
    for (int64_t k = 0; k < a.size; ++k) {
      const T* row = in + k * a.inner;
      T* dst = out + k * a.inner;
      for (int64_t i = 0; i < a.inner; ++i) {
        const T e = std::exp(row[i] - maxv[i]);
        if constexpr (!kLog) dst[i] = e;
        sum[i] += e;
      }
    }
    if constexpr (kLog) {
      for (int64_t i = 0; i < a.inner; ++i) sum[i] = std::log(sum[i]);
      for (int64_t k = 0; k < a.size; ++k) {
        const T* row = in + k * a.inner;
        T* dst = out + k * a.inner;
        for (int64_t i = 0; i < a.inner; ++i) dst[i] = (row[i] - maxv[i]) - sum[i];
      }
    } else {
      for (int64_t i = 0; i < a.inner; ++i) sum[i] = T(1) / sum[i];
      for (int64_t k = 0; k < a.size; ++k) {
        T* dst = out + k * a.inner;
        for (int64_t i = 0; i < a.inner; ++i) dst[i] *= sum[i];
      }
    }
  }
}

template <bool kLog>
Tensor softmaxImpl(const Tensor& x, int64_t dim) {
  const DType dtype = x.dtype();
  Tensor in = contiguousAs(x, dtype);
  Tensor out = Tensor::empty(in.shape(), dtype);
  if (in.numel() == 0) return out;
  const Around a = aroundDim(in.shape(), dim);
  dispatchFloat(dtype, kLog ? "logSoftmax" : "softmax", [&](auto zero) {
    using T = decltype(zero);
    if (a.inner == 1) softmaxRows<T, kLog>(in.data<T>(), out.data<T>(), a.outer, a.size);
    else softmaxColumns<T, kLog>(in.data<T>(), out.data<T>(), a);
  });
  return out;
}

// softmax: dx = y * (g - sum(g*y));  logSoftmax: dx = g - exp(y) * sum(g).
template <bool kLog>
Tensor softmaxBackwardImpl(const Tensor& gradOutput, const Tensor& output, int64_t dim) {
  const DType dtype = output.dtype();
  Tensor g = contiguousAs(gradOutput, dtype);
  Tensor y = contiguousAs(output, dtype);
  Tensor dx = Tensor::empty(y.shape(), dtype);
  if (y.numel() == 0) return dx;
  const Around a = aroundDim(y.shape(), dim);
  dispatchFloat(dtype, kLog ? "logSoftmax backward" : "softmax backward", [&](auto zero) {
    using T = decltype(zero);
    const T* gp = g.data<T>();
    const T* yp = y.data<T>();
    T* dp = dx.data<T>();
    std::vector<T> acc(static_cast<size_t>(a.inner));
    for (int64_t o = 0; o < a.outer; ++o) {
      const int64_t base = o * a.size * a.inner;
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t k = 0; k < a.size; ++k) {
        const T* gr = gp + base + k * a.inner;
        const T* yr = yp + base + k * a.inner;
        for (int64_t i = 0; i < a.inner; ++i) acc[i] += kLog ? gr[i] : gr[i] * yr[i];
      }
      for (int64_t k = 0; k < a.size; ++k) {
        const T* gr = gp + base + k * a.inner;
        const T* yr = yp + base + k * a.inner;
        T* dr = dp + base + k * a.inner;
        for (int64_t i = 0; i < a.inner; ++i) {
          dr[i] = kLog ? gr[i] - std::exp(yr[i]) * acc[i] : yr[i] * (gr[i] - acc[i]);
        }
      }
    }
  });
  return dx;
}

// ---------------------------------------------------------------- losses

void checkTargets(const int64_t* t, int64_t n, int64_t classes, const char* op) {
  for (int64_t i = 0; i < n; ++i) {
    DG_CHECK(t[i] >= 0 && t[i] < classes, op, ": target ", t[i], " at position ", i, " is out of range for ",
             classes, " classes (expected 0..", classes - 1, ")");
  }
}

Tensor reduceLosses(const Tensor& perSample, LossReduction reduction) {
  if (reduction == LossReduction::kNone) return perSample;
  return dispatchFloat(perSample.dtype(), "loss reduction", [&](auto zero) {
    using T = decltype(zero);
    const T* p = perSample.data<T>();
    double s = 0;
    for (int64_t i = 0, n = perSample.numel(); i < n; ++i) s += p[i];
    if (reduction == LossReduction::kMean) s /= static_cast<double>(perSample.numel());
    return Tensor::scalar(s, perSample.dtype());
  });
}

// The per-sample multiplier backward applies: gradOutput[n] (kNone) or the scalar gradOutput, divided
// by the number of samples for kMean.
template <typename T>
struct LossCoef {
  const T* perSample = nullptr;
  T scalar = 0;
  T operator()(int64_t n) const { return perSample ? perSample[n] : scalar; }
};

template <typename T>
LossCoef<T> lossCoef(const Tensor& g, LossReduction reduction, int64_t count) {
  LossCoef<T> c;
  if (reduction == LossReduction::kNone) {
    c.perSample = g.data<T>();
  } else {
    c.scalar = g.data<T>()[0];
    if (reduction == LossReduction::kMean) c.scalar /= static_cast<T>(count);
  }
  return c;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  if (cuda::onCuda("softmax", {{"x", &x}})) return cuda::dnn::softmax(x, dim);
  return softmaxImpl<false>(x, dim);
}
Tensor logSoftmax(const Tensor& x, int64_t dim) {
  if (cuda::onCuda("logSoftmax", {{"x", &x}})) return cuda::dnn::logSoftmax(x, dim);
  return softmaxImpl<true>(x, dim);
}
Tensor softmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim) {
  if (cuda::onCuda("softmax backward", {{"gradOutput", &gradOutput}, {"output", &output}}))
    return cuda::dnn::softmaxBackward(gradOutput, output, dim);
  return softmaxBackwardImpl<false>(gradOutput, output, dim);
}
Tensor logSoftmaxBackward(const Tensor& gradOutput, const Tensor& output, int64_t dim) {
  if (cuda::onCuda("logSoftmax backward", {{"gradOutput", &gradOutput}, {"output", &output}}))
    return cuda::dnn::logSoftmaxBackward(gradOutput, output, dim);
  return softmaxBackwardImpl<true>(gradOutput, output, dim);
}

CrossEntropyResult crossEntropy(const Tensor& logits, const Tensor& targets, LossReduction reduction,
                                const char* op) {
  if (cuda::onCuda(op, {{"logits", &logits}, {"targets", &targets}}))
    return cuda::dnn::crossEntropy(logits, targets, reduction, op);
  const DType dtype = logits.dtype();
  Tensor x = contiguousAs(logits, dtype);
  Tensor t = contiguousAs(targets, DType::kInt64);
  const int64_t n = x.shape()[0], classes = x.shape()[1];
  checkTargets(t.data<int64_t>(), n, classes, op);
  CrossEntropyResult r{Tensor::empty({n}, dtype), Tensor::empty({n}, dtype), Tensor::empty({n}, dtype)};
  dispatchFloat(dtype, op, [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data<T>();
    const int64_t* tp = t.data<int64_t>();
    T* loss = r.loss.data<T>();
    T* rowMax = r.rowMax.data<T>();
    T* logSum = r.logSum.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = xp + i * classes;
      T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t c = 0; c < classes; ++c) m = std::max(m, row[c]);
      if (std::isinf(m)) m = m > 0 ? m : T(0);
      T sum = 0;
      for (int64_t c = 0; c < classes; ++c) sum += std::exp(row[c] - m);
      rowMax[i] = m;
      logSum[i] = std::log(sum);
      loss[i] = logSum[i] - (row[tp[i]] - m);
    }
  });
  r.loss = reduceLosses(r.loss, reduction);
  return r;
}

Tensor crossEntropyBackward(const Tensor& gradOutput, const Tensor& logits, const Tensor& targets,
                            const CrossEntropyResult& forward, LossReduction reduction) {
  if (cuda::onCuda("crossEntropy backward", {{"gradOutput", &gradOutput}, {"logits", &logits}, {"targets", &targets}}))
    return cuda::dnn::crossEntropyBackward(gradOutput, logits, targets, forward, reduction);
  const DType dtype = logits.dtype();
  Tensor x = contiguousAs(logits, dtype);
  Tensor t = contiguousAs(targets, DType::kInt64);
  Tensor rowMax = contiguousAs(forward.rowMax, dtype);
  Tensor logSum = contiguousAs(forward.logSum, dtype);
  Tensor g = contiguousAs(gradOutput, dtype);
  const int64_t n = x.shape()[0], classes = x.shape()[1];
  Tensor dx = Tensor::empty(x.shape(), dtype);
  dispatchFloat(dtype, "crossEntropy backward", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data<T>();
    const T* mp = rowMax.data<T>();
    const T* lp = logSum.data<T>();
    const int64_t* tp = t.data<int64_t>();
    T* dp = dx.data<T>();
    const LossCoef<T> coef = lossCoef<T>(g, reduction, n);
    for (int64_t i = 0; i < n; ++i) {
      const T* row = xp + i * classes;
      T* out = dp + i * classes;
      const T k = coef(i);
      const T m = mp[i], logS = lp[i];
      for (int64_t c = 0; c < classes; ++c) out[c] = k * std::exp((row[c] - m) - logS);
      out[tp[i]] -= k;
    }
  });
  return dx;
}

Tensor nllLoss(const Tensor& logProbs, const Tensor& targets, LossReduction reduction, const char* op) {
  if (cuda::onCuda(op, {{"log-probabilities", &logProbs}, {"targets", &targets}}))
    return cuda::dnn::nllLoss(logProbs, targets, reduction, op);
  const DType dtype = logProbs.dtype();
  Tensor x = contiguousAs(logProbs, dtype);
  Tensor t = contiguousAs(targets, DType::kInt64);
  const int64_t n = x.shape()[0], classes = x.shape()[1];
  checkTargets(t.data<int64_t>(), n, classes, op);
  Tensor loss = Tensor::empty({n}, dtype);
  dispatchFloat(dtype, op, [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data<T>();
    const int64_t* tp = t.data<int64_t>();
    T* lp = loss.data<T>();
    for (int64_t i = 0; i < n; ++i) lp[i] = -xp[i * classes + tp[i]];
  });
  return reduceLosses(loss, reduction);
}

Tensor nllLossBackward(const Tensor& gradOutput, const Tensor& targets, const Shape& inputShape, DType dtype,
                       LossReduction reduction) {
  if (cuda::onCuda("nllLoss backward", {{"gradOutput", &gradOutput}, {"targets", &targets}}))
    return cuda::dnn::nllLossBackward(gradOutput, targets, inputShape, dtype, reduction);
  Tensor t = contiguousAs(targets, DType::kInt64);
  Tensor g = contiguousAs(gradOutput, dtype);
  Tensor dx = Tensor::zeros(inputShape, dtype);
  const int64_t n = inputShape[0], classes = inputShape[1];
  dispatchFloat(dtype, "nllLoss backward", [&](auto zero) {
    using T = decltype(zero);
    const int64_t* tp = t.data<int64_t>();
    T* dp = dx.data<T>();
    const LossCoef<T> coef = lossCoef<T>(g, reduction, n);
    for (int64_t i = 0; i < n; ++i) dp[i * classes + tp[i]] = -coef(i);
  });
  return dx;
}

Tensor mseLoss(const Tensor& input, const Tensor& target, LossReduction reduction) {
  if (cuda::onCuda("mseLoss", {{"input", &input}, {"target", &target}}))
    return cuda::dnn::mseLoss(input, target, reduction);
  const DType dtype = input.dtype();
  Tensor x = contiguousAs(input, dtype);
  Tensor y = contiguousAs(target, dtype);
  const int64_t n = x.numel();
  return dispatchFloat(dtype, "mseLoss", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data<T>();
    const T* yp = y.data<T>();
    if (reduction == LossReduction::kNone) {
      Tensor out = Tensor::empty(x.shape(), dtype);
      T* op = out.data<T>();
      for (int64_t i = 0; i < n; ++i) {
        const T d = xp[i] - yp[i];
        op[i] = d * d;
      }
      return out;
    }
    // Blocks of T-precision partial sums (vectorised) folded into a double total.
    constexpr int64_t kBlock = 4096;
    double total = 0;
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t e = std::min(n, b + kBlock);
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = b; i < e; ++i) {
        const T d = xp[i] - yp[i];
        s += d * d;
      }
      total += s;
    }
    if (reduction == LossReduction::kMean) total /= static_cast<double>(n);
    return Tensor::scalar(total, dtype);
  });
}

MseLossGrads mseLossBackward(const Tensor& gradOutput, const Tensor& input, const Tensor& target,
                             LossReduction reduction, bool needInput, bool needTarget) {
  if (cuda::onCuda("mseLoss backward", {{"gradOutput", &gradOutput}, {"input", &input}, {"target", &target}}))
    return cuda::dnn::mseLossBackward(gradOutput, input, target, reduction, needInput, needTarget);
  const DType dtype = input.dtype();
  Tensor x = contiguousAs(input, dtype);
  Tensor y = contiguousAs(target, dtype);
  Tensor g = contiguousAs(gradOutput, dtype);
  MseLossGrads r;
  if (!needInput && !needTarget) return r;
  Tensor dx = Tensor::empty(x.shape(), dtype);
  const int64_t n = x.numel();
  dispatchFloat(dtype, "mseLoss backward", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data<T>();
    const T* yp = y.data<T>();
    T* dp = dx.data<T>();
    if (reduction == LossReduction::kNone) {
      const T* gp = g.data<T>();
      for (int64_t i = 0; i < n; ++i) dp[i] = T(2) * (xp[i] - yp[i]) * gp[i];
    } else {
      T k = T(2) * g.data<T>()[0];
      if (reduction == LossReduction::kMean) k /= static_cast<T>(n);
      for (int64_t i = 0; i < n; ++i) dp[i] = k * (xp[i] - yp[i]);
    }
    if (needTarget) {
      r.target = Tensor::empty(x.shape(), dtype);
      T* tp = r.target.data<T>();
      for (int64_t i = 0; i < n; ++i) tp[i] = -dp[i];
    }
  });
  if (needInput) r.input = dx;
  return r;
}

DropoutResult dropout(const Tensor& x, double p, Generator& gen) {
  if (cuda::onCuda("dropout", {{"x", &x}})) return cuda::dnn::dropout(x, p, gen);
  DG_ASSERT(p >= 0.0 && p < 1.0, "dropout probability ", p);
  const DType dtype = x.dtype();
  Tensor in = contiguousAs(x, dtype);
  DropoutResult r{Tensor::empty(in.shape(), dtype), Tensor::empty(in.shape(), dtype)};
  dispatchFloat(dtype, "dropout", [&](auto zero) {
    using T = decltype(zero);
    const T scale = static_cast<T>(1.0 / (1.0 - p));
    const T* xp = in.data<T>();
    T* mp = r.mask.data<T>();
    T* op = r.output.data<T>();
    const int64_t n = in.numel();
    for (int64_t i = 0; i < n; ++i) mp[i] = gen.uniform01() < p ? T(0) : scale;
    for (int64_t i = 0; i < n; ++i) op[i] = xp[i] * mp[i];
  });
  return r;
}

Tensor dropoutBackward(const Tensor& gradOutput, const Tensor& mask) {
  if (cuda::onCuda("dropout backward", {{"gradOutput", &gradOutput}, {"mask", &mask}}))
    return cuda::dnn::dropoutBackward(gradOutput, mask);
  const DType dtype = mask.dtype();
  Tensor g = contiguousAs(gradOutput, dtype);
  Tensor dx = Tensor::empty(mask.shape(), dtype);
  dispatchFloat(dtype, "dropout backward", [&](auto zero) {
    using T = decltype(zero);
    const T* gp = g.data<T>();
    const T* mp = mask.data<T>();
    T* dp = dx.data<T>();
    for (int64_t i = 0, n = mask.numel(); i < n; ++i) dp[i] = gp[i] * mp[i];
  });
  return dx;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  if (cuda::onCuda("embedding", {{"weight", &weight}, {"indices", &indices}}))
    return cuda::dnn::embedding(weight, indices);
  const DType dtype = weight.dtype();
  Tensor w = contiguousAs(weight, dtype);
  Tensor idx = contiguousAs(indices, DType::kInt64);
  const int64_t rows = w.shape()[0], dim = w.shape()[1];
  const int64_t* ip = idx.data<int64_t>();
  const int64_t count = idx.numel();
  for (int64_t i = 0; i < count; ++i) {
    DG_CHECK(ip[i] >= 0 && ip[i] < rows, "embedding: index ", ip[i], " at position ", i,
             " is out of range for a weight with ", rows, " rows (expected 0..", rows - 1, ")");
  }
  Shape outShape = idx.shape();
  outShape.push_back(dim);
  Tensor out = Tensor::empty(outShape, dtype);
  const size_t rowBytes = static_cast<size_t>(dim) * w.itemSize();
  const char* src = static_cast<const char*>(w.rawData());
  char* dst = static_cast<char*>(out.rawData());
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(dst + static_cast<size_t>(i) * rowBytes, src + static_cast<size_t>(ip[i]) * rowBytes, rowBytes);
  }
  return out;
}

Tensor embeddingBackward(const Tensor& gradOutput, const Tensor& indices, const Shape& weightShape) {
  if (cuda::onCuda("embedding backward", {{"gradOutput", &gradOutput}, {"indices", &indices}}))
    return cuda::dnn::embeddingBackward(gradOutput, indices, weightShape);
  const DType dtype = gradOutput.dtype();
  Tensor g = contiguousAs(gradOutput, dtype);
  Tensor idx = contiguousAs(indices, DType::kInt64);
  Tensor dw = Tensor::zeros(weightShape, dtype);
  const int64_t dim = weightShape[1];
  dispatchFloat(dtype, "embedding backward", [&](auto zero) {
    using T = decltype(zero);
    const T* gp = g.data<T>();
    const int64_t* ip = idx.data<int64_t>();
    T* dp = dw.data<T>();
    for (int64_t i = 0, n = idx.numel(); i < n; ++i) {
      const T* src = gp + i * dim;
      T* dst = dp + ip[i] * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] += src[d];
    }
  });
  return dw;
}

}  // namespace distgrad::tensor::kernels
