// The CUDA implementations behind the kernels:: entry points of tensor/cpu/elementwise.h, reduce.h,
// shape_kernels.h and tensor/random.h, plus the device side of Tensor's copy/fill. Callers use the
// kernels:: functions, which route here when their operands are on a CUDA device (deviceOf below); these
// functions assume the routing was done (all operands on one CUDA device) and validate the rest with the
// same messages as the CPU kernels.
//
// Every kernel is queued on the calling thread's current stream of the operands' device
// (Stream::current) and returns without waiting for it; results are allocated on that stream too.
// Built without CUDA, each throws ValueError ("built without CUDA", tensor_kernels_stub.cpp).
// Thread-safety: stateless; safe to call concurrently.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "tensor/cpu/elementwise.h"
#include "tensor/cuda/device_check.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::cuda {

// True when the operand(s) of `op` are on a CUDA device (the routing test at the kernels:: entry points).
inline bool routeToCuda(const char* op, const Tensor& a) { return deviceOf(op, {{"input", &a}}).isCuda(); }
inline bool routeToCuda(const char* op, const Tensor& a, const Tensor& b) {
  return deviceOf(op, {{"first operand", &a}, {"second operand", &b}}).isCuda();
}

// ---- elementwise (tensor/cpu/elementwise.h) ----
Tensor binary(kernels::BinaryOp op, const Tensor& a, const Tensor& b, const char* name);
Tensor unary(kernels::UnaryOp op, const Tensor& a, const char* name);
Tensor addScalar(const Tensor& a, double b);
Tensor mulScalar(const Tensor& a, double b);
Tensor powScalar(const Tensor& a, double exponent);
Tensor clamp(const Tensor& a, double min, double max);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
enum class PointwiseBackward { kRelu, kSigmoid, kTanh, kSqrt, kGelu, kAbs, kPow, kClamp };
// grad * f'(saved) for the unary ops; p0/p1 carry the exponent (kPow) or min/max (kClamp).
Tensor pointwiseBackward(PointwiseBackward kind, const Tensor& grad, const Tensor& saved, double p0, double p1,
                         const char* name);
void maxMinBackward(const Tensor& grad, const Tensor& a, const Tensor& b, bool isMax, Tensor* gradA,
                    Tensor* gradB);

// ---- reductions (tensor/cpu/reduce.h) ----
Tensor sumDims(const Tensor& a, const std::vector<bool>& mask, bool keepDim);
Tensor maxAll(const Tensor& a);
void maxDim(const Tensor& a, int64_t dim, bool keepDim, Tensor* values, Tensor* indices, const char* op);
// Geometry validated by kernels::maxDimBackward: the input is [outer, size, inner] around the reduced dim.
Tensor maxDimBackward(const Tensor& grad, const Tensor& indices, const Shape& inputShape, int64_t outer,
                      int64_t size, int64_t inner);

// ---- layout and Tensor basics (tensor/cpu/shape_kernels.h, tensor/tensor.h) ----
// dst = src (same dtype, src broadcast to dst's shape; any strides), both on the same CUDA device.
void copyInto(const Tensor& dst, const Tensor& src, const char* op);
// dst = src converted to dst's dtype (same shape; any strides, any dtypes incl. the 16-bit storage types).
void copyConvert(const Tensor& dst, const Tensor& src);
// Every element of t (any strides) set to value converted to t's dtype.
void fill(const Tensor& t, double value);
Tensor cat(const std::vector<Tensor>& tensors, const Shape& outShape, int64_t dim, const char* op);

// ---- random (tensor/random.h): Philox4x32-10 keyed by `seed`, see random.cu ----
Tensor uniform(const Shape& shape, double low, double high, uint64_t seed, DType dtype, Device device);
Tensor normal(const Shape& shape, double mean, double stddev, uint64_t seed, DType dtype, Device device);

}  // namespace distgrad::tensor::cuda
