// ProcessGroup: argument checks, algorithm choice and the wiring of operations (detail/collective_op.cpp).
#include "rpc/collectives/process_group.h"

#include <cstring>
#include <set>

#include "rpc/collectives/detail/collective_op.h"

namespace distgrad::rpc::collectives {

using detail::GroupState;
using detail::OpDescriptor;
using detail::OpKind;
using tensor::DType;

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kProduct: return "product";
  }
  return "?";
}

const char* wireCompressionName(WireCompression compression) {
  switch (compression) {
    case WireCompression::kNone: return "none";
    case WireCompression::kFloat16: return "float16";
    case WireCompression::kBFloat16: return "bfloat16";
  }
  return "?";
}

void install(Registry& registry) {
  registry.bind(detail::kChunkFunction,
                [](const CallContext& ctx, detail::ChunkHeader header, Tensor data) -> Future<void> {
                  return detail::CollectivesContext::of(*ctx.agent)->deliverChunk(ctx, std::move(header),
                                                                                  std::move(data));
                });
  registry.bind(detail::kAbortFunction, [](const CallContext& ctx, uint64_t group, uint64_t seq, int64_t kind,
                                           std::string reason, std::string worker) {
    Error error;
    error.kind = kind >= 0 && kind <= static_cast<int64_t>(ErrorKind::kRemote) ? static_cast<ErrorKind>(kind)
                                                                                : ErrorKind::kFailed;
    error.message = std::move(reason);
    error.worker = worker.empty() ? ctx.caller : std::move(worker);
    detail::CollectivesContext::of(*ctx.agent)->deliverAbort(group, seq, std::move(error));
  });
}

namespace {

uint64_t shapeHash(const tensor::Shape& shape) {
  uint64_t hash = 1469598103934665603ull ^ shape.size();
  for (int64_t d : shape) {
    hash ^= static_cast<uint64_t>(d);
    hash *= 1099511628211ull;
  }
  return hash;
}

void checkTensor(const Tensor& t, const char* op) {
  DG_CHECK(t.defined(), "ProcessGroup::", op, ": the tensor is undefined");
  DG_CHECK(t.device().isCpu(), "ProcessGroup::", op, ": only CPU tensors are supported, got one on ",
           t.device().str());
  DG_CHECK(t.isContiguous(), "ProcessGroup::", op, ": the tensor must be contiguous (call cloneData() first)");
  DG_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64 || t.dtype() == DType::kInt64,
           "ProcessGroup::", op, ": dtype must be float32, float64 or int64, got ", tensor::dtypeName(t.dtype()),
           " (16-bit types: reduce in float32 and set the options' compression)");
}

void checkCompression(const Tensor& t, WireCompression compression, const char* op) {
  DG_CHECK(compression == WireCompression::kNone || t.dtype() == DType::kFloat32, "ProcessGroup::", op,
           ": ", wireCompressionName(compression), " compression needs a float32 tensor, got ",
           tensor::dtypeName(t.dtype()));
}

void checkReduce(const Tensor& t, ReduceOp op, const char* what) {
  DG_CHECK(op != ReduceOp::kMean || tensor::isFloatingPoint(t.dtype()), "ProcessGroup::", what,
           ": mean needs a float tensor, got ", tensor::dtypeName(t.dtype()));
}

Future<void> readyFuture(Agent& agent) {
  Promise<void> promise(agent.executor());
  Future<void> future = promise.getFuture();
  promise.setValue();
  return future;
}

OpDescriptor describe(OpKind kind, const Tensor& t) {
  OpDescriptor d;
  d.kind = kind;
  d.dtype = t.dtype();
  d.numel = t.numel();
  d.shapeHash = shapeHash(t.shape());
  return d;
}

}  // namespace

