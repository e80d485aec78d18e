// The autograd graph: Nodes (backward functions) linked by Edges.
//
// A differentiable op that sees an input requiring grad creates one Node whose next edges point at the
// nodes that produced its inputs (or the AccumulateGrad node of a leaf). The engine (autograd/engine.h)
// walks these edges backwards. Nodes never own the tensors they produced (only weak references, for
// retain_grad), so graphs have no reference cycles; hooks on those tensors are kept by the node itself.
// Thread-safety: a graph may be executed by one engine task at a time; AccumulateGrad serialises
// accumulation into a leaf that several tasks share.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensor/cuda/runtime.h"
#include "tensor/tensor.h"

namespace distgrad::autograd {

class Node;

struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t inputNr = 0;  // which of fn's gradient inputs this edge feeds
  bool valid() const { return fn != nullptr; }
};

// Shape/dtype of a tensor at one end of a node, for validating gradients and zero-filling missing ones.
struct TensorMeta {
  Shape shape;
  DType dtype = DType::kFloat32;
  Device device;
  static TensorMeta of(const Tensor& t) { return {t.shape(), t.dtype(), t.device()}; }
  Tensor zeros() const { return Tensor::zeros(shape, dtype, device); }
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  explicit Node(std::string name);
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Computes one gradient per next edge from one gradient per forward output. Gradients for outputs that
  // received none are zero-filled by the engine before the call.
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& gradOutputs) = 0;
  // Frees saved tensors after a backward without retain_graph; a second backward then fails clearly.
  virtual void releaseSaved() {}

  const std::string& name() const { return name_; }
  // Order of creation; the engine runs later nodes first (keeps activation memory low).
  uint64_t sequenceNr() const { return sequenceNr_; }

  std::vector<Edge>& nextEdges() { return nextEdges_; }
  const std::vector<Edge>& nextEdges() const { return nextEdges_; }
  // Metadata of each forward input (parallel to nextEdges): gradients returned by apply must match it.
  std::vector<TensorMeta>& inputMeta() { return inputMeta_; }
  const std::vector<TensorMeta>& inputMeta() const { return inputMeta_; }
  // Metadata of each forward output, and weak references to the outputs (for tensor hooks/retain_grad).
  std::vector<TensorMeta>& outputMeta() { return outputMeta_; }
  const std::vector<TensorMeta>& outputMeta() const { return outputMeta_; }
  std::vector<std::weak_ptr<tensor::TensorImpl>>& outputs() { return outputs_; }
  uint32_t numOutputs() const { return static_cast<uint32_t>(outputMeta_.size()); }

  // True if gradient `i` (for forward input i) is wanted by some later node.
  bool needsInputGrad(size_t i) const { return i < nextEdges_.size() && nextEdges_[i].valid(); }

  // Hooks run around apply(): pre-hooks may replace incoming gradients, post-hooks see inputs and results.
  using PreHook = std::function<void(std::vector<Tensor>& gradOutputs)>;
  using PostHook = std::function<void(const std::vector<Tensor>& gradInputs, const std::vector<Tensor>& gradOutputs)>;
  void addPreHook(PreHook hook) { preHooks_.push_back(std::move(hook)); }
  // A hook on the gradient of forward output `output` (Tensor::registerHook on a non-leaf): kept here,
  // not in the tensor, so it runs even when nobody holds the tensor any more. Runs before the pre-hooks.
  using TensorHook = std::function<Tensor(const Tensor&)>;
  void addTensorHook(uint32_t output, TensorHook hook) { tensorHooks_.emplace_back(output, std::move(hook)); }
  const std::vector<std::pair<uint32_t, TensorHook>>& tensorHooks() const { return tensorHooks_; }
  void addPostHook(PostHook hook) { postHooks_.push_back(std::move(hook)); }
  const std::vector<PreHook>& preHooks() const { return preHooks_; }
  const std::vector<PostHook>& postHooks() const { return postHooks_; }

  // The current stream of the forward's CUDA device when any forward input was on one (recordOp sets it);
  // the engine runs apply() on it (Note [Backward streams] in autograd/graph_task.cpp).
  const std::optional<tensor::cuda::Stream>& forwardStream() const { return forwardStream_; }
  void setForwardStream(const tensor::cuda::Stream& stream) { forwardStream_ = stream; }

 private:
  std::string name_;
  uint64_t sequenceNr_;
  std::vector<Edge> nextEdges_;
  std::vector<TensorMeta> inputMeta_;
  std::vector<TensorMeta> outputMeta_;
  std::vector<std::weak_ptr<tensor::TensorImpl>> outputs_;
  std::vector<PreHook> preHooks_;
  std::vector<PostHook> postHooks_;
  std::vector<std::pair<uint32_t, TensorHook>> tensorHooks_;  // in registration order
  std::optional<tensor::cuda::Stream> forwardStream_;
};

// Sink node for a leaf that requires grad: adds the incoming gradient into the leaf's .grad.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<tensor::TensorImpl> leaf);
  std::vector<Tensor> apply(std::vector<Tensor>&& gradOutputs) override;
  Tensor variable() const { return Tensor(leaf_); }

 private:
  std::shared_ptr<tensor::TensorImpl> leaf_;
};

// The node most ops use: a backward closure that captures what it saved (always detached tensors, so
// nothing points back at the node's own outputs).
// Known limitation: saved tensors alias their storage and there is no version counter yet, so writing a
// saved tensor in place between forward and backward (an optimizer step, copyFrom, fill, loadStateDict)
// silently changes the gradients. Step the optimizer after backward, as the usual loop does.
// TODO(correctness): a storage version counter checked when a node runs, like PyTorch's saved variables.
class FunctionNode final : public Node {
 public:
  // Returns one gradient per forward input (undefined for inputs that need none, see needsInputGrad).
  using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& gradOutputs, const Node& self)>;
  FunctionNode(std::string name, BackwardFn fn) : Node(std::move(name)), fn_(std::move(fn)) {}
  std::vector<Tensor> apply(std::vector<Tensor>&& gradOutputs) override;
  void releaseSaved() override { fn_ = nullptr; }

 private:
  BackwardFn fn_;
};

// The edge a gradient for `t` must flow into: its grad_fn, or its leaf's AccumulateGrad (created on
// demand), or an invalid edge if `t` does not require grad.
Edge gradientEdge(const Tensor& t);

// True when grad recording is on for this thread and any input requires grad.
bool anyRequiresGrad(std::initializer_list<Tensor> inputs);
bool anyRequiresGrad(const std::vector<Tensor>& inputs);

// Records an op: makes `outputs` non-leaf tensors produced by a FunctionNode named `name` whose next
// edges point at `inputs`. Does nothing when grad mode is off or no input requires grad. Outputs must be
// fresh tensors (not aliases of inputs' impls).
void recordOp(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs,
              FunctionNode::BackwardFn backward);

// Convenience for the common single-output op; returns `output`.
inline Tensor recordOp(const char* name, const std::vector<Tensor>& inputs, Tensor output,
                       FunctionNode::BackwardFn backward) {
  recordOp(name, inputs, std::vector<Tensor>{output}, std::move(backward));
  return output;
}

}  // namespace distgrad::autograd
