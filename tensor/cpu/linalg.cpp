#include "tensor/cpu/linalg.h"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "tensor/cpu/dnnl_context.h"
#include "tensor/cuda/device_check.h"
#include "tensor/cuda/dnn_ops.h"

namespace distgrad::tensor::kernels {

// ---------------------------------------------------------------- raw GEMM

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // dnnl_sgemm rejects k == 0; the product is empty, so only the beta scaling remains.
    for (int64_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  // Applies this process's thread count to the calling thread's OpenMP state, which dnnl_sgemm reads.
  (void)dnnlStream();
  dnnl_status_t status = dnnl_sgemm(transA ? 'T' : 'N', transB ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb,
                                    beta, c, ldc);
  DG_ASSERT(status == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(status), " (m=", m,
            " n=", n, " k=", k, " lda=", lda, " ldb=", ldb, " ldc=", ldc, ")");
}

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  // Reference loops (oneDNN has no float64): i-p-j order so the innermost loop walks a row of C and, for
  // an untransposed B, a row of B.
  const int64_t ars = transA ? 1 : lda, acs = transA ? lda : 1;
  const int64_t brs = transB ? 1 : ldb, bcs = transB ? ldb : 1;
  for (int64_t i = 0; i < m; ++i) {
    double* crow = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) crow[j] = beta == 0.0 ? 0.0 : beta * crow[j];
    for (int64_t p = 0; p < k; ++p) {
      const double aip = alpha * a[i * ars + p * acs];
      const double* brow = b + p * brs;
      if (bcs == 1) {
        for (int64_t j = 0; j < n; ++j) crow[j] += aip * brow[j];
      } else {
        for (int64_t j = 0; j < n; ++j) crow[j] += aip * brow[j * bcs];
      }
    }
  }
}

namespace {

// A matrix inside a strided tensor: element (i, j) is at data[i * rs + j * cs].
template <typename T>
struct MatrixView {
  T* data = nullptr;
  int64_t rows = 0, cols = 0, rs = 0, cs = 0;
};

// How a GEMM can read a strided matrix in place: untransposed with row stride ld, or transposed (stored
// column-major) with column stride ld. False when the view is neither and must be copied.
bool gemmLayout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, bool& trans, int64_t& ld) {
  if ((cols == 1 || cs == 1) && (rows == 1 || rs >= std::max<int64_t>(cols, 1))) {
    trans = false;
    ld = rows == 1 ? std::max<int64_t>(cols, 1) : rs;
    return true;
  }
  if ((rows == 1 || rs == 1) && (cols == 1 || cs >= std::max<int64_t>(rows, 1))) {
    trans = true;
    ld = cols == 1 ? std::max<int64_t>(rows, 1) : cs;
    return true;
  }
  return false;
}

// C = A * B + beta * C for one matrix triple; copies an operand only when no GEMM layout fits it.
template <typename T>
void gemmViews(const MatrixView<T>& a, const MatrixView<T>& b, const MatrixView<T>& c, T beta,
               std::vector<T>& scratchA, std::vector<T>& scratchB) {
  const int64_t m = a.rows, k = a.cols, n = b.cols;
  DG_ASSERT(b.rows == k && c.rows == m && c.cols == n, "gemm operand sizes disagree");
  bool transC = false;
  int64_t ldc = 0;
  DG_ASSERT(gemmLayout(m, n, c.rs, c.cs, transC, ldc) && !transC, "gemm output must be row-major");
  auto resolve = [](const MatrixView<T>& v, std::vector<T>& scratch, const T*& ptr, bool& trans, int64_t& ld) {
    ptr = v.data;
    if (gemmLayout(v.rows, v.cols, v.rs, v.cs, trans, ld)) return;
    scratch.resize(static_cast<size_t>(v.rows * v.cols));
    for (int64_t i = 0; i < v.rows; ++i) {
      for (int64_t j = 0; j < v.cols; ++j) scratch[static_cast<size_t>(i * v.cols + j)] = v.data[i * v.rs + j * v.cs];
    }
    ptr = scratch.data();
    trans = false;
    ld = std::max<int64_t>(v.cols, 1);
  };
  const T* pa = nullptr;
  const T* pb = nullptr;
  bool ta = false, tb = false;
  int64_t lda = 0, ldb = 0;
  resolve(a, scratchA, pa, ta, lda);
  resolve(b, scratchB, pb, tb, ldb);
  gemm(ta, tb, m, n, k, T(1), pa, lda, pb, ldb, beta, c.data, ldc);
}

