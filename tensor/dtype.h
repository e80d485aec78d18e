// Element types and devices of tensors.
// Thread-safety: value types, freely copyable.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>

#include "tensor/error.h"

namespace distgrad::tensor {

// float32 is the training type, float64 backs gradchecks, int64 holds labels and indices, and the two
// 16-bit float types are storage types (converted with Tensor::to, computed in float32).
enum class DType : uint8_t { kFloat32 = 0, kFloat64 = 1, kInt64 = 2, kBFloat16 = 3, kFloat16 = 4 };

inline constexpr int kNumDTypes = 5;

constexpr size_t itemSize(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kInt64: return 8;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
  }
  return 0;
}

constexpr const char* dtypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt64: return "int64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
  }
  return "?";
}

constexpr bool isFloatingPoint(DType t) { return t != DType::kInt64; }

inline std::ostream& operator<<(std::ostream& out, DType t) { return out << dtypeName(t); }

// Maps C++ element types to DType.
template <typename T>
struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kFloat64; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kInt64; };

// 16-bit float conversions (round to nearest even).
uint16_t floatToBFloat16(float v);
float bfloat16ToFloat(uint16_t v);
uint16_t floatToHalf(float v);
float halfToFloat(uint16_t v);

enum class DeviceType : uint8_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int16_t index = -1;  // -1 on CPU; the CUDA ordinal otherwise

  static Device cpu() { return Device{}; }
  static Device cuda(int index) { return Device{DeviceType::kCUDA, static_cast<int16_t>(index)}; }
  bool isCpu() const { return type == DeviceType::kCPU; }
  bool isCuda() const { return type == DeviceType::kCUDA; }
  friend bool operator==(const Device&, const Device&) = default;
  std::string str() const { return isCpu() ? "cpu" : "cuda:" + std::to_string(index); }
};

inline std::ostream& operator<<(std::ostream& out, const Device& d) { return out << d.str(); }

}  // namespace distgrad::tensor
