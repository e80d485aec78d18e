#include "tensor/cpu/reduce.h"

#include "tensor/cuda/tensor_kernels.h"
#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cpu/strided.h"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor::kernels {
namespace {

// Accumulator type per element type: float sums in double (see the header), integers in int64.
template <typename T> struct AccOf { using type = T; };
template <> struct AccOf<float> { using type = double; };

// Sum of a run of n elements with element stride s.
template <typename T>
typename AccOf<T>::type sumRun(const T* p, int64_t s, int64_t n) {
  using Acc = typename AccOf<T>::type;
  if (s != 1) {
    Acc total = 0;
    for (int64_t i = 0; i < n; ++i) total += p[i * s];
    return total;
  }
  if constexpr (std::is_same_v<T, float>) {
    // 16 independent float lanes per block vectorise (two AVX registers); blocks are short (16 adds per lane) so
    // float rounding cannot build up (repeated values otherwise drift ~1e-6 relative), and block sums are
    // added in double.
    constexpr int64_t kLanes = 16;
    constexpr int64_t kBlock = 256;
    double total = 0;
    for (int64_t start = 0; start < n; start += kBlock) {
      const int64_t m = std::min(kBlock, n - start);
      const float* q = p + start;
      float lanes[kLanes] = {};
      int64_t j = 0;
      for (; j + kLanes <= m; j += kLanes) {
        for (int64_t k = 0; k < kLanes; ++k) lanes[k] += q[j + k];
      }
      float blockSum = 0;
      for (int64_t k = 0; k < kLanes; ++k) blockSum += lanes[k];
      for (; j < m; ++j) blockSum += q[j];
      total += blockSum;
    }
    return total;
  } else {
    // double and int64: 8 lanes (two AVX registers) of independent accumulators.
    constexpr int64_t kLanes = 8;
    Acc lanes[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int64_t k = 0; k < kLanes; ++k) lanes[k] += p[j + k];
    }
    Acc total = 0;
    for (int64_t k = 0; k < kLanes; ++k) total += lanes[k];
    for (; j < n; ++j) total += p[j];
    return total;
  }
}

template <typename T>
Tensor sumDimsImpl(const Tensor& a, const std::vector<bool>& mask, bool keepDim) {
  using Acc = typename AccOf<T>::type;
  const Shape keepShape = reducedShape(a.shape(), mask, true);
  const int64_t outNumel = numelOf(keepShape);
  std::vector<Acc> acc(static_cast<size_t>(outNumel), Acc(0));
  if (a.numel() > 0) {
    // Accumulator strides: contiguous over kept dims, 0 over reduced ones.
    const Shape accStrides = contiguousStrides(keepShape);
    const int64_t nd = a.dim();
    // Visit the input in memory order (largest input stride first) so transposed inputs stream through
    // memory; the sum's value does not depend on the order beyond rounding.
    std::vector<int64_t> order(static_cast<size_t>(nd));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return a.strides()[x] > a.strides()[y]; });
    Shape shape(nd), inBytes(nd), accBytes(nd);
    for (int64_t i = 0; i < nd; ++i) {
      const int64_t d = order[i];
      shape[i] = a.shape()[d];
      inBytes[i] = a.strides()[d] * static_cast<int64_t>(sizeof(T));
      accBytes[i] = mask[d] ? 0 : accStrides[d] * static_cast<int64_t>(sizeof(Acc));
    }
    forEachStrided<2>(shape, {accBytes, inBytes},
                      {reinterpret_cast<char*>(acc.data()), static_cast<char*>(a.rawData())},
                      [&](const std::array<char*, 2>& p, const std::array<int64_t, 2>& s, int64_t n) {
                        Acc* out = reinterpret_cast<Acc*>(p[0]);
                        const T* in = reinterpret_cast<const T*>(p[1]);
                        const int64_t sin = s[1] / static_cast<int64_t>(sizeof(T));
                        if (s[0] == 0) {
                          *out += sumRun<T>(in, sin, n);
                          return;
                        }
                        const int64_t sout = s[0] / static_cast<int64_t>(sizeof(Acc));
                        if (sout == 1 && sin == 1) {
                          for (int64_t i = 0; i < n; ++i) out[i] += static_cast<Acc>(in[i]);
                        } else {
                          for (int64_t i = 0; i < n; ++i) out[i * sout] += static_cast<Acc>(in[i * sin]);
                        }
                      });
  }
  Tensor out = Tensor::empty(keepDim ? keepShape : reducedShape(a.shape(), mask, false), a.dtype());
  T* o = static_cast<T*>(out.rawData());
  for (int64_t i = 0; i < outNumel; ++i) o[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
  return out;
}

// "greater, or a NaN that displaces a number": keeps the first maximum and lets NaN propagate.
template <typename T>
inline bool beats(T v, T best) {
  return v > best || (v != v && best == best);
}

