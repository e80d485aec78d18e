#include "tensor/cpu/shape_kernels.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/strided.h"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor::kernels {
namespace {

#if defined(__AVX2__)
// In-register transposes of one block: src holds `lanes` rows (stride srcCol) of `lanes` contiguous
// elements; dst receives the transpose (rows of stride dstRow). Shuffles move bits untouched, so these
// serve every dtype of the element size (NaN payloads included).
inline void transposeBlock(const uint32_t* srcU, int64_t srcCol, uint32_t* dstU, int64_t dstRow) {
  const float* src = reinterpret_cast<const float*>(srcU);
  float* dst = reinterpret_cast<float*>(dstU);
  __m256 r0 = _mm256_loadu_ps(src + 0 * srcCol), r1 = _mm256_loadu_ps(src + 1 * srcCol);
  __m256 r2 = _mm256_loadu_ps(src + 2 * srcCol), r3 = _mm256_loadu_ps(src + 3 * srcCol);
  __m256 r4 = _mm256_loadu_ps(src + 4 * srcCol), r5 = _mm256_loadu_ps(src + 5 * srcCol);
  __m256 r6 = _mm256_loadu_ps(src + 6 * srcCol), r7 = _mm256_loadu_ps(src + 7 * srcCol);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(dst + 0 * dstRow, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * dstRow, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * dstRow, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * dstRow, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * dstRow, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * dstRow, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * dstRow, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * dstRow, _mm256_permute2f128_ps(u3, u7, 0x31));
}

inline void transposeBlock(const uint64_t* srcU, int64_t srcCol, uint64_t* dstU, int64_t dstRow) {
  const double* src = reinterpret_cast<const double*>(srcU);
  double* dst = reinterpret_cast<double*>(dstU);
  const __m256d r0 = _mm256_loadu_pd(src + 0 * srcCol), r1 = _mm256_loadu_pd(src + 1 * srcCol);
  const __m256d r2 = _mm256_loadu_pd(src + 2 * srcCol), r3 = _mm256_loadu_pd(src + 3 * srcCol);
  const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
  const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
  _mm256_storeu_pd(dst + 0 * dstRow, _mm256_permute2f128_pd(t0, t2, 0x20));
  _mm256_storeu_pd(dst + 1 * dstRow, _mm256_permute2f128_pd(t1, t3, 0x20));
  _mm256_storeu_pd(dst + 2 * dstRow, _mm256_permute2f128_pd(t0, t2, 0x31));
  _mm256_storeu_pd(dst + 3 * dstRow, _mm256_permute2f128_pd(t1, t3, 0x31));
}
template <typename U>
constexpr int64_t kBlockLanes = (std::is_same_v<U, uint32_t> || std::is_same_v<U, uint64_t>) ? 32 / sizeof(U) : 0;
#else
template <typename U>
constexpr int64_t kBlockLanes = 0;
#endif

// dst[r * dstRowStride + c] = src[r + c * srcColStride] for an R x C block: a transpose. Walking 32x32
// tiles keeps both the rows being written and the columns being read in cache (a plain row-by-row loop
// touches a new cache line of src for every element); inside a tile, 8x8 (4-byte) or 4x4 (8-byte) blocks
// are transposed in registers.
template <typename U>
void transposeTiles(U* dst, int64_t dstRowStride, const U* src, int64_t srcColStride, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = std::min(rows, r0 + kTile);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = std::min(cols, c0 + kTile);
      int64_t rDone = r0;
#if defined(__AVX2__)
      if constexpr (kBlockLanes<U> > 0) {
        constexpr int64_t b = kBlockLanes<U>;
        for (; rDone + b <= r1; rDone += b) {
          int64_t c = c0;
          for (; c + b <= c1; c += b) {
            transposeBlock(src + rDone + c * srcColStride, srcColStride, dst + rDone * dstRowStride + c, dstRowStride);
          }
          for (int64_t r = rDone; r < rDone + b; ++r) {
            for (int64_t cc = c; cc < c1; ++cc) dst[r * dstRowStride + cc] = src[r + cc * srcColStride];
          }
        }
      }
#endif
      for (int64_t r = rDone; r < r1; ++r) {
        U* o = dst + r * dstRowStride;
        const U* in = src + r;
        for (int64_t c = c0; c < c1; ++c) o[c] = in[c * srcColStride];
      }
    }
  }
}