// True when dims (sizes, strides) laid out outer to inner, followed by a final dim of stride `innerStride`
// and size `innerSize`, form one evenly strided dim (so a loop over them is one longer matrix dim).
bool mergesWith(const Shape& sizes, const Shape& strides, int64_t innerSize, int64_t innerStride) {
  int64_t expected = innerSize * innerStride;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

bool allZero(const Shape& v) {
  return std::all_of(v.begin(), v.end(), [](int64_t s) { return s == 0; });
}

// The batched product over batch dims `batch` (all > 1) with per-operand batch strides (0 = broadcast for
// a and b, 0 = reduce for c). c must be zeroed by the caller when any of its batch strides is 0.
template <typename T>
void gemmBatched(const Shape& batch, MatrixView<T> a, const Shape& aStrides, MatrixView<T> b,
                 const Shape& bStrides, MatrixView<T> c, const Shape& cStrides) {
  std::vector<T> scratchA, scratchB;
  const bool reducing = std::any_of(cStrides.begin(), cStrides.end(), [](int64_t s) { return s == 0; });
  const T beta = reducing ? T(1) : T(0);
  const int64_t batchCount = numelOf(batch);
  if (batchCount == 0) return;
  if (!batch.empty()) {
    bool t = false;
    int64_t ld = 0;
    // b shared by every batch: stack the batches of a (and c) as extra rows of one GEMM.
    if (allZero(bStrides) && mergesWith(batch, aStrides, a.rows, a.rs) && mergesWith(batch, cStrides, c.rows, c.rs)) {
      MatrixView<T> a2 = a, c2 = c;
      a2.rows = c2.rows = a.rows * batchCount;
      if (gemmLayout(a2.rows, a2.cols, a2.rs, a2.cs, t, ld) && gemmLayout(c2.rows, c2.cols, c2.rs, c2.cs, t, ld) &&
          !t) {
        gemmViews(a2, b, c2, beta, scratchA, scratchB);
        return;
      }
    }
    // c reduced over every batch: the batches extend the inner (k) dim of one GEMM.
    if (allZero(cStrides) && mergesWith(batch, aStrides, a.cols, a.cs) && mergesWith(batch, bStrides, b.rows, b.rs)) {
      MatrixView<T> a2 = a, b2 = b;
      a2.cols = b2.rows = a.cols * batchCount;
      if (gemmLayout(a2.rows, a2.cols, a2.rs, a2.cs, t, ld) && gemmLayout(b2.rows, b2.cols, b2.rs, b2.cs, t, ld)) {
        gemmViews(a2, b2, c, beta, scratchA, scratchB);
        return;
      }
    }
  }
  const int64_t nd = static_cast<int64_t>(batch.size());
  std::vector<int64_t> counter(static_cast<size_t>(nd), 0);
  T* const a0 = a.data;
  T* const b0 = b.data;
  T* const c0 = c.data;
  for (int64_t it = 0; it < batchCount; ++it) {
    int64_t oa = 0, ob = 0, oc = 0;
    for (int64_t d = 0; d < nd; ++d) {
      oa += counter[d] * aStrides[d];
      ob += counter[d] * bStrides[d];
      oc += counter[d] * cStrides[d];
    }
    a.data = a0 + oa;
    b.data = b0 + ob;
    c.data = c0 + oc;
    gemmViews(a, b, c, beta, scratchA, scratchB);
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++counter[d] < batch[d]) break;
      counter[d] = 0;
    }
  }
}

void requireMatmulDTypes(const Tensor& a, const Tensor& b, const char* op) {
  DG_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", dtypeName(a.dtype()), " ", shapeStr(a.shape()),
           " vs ", dtypeName(b.dtype()), " ", shapeStr(b.shape()));
  DG_CHECK(a.dtype() == DType::kFloat32 || a.dtype() == DType::kFloat64, op,
           ": expected float32 or float64 tensors, got ", dtypeName(a.dtype()));
}

Tensor viewOf(const Tensor& t, const Shape& shape, const Shape& strides) {
  return Tensor::fromStorage(t.storage(), shape, strides, t.offset(), t.dtype());
}

