// CUDA layout kernels and Tensor basics: strided copies (with broadcasting), dtype conversion, fill and
// cat on the device. Same-dtype copies move raw 2/4/8-byte words, so they also carry the 16-bit storage
// types; conversions go through double like the CPU's (loadAsDouble/storeFromDouble in tensor.cpp), and
// the 16-bit types round to nearest even with CUDA's intrinsics, as the CPU's converters do.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>

#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor::cuda {
namespace {

template <typename U>
struct CopyFn {
  U* dst;
  const U* src;
  __device__ void operator()(const int64_t (&o)[2]) const { dst[o[0]] = src[o[1]]; }
};

__device__ __forceinline__ double loadAsDouble(const char* p, DType t) {
  switch (t) {
    case DType::kFloat32: return *reinterpret_cast<const float*>(p);
    case DType::kFloat64: return *reinterpret_cast<const double*>(p);
    case DType::kInt64: return static_cast<double>(*reinterpret_cast<const int64_t*>(p));
    case DType::kBFloat16: return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
    case DType::kFloat16: return __half2float(*reinterpret_cast<const __half*>(p));
  }
  return 0;
}

__device__ __forceinline__ void storeFromDouble(char* p, DType t, double v) {
  switch (t) {
    case DType::kFloat32: *reinterpret_cast<float*>(p) = static_cast<float>(v); break;
    case DType::kFloat64: *reinterpret_cast<double*>(p) = v; break;
    case DType::kInt64: *reinterpret_cast<int64_t*>(p) = static_cast<int64_t>(v); break;
    case DType::kBFloat16: *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(static_cast<float>(v)); break;
    case DType::kFloat16: *reinterpret_cast<__half*>(p) = __float2half_rn(static_cast<float>(v)); break;
  }
}

struct ConvertFn {
  char* dst;
  const char* src;
  DType dstType, srcType;
  int64_t dstItem, srcItem;
  __device__ void operator()(const int64_t (&o)[2]) const {
    storeFromDouble(dst + o[0] * dstItem, dstType, loadAsDouble(src + o[1] * srcItem, srcType));
  }
};

template <typename U>
struct FillFn {
  U* dst;
  U value;
  __device__ void operator()(const int64_t (&o)[1]) const { dst[o[0]] = value; }
};

// Calls f(U{}) with U an unsigned word of the dtype's size.
template <typename F>
void dispatchWord(DType dtype, F&& f) {
  switch (itemSize(dtype)) {
    case 2: f(uint16_t{}); return;
    case 4: f(uint32_t{}); return;
    case 8: f(uint64_t{}); return;
    default: DG_ASSERT(false, "unexpected item size ", itemSize(dtype));
  }
}

}  // namespace

void copyInto(const Tensor& dst, const Tensor& src, const char* op) {
  DG_CHECK(dst.dtype() == src.dtype(), op, ": dtype mismatch: destination ", dtypeName(dst.dtype()), ", source ",
           dtypeName(src.dtype()));
  DG_CHECK(src.dim() <= dst.dim(), op, ": cannot broadcast ", shapeStr(src.shape()), " to ", shapeStr(dst.shape()));
  for (int64_t i = 0; i < src.dim(); ++i) {
    const int64_t s = src.shape()[i];
    const int64_t d = dst.shape()[dst.dim() - src.dim() + i];
    DG_CHECK(s == d || s == 1, op, ": cannot broadcast ", shapeStr(src.shape()), " to ", shapeStr(dst.shape()));
  }
  if (dst.numel() == 0) return;
  dispatchWord(dst.dtype(), [&](auto tag) {
    using U = decltype(tag);
    launchPointwise<2>(op, dst.device(), dst.shape(), {dst.strides(), broadcastStridesOf(src, dst.shape())},
                       CopyFn<U>{static_cast<U*>(dst.rawData()), static_cast<const U*>(src.rawData())});
  });
}

void copyConvert(const Tensor& dst, const Tensor& src) {
  DG_CHECK(dst.shape() == src.shape(), "Tensor::copyFrom: source shape ", shapeStr(src.shape()),
           " does not match destination shape ", shapeStr(dst.shape()));
  if (dst.dtype() == src.dtype()) {
    copyInto(dst, src, "Tensor::copyFrom");
    return;
  }
  launchPointwise<2>("Tensor::copyFrom (dtype conversion)", dst.device(), dst.shape(), {dst.strides(), src.strides()},
                     ConvertFn{static_cast<char*>(dst.rawData()), static_cast<const char*>(src.rawData()), dst.dtype(),
                               src.dtype(), static_cast<int64_t>(dst.itemSize()), static_cast<int64_t>(src.itemSize())});
}

void fill(const Tensor& t, double value) {
  // The element's bit pattern, made on the host with the CPU's converters.
  uint64_t pattern = 0;
  switch (t.dtype()) {
    case DType::kFloat32: { float v = static_cast<float>(value); std::memcpy(&pattern, &v, 4); break; }
    case DType::kFloat64: std::memcpy(&pattern, &value, 8); break;
    case DType::kInt64: { int64_t v = static_cast<int64_t>(value); std::memcpy(&pattern, &v, 8); break; }
    case DType::kBFloat16: pattern = floatToBFloat16(static_cast<float>(value)); break;
    case DType::kFloat16: pattern = floatToHalf(static_cast<float>(value)); break;
  }
  if (t.numel() == 0) return;
  dispatchWord(t.dtype(), [&](auto tag) {
    using U = decltype(tag);
    U word;
    std::memcpy(&word, &pattern, sizeof(U));  // little-endian: the low bytes hold the element
    launchPointwise<1>("Tensor::fill", t.device(), t.shape(), {t.strides()},
                       FillFn<U>{static_cast<U*>(t.rawData()), word});
  });
}

Tensor cat(const std::vector<Tensor>& tensors, const Shape& outShape, int64_t dim, const char* op) {
  const Tensor& first = tensors[0];
  Tensor out = Tensor::empty(outShape, first.dtype(), first.device());
  int64_t start = 0;
  for (const Tensor& t : tensors) {
    const int64_t len = t.shape()[dim];
    if (len > 0 && t.numel() > 0) {
      Tensor dst = kernels::asStrided(out, t.shape(), out.strides(), start * out.strides()[dim]);
      copyInto(dst, t, op);
    }
    start += len;
  }
  return out;
}

}  // namespace distgrad::tensor::cuda