ProcessGroup::ProcessGroup(Agent& agent, std::vector<std::string> members, ProcessGroupOptions options) {
  DG_CHECK(agent.registry().find(detail::kChunkFunction.name()) != nullptr,
           "ProcessGroup: collectives are not installed on worker '", agent.name(),
           "': call rpc::collectives::install(registry) before Agent::start");
  DG_CHECK(!members.empty(), "ProcessGroup: the member list is empty");
  DG_CHECK(options.segmentBytes >= 64, "ProcessGroup: segmentBytes must be >= 64, got ", options.segmentBytes);
  const auto workers = agent.workerNames();
  const std::set<std::string> known(workers.begin(), workers.end());
  std::set<std::string> seen;
  for (const auto& m : members) {
    DG_CHECK(known.count(m) != 0, "ProcessGroup: '", m, "' is not a worker of this job");
    DG_CHECK(seen.insert(m).second, "ProcessGroup: '", m, "' is listed twice");
  }
  auto state = std::make_shared<GroupState>();
  state->members = std::move(members);
  state->rank = state->rankOf(agent.name());
  DG_CHECK(state->rank >= 0, "ProcessGroup: this worker ('", agent.name(), "') is not among the members");
  state->options = std::move(options);
  state->agent = &agent;
  state->context = detail::CollectivesContext::of(agent);
  state->membersText = "[";
  for (size_t i = 0; i < state->members.size(); ++i) state->membersText += (i ? ", " : "") + state->members[i];
  state->membersText += "]";
  state->context->registerGroup(*state);
  state_ = std::move(state);
}

ProcessGroup ProcessGroup::world(Agent& agent, ProcessGroupOptions options) {
  return ProcessGroup(agent, agent.workerNames(), std::move(options));
}

ProcessGroup::~ProcessGroup() {
  if (state_) state_->context->unregisterGroup(state_->id);
}

ProcessGroup::ProcessGroup(ProcessGroup&& other) noexcept = default;
ProcessGroup& ProcessGroup::operator=(ProcessGroup&& other) noexcept {
  if (this != &other) {
    if (state_) state_->context->unregisterGroup(state_->id);
    state_ = std::move(other.state_);
  }
  return *this;
}

ProcessGroup ProcessGroup::subgroup(const std::vector<int>& ranks, const std::string& tag) const {
  std::vector<std::string> names;
  for (int r : ranks) {
    DG_CHECK(r >= 0 && r < size(), "ProcessGroup::subgroup: rank ", r, " is outside [0, ", size(), ")");
    names.push_back(state_->members[static_cast<size_t>(r)]);
  }
  ProcessGroupOptions options = state_->options;
  options.tag = tag;
  return ProcessGroup(*state_->agent, std::move(names), std::move(options));
}

int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::size() const { return static_cast<int>(state_->members.size()); }
const std::vector<std::string>& ProcessGroup::members() const { return state_->members; }
const ProcessGroupOptions& ProcessGroup::options() const { return state_->options; }
Agent& ProcessGroup::agent() const { return *state_->agent; }

uint64_t ProcessGroup::collectivesStarted() const {
  return state_->nextSeq.load(std::memory_order_relaxed);
}

Future<void> ProcessGroup::allReduce(Tensor tensor, AllReduceOptions options) {
  DG_CHECK(state_ != nullptr, "ProcessGroup::allReduce on a moved-from group");
  checkTensor(tensor, "allReduce");
  checkCompression(tensor, options.compression, "allReduce");
  checkReduce(tensor, options.op, "allReduce");
  const int n = size();
  if (n == 1) return readyFuture(agent());
  AllReduceAlgorithm algorithm = options.algorithm;
  if (algorithm == AllReduceAlgorithm::kAuto) {
    algorithm = tensor.nbytes() <= state_->options.smallTensorBytes || tensor.numel() < n
                    ? AllReduceAlgorithm::kRecursiveDoubling
                    : AllReduceAlgorithm::kRing;
  }
  OpDescriptor d = describe(OpKind::kAllReduce, tensor);
  d.reduce = options.op;
  d.compression = options.compression;
  d.algorithm = static_cast<int64_t>(algorithm);
  std::shared_ptr<detail::Op> op =
      algorithm == AllReduceAlgorithm::kRing
          ? detail::makeRingOp(state_, std::move(d), std::move(tensor), true, true, 0)
          : detail::makeRecursiveDoublingOp(state_, std::move(d), std::move(tensor));
  Future<void> future = op->future();
  state_->context->run(state_, op);
  return future;
}