// t [..., c] as a [rows, c] matrix: a view when the leading dims merge into one evenly strided dim,
// otherwise a contiguous copy. Rank-1 t is one row.
Tensor asRows(const Tensor& t) {
  const int64_t nd = t.dim();
  const int64_t cols = t.shape().back();
  const int64_t cs = t.strides().back();
  // Size-1 leading dims carry arbitrary strides; only the others must line up.
  Shape sizes, strides;
  int64_t rows = 1;
  for (int64_t d = 0; d < nd - 1; ++d) {
    rows *= t.shape()[d];
    if (t.shape()[d] != 1) {
      sizes.push_back(t.shape()[d]);
      strides.push_back(t.strides()[d]);
    }
  }
  if (sizes.empty()) return viewOf(t, {rows, cols}, {std::max<int64_t>(cols, 1) * cs, cs});
  const int64_t rowSize = sizes.back(), rowStride = strides.back();
  sizes.pop_back();
  strides.pop_back();
  if (rows > 0 && mergesWith(sizes, strides, rowSize, rowStride)) return viewOf(t, {rows, cols}, {rowStride, cs});
  Tensor copy = t.cloneData();
  return viewOf(copy, {rows, cols}, {cols, 1});
}

template <typename T>
MatrixView<T> matrixOf(const Tensor& m2d, bool transposed = false) {
  MatrixView<T> v;
  v.data = static_cast<T*>(m2d.rawData());
  v.rows = m2d.shape()[0];
  v.cols = m2d.shape()[1];
  v.rs = m2d.strides()[0];
  v.cs = m2d.strides()[1];
  if (transposed) {
    std::swap(v.rows, v.cols);
    std::swap(v.rs, v.cs);
  }
  return v;
}

}  // namespace

// ---------------------------------------------------------------- matmul

Shape matmulShape(const Shape& a, const Shape& b, const char* op) {
  DG_CHECK(!a.empty() && !b.empty(), op, ": both operands need at least 1 dimension, got shapes ", shapeStr(a),
           " and ", shapeStr(b));
  const int64_t k = a.back();
  const int64_t kb = b.size() == 1 ? b[0] : b[b.size() - 2];
  DG_CHECK(k == kb, op, ": shapes ", shapeStr(a), " and ", shapeStr(b), " cannot be multiplied (", k, " != ",
           kb, " in the contracted dimension)");
  Shape batchA = a.size() > 2 ? Shape(a.begin(), a.end() - 2) : Shape{};
  Shape batchB = b.size() > 2 ? Shape(b.begin(), b.end() - 2) : Shape{};
  const size_t nb = std::max(batchA.size(), batchB.size());
  Shape out(nb);
  for (size_t i = 0; i < nb; ++i) {
    const int64_t sa = i + batchA.size() >= nb ? batchA[i + batchA.size() - nb] : 1;
    const int64_t sb = i + batchB.size() >= nb ? batchB[i + batchB.size() - nb] : 1;
    DG_CHECK(sa == sb || sa == 1 || sb == 1, op, ": batch dimensions of shapes ", shapeStr(a), " and ",
             shapeStr(b), " do not broadcast (", sa, " vs ", sb, ")");
    out[i] = sa == 1 ? sb : sa;
  }
  if (a.size() >= 2) out.push_back(a[a.size() - 2]);
  if (b.size() >= 2) out.push_back(b.back());
  return out;
}

