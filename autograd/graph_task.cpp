#include "autograd/graph_task.h"

#include <unordered_set>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "tensor/cuda/cuda_memory.h"

namespace distgrad::autograd {
namespace {

// Sums a gradient into a buffer slot (out of place: the incoming tensor may be shared).
void accumulateInto(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? add(slot, g) : g;
}

// Note [Backward streams]: like PyTorch, a node's backward runs on the stream its forward ran on (the
// forward's current stream, recorded by recordOp when an input was on a CUDA device), so the backward of
// work a user put on a side stream stays there and is ordered after the forward's own kernels. The
// engine thread's current stream is the hub everything else runs on (AccumulateGrad, nodes without a
// CUDA input, the caller reading results): when a node's stream differs from it, the node's stream first
// waits for an event on the hub (the incoming gradients were produced there, or on streams the hub
// already waited for), and afterwards the hub waits for an event on the node's stream; no host blocks.
// Gradients crossing between the two are recordStream()'d for the stream that reads them, so the caching
// allocator does not hand their memory out again while that stream may still use it.
std::vector<Tensor> applyOnForwardStream(Node& node, std::vector<Tensor>&& grads) {
  const std::optional<tensor::cuda::Stream>& forward = node.forwardStream();
  if (!forward) return node.apply(std::move(grads));
  const tensor::cuda::Stream stream = *forward;
  const tensor::cuda::Stream hub = tensor::cuda::Stream::current(stream.device());
  if (stream == hub) return node.apply(std::move(grads));
  auto recordFor = [](const std::vector<Tensor>& tensors, const tensor::cuda::Stream& reader) {
    for (const Tensor& t : tensors) {
      if (t.defined() && t.device().isCuda() && t.device().index == reader.device()) {
        tensor::cuda::recordStream(t, reader);
      }
    }
  };
  tensor::cuda::Event incoming;
  incoming.record(hub);
  incoming.block(stream);
  recordFor(grads, stream);
  std::vector<Tensor> out;
  {
    tensor::cuda::StreamGuard guard(stream);
    out = node.apply(std::move(grads));
  }
  tensor::cuda::Event done;
  done.record(stream);
  done.block(hub);
  recordFor(out, hub);
  return out;
}

void runTensorHooks(Node& node, std::vector<Tensor>& grads) {
  for (const auto& [output, hook] : node.tensorHooks()) {
    if (output >= grads.size() || !grads[output].defined()) continue;
    Tensor replaced = hook(grads[output]);
    if (replaced.defined()) grads[output] = replaced;
  }
  // retainGrad lives on the tensor: a retained gradient is only observable while someone holds it.
  auto& outs = node.outputs();
  for (size_t i = 0; i < outs.size() && i < grads.size(); ++i) {
    auto impl = outs[i].lock();
    if (!impl || !impl->autograd || !grads[i].defined()) continue;
    auto& meta = *impl->autograd;
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

GraphTask::GraphTask(const std::vector<Edge>& starts, GraphTaskOptions options)
    : options_(std::move(options)), captured_(options_.captures.size()) {
  // Count, for every reachable node, the edges that lead into it: internal edges and start edges alike.
  std::vector<Node*> stack;
  auto visit = [&](Node* n) {
    auto [it, fresh] = dependencies_.try_emplace(n, 0);
    ++it->second;
    if (fresh) stack.push_back(n);
  };
  std::unordered_set<Node*> kept;
  for (const auto& e : starts) {
    if (!e.valid()) continue;
    if (kept.insert(e.fn.get()).second) startNodes_.push_back(e.fn);
    visit(e.fn.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& e : n->nextEdges()) {
      if (e.valid()) visit(e.fn.get());
    }
  }
  remaining_ = dependencies_.size();
}

std::vector<Tensor>& GraphTask::bufferOf(Node* node) {
  auto& b = buffers_[node];
  if (b.size() < node->numOutputs()) b.resize(node->numOutputs());
  return b;
}

void GraphTask::countDown(Node* node) {
  auto it = dependencies_.find(node);
  DG_ASSERT(it != dependencies_.end(), "gradient delivered to ", node->name(), ", which is not in the graph task");
  DG_ASSERT(it->second > 0, "more gradients delivered to ", node->name(), " than edges lead into it");
  if (--it->second == 0) ready_.push(node);
}

void GraphTask::deliver(const Edge& edge, const Tensor& grad) {
  if (!edge.valid()) return;
  NoGradGuard noGrad;
  auto& b = bufferOf(edge.fn.get());
  DG_ASSERT(edge.inputNr < b.size(), "gradient delivered to input ", edge.inputNr, " of ", edge.fn->name(),
            ", which has ", b.size());
  accumulateInto(b[edge.inputNr], grad);
  countDown(edge.fn.get());
}

void GraphTask::deliverAll(Node* node, std::vector<Tensor> grads) {
  NoGradGuard noGrad;
  auto& b = bufferOf(node);
  DG_ASSERT(grads.size() <= b.size(), node->name(), " takes ", b.size(), " gradients, got ", grads.size());
  for (size_t i = 0; i < grads.size(); ++i) accumulateInto(b[i], grads[i]);
  countDown(node);
}

Node* GraphTask::popReady() {
  if (ready_.empty()) return nullptr;
  Node* node = ready_.top();
  ready_.pop();
  return node;
}

std::vector<Tensor> GraphTask::takeInputs(Node* node) {
  std::vector<Tensor> grads = std::move(bufferOf(node));
  buffers_.erase(node);
  for (size_t c = 0; c < options_.captures.size(); ++c) {
    const Edge& e = options_.captures[c];
    if (e.fn.get() == node && e.inputNr < grads.size()) accumulateInto(captured_[c], grads[e.inputNr]);
  }
  return grads;
}

std::vector<Tensor> GraphTask::run(Node& node, std::vector<Tensor>&& grads) const {
  NoGradGuard noGrad;  // backward formulas are not themselves recorded (no higher-order gradients yet)
  auto* leaf = dynamic_cast<AccumulateGrad*>(&node);
  bool anyDefined = false;
  for (const auto& g : grads) anyDefined = anyDefined || g.defined();
  std::vector<Tensor> gradInputs;
  if (leaf && options_.leafSink) {
    if (anyDefined) {
      // The leaf's hooks (Tensor::registerHook) run as AccumulateGrad::apply runs them, so they see every
      // gradient whichever engine computed it (DistributedDataParallel inside distributed autograd).
      Tensor g = std::move(grads[0]);
      Tensor variable = leaf->variable();
      {
        std::lock_guard<std::mutex> lock(variable.ensureAutogradMeta().mutex);
        for (auto& hook : variable.ensureAutogradMeta().hooks) {
          Tensor replaced = hook(g);
          if (replaced.defined()) g = replaced;
        }
      }
      options_.leafSink(*leaf, std::move(g));
    }
  } else if (anyDefined && !(leaf && !options_.accumulateLeaves)) {
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) grads[i] = node.outputMeta()[i].zeros();
    }
    runTensorHooks(node, grads);
    for (auto& hook : node.preHooks()) hook(grads);
    // Hand the buffer over (no copy) unless post-hooks still need it: AccumulateGrad then steals an
    // unshared gradient instead of cloning it.
    gradInputs = node.postHooks().empty() ? applyOnForwardStream(node, std::move(grads))
                                          : applyOnForwardStream(node, std::vector<Tensor>(grads));
    if (!leaf) validateGrads(node, gradInputs);
    for (auto& hook : node.postHooks()) hook(gradInputs, grads);
  }
  if (!options_.retainGraph) node.releaseSaved();
  return gradInputs;
}

std::vector<Tensor> GraphTask::runPreHooks(Node& node, std::vector<Tensor>&& grads) const {
  NoGradGuard noGrad;
  runTensorHooks(node, grads);
  for (auto& hook : node.preHooks()) hook(grads);
  return std::move(grads);
}

void GraphTask::runPostHooks(Node& node, const std::vector<Tensor>& grads) const {
  NoGradGuard noGrad;
  for (auto& hook : node.postHooks()) hook({}, grads);
}

void GraphTask::finish(Node* node, std::vector<Tensor>&& gradInputs) {
  DG_ASSERT(remaining_ > 0, "GraphTask::finish called more often than nodes exist");
  --remaining_;
  NoGradGuard noGrad;
  const auto& edges = node->nextEdges();
  for (size_t i = 0; i < edges.size(); ++i) {
    if (!edges[i].valid()) continue;
    Node* next = edges[i].fn.get();
    if (i < gradInputs.size()) accumulateInto(bufferOf(next)[edges[i].inputNr], gradInputs[i]);
    countDown(next);
  }
}

}  // namespace distgrad::autograd
