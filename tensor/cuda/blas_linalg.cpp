// CUDA GEMMs behind tensor/cpu/linalg.h: cuBLASLt first, cublasGemmStridedBatchedEx when Lt's heuristics
// offer no algorithm for a layout (odd leading dimensions or alignments, more batches than one Lt call
// takes). Everything is expressed as one strided-batched row-major product
//   C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b],  b < batch, X[b] = X + b * strideX,
// which covers broadcast batches (stride 0), folded leading dims and transposed views without copies. An
// operand that is not a strided matrix (neither of its last two dims unit-stride) or whose batch dims do
// not collapse into one stride is copied to a contiguous buffer on the device first. Row-major products
// run as the column-major C^T = op(B)^T op(A)^T, cuBLAS's native order.
// Lt algorithm choices are cached per thread by (device, dtype, compute type, layouts, alignments,
// epilogue); the shared workspace is library_handles.h's.
// Compiled, untested on hardware in the session that wrote it (no GPU was available).
#ifdef DG_WITH_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>

#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/linalg.h"
#include "tensor/cpu/reduce.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/cublas_api.h"
#include "tensor/cuda/dnn_common.h"
#include "tensor/cuda/dnn_ops.h"
#include "tensor/cuda/library_handles.h"
#include "tensor/cuda/math_mode.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda::dnn {

using dnn_detail::contiguousOnDevice;
using dnn_detail::deviceOf;
using dnn_detail::emptyOn;

namespace {

// One operand in row-major terms: the logical matrix is stored as-is (trans = false, element (i, j) at
// i * ld + j) or as its transpose (trans = true, element (i, j) at j * ld + i).
struct Operand {
  const void* ptr = nullptr;
  bool trans = false;
  int64_t ld = 1;
  int64_t batchStride = 0;
  Tensor keepAlive;  // a copy made for this call, if any
};

struct GemmShape {
  int64_t batch = 1, m = 0, n = 0, k = 0;
};

cublasComputeType_t computeTypeFor(DType dtype) {
  if (dtype == DType::kFloat64) return CUBLAS_COMPUTE_64F;
  switch (matmulMathMode()) {
    case MathMode::kTf32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case MathMode::kBf16: return CUBLAS_COMPUTE_32F_FAST_16BF;
    case MathMode::kFp32: break;
  }
  return CUBLAS_COMPUTE_32F;
}

cudaDataType_t dataTypeFor(DType dtype) { return dtype == DType::kFloat64 ? CUDA_R_64F : CUDA_R_32F; }

// Largest power of two (<= 256) dividing the address: what Lt's alignment preferences ask for.
uint32_t alignmentOf(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

// RAII for the Lt descriptors.
struct LtMatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  LtMatmulDesc(cublasComputeType_t compute, cudaDataType_t scale) {
    DG_CUBLAS_CHECK(cublasApi().cublasLtMatmulDescCreate(&desc, compute, scale));
  }
  ~LtMatmulDesc() { cublasApi().cublasLtMatmulDescDestroy(desc); }
  LtMatmulDesc(const LtMatmulDesc&) = delete;
  LtMatmulDesc& operator=(const LtMatmulDesc&) = delete;
  template <typename V>
  void set(cublasLtMatmulDescAttributes_t attr, const V& v) {
    DG_CUBLAS_CHECK(cublasApi().cublasLtMatmulDescSetAttribute(desc, attr, &v, sizeof(v)));
  }
};

struct LtLayout {
  cublasLtMatrixLayout_t layout = nullptr;
  LtLayout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld, int32_t batch, int64_t batchStride) {
    DG_CUBLAS_CHECK(cublasApi().cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
    if (batch > 1) {
      DG_CUBLAS_CHECK(cublasApi().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                                                   sizeof(batch)));
      DG_CUBLAS_CHECK(cublasApi().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                                   &batchStride, sizeof(batchStride)));
    }
  }
  ~LtLayout() { cublasApi().cublasLtMatrixLayoutDestroy(layout); }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
};

struct LtPreference {
  cublasLtMatmulPreference_t pref = nullptr;
  LtPreference() { DG_CUBLAS_CHECK(cublasApi().cublasLtMatmulPreferenceCreate(&pref)); }
  ~LtPreference() { cublasApi().cublasLtMatmulPreferenceDestroy(pref); }
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
  template <typename V>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const V& v) {
    DG_CUBLAS_CHECK(cublasApi().cublasLtMatmulPreferenceSetAttribute(pref, attr, &v, sizeof(v)));
  }
};

