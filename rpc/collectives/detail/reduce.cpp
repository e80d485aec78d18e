// Reduction kernels of the collectives: plain loops the compiler vectorises (AVX2 for the float types),
// with the 16-bit wire types widened on the fly so a compressed segment is never expanded into a
// temporary.
#include <algorithm>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "rpc/collectives/detail/collective_op.h"

namespace distgrad::rpc::collectives::detail {

namespace {

using tensor::DType;

// 16-bit conversions in blocks: F16C instructions when the CPU has them (every x86-64 since 2013), the
// scalar conversions of tensor/ otherwise; bfloat16 with integer operations the compiler vectorises.
#if defined(__x86_64__)
__attribute__((target("f16c,avx"))) void halfToFloatF16c(const uint16_t* in, float* out, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < count; ++i) out[i] = tensor::halfToFloat(in[i]);
}
__attribute__((target("f16c,avx"))) void floatToHalfF16c(const float* in, uint16_t* out, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < count; ++i) out[i] = tensor::floatToHalf(in[i]);
}
bool hasF16c() {
  static const bool has = __builtin_cpu_supports("f16c");
  return has;
}
#endif

void halfToFloatBlock(const uint16_t* in, float* out, int64_t count) {
#if defined(__x86_64__)
  if (hasF16c()) return halfToFloatF16c(in, out, count);
#endif
  for (int64_t i = 0; i < count; ++i) out[i] = tensor::halfToFloat(in[i]);
}

void floatToHalfBlock(const float* in, uint16_t* out, int64_t count) {
#if defined(__x86_64__)
  if (hasF16c()) return floatToHalfF16c(in, out, count);
#endif
  for (int64_t i = 0; i < count; ++i) out[i] = tensor::floatToHalf(in[i]);
}

void bfloat16ToFloatBlock(const uint16_t* in, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof bits);
  }
}

// Round to nearest even, NaN kept a (quiet) NaN: the same results as tensor::floatToBFloat16.
void floatToBFloat16Block(const float* in, uint16_t* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], sizeof bits);
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    out[i] = static_cast<uint16_t>(nan ? ((bits >> 16) | 0x40u) : rounded);
  }
}

constexpr int64_t kBlock = 2048;

template <typename T, typename Load>
void reduceLoop(ReduceOp op, T* dst, int64_t count, Load load) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
      for (int64_t i = 0; i < count; ++i) dst[i] += load(i);
      return;
    case ReduceOp::kMax:
      for (int64_t i = 0; i < count; ++i) dst[i] = std::max(dst[i], load(i));
      return;
    case ReduceOp::kMin:
      for (int64_t i = 0; i < count; ++i) dst[i] = std::min(dst[i], load(i));
      return;
    case ReduceOp::kProduct:
      for (int64_t i = 0; i < count; ++i) dst[i] *= load(i);
      return;
  }
}

template <typename T>
void reduceTyped(ReduceOp op, T* dst, const Tensor& src, int64_t count) {
  if (src.dtype() == tensor::DTypeOf<T>::value) {
    const T* s = static_cast<const T*>(src.rawData());
    reduceLoop(op, dst, count, [s](int64_t i) { return s[i]; });
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    // A 16-bit wire type: widen a block at a time into a stack buffer, never the whole segment.
    const auto* s = static_cast<const uint16_t*>(src.rawData());
    alignas(64) float wide[kBlock];
    for (int64_t begin = 0; begin < count; begin += kBlock) {
      const int64_t n = std::min(kBlock, count - begin);
      if (src.dtype() == DType::kFloat16) {
        halfToFloatBlock(s + begin, wide, n);
      } else {
        bfloat16ToFloatBlock(s + begin, wide, n);
      }
      reduceLoop(op, dst + begin, n, [&wide](int64_t i) { return wide[i]; });
    }
    return;
  }
  DG_ASSERT(false, "collectives: a 16-bit wire type for a non-float32 tensor");
}

}  // namespace

