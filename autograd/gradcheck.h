// Finite-difference gradient checking for differentiable ops and modules.
//
// gradcheck compares, for a random projection v of the output, the analytic gradient of <f(x), v> (from
// backward) with central differences ((<f(x+eps e_i), v> - <f(x-eps e_i), v>) / 2eps) for every element of
// every input that requires grad. Use float64 inputs. Thread-safety: reentrant.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace distgrad::autograd {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
  uint64_t seed = 1234;
};

struct GradcheckResult {
  bool ok = true;
  std::string message;  // the first mismatch, naming the input and element
  explicit operator bool() const { return ok; }
};

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& options = {});

}  // namespace distgrad::autograd