// nullopt: Lt had no algorithm for this problem (cached too, so it is asked once).
thread_local std::unordered_map<std::string, std::optional<cublasLtMatmulAlgo_t>> tLtAlgoCache;

// The column-major problem handed to the libraries.
struct ColMajorProblem {
  cublasOperation_t opFirst, opSecond;  // op(B^T-side), op(A^T-side)
  uint64_t rowsFirst, colsFirst, rowsSecond, colsSecond;
  int64_t m, n, k;  // column-major: C' [m, n] = first [m, k] * second [k, n]
};

ColMajorProblem colMajor(const GemmShape& s, const Operand& a, const Operand& b) {
  ColMajorProblem p;
  p.m = s.n;
  p.n = s.m;
  p.k = s.k;
  // First operand: B^T as column-major [n, k] (not transposed) or its stored transpose [k, n].
  p.opFirst = b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  p.rowsFirst = static_cast<uint64_t>(b.trans ? s.k : s.n);
  p.colsFirst = static_cast<uint64_t>(b.trans ? s.n : s.k);
  p.opSecond = a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  p.rowsSecond = static_cast<uint64_t>(a.trans ? s.m : s.k);
  p.colsSecond = static_cast<uint64_t>(a.trans ? s.k : s.m);
  return p;
}

// Runs one chunk through Lt; false when Lt has no algorithm (the caller falls back to cuBLAS).
template <typename T>
bool ltGemm(int device, const Stream& stream, DType dtype, const GemmShape& s, T alpha, const Operand& a,
            const Operand& b, T beta, T* c, int64_t ldc, int64_t strideC, const T* bias) {
  const cudaDataType_t type = dataTypeFor(dtype);
  const cublasComputeType_t compute = computeTypeFor(dtype);
  const ColMajorProblem p = colMajor(s, a, b);
  const auto batch = static_cast<int32_t>(s.batch);
  const uint32_t alignFirst = alignmentOf(b.ptr), alignSecond = alignmentOf(a.ptr), alignC = alignmentOf(c);
  LtMatmulDesc desc(compute, type);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, p.opFirst);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, p.opSecond);
  if (bias != nullptr) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
  }
  LtLayout layoutFirst(type, p.rowsFirst, p.colsFirst, b.ld, batch, b.batchStride);
  LtLayout layoutSecond(type, p.rowsSecond, p.colsSecond, a.ld, batch, a.batchStride);
  LtLayout layoutC(type, static_cast<uint64_t>(p.m), static_cast<uint64_t>(p.n), ldc, batch, strideC);

  std::ostringstream key;
  key << device << '|' << static_cast<int>(dtype) << '|' << static_cast<int>(compute) << '|' << p.opFirst << p.opSecond
      << '|' << p.m << ',' << p.n << ',' << p.k << '|' << b.ld << ',' << a.ld << ',' << ldc << '|' << batch << ','
      << b.batchStride << ',' << a.batchStride << ',' << strideC << '|' << alignFirst << ',' << alignSecond << ','
      << alignC << '|' << (bias != nullptr ? alignmentOf(bias) : 0);
  cublasLtHandle_t lt = cublasLtHandle(device);
  auto it = tLtAlgoCache.find(key.str());
  if (it == tLtAlgoCache.end()) {
    LtPreference pref;
    pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kBlasWorkspaceBytes));
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignFirst);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignSecond);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignC);
    pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignC);
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t st =
        cublasApi().cublasLtMatmulAlgoGetHeuristic(lt, desc.desc, layoutFirst.layout, layoutSecond.layout,
                                                   layoutC.layout, layoutC.layout, pref.pref, 1, &result, &returned);
    std::optional<cublasLtMatmulAlgo_t> algo;
    // NOT_SUPPORTED (no algorithm for this configuration) is an answer, not an error: fall back to cuBLAS.
    if (st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
      algo = result.algo;
    } else if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_SUCCESS) {
      checkCublas(st, "cublasLtMatmulAlgoGetHeuristic");
    }
    it = tLtAlgoCache.emplace(key.str(), algo).first;
  }
  if (!it->second.has_value()) return false;
  DG_CUBLAS_CHECK(cublasApi().cublasLtMatmul(
      lt, desc.desc, &alpha, b.ptr, layoutFirst.layout, a.ptr, layoutSecond.layout, &beta, c, layoutC.layout, c,
      layoutC.layout, &*it->second, blasWorkspace(stream), kBlasWorkspaceBytes, rawStream(stream)));
  return true;
}

