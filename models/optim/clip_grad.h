// Gradient clipping by global L2 norm (PyTorch's clip_grad_norm_): if the norm of all gradients together
// exceeds maxNorm, every gradient is scaled in place by maxNorm / (norm + 1e-6).
// Gradients may be on the CPU and on CUDA devices, mixed (model parallel across devices): CUDA gradients are
// reduced by a kernel per gradient into one float64 accumulator per device on the current stream, and the
// host waits once per device to read it (returning a double makes that sync unavoidable; PyTorch's
// clip_grad_norm_ returns a tensor instead). CUDA gradients must be contiguous. The device sums meet through
// atomics, so the norm's last bits may vary from run to run on a GPU.
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