void reduceInto(ReduceOp op, DType dtype, void* destination, const Tensor& source, int64_t count) {
  switch (dtype) {
    case DType::kFloat32: return reduceTyped(op, static_cast<float*>(destination), source, count);
    case DType::kFloat64: return reduceTyped(op, static_cast<double*>(destination), source, count);
    case DType::kInt64: return reduceTyped(op, static_cast<int64_t*>(destination), source, count);
    default: DG_ASSERT(false, "collectives: unsupported dtype ", tensor::dtypeName(dtype));
  }
}

void copyInto(DType dtype, void* destination, const Tensor& source, int64_t count) {
  if (source.dtype() == dtype) {
    std::memcpy(destination, source.rawData(), static_cast<size_t>(count) * tensor::itemSize(dtype));
    return;
  }
  DG_ASSERT(dtype == DType::kFloat32, "collectives: a 16-bit wire type for a non-float32 tensor");
  auto* dst = static_cast<float*>(destination);
  const auto* s = static_cast<const uint16_t*>(source.rawData());
  if (source.dtype() == DType::kFloat16) {
    halfToFloatBlock(s, dst, count);
  } else {
    bfloat16ToFloatBlock(s, dst, count);
  }
}

void scaleInPlace(DType dtype, void* data, int64_t count, double factor) {
  if (dtype == DType::kFloat32) {
    auto* d = static_cast<float*>(data);
    const auto f = static_cast<float>(factor);
    for (int64_t i = 0; i < count; ++i) d[i] *= f;
  } else if (dtype == DType::kFloat64) {
    auto* d = static_cast<double*>(data);
    for (int64_t i = 0; i < count; ++i) d[i] *= factor;
  } else {
    DG_ASSERT(false, "collectives: mean of a non-float tensor");
  }
}

void roundToWire(WireCompression compression, float* data, int64_t count) {
  if (compression == WireCompression::kNone) return;
  alignas(64) uint16_t narrow[kBlock];
  for (int64_t begin = 0; begin < count; begin += kBlock) {
    const int64_t n = std::min(kBlock, count - begin);
    if (compression == WireCompression::kFloat16) {
      floatToHalfBlock(data + begin, narrow, n);
      halfToFloatBlock(narrow, data + begin, n);
    } else {
      floatToBFloat16Block(data + begin, narrow, n);
      bfloat16ToFloatBlock(narrow, data + begin, n);
    }
  }
}

Tensor flatView(const Tensor& base, int64_t offset, int64_t count) {
  const size_t item = base.itemSize();
  auto* data = static_cast<char*>(base.rawData()) + static_cast<size_t>(offset) * item;
  tensor::Storage alias = tensor::Storage::wrap(data, static_cast<size_t>(count) * item, base.device(),
                                                [keep = base.storage()](void*) {});
  return Tensor::fromStorage(std::move(alias), {count}, {1}, 0, base.dtype());
}

tensor::DType wireDType(DType dtype, WireCompression compression) {
  switch (compression) {
    case WireCompression::kNone: return dtype;
    case WireCompression::kFloat16: return DType::kFloat16;
    case WireCompression::kBFloat16: return DType::kBFloat16;
  }
  return dtype;
}

Tensor toWire(const Tensor& view, WireCompression compression) {
  if (compression == WireCompression::kNone) return view;
  DG_ASSERT(view.dtype() == DType::kFloat32 && view.isContiguous(), "collectives: compressing a non-float32 view");
  Tensor out = Tensor::empty({view.numel()}, wireDType(view.dtype(), compression));
  const auto* in = static_cast<const float*>(view.rawData());
  auto* narrow = static_cast<uint16_t*>(out.rawData());
  if (compression == WireCompression::kFloat16) {
    floatToHalfBlock(in, narrow, view.numel());
  } else {
    floatToBFloat16Block(in, narrow, view.numel());
  }
  return out;
}

}  // namespace distgrad::rpc::collectives::detail