template <typename T>
void cublasGemm(const Stream& stream, DType dtype, const GemmShape& s, T alpha, const Operand& a, const Operand& b,
                T beta, T* c, int64_t ldc, int64_t strideC) {
  const ColMajorProblem p = colMajor(s, a, b);
  for (int64_t v : {p.m, p.n, p.k, a.ld, b.ld, ldc, s.batch}) {
    DG_CHECK(v <= INT_MAX, "matmul: dimension ", v, " exceeds cuBLAS's 32-bit limit for this layout");
  }
  const cudaDataType_t type = dataTypeFor(dtype);
  cublasHandle_t handle = cublasHandle(stream);
  DG_CUBLAS_CHECK(cublasApi().cublasGemmStridedBatchedEx(
      handle, p.opFirst, p.opSecond, static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), &alpha, b.ptr,
      type, static_cast<int>(b.ld), b.batchStride, a.ptr, type, static_cast<int>(a.ld), a.batchStride, &beta, c, type,
      static_cast<int>(ldc), strideC, static_cast<int>(s.batch), computeTypeFor(dtype), CUBLAS_GEMM_DEFAULT));
}

// Lt takes a 32-bit batch count and the grid's z dimension caps cuBLAS's; chunks keep both safe.
constexpr int64_t kMaxBatchPerCall = 65535;

// Returns whether the bias epilogue was applied (only ever asked for with batch == 1).
template <typename T>
bool runGemm(int device, DType dtype, const GemmShape& s, T alpha, const Operand& a, const Operand& b, T beta, T* c,
             int64_t ldc, int64_t strideC, const T* bias = nullptr) {
  const Stream stream = Stream::current(device);
  if (s.batch == 0 || s.m == 0 || s.n == 0) return bias != nullptr;  // nothing to write
  if (s.k == 0 && beta == T(0)) {
    // An empty contraction with beta == 0: C = 0 (Lt rejects k == 0; BLAS may skip the write entirely).
    if (ldc == s.n && strideC == s.m * s.n) {
      DG_CUDA_CHECK(cudaMemsetAsync(c, 0, sizeof(T) * static_cast<size_t>(s.batch * s.m * s.n), rawStream(stream)));
    } else {
      for (int64_t i = 0; i < s.batch; ++i) {
        DG_CUDA_CHECK(cudaMemset2DAsync(c + i * strideC, sizeof(T) * static_cast<size_t>(ldc), 0,
                                        sizeof(T) * static_cast<size_t>(s.n), static_cast<size_t>(s.m),
                                        rawStream(stream)));
      }
    }
    return false;
  }
  if (s.k == 0) {
    // C = beta * C: cuBLAS follows BLAS here; Lt does not take k == 0.
    cublasGemm<T>(stream, dtype, s, alpha, a, b, beta, c, ldc, strideC);
    return false;
  }
  bool biasApplied = bias != nullptr;
  for (int64_t first = 0; first < s.batch; first += kMaxBatchPerCall) {
    GemmShape chunk = s;
    chunk.batch = std::min(kMaxBatchPerCall, s.batch - first);
    Operand ca = a, cb = b;
    ca.ptr = static_cast<const T*>(a.ptr) + first * a.batchStride;
    cb.ptr = static_cast<const T*>(b.ptr) + first * b.batchStride;
    T* cc = c + first * strideC;
    if (ltGemm<T>(device, stream, dtype, chunk, alpha, ca, cb, beta, cc, ldc, strideC, bias)) continue;
    if (bias != nullptr && ltGemm<T>(device, stream, dtype, chunk, alpha, ca, cb, beta, cc, ldc, strideC, nullptr)) {
      biasApplied = false;
      continue;
    }
    cublasGemm<T>(stream, dtype, chunk, alpha, ca, cb, beta, cc, ldc, strideC);
    biasApplied = false;
  }
  return biasApplied;
}

// ---------------------------------------------------------------- operands from tensors

