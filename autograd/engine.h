// The local backward engine: dependency counting over the reachable graph and a ready queue.
//
// execute() runs on the calling thread. Nodes become ready once every edge into them has delivered its
// gradient; among ready nodes the most recently created runs first. Gradients arriving at `captures` are
// handed back to the caller instead of (for leaves) accumulated, which is how autograd::grad and the
// distributed engine (per-context accumulation) reuse this engine.
// Thread-safety: independent execute() calls may run concurrently on different threads, also over graphs
// that share leaves (accumulation into a leaf is serialised).
#pragma once

#include <vector>

#include "autograd/node.h"

namespace distgrad::autograd {

struct ExecuteOptions {
  bool retainGraph = false;
  // Edges whose (fully summed) gradient execute() returns, in this order (undefined if none arrived).
  std::vector<Edge> captures;
  // When false, AccumulateGrad nodes do not run: leaves' .grad stays untouched.
  bool accumulateLeaves = true;
};

// Runs backward from `roots` with gradients `rootGrads` (one per root, same shape as the root's tensor).
std::vector<Tensor> execute(const std::vector<Edge>& roots, const std::vector<Tensor>& rootGrads,
                            const ExecuteOptions& options);

// Accumulates d(sum of roots * grads)/d(leaf) into every reachable leaf's .grad. `grads` may be empty
// when every root is a one-element tensor (implicit gradient 1).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {}, bool retainGraph = false);

// Returns d(outputs)/d(inputs) without touching any .grad.
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& gradOutputs = {}, bool retainGraph = false);

}  // namespace distgrad::autograd

namespace distgrad {
// loss.backward() for the common case.
inline void backward(const Tensor& root, const Tensor& grad = Tensor(), bool retainGraph = false) {
  autograd::backward({root}, grad.defined() ? std::vector<Tensor>{grad} : std::vector<Tensor>{}, retainGraph);
}
}  // namespace distgrad