Future<void> ProcessGroup::broadcast(Tensor tensor, int root, BroadcastOptions options) {
  DG_CHECK(state_ != nullptr, "ProcessGroup::broadcast on a moved-from group");
  checkTensor(tensor, "broadcast");
  checkCompression(tensor, options.compression, "broadcast");
  DG_CHECK(root >= 0 && root < size(), "ProcessGroup::broadcast: root must be in [0, ", size(), "), got ", root);
  if (size() == 1) return readyFuture(agent());
  BroadcastAlgorithm algorithm = options.algorithm;
  if (algorithm == BroadcastAlgorithm::kAuto) {
    algorithm = tensor.nbytes() <= state_->options.smallTensorBytes ? BroadcastAlgorithm::kTree
                                                                     : BroadcastAlgorithm::kChain;
  }
  OpDescriptor d = describe(OpKind::kBroadcast, tensor);
  d.compression = options.compression;
  d.algorithm = static_cast<int64_t>(algorithm);
  d.root = root;
  auto op = detail::makeBroadcastOp(state_, std::move(d), std::move(tensor), algorithm == BroadcastAlgorithm::kChain);
  Future<void> future = op->future();
  state_->context->run(state_, op);
  return future;
}

Future<Tensor> ProcessGroup::allGather(Tensor tensor, AllGatherOptions options) {
  DG_CHECK(state_ != nullptr, "ProcessGroup::allGather on a moved-from group");
  checkTensor(tensor, "allGather");
  checkCompression(tensor, options.compression, "allGather");
  const int n = size();
  tensor::Shape shape = tensor.shape();
  if (shape.empty()) {
    shape = {n};
  } else {
    shape[0] *= n;
  }
  Tensor output = Tensor::empty(shape, tensor.dtype());
  if (tensor.nbytes() > 0) {
    std::memcpy(static_cast<char*>(output.rawData()) + tensor.nbytes() * static_cast<size_t>(rank()),
                tensor.rawData(), tensor.nbytes());
  }
  if (n == 1) return readyFuture(agent()).then([output] { return output; });
  OpDescriptor d = describe(OpKind::kAllGather, tensor);
  d.compression = options.compression;
  auto op = detail::makeRingOp(state_, std::move(d), output, false, true, 0);
  Future<void> done = op->future();
  state_->context->run(state_, op);
  return std::move(done).then([output] { return output; });
}

Future<Tensor> ProcessGroup::reduceScatter(Tensor input, ReduceScatterOptions options) {
  DG_CHECK(state_ != nullptr, "ProcessGroup::reduceScatter on a moved-from group");
  checkTensor(input, "reduceScatter");
  checkCompression(input, options.compression, "reduceScatter");
  checkReduce(input, options.op, "reduceScatter");
  const int n = size();
  DG_CHECK(input.dim() >= 1 && input.size(0) % n == 0, "ProcessGroup::reduceScatter: dimension 0 of the input ",
           "must be divisible by the group size ", n, ", got shape ", tensor::shapeStr(input.shape()));
  Tensor workspace = input.cloneData();
  tensor::Shape shape = input.shape();
  shape[0] /= n;
  const int64_t sliceElements = tensor::numelOf(shape);
  const int64_t offset = sliceElements * rank();
  auto slice = [workspace, shape, offset] {
    return Tensor::fromStorage(workspace.storage(), shape, tensor::contiguousStrides(shape), offset,
                               workspace.dtype())
        .cloneData();
  };
  if (n == 1) return readyFuture(agent()).then(slice);
  OpDescriptor d = describe(OpKind::kReduceScatter, input);
  d.reduce = options.op;
  d.compression = options.compression;
  auto op = detail::makeRingOp(state_, std::move(d), workspace, true, false, -1);
  Future<void> done = op->future();
  state_->context->run(state_, op);
  return std::move(done).then(slice);
}

Future<void> ProcessGroup::barrier() {
  DG_CHECK(state_ != nullptr, "ProcessGroup::barrier on a moved-from group");
  if (size() == 1) return readyFuture(agent());
  Tensor token = Tensor::zeros({1}, DType::kInt64);
  OpDescriptor d = describe(OpKind::kBarrier, token);
  d.algorithm = static_cast<int64_t>(AllReduceAlgorithm::kRecursiveDoubling);
  auto op = detail::makeRecursiveDoublingOp(state_, std::move(d), std::move(token));
  Future<void> future = op->future();
  state_->context->run(state_, op);
  return future;
}

}  // namespace distgrad::rpc::collectives
