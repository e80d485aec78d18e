#include "autograd/engine.h"

#include <queue>
#include <unordered_map>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"

namespace distgrad::autograd {
namespace {

struct ReadyOrder {
  bool operator()(const Node* a, const Node* b) const { return a->sequenceNr() < b->sequenceNr(); }
};

// Sums a gradient into a buffer slot (out of place: the incoming tensor may be shared).
void accumulateInto(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? add(slot, g) : g;
}

void runTensorHooks(Node& node, std::vector<Tensor>& grads) {
  auto& outs = node.outputs();
  for (size_t i = 0; i < outs.size() && i < grads.size(); ++i) {
    auto impl = outs[i].lock();
    if (!impl || !impl->autograd || !grads[i].defined()) continue;
    auto& meta = *impl->autograd;
    for (auto& hook : meta.hooks) {
      Tensor replaced = hook(grads[i]);
      if (replaced.defined()) grads[i] = replaced;
    }
    if (meta.retainsGrad) {
      std::lock_guard<std::mutex> lock(meta.mutex);
      meta.grad = meta.grad ? add(Tensor(meta.grad), grads[i]).detach().implPtr() : grads[i].cloneData().implPtr();
    }
  }
}

void validateGrads(const Node& node, std::vector<Tensor>& grads) {
  DG_CHECK(grads.size() == node.nextEdges().size(), "backward of ", node.name(), " returned ", grads.size(),
           " gradients, expected ", node.nextEdges().size());
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() || !node.nextEdges()[i].valid()) continue;
    const auto& meta = node.inputMeta()[i];
    DG_CHECK(grads[i].shape() == meta.shape, "backward of ", node.name(), ": gradient ", i, " has shape ",
             tensor::shapeStr(grads[i].shape()), " but the input had shape ", tensor::shapeStr(meta.shape));
    if (grads[i].dtype() != meta.dtype) grads[i] = grads[i].toDType(meta.dtype);
  }
}

}  // namespace

std::vector<Tensor> execute(const std::vector<Edge>& roots, const std::vector<Tensor>& rootGrads,
                            const ExecuteOptions& options) {
  DG_CHECK(roots.size() == rootGrads.size(), "backward: ", roots.size(), " roots but ", rootGrads.size(),
           " gradients");
  NoGradGuard noGrad;  // backward formulas are not themselves recorded (no higher-order gradients yet)

  // 1. Count, for every reachable node, how many edges lead into it.
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack;
  std::unordered_map<Node*, bool> seen;
  for (const auto& r : roots) {
    if (r.valid() && !seen[r.fn.get()]) {
      seen[r.fn.get()] = true;
      stack.push_back(r.fn.get());
    }
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& e : n->nextEdges()) {
      if (!e.valid()) continue;
      ++dependencies[e.fn.get()];
      if (!seen[e.fn.get()]) {
        seen[e.fn.get()] = true;
        stack.push_back(e.fn.get());
      }
    }
  }

  // 2. Seed input buffers with the root gradients.
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  auto bufferOf = [&](Node* n) -> std::vector<Tensor>& {
    auto& b = buffers[n];
    if (b.size() < n->numOutputs()) b.resize(n->numOutputs());
    return b;
  };
  std::priority_queue<Node*, std::vector<Node*>, ReadyOrder> ready;
  for (size_t i = 0; i < roots.size(); ++i) {
    if (!roots[i].valid()) continue;
    auto& b = bufferOf(roots[i].fn.get());
    DG_ASSERT(roots[i].inputNr < b.size(), "root edge input index out of range");
    accumulateInto(b[roots[i].inputNr], rootGrads[i]);
  }
  for (auto& [node, _] : seen) {
    if (dependencies[node] == 0) ready.push(node);
  }

  std::vector<Tensor> captured(options.captures.size());
  auto captureFrom = [&](Node* n, const std::vector<Tensor>& grads) {
    for (size_t c = 0; c < options.captures.size(); ++c) {
      const Edge& e = options.captures[c];
      if (e.fn.get() == n && e.inputNr < grads.size()) accumulateInto(captured[c], grads[e.inputNr]);
    }
  };

  // 3. Run ready nodes, later-created first.
  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(bufferOf(node));
    buffers.erase(node);
    captureFrom(node, grads);

    const bool isLeafSink = dynamic_cast<AccumulateGrad*>(node) != nullptr;
    std::vector<Tensor> gradInputs;
    bool anyDefined = false;
    for (const auto& g : grads) anyDefined = anyDefined || g.defined();
    if (anyDefined && !(isLeafSink && !options.accumulateLeaves)) {
      for (size_t i = 0; i < grads.size(); ++i) {
        if (!grads[i].defined()) grads[i] = node->outputMeta()[i].zeros();
      }
      runTensorHooks(*node, grads);
      for (auto& hook : node->preHooks()) hook(grads);
      // Hand the buffer over (no copy) unless post-hooks still need it: AccumulateGrad then steals an
      // unshared gradient instead of cloning it.
      gradInputs = node->postHooks().empty() ? node->apply(std::move(grads)) : node->apply(std::vector<Tensor>(grads));
      if (!isLeafSink) validateGrads(*node, gradInputs);
      for (auto& hook : node->postHooks()) hook(gradInputs, grads);
    }
    if (!options.retainGraph) node->releaseSaved();

    const auto& edges = node->nextEdges();
    for (size_t i = 0; i < edges.size(); ++i) {
      if (!edges[i].valid()) continue;
      Node* next = edges[i].fn.get();
      if (i < gradInputs.size()) accumulateInto(bufferOf(next)[edges[i].inputNr], gradInputs[i]);
      if (--dependencies[next] == 0) ready.push(next);
    }
  }
  return captured;
}