// Value and first index of the maximum of a contiguous run (NaN-propagating, first NaN wins).
template <typename T>
void argmaxRun(const T* p, int64_t n, T* value, int64_t* index) {
  // GCC's vectoriser will not turn a max loop into packed instructions without -ffast-math, so the fast
  // path uses vector extensions (AVX2 compares and blends): each lane keeps its maximum and the index
  // where it first saw it (strict > keeps the earliest), plus a probe that turns NaN if any element is
  // NaN or infinite (x * 0). Rows with NaN or infinity take the exact scalar scan at the end.
  using Index = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;  // same lane width as T
  typedef T Vec __attribute__((vector_size(32)));
  typedef Index IndexVec __attribute__((vector_size(32)));
  constexpr int64_t kLanes = static_cast<int64_t>(sizeof(Vec) / sizeof(T));
  if (n >= 2 * kLanes && n <= std::numeric_limits<Index>::max()) {
    Vec lanes, probe = {};
    IndexVec laneIndex, current;
    for (int64_t k = 0; k < kLanes; ++k) current[k] = static_cast<Index>(k);
    laneIndex = current;
    std::memcpy(&lanes, p, sizeof(Vec));
    if constexpr (std::is_floating_point_v<T>) probe = lanes * T(0);  // the first block can hold NaN too
    int64_t j = kLanes;
    for (; j + kLanes <= n; j += kLanes) {
      Vec v;
      std::memcpy(&v, p + j, sizeof(Vec));
      current += static_cast<Index>(kLanes);
      const auto better = v > lanes;
      lanes = better ? v : lanes;
      laneIndex = better ? current : laneIndex;
      if constexpr (std::is_floating_point_v<T>) probe += v * T(0);
    }
    bool special = false;
    T best = lanes[0];
    int64_t at = laneIndex[0];
    for (int64_t k = 1; k < kLanes; ++k) {
      if (lanes[k] > best || (lanes[k] == best && laneIndex[k] < at)) {
        best = lanes[k];
        at = laneIndex[k];
      }
    }
    if constexpr (std::is_floating_point_v<T>) {
      for (int64_t k = 0; k < kLanes; ++k) special |= probe[k] != probe[k];
    }
    for (; j < n; ++j) {  // the tail comes after every lane's index, so strict > keeps first occurrences
      if (p[j] > best) {
        best = p[j];
        at = j;
      }
      if constexpr (std::is_floating_point_v<T>) special |= p[j] != p[j];
    }
    if (!special) {
      *value = best;
      *index = at;
      return;
    }
  }
  T best = p[0];
  int64_t bestIdx = 0;
  for (int64_t k = 1; k < n; ++k) {
    if (beats(p[k], best)) {
      best = p[k];
      bestIdx = k;
    }
  }
  *value = best;
  *index = bestIdx;
}

template <typename T>
void maxDimImpl(const Tensor& src, int64_t dim, T* values, int64_t* indices) {
  // src is contiguous: view it as [outer, R, inner].
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= src.shape()[d];
  for (int64_t d = dim + 1; d < src.dim(); ++d) inner *= src.shape()[d];
  const int64_t r = src.shape()[dim];
  const T* in = static_cast<const T*>(src.rawData());
  for (int64_t o = 0; o < outer; ++o) {
    const T* block = in + o * r * inner;
    T* vals = values + o * inner;
    int64_t* idx = indices + o * inner;
    if (inner == 1) {
      argmaxRun<T>(block, r, vals, idx);
      continue;
    }
    // Reduce rows into the running maxima elementwise: streams through memory once.
    for (int64_t j = 0; j < inner; ++j) {
      vals[j] = block[j];
      idx[j] = 0;
    }
    for (int64_t k = 1; k < r; ++k) {
      const T* row = block + k * inner;
      for (int64_t j = 0; j < inner; ++j) {
        const bool take = beats(row[j], vals[j]);
        vals[j] = take ? row[j] : vals[j];
        idx[j] = take ? k : idx[j];
      }
    }
  }
}

}  // namespace

Shape reducedShape(const Shape& shape, const std::vector<bool>& mask, bool keepDim) {
  Shape out;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (!mask[d]) out.push_back(shape[d]);
    else if (keepDim) out.push_back(1);
  }
  return out;
}

std::vector<bool> reductionMask(const std::vector<int64_t>& dims, int64_t ndim, const char* op) {
  std::vector<bool> mask(static_cast<size_t>(ndim), false);
  for (int64_t d : dims) {
    DG_CHECK(ndim > 0, op, ": cannot reduce over dim ", d, " of a 0-d tensor");
    const int64_t w = wrapDim(d, ndim, op);
    DG_CHECK(!mask[w], op, ": dim ", d, " appears more than once in the reduction dims");
    mask[w] = true;
  }
  return mask;
}