Tensor batchedMatmul(const Tensor& a, bool transA, const Tensor& b, bool transB, const Shape& outBatch) {
  if (cuda::onCuda("batchedMatmul", {{"a", &a}, {"b", &b}}))
    return cuda::dnn::batchedMatmul(a, transA, b, transB, outBatch);
  const char* op = "batchedMatmul";
  requireMatmulDTypes(a, b, op);
  DG_CHECK(a.dim() >= 2 && a.dim() == b.dim() && static_cast<int64_t>(outBatch.size()) == a.dim() - 2, op,
           ": expected operands of equal rank >= 2 and an output batch of rank - 2, got ", shapeStr(a.shape()),
           ", ", shapeStr(b.shape()), " and batch ", shapeStr(outBatch));
  const int64_t nd = a.dim();
  const int64_t nb = nd - 2;
  // {rows, cols, row stride, col stride} of an operand's last two dims, swapped when transposed.
  auto matrixAt = [nd](const Tensor& t, bool trans) {
    std::array<int64_t, 4> m{t.shape()[nd - 2], t.shape()[nd - 1], t.strides()[nd - 2], t.strides()[nd - 1]};
    if (trans) {
      std::swap(m[0], m[1]);
      std::swap(m[2], m[3]);
    }
    return m;
  };
  const auto ma = matrixAt(a, transA);
  const auto mb = matrixAt(b, transB);
  DG_CHECK(ma[1] == mb[0], op, ": shapes ", shapeStr(a.shape()), (transA ? "^T" : ""), " and ",
           shapeStr(b.shape()), (transB ? "^T" : ""), " cannot be multiplied (", ma[1], " != ", mb[0], ")");
  Shape batch, aStrides, bStrides, cStrides;
  Shape outShape = outBatch;
  outShape.push_back(ma[0]);
  outShape.push_back(mb[1]);
  Tensor out = Tensor::empty(outShape, a.dtype());
  const Shape outStrides = contiguousStrides(outShape);
  bool reducing = false;
  for (int64_t d = 0; d < nb; ++d) {
    const int64_t sa = a.shape()[d], sb = b.shape()[d];
    DG_CHECK(sa == sb || sa == 1 || sb == 1, op, ": batch dimensions of shapes ", shapeStr(a.shape()), " and ",
             shapeStr(b.shape()), " do not broadcast");
    const int64_t s = sa == 1 ? sb : sa;
    DG_CHECK(outBatch[d] == s || outBatch[d] == 1, op, ": output batch ", shapeStr(outBatch),
             " is neither the broadcast batch nor a reduction of it");
    if (s == 1) continue;
    batch.push_back(s);
    aStrides.push_back(sa == 1 ? 0 : a.strides()[d]);
    bStrides.push_back(sb == 1 ? 0 : b.strides()[d]);
    const bool reduced = outBatch[d] == 1;
    reducing = reducing || reduced;
    cStrides.push_back(reduced ? 0 : outStrides[d]);
  }
  dispatchFloat(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    if (reducing) std::memset(out.rawData(), 0, out.nbytes());
    auto view = [&](const Tensor& t, const std::array<int64_t, 4>& m) {
      return MatrixView<T>{static_cast<T*>(t.rawData()), m[0], m[1], m[2], m[3]};
    };
    MatrixView<T> c{static_cast<T*>(out.rawData()), ma[0], mb[1], outStrides[nd - 2], outStrides[nd - 1]};
    gemmBatched<T>(batch, view(a, ma), aStrides, view(b, mb), bStrides, c, cStrides);
  });
  return out;
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  // Device-independent: the shape work below makes views, and batchedMatmul routes CUDA operands.
  cuda::onCuda("matmul", {{"a", &a}, {"b", &b}});
  requireMatmulDTypes(a, b, "matmul");
  const Shape resultShape = matmulShape(a.shape(), b.shape(), "matmul");
  // Promote 1-D operands to matrices and pad batch ranks with size-1 dims (views, no copies).
  Tensor a2 = a.dim() == 1 ? viewOf(a, {1, a.shape()[0]}, {0, a.strides()[0]}) : a;
  Tensor b2 = b.dim() == 1 ? viewOf(b, {b.shape()[0], 1}, {b.strides()[0], 0}) : b;
  const int64_t nd = std::max(a2.dim(), b2.dim());
  auto pad = [nd](const Tensor& t) {
    if (t.dim() == nd) return t;
    Shape shape(static_cast<size_t>(nd - t.dim()), 1);
    Shape strides(static_cast<size_t>(nd - t.dim()), 0);
    shape.insert(shape.end(), t.shape().begin(), t.shape().end());
    strides.insert(strides.end(), t.strides().begin(), t.strides().end());
    return viewOf(t, shape, strides);
  };
  a2 = pad(a2);
  b2 = pad(b2);
  Shape batch(static_cast<size_t>(nd - 2));
  for (int64_t d = 0; d < nd - 2; ++d) batch[d] = std::max(a2.shape()[d], b2.shape()[d]);
  Tensor out = batchedMatmul(a2, false, b2, false, batch);
  return viewOf(out, resultShape, contiguousStrides(resultShape));
}

// ---------------------------------------------------------------- linear

namespace {
void checkLinear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const char* op = "linear";
  requireMatmulDTypes(x, weight, op);
  DG_CHECK(weight.dim() == 2, op, ": weight must be 2-D [out, in], got shape ", shapeStr(weight.shape()));
  DG_CHECK(x.dim() >= 1, op, ": input must have at least 1 dimension, got shape ", shapeStr(x.shape()));
  DG_CHECK(x.shape().back() == weight.shape()[1], op, ": input shape ", shapeStr(x.shape()),
           " does not match weight shape ", shapeStr(weight.shape()), " (input's last dim ", x.shape().back(),
           " != weight's in_features ", weight.shape()[1], ")");
  if (bias.defined()) {
    requireMatmulDTypes(x, bias, op);
    DG_CHECK(bias.dim() == 1 && bias.shape()[0] == weight.shape()[0], op, ": bias shape ", shapeStr(bias.shape()),
             " does not match weight shape ", shapeStr(weight.shape()), " (expected [", weight.shape()[0], "])");
  }
}