Tensor viewOf(const Tensor& t, const Shape& shape, const Shape& strides) {
  return Tensor::fromStorage(t.storage(), shape, strides, t.offset(), t.dtype());
}

// The last two dims of t (logical rows x cols, strides rs, cs) as a strided matrix, if they are one.
bool matrixLayout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, Operand* out) {
  if ((cs == 1 || cols == 1) && (rows == 1 || rs >= std::max<int64_t>(cols, 1))) {
    out->trans = false;
    out->ld = rows == 1 ? std::max<int64_t>(cols, 1) : rs;
    return true;
  }
  if ((rs == 1 || rows == 1) && (cols == 1 || cs >= std::max<int64_t>(rows, 1))) {
    out->trans = true;
    out->ld = cols == 1 ? std::max<int64_t>(rows, 1) : cs;
    return true;
  }
  return false;
}

// One stride stepping through every batch of `fullBatch` (row-major), given the operand's own batch sizes
// and strides (a size-1 dim against a larger full dim broadcasts: stride 0).
std::optional<int64_t> batchStrideOf(const Shape& fullBatch, const Shape& sizes, const Shape& strides) {
  std::optional<int64_t> stride;
  int64_t expected = -1;  // the stride the next-outer dim must have, once a dim has been seen
  bool allBroadcast = true, anyBroadcast = false;
  for (int64_t d = static_cast<int64_t>(fullBatch.size()) - 1; d >= 0; --d) {
    if (fullBatch[d] == 1) continue;
    const bool broadcast = sizes[d] == 1;
    anyBroadcast = anyBroadcast || broadcast;
    allBroadcast = allBroadcast && broadcast;
    if (broadcast) continue;
    if (!stride.has_value()) {
      stride = strides[d];
    } else if (strides[d] != expected) {
      return std::nullopt;
    }
    expected = strides[d] * fullBatch[d];
  }
  if (allBroadcast) return 0;
  if (anyBroadcast) return std::nullopt;  // some dims broadcast, others not: no single stride
  return stride;
}

// t [batch..., rows, cols] (logical, after transposition) as an Operand for `fullBatch`.
Operand operandOf(const Tensor& t, const Shape& fullBatch) {
  const int64_t nd = t.dim();
  auto tryView = [&](const Tensor& v, Operand* o) {
    const Shape batchSizes(v.shape().begin(), v.shape().end() - 2);
    const Shape batchStrides(v.strides().begin(), v.strides().end() - 2);
    if (!matrixLayout(v.shape()[nd - 2], v.shape()[nd - 1], v.strides()[nd - 2], v.strides()[nd - 1], o)) return false;
    const std::optional<int64_t> bs = batchStrideOf(fullBatch, batchSizes, batchStrides);
    if (!bs.has_value()) return false;
    o->batchStride = *bs;
    o->ptr = v.rawData();
    return true;
  };
  Operand o;
  if (tryView(t, &o)) return o;
  // A contiguous copy of the operand itself is always a strided matrix; its batch may still mix broadcast
  // and real dims, which only the expanded copy resolves.
  Tensor copy = kernels::contiguous(t);
  if (tryView(copy, &o)) {
    o.keepAlive = copy;
    return o;
  }
  Shape shape = fullBatch, strides(fullBatch.size(), 0);
  for (size_t d = 0; d < fullBatch.size(); ++d) strides[d] = t.shape()[d] == 1 ? 0 : t.strides()[d];
  shape.push_back(t.shape()[nd - 2]);
  shape.push_back(t.shape()[nd - 1]);
  strides.push_back(t.strides()[nd - 2]);
  strides.push_back(t.strides()[nd - 1]);
  Tensor expanded = kernels::contiguous(viewOf(t, shape, strides));
  const bool ok = tryView(expanded, &o);
  DG_ASSERT(ok, "a contiguous expanded matmul operand must be a strided batch");
  o.keepAlive = expanded;
  return o;
}

// t with its last two dims swapped (a view).
Tensor transposedView(const Tensor& t) {
  Shape shape = t.shape(), strides = t.strides();
  const size_t nd = shape.size();
  std::swap(shape[nd - 1], shape[nd - 2]);
  std::swap(strides[nd - 1], strides[nd - 2]);
  return viewOf(t, shape, strides);
}