Tensor sumAll(const Tensor& a) {
  std::vector<bool> mask(static_cast<size_t>(a.dim()), true);
  return sumDims(a, mask, false);
}

Tensor sumDims(const Tensor& a, const std::vector<bool>& mask, bool keepDim) {
  if (cuda::routeToCuda("sum", a)) return cuda::sumDims(a, mask, keepDim);
  requireCpuTensor(a, "sum");
  DG_ASSERT(static_cast<int64_t>(mask.size()) == a.dim(), "reduction mask rank mismatch");
  return dispatchDType(a.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    return sumDimsImpl<T>(a, mask, keepDim);
  });
}

Tensor maxAll(const Tensor& a) {
  if (cuda::routeToCuda("max", a)) return cuda::maxAll(a);
  requireCpuTensor(a, "max");
  DG_CHECK(a.numel() > 0, "max: cannot take the max of an empty tensor (shape ", shapeStr(a.shape()), ")");
  Tensor src = contiguous(a);
  return dispatchDType(a.dtype(), "max", [&](auto tag) {
    using T = decltype(tag);
    T best;
    int64_t unusedIndex;
    argmaxRun<T>(static_cast<const T*>(src.rawData()), src.numel(), &best, &unusedIndex);
    Tensor out = Tensor::empty({}, a.dtype());
    *static_cast<T*>(out.rawData()) = best;
    return out;
  });
}

void maxDim(const Tensor& a, int64_t dim, bool keepDim, Tensor* values, Tensor* indices, const char* op) {
  if (cuda::routeToCuda(op, a)) {
    cuda::maxDim(a, dim, keepDim, values, indices, op);
    return;
  }
  requireCpuTensor(a, op);
  // A 0-d tensor has one element; dim 0 / -1 reduce over it, as in PyTorch.
  const int64_t d = wrapDim(dim, a.dim(), op);
  Tensor src = contiguous(a);
  if (a.dim() == 0) src = Tensor::fromStorage(src.storage(), {1}, {1}, src.offset(), a.dtype());
  DG_CHECK(src.shape()[d] > 0, op, ": cannot reduce over dim ", dim, " of size 0 (shape ", shapeStr(a.shape()), ")");
  std::vector<bool> mask(static_cast<size_t>(src.dim()), false);
  mask[d] = true;
  Shape outShape = a.dim() == 0 ? Shape{} : reducedShape(src.shape(), mask, keepDim);
  Tensor idx = Tensor::empty(outShape, DType::kInt64);
  Tensor vals = dispatchDType(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    Tensor v = Tensor::empty(outShape, a.dtype());
    maxDimImpl<T>(src, d, static_cast<T*>(v.rawData()), static_cast<int64_t*>(idx.rawData()));
    return v;
  });
  if (values) *values = vals;
  if (indices) *indices = idx;
}

Tensor maxDimBackward(const Tensor& grad, const Tensor& indices, const Shape& inputShape, int64_t dim) {
  // One validation for both devices: the CUDA kernel gets the checked geometry.
  const Device device = cuda::deviceOf("max backward", {{"gradient", &grad}, {"indices", &indices}});
  DG_CHECK(indices.dtype() == DType::kInt64, "max backward: indices must be int64, got ", dtypeName(indices.dtype()));
  const int64_t nd = static_cast<int64_t>(inputShape.size());
  DG_CHECK(nd == 0 ? dim == 0 : dim >= 0 && dim < nd, "max backward: dim ", dim, " is out of range for input ",
           shapeStr(inputShape));
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= inputShape[d];
  for (int64_t d = dim + 1; d < nd; ++d) inner *= inputShape[d];
  const int64_t r = nd == 0 ? 1 : inputShape[dim];
  DG_CHECK(grad.numel() == outer * inner && indices.numel() == outer * inner, "max backward: gradient ",
           shapeStr(grad.shape()), " / indices ", shapeStr(indices.shape()), " do not match input ",
           shapeStr(inputShape), " reduced over dim ", dim);
  if (device.isCuda()) return cuda::maxDimBackward(grad, indices, inputShape, outer, r, inner);
  requireCpuTensor(grad, "max backward");
  Tensor out = Tensor::zeros(inputShape, grad.dtype());
  Tensor g = contiguous(grad);
  Tensor idx = contiguous(indices);
  const int64_t* ip = static_cast<const int64_t*>(idx.rawData());
  dispatchDType(grad.dtype(), "max backward", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = static_cast<const T*>(g.rawData());
    T* op = static_cast<T*>(out.rawData());
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t j = 0; j < inner; ++j) {
        const int64_t k = ip[o * inner + j];
        DG_ASSERT(k >= 0 && k < r, "argmax index out of range");
        op[(o * r + k) * inner + j] = gp[o * inner + j];
      }
    }
  });
  return out;
}

}  // namespace distgrad::tensor::kernels
