// Reduction kernels of the collectives: plain loops the compiler vectorises (AVX2 for the float types),
// with the 16-bit wire types widened on the fly so a compressed segment is never expanded into a
// temporary.
#include <algorithm>
#include <cstring>

#include "rpc/collectives/detail/collective_op.h"

namespace distgrad::rpc::collectives::detail {

namespace {

using tensor::DType;

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
  if (src.dtype() == DType::kFloat16) {
    const auto* s = static_cast<const uint16_t*>(src.rawData());
    if constexpr (std::is_same_v<T, float>) {
      reduceLoop(op, dst, count, [s](int64_t i) { return tensor::halfToFloat(s[i]); });
      return;
    }
  } else if (src.dtype() == DType::kBFloat16) {
    const auto* s = static_cast<const uint16_t*>(src.rawData());
    if constexpr (std::is_same_v<T, float>) {
      // bfloat16 is the top half of a float32: widening is a shift.
      reduceLoop(op, dst, count, [s](int64_t i) {
        const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof v);
        return v;
      });
      return;
    }
  } else {
    const T* s = static_cast<const T*>(src.rawData());
    reduceLoop(op, dst, count, [s](int64_t i) { return s[i]; });
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
    for (int64_t i = 0; i < count; ++i) dst[i] = tensor::halfToFloat(s[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) {
      const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
      std::memcpy(&dst[i], &bits, sizeof bits);
    }
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
  if (compression == WireCompression::kFloat16) {
    for (int64_t i = 0; i < count; ++i) data[i] = tensor::halfToFloat(tensor::floatToHalf(data[i]));
  } else if (compression == WireCompression::kBFloat16) {
    for (int64_t i = 0; i < count; ++i) data[i] = tensor::bfloat16ToFloat(tensor::floatToBFloat16(data[i]));
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
  return view.toDType(wireDType(view.dtype(), compression));
}

}  // namespace distgrad::rpc::collectives::detail