void requireMatmulOperands(const Tensor& a, const Tensor& b, const char* op) {
  DG_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", dtypeName(a.dtype()), " ", shapeStr(a.shape()), " vs ",
           dtypeName(b.dtype()), " ", shapeStr(b.shape()));
  DG_CHECK(a.dtype() == DType::kFloat32 || a.dtype() == DType::kFloat64, op,
           ": expected float32 or float64 tensors on CUDA, got ", dtypeName(a.dtype()));
}

// t [..., c] as [rows, c] (a view when the leading dims merge, else a device copy), as linalg.cpp's asRows.
Tensor asRows(const Tensor& t) {
  const int64_t nd = t.dim();
  const int64_t cols = t.shape().back();
  int64_t rows = 1;
  for (int64_t d = 0; d < nd - 1; ++d) rows *= t.shape()[d];
  // Leading dims (size > 1) must merge into one evenly strided dim.
  int64_t rowStride = -1, expected = -1;
  bool merges = true;
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (t.shape()[d] == 1) continue;
    if (rowStride < 0) {
      rowStride = t.strides()[d];
    } else if (t.strides()[d] != expected) {
      merges = false;
      break;
    }
    expected = t.strides()[d] * t.shape()[d];
  }
  const int64_t cs = t.strides().back();
  if (merges && rows > 0) {
    return viewOf(t, {rows, cols}, {rowStride < 0 ? std::max<int64_t>(cols, 1) * cs : rowStride, cs});
  }
  Tensor copy = contiguousOnDevice(t);
  return viewOf(copy, {rows, cols}, {cols, 1});
}

// out = a2d * b2d (+ bias broadcast over rows); returns out, or a new tensor when the bias had to be added
// separately.
template <typename T>
Tensor gemmTensors(const Tensor& a2d, const Tensor& b2d, const Tensor& out, const Tensor& bias = Tensor()) {
  const int device = deviceOf(out);
  Operand a = operandOf(a2d, {});
  Operand b = operandOf(b2d, {});
  GemmShape s{1, a2d.shape()[0], b2d.shape()[1], a2d.shape()[1]};
  Tensor biasC = bias.defined() ? contiguousOnDevice(bias) : Tensor();
  const bool applied =
      runGemm<T>(device, out.dtype(), s, T(1), a, b, T(0), static_cast<T*>(out.rawData()), out.strides()[0], 0,
                 biasC.defined() ? static_cast<const T*>(biasC.rawData()) : nullptr);
  if (biasC.defined() && !applied) {
    // No Lt algorithm with the bias epilogue for this layout: add it with the element-wise kernels.
    return kernels::binary(kernels::BinaryOp::kAdd, out, biasC, "linear");
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------- entry points

void gemm(int device, bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  DeviceGuard guard(device);
  Operand oa{a, transA, std::max<int64_t>(lda, 1), 0, {}}, ob{b, transB, std::max<int64_t>(ldb, 1), 0, {}};
  runGemm<float>(device, DType::kFloat32, {1, m, n, k}, alpha, oa, ob, beta, c, ldc, 0);
}

void gemm(int device, bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  DeviceGuard guard(device);
  Operand oa{a, transA, std::max<int64_t>(lda, 1), 0, {}}, ob{b, transB, std::max<int64_t>(ldb, 1), 0, {}};
  runGemm<double>(device, DType::kFloat64, {1, m, n, k}, alpha, oa, ob, beta, c, ldc, 0);
}

Tensor batchedMatmul(const Tensor& a, bool transA, const Tensor& b, bool transB, const Shape& outBatch) {
  const char* op = "batchedMatmul";
  requireMatmulOperands(a, b, op);
  DG_CHECK(a.dim() >= 2 && a.dim() == b.dim() && static_cast<int64_t>(outBatch.size()) == a.dim() - 2, op,
           ": expected operands of equal rank >= 2 and an output batch of rank - 2, got ", shapeStr(a.shape()), ", ",
           shapeStr(b.shape()), " and batch ", shapeStr(outBatch));
  const int device = deviceOf(a);
  DeviceGuard guard(device);
  const Tensor la = transA ? transposedView(a) : a;
  const Tensor lb = transB ? transposedView(b) : b;
  const int64_t nd = a.dim(), nb = nd - 2;
  const int64_t m = la.shape()[nd - 2], k = la.shape()[nd - 1], n = lb.shape()[nd - 1];
  DG_CHECK(k == lb.shape()[nd - 2], op, ": shapes ", shapeStr(a.shape()), (transA ? "^T" : ""), " and ",
           shapeStr(b.shape()), (transB ? "^T" : ""), " cannot be multiplied (", k, " != ", lb.shape()[nd - 2], ")");
  Shape fullBatch(static_cast<size_t>(nb));
  std::vector<bool> reduceMask(static_cast<size_t>(nd), false);
  bool reducing = false;
  int64_t batch = 1;
  for (int64_t d = 0; d < nb; ++d) {
    const int64_t sa = a.shape()[d], sb = b.shape()[d];
    DG_CHECK(sa == sb || sa == 1 || sb == 1, op, ": batch dimensions of shapes ", shapeStr(a.shape()), " and ",
             shapeStr(b.shape()), " do not broadcast");
    fullBatch[d] = sa == 1 ? sb : sa;
    DG_CHECK(outBatch[d] == fullBatch[d] || outBatch[d] == 1, op, ": output batch ", shapeStr(outBatch),
             " is neither the broadcast batch nor a reduction of it");
    if (outBatch[d] != fullBatch[d]) {
      reduceMask[d] = true;
      reducing = true;
    }
    batch *= fullBatch[d];
  }
  Shape fullShape = fullBatch;
  fullShape.push_back(m);
  fullShape.push_back(n);
  Tensor out = emptyOn(fullShape, a.dtype(), device);
  const Operand oa = operandOf(la, fullBatch);
  const Operand ob = operandOf(lb, fullBatch);
  dispatchFloat(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    runGemm<T>(device, a.dtype(), {batch, m, n, k}, T(1), oa, ob, T(0), static_cast<T*>(out.rawData()), n, m * n);
  });
  if (!reducing) return out;
  // The summed-over batch dims (the gradient of a broadcast operand): a reduction over the full products.
  // TODO(perf): fold a reduced batch into k when both operands' batches collapse, as the CPU path does.
  return kernels::sumDims(out, reduceMask, /*keepDim=*/true);
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  // kernels::linear validated shapes and dtypes before routing here.
  const char* op = "linear";
  const int device = deviceOf(x);
  DeviceGuard guard(device);
  const int64_t outFeatures = weight.shape()[0];
  Tensor x2 = asRows(x);
  Tensor out = emptyOn({x2.shape()[0], outFeatures}, x.dtype(), device);
  dispatchFloat(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    out = gemmTensors<T>(x2, transposedView(weight), out, bias);
  });
  Shape resultShape = x.shape();
  resultShape.back() = outFeatures;
  return viewOf(out, resultShape, contiguousStrides(resultShape));
}