Shape withLastDim(const Shape& s, int64_t last) {
  Shape out = s;
  out.back() = last;
  return out;
}
}  // namespace

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const bool onCuda = cuda::onCuda("linear", {{"x", &x}, {"weight", &weight}, {"bias", &bias}});
  checkLinear(x, weight, bias);  // device-independent: shapes and dtypes
  if (onCuda) return cuda::dnn::linear(x, weight, bias);
  const int64_t outFeatures = weight.shape()[0];
  Tensor x2 = asRows(x);
  const int64_t rows = x2.shape()[0];
  Tensor out = Tensor::empty({rows, outFeatures}, x.dtype());
  dispatchFloat(x.dtype(), "linear", [&](auto tag) {
    using T = decltype(tag);
    T beta = T(0);
    if (bias.defined()) {
      // Seed every row with the bias and let the GEMM accumulate onto it (no second pass over the output).
      Tensor bc = bias.isContiguous() ? bias : bias.cloneData();
      const T* bp = bc.data<T>();
      T* op = out.data<T>();
      for (int64_t r = 0; r < rows; ++r) std::memcpy(op + r * outFeatures, bp, sizeof(T) * outFeatures);
      beta = T(1);
    }
    std::vector<T> sa, sb;
    gemmViews(matrixOf<T>(x2), matrixOf<T>(weight, /*transposed=*/true), matrixOf<T>(out), beta, sa, sb);
  });
  Shape resultShape = withLastDim(x.shape(), outFeatures);
  return viewOf(out, resultShape, contiguousStrides(resultShape));
}

Tensor linearBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape) {
  if (cuda::onCuda("linear backward", {{"gradOut", &gradOut}, {"weight", &weight}}))
    return cuda::dnn::linearBackwardInput(gradOut, weight, inputShape);
  requireMatmulDTypes(gradOut, weight, "linear backward");
  Tensor g2 = asRows(gradOut);
  Tensor dx = Tensor::empty({g2.shape()[0], weight.shape()[1]}, gradOut.dtype());
  dispatchFloat(gradOut.dtype(), "linear backward", [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> sa, sb;
    gemmViews(matrixOf<T>(g2), matrixOf<T>(weight), matrixOf<T>(dx), T(0), sa, sb);
  });
  return viewOf(dx, inputShape, contiguousStrides(inputShape));
}

Tensor linearBackwardWeight(const Tensor& gradOut, const Tensor& input) {
  if (cuda::onCuda("linear backward", {{"gradOut", &gradOut}, {"input", &input}}))
    return cuda::dnn::linearBackwardWeight(gradOut, input);
  requireMatmulDTypes(gradOut, input, "linear backward");
  Tensor g2 = asRows(gradOut);
  Tensor x2 = asRows(input);
  Tensor dw = Tensor::empty({g2.shape()[1], x2.shape()[1]}, gradOut.dtype());
  dispatchFloat(gradOut.dtype(), "linear backward", [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> sa, sb;
    gemmViews(matrixOf<T>(g2, /*transposed=*/true), matrixOf<T>(x2), matrixOf<T>(dw), T(0), sa, sb);
  });
  return dw;
}

Tensor linearBackwardBias(const Tensor& gradOut) {
  if (cuda::onCuda("linear backward", {{"gradOut", &gradOut}})) return cuda::dnn::linearBackwardBias(gradOut);
  Tensor g2 = asRows(gradOut);
  const int64_t rows = g2.shape()[0], cols = g2.shape()[1];
  Tensor db = Tensor::zeros({cols}, gradOut.dtype());
  dispatchFloat(gradOut.dtype(), "linear backward", [&](auto tag) {
    using T = decltype(tag);
    T* acc = db.data<T>();
    const T* g = static_cast<const T*>(g2.rawData());
    const int64_t rs = g2.strides()[0], cs = g2.strides()[1];
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = g + r * rs;
      if (cs == 1) {
        for (int64_t j = 0; j < cols; ++j) acc[j] += row[j];
      } else {
        for (int64_t j = 0; j < cols; ++j) acc[j] += row[j * cs];
      }
    }
  });
  return db;
}

}  // namespace distgrad::tensor::kernels