// Copies with the element's bit pattern (U is an unsigned integer of the element's size), so one loop
// serves every dtype of that size.
template <typename U>
void copyTyped(const Tensor& dst, const Tensor& src, const Shape& srcStrides) {
  const int64_t isz = static_cast<int64_t>(sizeof(U));
  Shape shape = dst.shape();
  std::array<Shape, 2> strides{dst.strides(), srcStrides};
  coalesceDims(shape, strides);
  const int64_t nd = static_cast<int64_t>(shape.size());
  // Transpose-like layouts (contiguous destination rows, source contiguous along the second-to-last dim:
  // contiguous(transpose(x)), NCHW <-> NHWC permutes) go through cache tiles, once per leading index.
  if (nd >= 2 && strides[0][nd - 1] == 1 && strides[1][nd - 2] == 1 && strides[1][nd - 1] != 1 &&
      shape[nd - 1] >= 8 && shape[nd - 2] >= 8) {
    const int64_t rows = shape[nd - 2], cols = shape[nd - 1];
    const int64_t dstRow = strides[0][nd - 2], srcCol = strides[1][nd - 1];
    Shape outerShape(shape.begin(), shape.end() - 2);
    if (outerShape.empty()) outerShape.push_back(1);
    Shape outerDst(strides[0].begin(), strides[0].end() - 2), outerSrc(strides[1].begin(), strides[1].end() - 2);
    if (outerDst.empty()) {
      outerDst.push_back(0);
      outerSrc.push_back(0);
    }
    for (auto& v : outerDst) v *= isz;
    for (auto& v : outerSrc) v *= isz;
    // Iterate the leading dims with forEachStrided, one tile pass per visited index.
    forEachStrided<2>(outerShape, {outerDst, outerSrc},
                      {static_cast<char*>(dst.rawData()), static_cast<char*>(src.rawData())},
                      [&](const std::array<char*, 2>& p, const std::array<int64_t, 2>& s, int64_t n) {
                        for (int64_t i = 0; i < n; ++i) {
                          transposeTiles<U>(reinterpret_cast<U*>(p[0] + i * s[0]), dstRow,
                                            reinterpret_cast<const U*>(p[1] + i * s[1]), srcCol, rows, cols);
                        }
                      });
    return;
  }
  Shape dstBytes(nd), srcBytes(nd);
  for (int64_t i = 0; i < nd; ++i) {
    dstBytes[i] = strides[0][i] * isz;
    srcBytes[i] = strides[1][i] * isz;
  }
  forEachStrided<2>(shape, {dstBytes, srcBytes},
                    {static_cast<char*>(dst.rawData()), static_cast<char*>(src.rawData())},
                    [&](const std::array<char*, 2>& p, const std::array<int64_t, 2>& s, int64_t n) {
                      U* o = reinterpret_cast<U*>(p[0]);
                      const U* in = reinterpret_cast<const U*>(p[1]);
                      const int64_t so = s[0] / isz;
                      const int64_t si = s[1] / isz;
                      if (so == 1 && si == 1) {
                        std::memmove(o, in, static_cast<size_t>(n) * sizeof(U));
                      } else if (so == 1 && si == 0) {
                        const U v = *in;
                        for (int64_t i = 0; i < n; ++i) o[i] = v;
                      } else if (so == 1) {
                        for (int64_t i = 0; i < n; ++i) o[i] = in[i * si];
                      } else {
                        for (int64_t i = 0; i < n; ++i) o[i * so] = in[i * si];
                      }
                    });
}

}  // namespace

Tensor asStrided(const Tensor& t, const Shape& shape, const Shape& strides, int64_t offset) {
  return Tensor::fromStorage(t.storage(), shape, strides, offset, t.dtype());
}

std::optional<Shape> viewStrides(const Shape& oldShape, const Shape& oldStrides, const Shape& newShape) {
  if (numelOf(oldShape) == 0 || oldShape.empty()) return contiguousStrides(newShape);
  // Walk both shapes from the right, matching "chunks" of old dims that are contiguous with each other
  // (the same algorithm as PyTorch's computeStride): a view exists iff every new dim falls inside one chunk.
  const int64_t newNd = static_cast<int64_t>(newShape.size());
  Shape newStrides(newShape.size(), 0);
  int64_t viewD = newNd - 1;
  int64_t chunkBaseStride = oldStrides.back();
  int64_t tensorNumel = 1;
  int64_t viewNumel = 1;
  for (int64_t tensorD = static_cast<int64_t>(oldShape.size()) - 1; tensorD >= 0; --tensorD) {
    tensorNumel *= oldShape[tensorD];
    const bool chunkEnds = tensorD == 0 || (oldShape[tensorD - 1] != 1 &&
                                            oldStrides[tensorD - 1] != tensorNumel * chunkBaseStride);
    if (!chunkEnds) continue;
    while (viewD >= 0 && (viewNumel < tensorNumel || newShape[viewD] == 1)) {
      newStrides[viewD] = viewNumel * chunkBaseStride;
      viewNumel *= newShape[viewD];
      --viewD;
    }
    if (viewNumel != tensorNumel) return std::nullopt;
    if (tensorD > 0) {
      chunkBaseStride = oldStrides[tensorD - 1];
      tensorNumel = 1;
      viewNumel = 1;
    }
  }
  if (viewD != -1) return std::nullopt;
  return newStrides;
}

