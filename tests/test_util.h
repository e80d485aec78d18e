// Helpers shared by the test suites: value comparison, error-message checks, random inputs, gradcheck.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "autograd/gradcheck.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

namespace distgrad::testing {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

inline void expectValues(const Tensor& t, const Shape& shape, const std::vector<double>& expected, double tol = 1e-6) {
  ASSERT_EQ(t.shape(), shape);
  auto v = t.toVector<double>();
  ASSERT_EQ(v.size(), expected.size());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], expected[i], tol) << "element " << i;
}

inline void expectNear(const std::vector<double>& actual, const std::vector<double>& expected, double tol) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_NEAR(actual[i], expected[i], tol) << "element " << i;
}

// A tensor of `shape` holding `values` (row-major), converted to `dtype`.
inline Tensor shaped(const std::vector<double>& values, const Shape& shape, DType dtype = DType::kFloat64) {
  return Tensor::fromVector(values, shape).toDType(dtype);
}

// f must throw distgrad::ValueError whose message contains every needle.
template <typename F>
void expectThrowsWith(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    FAIL() << "expected distgrad::ValueError";
  } catch (const ValueError& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << " lacks " << n;
  }
}

// Standard-normal values; float64 leaves that require grad by default (gradcheck inputs).
inline Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat64, bool requiresGrad = true) {
  tensor::Generator gen(seed);
  Tensor t = tensor::normal(shape, 0.0, 1.0, gen, dtype);
  if (requiresGrad) t.setRequiresGrad();
  return t;
}

inline void expectGradcheck(const Fn& fn, const std::vector<Tensor>& inputs) {
  auto r = autograd::gradcheck(fn, inputs);
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace distgrad::testing
