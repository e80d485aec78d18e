#include "autograd/node.h"

#include "autograd/grad_mode.h"
#include "autograd/ops.h"

namespace distgrad::autograd {
namespace {
std::atomic<uint64_t> gNextSequenceNr{0};
thread_local bool tGradEnabled = true;
}  // namespace

bool isGradEnabled() { return tGradEnabled; }
void setGradEnabled(bool enabled) { tGradEnabled = enabled; }

Node::Node(std::string name)
    : name_(std::move(name)), sequenceNr_(gNextSequenceNr.fetch_add(1, std::memory_order_relaxed)) {}

AccumulateGrad::AccumulateGrad(std::shared_ptr<tensor::TensorImpl> leaf)
    : Node("AccumulateGrad"), leaf_(std::move(leaf)) {
  Tensor t(leaf_);
  outputMeta().push_back(TensorMeta::of(t));
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& gradOutputs) {
  DG_ASSERT(gradOutputs.size() == 1, "AccumulateGrad takes one gradient");
  Tensor g = std::move(gradOutputs[0]);
  if (!g.defined()) return {};
  Tensor leaf(leaf_);
  std::lock_guard<std::mutex> lock(leaf.ensureAutogradMeta().mutex);
  for (auto& hook : leaf.ensureAutogradMeta().hooks) {
    Tensor replaced = hook(g);
    if (replaced.defined()) g = replaced;
  }
  Tensor current = leaf.grad();
  if (!current.defined()) {
    // Steal the incoming buffer when nobody else can see it; otherwise keep a private copy so later
    // in-place optimizer updates of .grad never write into someone else's tensor.
    bool exclusive = g.implPtr().use_count() == 1 && g.storage().useCount() == 1 && g.isContiguous();
    leaf.setGrad(exclusive ? g : g.cloneData());
  } else {
    NoGradGuard noGrad;
    leaf.setGrad(add(current, g).detach());
  }
  return {};
}

std::vector<Tensor> FunctionNode::apply(std::vector<Tensor>&& gradOutputs) {
  DG_CHECK(fn_ != nullptr, "backward through ", name(),
           " a second time: its saved tensors were freed after the first backward "
           "(pass retainGraph=true to the first backward)");
  return fn_(gradOutputs, *this);
}

Edge gradientEdge(const Tensor& t) {
  if (!t.defined() || !t.requiresGrad()) return Edge{};
  auto& meta = t.ensureAutogradMeta();
  if (meta.gradFn) return Edge{meta.gradFn, meta.outputNr};
  std::lock_guard<std::mutex> lock(meta.mutex);  // one accumulator per leaf, also across threads
  std::shared_ptr<Node> acc = meta.gradAccumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.implPtr());
    meta.gradAccumulator = acc;
  }
  return Edge{acc, 0};
}

bool anyRequiresGrad(std::initializer_list<Tensor> inputs) {
  if (!isGradEnabled()) return false;
  for (const auto& t : inputs) {
    if (t.defined() && t.requiresGrad()) return true;
  }
  return false;
}

bool anyRequiresGrad(const std::vector<Tensor>& inputs) {
  if (!isGradEnabled()) return false;
  for (const auto& t : inputs) {
    if (t.defined() && t.requiresGrad()) return true;
  }
  return false;
}

void recordOp(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs,
              FunctionNode::BackwardFn backward) {
  if (!anyRequiresGrad(inputs)) return;
  auto node = std::make_shared<FunctionNode>(name, std::move(backward));
  for (const auto& in : inputs) {
    if (in.defined() && in.device().isCuda() && !node->forwardStream()) {
      node->setForwardStream(tensor::cuda::Stream::current(in.device().index));
    }
    node->nextEdges().push_back(gradientEdge(in));
    node->inputMeta().push_back(in.defined() ? TensorMeta::of(in) : TensorMeta{});
  }
  uint32_t nr = 0;
  for (const auto& out : outputs) {
    DG_ASSERT(out.defined(), name, ": undefined output");
    node->outputMeta().push_back(TensorMeta::of(out));
    node->outputs().push_back(out.implPtr());
    if (!isFloatingPoint(out.dtype())) {  // integer outputs (indices) carry no gradient
      ++nr;
      continue;
    }
    auto& meta = out.ensureAutogradMeta();
    DG_ASSERT(meta.gradFn == nullptr, name, ": output already has a grad_fn (outputs must be fresh tensors)");
    meta.requiresGrad = true;
    meta.gradFn = node;
    meta.outputNr = nr++;
  }
}

}  // namespace distgrad::autograd

namespace distgrad::tensor {

// Declared in tensor/tensor.h; defined here because a non-leaf's hooks belong to its grad_fn.
void Tensor::registerHook(std::function<Tensor(const Tensor&)> hook) const {
  DG_CHECK(requiresGrad(), "registerHook: the tensor does not require grad");
  AutogradMeta& meta = ensureAutogradMeta();
  if (meta.gradFn != nullptr) {
    meta.gradFn->addTensorHook(meta.outputNr, std::move(hook));
  } else {
    meta.hooks.push_back(std::move(hook));
  }
}

}  // namespace distgrad::tensor
