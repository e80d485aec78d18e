// Helpers the autograd op tests (conv, linalg, nn, batch_norm, pool) share: seeded inputs, leaves,
// element-wise comparison with a relative tolerance and ValueError checks. Single-threaded test code.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

namespace distgrad::autograd_testing {

// Normal(mean, sd) values from a generator seeded with `seed` (not a leaf: see leaf()).
inline Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat64, double mean = 0,
                    double sd = 1) {
  tensor::Generator gen(seed);
  return tensor::normal(shape, mean, sd, gen, dtype);
}

inline Tensor leaf(Tensor t) {
  t.setRequiresGrad(true);
  return t;
}

// Every element of `actual` within tol * (1 + |expected|) of `expected`; stops at the first that is not.
inline void expectNear(const Tensor& actual, const std::vector<double>& expected, double tol,
                       const std::string& what) {
  std::vector<double> got = actual.toVector<double>();
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], expected[i], tol * (1.0 + std::abs(expected[i]))) << what << " element " << i;
  }
}

// The message of the ValueError f throws ("<no ValueError thrown>" when it throws none).
template <typename F>
std::string errorOf(F&& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "<no ValueError thrown>";
}

// f must throw a ValueError whose message contains `fragment`.
template <typename F>
void expectValueError(F&& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected ValueError mentioning '" << fragment << "'";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace distgrad::autograd_testing