Tensor linearBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape) {
  requireMatmulOperands(gradOut, weight, "linear backward");
  const int device = deviceOf(gradOut);
  DeviceGuard guard(device);
  Tensor g2 = asRows(gradOut);
  Tensor dx = emptyOn({g2.shape()[0], weight.shape()[1]}, gradOut.dtype(), device);
  dispatchFloat(gradOut.dtype(), "linear backward", [&](auto tag) {
    using T = decltype(tag);
    gemmTensors<T>(g2, weight, dx);
  });
  return viewOf(dx, inputShape, contiguousStrides(inputShape));
}

Tensor linearBackwardWeight(const Tensor& gradOut, const Tensor& input) {
  requireMatmulOperands(gradOut, input, "linear backward");
  const int device = deviceOf(gradOut);
  DeviceGuard guard(device);
  Tensor g2 = asRows(gradOut);
  Tensor x2 = asRows(input);
  Tensor dw = emptyOn({g2.shape()[1], x2.shape()[1]}, gradOut.dtype(), device);
  dispatchFloat(gradOut.dtype(), "linear backward", [&](auto tag) {
    using T = decltype(tag);
    gemmTensors<T>(transposedView(g2), x2, dw);
  });
  return dw;
}

Tensor linearBackwardBias(const Tensor& gradOut) {
  const int device = deviceOf(gradOut);
  DeviceGuard guard(device);
  // A column sum: the reduction kernels' CUDA path.
  return kernels::sumDims(asRows(gradOut), {true, false}, /*keepDim=*/false);
}

}  // namespace distgrad::tensor::cuda::dnn

#endif  // DG_WITH_CUDA
