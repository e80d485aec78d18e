// Gradient clipping by global L2 norm (PyTorch's clip_grad_norm_): if the norm of all gradients together
// exceeds maxNorm, every gradient is scaled in place by maxNorm / (norm + 1e-6).
// Thread-safety: not thread-safe with respect to a concurrent backward writing the same gradients.
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace distgrad::models::optim {

// The total L2 norm of the defined gradients (computed in double).
double gradNorm(const std::vector<Tensor>& grads);
// Clips the parameters' .grad; returns the norm before clipping.
double clipGradNorm(const std::vector<Tensor>& parameters, double maxNorm);
// Clips explicit gradients (e.g. a distributed context's) in place; returns the norm before clipping.
double clipGradients(const std::vector<Tensor>& grads, double maxNorm);

}  // namespace distgrad::models::optim