namespace {
std::vector<Tensor> defaultRootGrads(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                                     const char* op) {
  if (!grads.empty()) {
    DG_CHECK(grads.size() == roots.size(), op, ": ", roots.size(), " tensors but ", grads.size(), " gradients");
    for (size_t i = 0; i < roots.size(); ++i) {
      DG_CHECK(grads[i].defined(), op, ": gradient ", i, " is undefined");
      DG_CHECK(grads[i].shape() == roots[i].shape(), op, ": gradient ", i, " has shape ",
               tensor::shapeStr(grads[i].shape()), " but the tensor has shape ", tensor::shapeStr(roots[i].shape()));
      DG_CHECK(grads[i].dtype() == roots[i].dtype() && grads[i].device() == roots[i].device(), op, ": gradient ", i,
               " is ", dtypeName(grads[i].dtype()), " on ", grads[i].device().str(), " but the tensor is ",
               dtypeName(roots[i].dtype()), " on ", roots[i].device().str());
    }
    return grads;
  }
  std::vector<Tensor> out;
  for (const auto& r : roots) {
    DG_CHECK(r.numel() == 1, op, ": an implicit gradient needs a one-element tensor, got shape ",
             tensor::shapeStr(r.shape()), " (pass explicit gradients)");
    out.push_back(Tensor::ones(r.shape(), r.dtype(), r.device()));
  }
  return out;
}

std::vector<Edge> rootEdges(const std::vector<Tensor>& roots, const char* op) {
  std::vector<Edge> edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    DG_CHECK(roots[i].defined() && roots[i].requiresGrad(), op, ": tensor ", i,
             " does not require grad and has no grad_fn");
    edges.push_back(gradientEdge(roots[i]));
  }
  return edges;
}
}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retainGraph) {
  ExecuteOptions options;
  options.retainGraph = retainGraph;
  execute(rootEdges(roots, "backward"), defaultRootGrads(roots, grads, "backward"), options);
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& gradOutputs, bool retainGraph) {
  ExecuteOptions options;
  options.retainGraph = retainGraph;
  options.accumulateLeaves = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    DG_CHECK(inputs[i].requiresGrad(), "grad: input ", i, " does not require grad");
    options.captures.push_back(gradientEdge(inputs[i]));
  }
  return execute(rootEdges(outputs, "grad"), defaultRootGrads(outputs, gradOutputs, "grad"), options);
}

}  // namespace distgrad::autograd