void copyInto(const Tensor& dst, const Tensor& src, const char* op) {
  if (cuda::deviceOf(op, {{"destination", &dst}, {"source", &src}}).isCuda()) {
    cuda::copyInto(dst, src, op);
    return;
  }
  requireCpuTensor(dst, op, "destination");
  requireCpuTensor(src, op, "source");
  DG_CHECK(dst.dtype() == src.dtype(), op, ": dtype mismatch: destination ", dtypeName(dst.dtype()), ", source ",
           dtypeName(src.dtype()));
  DG_CHECK(src.dim() <= dst.dim(), op, ": cannot broadcast ", shapeStr(src.shape()), " to ", shapeStr(dst.shape()));
  Shape srcStrides(dst.dim(), 0);
  const int64_t lead = dst.dim() - src.dim();
  for (int64_t i = 0; i < src.dim(); ++i) {
    const int64_t s = src.shape()[i];
    const int64_t d = dst.shape()[lead + i];
    DG_CHECK(s == d || s == 1, op, ": cannot broadcast ", shapeStr(src.shape()), " to ", shapeStr(dst.shape()));
    srcStrides[lead + i] = s == 1 ? 0 : src.strides()[i];
  }
  if (dst.numel() == 0) return;
  switch (dst.itemSize()) {
    case 2: copyTyped<uint16_t>(dst, src, srcStrides); break;
    case 4: copyTyped<uint32_t>(dst, src, srcStrides); break;
    case 8: copyTyped<uint64_t>(dst, src, srcStrides); break;
    default: DG_ASSERT(false, "unsupported item size ", dst.itemSize());
  }
}

Tensor contiguous(const Tensor& t) {
  if (t.isContiguous()) return t;
  cuda::routeToCuda("contiguous", t);  // a CUDA device that is unusable fails here, naming the op
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  copyInto(out, t, "contiguous");
  return out;
}

Tensor contiguousAs(const Tensor& t, DType dtype) {
  if (!t.defined()) return t;
  return t.dtype() == dtype ? contiguous(t) : t.toDType(dtype);  // toDType writes a contiguous tensor
}

Tensor broadcastTo(const Tensor& t, const Shape& shape, const char* op) {
  cuda::routeToCuda(op, t);  // a CUDA device that is unusable fails here, naming the op
  Tensor out = Tensor::empty(shape, t.dtype(), t.device());
  copyInto(out, t, op);
  return out;
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim, const char* op) {
  DG_CHECK(!tensors.empty(), op, ": expected at least one tensor");
  const Tensor& first = tensors[0];
  DG_CHECK(first.defined(), op, ": tensor 0 is undefined");
  const int64_t nd = first.dim();
  DG_CHECK(nd > 0, op, ": cannot concatenate 0-d tensors (unsqueeze them or use stack)");
  DG_ASSERT(dim >= 0 && dim < nd, "cat dim must be wrapped");
  Shape outShape = first.shape();
  outShape[dim] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    DG_CHECK(t.defined(), op, ": tensor ", i, " is undefined");
    DG_CHECK(t.device() == first.device(), op, ": operands are on different devices: tensor ", i, " on ",
             t.device().str(), ", tensor 0 on ", first.device().str(), " (move one with .to(device))");
    DG_CHECK(t.dtype() == first.dtype(), op, ": tensor ", i, " has dtype ", dtypeName(t.dtype()),
             " but tensor 0 has ", dtypeName(first.dtype()));
    DG_CHECK(t.dim() == nd, op, ": tensor ", i, " has shape ", shapeStr(t.shape()), " but tensor 0 has shape ",
             shapeStr(first.shape()), " (ranks differ)");
    for (int64_t d = 0; d < nd; ++d) {
      DG_CHECK(d == dim || t.shape()[d] == first.shape()[d], op, ": tensor ", i, " has shape ",
               shapeStr(t.shape()), " but tensor 0 has shape ", shapeStr(first.shape()),
               " (sizes must match except in dim ", dim, ")");
    }
    outShape[dim] += t.shape()[dim];
  }
  if (cuda::routeToCuda(op, first)) return cuda::cat(tensors, outShape, dim, op);
  requireCpuTensor(first, op);
  Tensor out = Tensor::empty(outShape, first.dtype());
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= outShape[d];
  for (int64_t d = dim + 1; d < nd; ++d) inner *= outShape[d];
  const size_t isz = first.itemSize();
  const size_t outRowBytes = static_cast<size_t>(outShape[dim] * inner) * isz;
  int64_t start = 0;
  for (const Tensor& t : tensors) {
    const int64_t len = t.shape()[dim];
    if (len > 0 && t.numel() > 0) {
      if (t.isContiguous()) {
        // Each outer index contributes one contiguous block of len*inner elements.
        const size_t blockBytes = static_cast<size_t>(len * inner) * isz;
        const char* in = static_cast<const char*>(t.rawData());
        char* o = static_cast<char*>(out.rawData()) + static_cast<size_t>(start * inner) * isz;
        for (int64_t i = 0; i < outer; ++i) std::memcpy(o + i * outRowBytes, in + i * blockBytes, blockBytes);
      } else {
        Shape strides = out.strides();
        Tensor dst = asStrided(out, t.shape(), strides, start * out.strides()[dim]);
        copyInto(dst, t, op);
      }
    }
    start += len;
  }
  return out;
}

}  // namespace distgrad::tensor::kernels
