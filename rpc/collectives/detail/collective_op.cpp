// The collectives' mailbox and operation state machines.
//
// Note [Collective messages]: a collective moves data only as calls of "dg.collectives.chunk"
// (ChunkHeader + one tensor). The header names the group, the collective's sequence number on it, the step
// and segment the tensor belongs to, the sender's rank, and the sender's OpDescriptor, which the receiver
// compares with its own (a mismatch fails the collective on every member, naming the sender). The handler
// never blocks: it hands the tensor to the operation if it has started here, else parks it until it does.
// Its reply is the acknowledgement that the segment was consumed (reduced or copied), so a sender's window
// of maxSegmentsInFlight unacknowledged segments bounds the memory a collective costs its receiver, and
// the deadline of the call is the collective's own. "dg.collectives.abort" tells the other members that a
// collective failed here (mismatch, timeout, a failed send), so every member's handle fails, not only the
// one that noticed.
//
// Note [Ring buffer reuse]: the ring sends views of the caller's tensor (no copy) and later overwrites
// regions it sent. That is safe without waiting for the sends' acknowledgements: a region is overwritten
// in the all-gather phase only by data that causally depends on the successor having received what we sent
// from that region (the reduced chunk travelled the whole ring through it). Recursive doubling has no such
// chain (partners send independently), so it never sends a buffer it later changes.
#include "rpc/collectives/detail/collective_op.h"

#include <algorithm>
#include <cstring>
#include <sstream>

namespace distgrad::rpc::collectives::detail {

namespace {

constexpr const char* kExtensionKey = "dg.collectives";

uint64_t fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ull) {
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

int mod(int64_t x, int n) { return static_cast<int>(((x % n) + n) % n); }

std::string algorithmName(OpKind kind, int64_t algorithm) {
  if (kind == OpKind::kAllReduce || kind == OpKind::kBarrier) {
    return algorithm == static_cast<int64_t>(AllReduceAlgorithm::kRing) ? "ring" : "recursive doubling";
  }
  if (kind == OpKind::kBroadcast) {
    return algorithm == static_cast<int64_t>(BroadcastAlgorithm::kChain) ? "chain" : "tree";
  }
  return "ring";
}

OpDescriptor descriptorOf(const ChunkHeader& h) {
  OpDescriptor d;
  d.kind = static_cast<OpKind>(h.kind);
  d.reduce = static_cast<ReduceOp>(h.reduce);
  d.dtype = static_cast<tensor::DType>(h.dtype);
  d.compression = static_cast<WireCompression>(h.compression);
  d.algorithm = h.algorithm;
  d.root = h.root;
  d.numel = h.numel;
  d.shapeHash = h.shapeHash;
  return d;
}

bool headerInRange(const ChunkHeader& h) {
  return h.kind >= 0 && h.kind <= static_cast<int64_t>(OpKind::kBarrier) && h.reduce >= 0 &&
         h.reduce <= static_cast<int64_t>(ReduceOp::kProduct) && h.dtype >= 0 && h.dtype < tensor::kNumDTypes &&
         h.compression >= 0 && h.compression <= static_cast<int64_t>(WireCompression::kBFloat16);
}

}  // namespace

const char* opKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "allReduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllGather: return "allGather";
    case OpKind::kReduceScatter: return "reduceScatter";
    case OpKind::kBarrier: return "barrier";
  }
  return "?";
}

std::string OpDescriptor::describe() const {
  std::ostringstream out;
  out << opKindName(kind) << "(" << tensor::dtypeName(dtype) << ", " << numel << " elements";
  if (kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter) out << ", " << reduceOpName(reduce);
  if (kind == OpKind::kBroadcast) out << ", root " << root;
  if (compression != WireCompression::kNone) out << ", " << wireCompressionName(compression) << " on the wire";
  out << ", " << algorithmName(kind, algorithm) << ")";
  return out.str();
}

// ---- GroupState ----

int GroupState::rankOf(const std::string& worker) const {
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == worker) return static_cast<int>(i);
  }
  return -1;
}

std::chrono::milliseconds GroupState::timeout() const {
  if (options.timeout.count() == 0) return agent->options().defaultTimeout;
  return options.timeout;
}

// ---- CollectivesContext ----

std::shared_ptr<CollectivesContext> CollectivesContext::of(Agent& agent) {
  auto extension = agent.extension(kExtensionKey, [](Agent& a) -> std::shared_ptr<AgentExtension> {
    return std::make_shared<CollectivesContext>(a);
  });
  return std::static_pointer_cast<CollectivesContext>(extension);
}

CollectivesContext::CollectivesContext(Agent& agent) : agent_(&agent), executor_(agent.executor()) {}

CollectivesContext::~CollectivesContext() { timers_.shutdown(); }

void CollectivesContext::registerGroup(GroupState& group) {
  std::string key = group.options.tag;
  key += '\0';
  for (const auto& m : group.members) {
    key += m;
    key += '\0';
  }
  std::lock_guard<std::mutex> lock(mutex_);
  DG_CHECK(!closed_, "ProcessGroup: agent '", agent_->name(), "' is shut down");
  const uint64_t instance = instances_[key]++;
  group.id = fnv1a(std::to_string(instance), fnv1a(key));
  DG_ASSERT(groups_.find(group.id) == groups_.end(), "collectives: group id collision");
  groups_[group.id] = &group;
}

void CollectivesContext::unregisterGroup(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.erase(id);
  // Chunks parked for collectives this worker will now never start: their senders learn it at once.
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (it->first.first == id) {
      for (auto& chunk : it->second.chunks) {
        chunk.ack->trySetError(Error::failed("the process group was destroyed on " + agent_->name()));
      }
      it = parked_.erase(it);
    } else {
      ++it;
    }
  }
}

void CollectivesContext::run(const std::shared_ptr<GroupState>& group, const std::shared_ptr<Op>& op) {
  std::unique_lock<std::mutex> beginLock(op->beginMutex());
  Parked parked;
  std::optional<Error> refused;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    op->setSeq(group->nextSeq++);
    if (closed_) {
      refused = Error::failed("agent '" + agent_->name() + "' is shut down");
    } else if (group->broken) {
      refused = *group->broken;
    } else {
      const auto key = std::make_pair(group->id, op->seq());
      active_[key] = op;
      auto it = parked_.find(key);
      if (it != parked_.end()) {
        parked = std::move(it->second);
        parked_.erase(it);
      }
    }
  }
  if (refused) {
    beginLock.unlock();
    refused->message = op->what() + ": " + refused->message;
    op->fail(std::move(*refused), false);
    return;
  }
  op->begin();
  beginLock.unlock();
  if (parked.abort) op->fail(std::move(*parked.abort), false);
  for (auto& chunk : parked.chunks) {
    Result<void> result = op->onChunk(chunk.header, chunk.sender, std::move(chunk.data));
    chunk.ack->trySetResult(std::move(result));
  }
}

void CollectivesContext::finished(const Op& op, const Error* error) {
  // The causes of the last failures, for chunks still on their way to them.
  constexpr size_t kRememberedFailures = 256;
  std::lock_guard<std::mutex> lock(mutex_);
  const auto key = std::make_pair(op.groupId(), op.seq());
  auto it = active_.find(key);
  if (it != active_.end() && it->second.get() == &op) active_.erase(it);
  if (error != nullptr && failures_.emplace(key, *error).second) {
    failureOrder_.push_back(key);
    if (failureOrder_.size() > kRememberedFailures) {
      failures_.erase(failureOrder_.front());
      failureOrder_.pop_front();
    }
  }
}

Future<void> CollectivesContext::deliverChunk(const CallContext& ctx, ChunkHeader header, Tensor data) {
  Promise<void> ready(executor_);
  Future<void> readyFuture = ready.getFuture();
  std::shared_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
      ready.setError(Error::failed("agent '" + agent_->name() + "' is shut down"));
      return readyFuture;
    }
    const auto key = std::make_pair(header.group, header.seq);
    auto active = active_.find(key);
    if (active != active_.end()) {
      op = active->second;
    } else {
      auto group = groups_.find(header.group);
      if (group != groups_.end() && header.seq < group->second->nextSeq) {
        // The collective ended here already (it failed: a successful one consumed every chunk).
        auto failure = failures_.find(key);
        if (failure != failures_.end()) {
          ready.setError(failure->second);
          return readyFuture;
        }
        ready.setError(Error::failed("collective #" + std::to_string(header.seq) + " on group " +
                                     group->second->membersText + " already ended on " + agent_->name())
                           .onWorker(agent_->name()));
        return readyFuture;
      }
      auto ack = std::make_shared<Promise<void>>(executor_);
      Future<void> acked = ack->getFuture();
      parked_[key].chunks.push_back({header, ctx.caller, std::move(data), std::move(ack)});
      return acked;
    }
  }
  // Wait out begin() if the operation is being started on another thread right now (it only queues sends).
  { std::lock_guard<std::mutex> beginLock(op->beginMutex()); }
  ready.setResult(op->onChunk(header, ctx.caller, std::move(data)));
  return readyFuture;
}

void CollectivesContext::deliverAbort(uint64_t group, uint64_t seq, Error error) {
  std::shared_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto key = std::make_pair(group, seq);
    auto active = active_.find(key);
    if (active != active_.end()) {
      op = active->second;
    } else {
      auto known = groups_.find(group);
      if (known != groups_.end() && seq < known->second->nextSeq) return;  // ended here already
      parked_[key].abort = std::move(error);
      return;
    }
  }
  op->fail(std::move(error), false);
}

void CollectivesContext::onPeerDown(const std::string& peer, const Error& error) {
  std::vector<std::shared_ptr<Op>> affected;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, group] : groups_) {
      if (group->rankOf(peer) >= 0 && !group->broken) {
        group->broken = Error::disconnected("member " + peer + " of group " + group->membersText +
                                            " is down (" + error.message + ")")
                            .onWorker(peer);
      }
    }
    for (auto& [key, op] : active_) {
      if (op->involves(peer)) affected.push_back(op);
    }
  }
  for (auto& op : affected) {
    op->fail(Error::disconnected(op->what() + " failed: member " + peer + " is down (" + error.message + ")")
                 .onWorker(peer),
             false);
  }
}

void CollectivesContext::onAgentClosed() {
  std::vector<std::shared_ptr<Op>> affected;
  std::map<std::pair<uint64_t, uint64_t>, Parked> parked;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    for (auto& [key, op] : active_) affected.push_back(op);
    parked.swap(parked_);
  }
  for (auto& op : affected) op->fail(Error::failed(op->what() + " failed: the agent shut down"), false);
  for (auto& [key, entry] : parked) {
    for (auto& chunk : entry.chunks) chunk.ack->trySetError(Error::failed("the agent shut down"));
  }
}

// ---- Op ----

Op::Op(std::shared_ptr<GroupState> group, OpDescriptor descriptor)
    : group_(std::move(group)),
      descriptor_(std::move(descriptor)),
      n_(static_cast<int>(group_->members.size())),
      rank_(group_->rank),
      promise_(group_->context->executor()),
      future_(promise_.getFuture()),
      receivedFrom_(static_cast<size_t>(n_), 0),
      expectedFrom_(static_cast<size_t>(n_), 0) {}

Future<void> Op::future() { return std::move(future_); }

std::string Op::what() const {
  return "collective #" + std::to_string(seq_) + " " + descriptor_.describe() + " on group " + group_->membersText;
}

bool Op::involves(const std::string& worker) const { return group_->rankOf(worker) >= 0; }

void Op::begin() {
  try {
    start();
  } catch (const std::exception& e) {
    fail(Error::failed(what() + ": " + e.what()), true);
    return;
  }
  // The deadline is armed once start() set the expectations its message reads (onTimeout).
  const auto timeout = group_->timeout();
  if (timeout.count() > 0) {
    const TimerId timer = group_->context->timers().scheduleAfter(
        timeout, [weak = std::weak_ptr<Op>(shared_from_this())] {
          if (auto op = weak.lock()) op->onTimeout();
        });
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) {
      group_->context->timers().cancel(timer);
    } else {
      timer_ = timer;
    }
  }
  bool done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    begun_ = true;
    done = doneLocked();
  }
  if (done) succeed();
}

Error Op::mismatch(const std::string& peer, const std::string& what) const {
  return Error::failed(this->what() + ": " + what).onWorker(peer);
}

Result<void> Op::onChunk(const ChunkHeader& header, const std::string& sender, Tensor data) {
  const int source = group_->rankOf(sender);
  if (source < 0 || header.source != source) {
    return Error::failed(what() + ": chunk from " + sender + " claims rank " + std::to_string(header.source) +
                         " but that worker is rank " + std::to_string(source) + " of the group")
        .onWorker(group_->agent->name());
  }
  if (!headerInRange(header) || descriptorOf(header) != descriptor_) {
    std::string theirs = headerInRange(header) ? descriptorOf(header).describe() : "an unknown collective";
    if (headerInRange(header) && descriptorOf(header).shapeHash != descriptor_.shapeHash &&
        descriptorOf(header).numel == descriptor_.numel) {
      theirs += " with another shape";
    }
    Error error = mismatch(sender, "members disagree: " + sender + " called " + theirs + " but " +
                                       group_->agent->name() + " called " + descriptor_.describe());
    fail(error, true);
    return error;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // A chunk after a failure learns its cause (the operation is still reachable until finished() ran).
    if (failure_) return *failure_;
    if (done_) {
      return Error::failed(what() + " already ended on " + group_->agent->name()).onWorker(group_->agent->name());
    }
  }
  if (!data.defined() || data.dtype() != wireDType(descriptor_.dtype, descriptor_.compression) ||
      !data.isContiguous() || !data.device().isCpu()) {
    Error error = mismatch(sender, "chunk from " + sender + " holds " +
                                       (data.defined() ? std::string(tensor::dtypeName(data.dtype())) : "no tensor") +
                                       ", expected " +
                                       tensor::dtypeName(wireDType(descriptor_.dtype, descriptor_.compression)));
    fail(error, true);
    return error;
  }
  Result<void> handled = Error::failed("unhandled");
  try {
    handled = handle(header.step, header.segment, source, std::move(data));
  } catch (const std::exception& e) {
    handled = Error::failed(what() + ": " + e.what());
  }
  if (!handled.ok()) {
    Error error = handled.error();
    if (error.worker.empty()) error.worker = sender;
    fail(error, true);
    return error;
  }
  received();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++receivedFrom_[static_cast<size_t>(source)];
  }
  return Result<void>();
}

void Op::expectReceives(int64_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  expected_ += count;
}

void Op::send(int destination, int64_t step, int64_t segment, Tensor data) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    if (inFlight_ >= std::max<size_t>(1, group_->options.maxSegmentsInFlight)) {
      queued_.push_back({destination, step, segment, std::move(data)});
      return;
    }
    ++inFlight_;
  }
  issue({destination, step, segment, std::move(data)});
}

void Op::issue(PendingSend send) {
  ChunkHeader header;
  header.group = group_->id;
  header.seq = seq_;
  header.step = send.step;
  header.segment = send.segment;
  header.source = rank_;
  header.kind = static_cast<int64_t>(descriptor_.kind);
  header.reduce = static_cast<int64_t>(descriptor_.reduce);
  header.dtype = static_cast<int64_t>(descriptor_.dtype);
  header.compression = static_cast<int64_t>(descriptor_.compression);
  header.algorithm = descriptor_.algorithm;
  header.root = descriptor_.root;
  header.numel = descriptor_.numel;
  header.shapeHash = descriptor_.shapeHash;
  CallOptions options;
  const auto timeout = group_->timeout();
  options.timeout = timeout.count() > 0 ? timeout : std::chrono::milliseconds(-1);
  Tensor wire = toWire(send.data, descriptor_.compression);
  const int destination = send.destination;
  send.data = Tensor();
  (void)group_->agent
      ->rpcAsyncWith(options, group_->members[static_cast<size_t>(destination)], kChunkFunction, header,
                     std::move(wire))
      .then([self = shared_from_this(), destination](Result<void> result) {
        self->onSent(destination, std::move(result));
      });
}

void Op::onSent(int destination, Result<void> result) {
  if (!result.ok()) {
    Error error = result.error();
    const std::string& peer = group_->members[static_cast<size_t>(destination)];
    // A refusal that describes the collective already (a mismatch seen by the receiver) keeps its words.
    if (error.message.rfind("collective #", 0) != 0) {
      error.message = what() + ": sending to " + peer + " failed: " + error.message;
    }
    if (error.worker.empty()) error.worker = peer;
    fail(std::move(error), true);
    return;
  }
  std::optional<PendingSend> next;
  bool done = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --inFlight_;
    if (!done_ && !queued_.empty()) {
      next = std::move(queued_.front());
      queued_.pop_front();
      ++inFlight_;
    }
    done = doneLocked();
  }
  if (next) issue(std::move(*next));
  if (done) succeed();
}

void Op::received() {
  bool done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++receivedCount_;
    done = doneLocked();
  }
  if (done) succeed();
}

void Op::checkDone() {
  bool done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done = doneLocked();
  }
  if (done) succeed();
}

bool Op::doneLocked() {
  if (done_ || !begun_ || receivedCount_ < expected_ || inFlight_ > 0 || !queued_.empty()) return false;
  done_ = true;
  return true;
}

void Op::succeed() {
  TimerId timer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    timer = timer_;
  }
  if (timer != kInvalidTimerId) group_->context->timers().cancel(timer);
  group_->context->finished(*this);
  promise_.trySetValue();
}

void Op::fail(Error error, bool tellOthers) {
  TimerId timer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    failure_ = error;
    queued_.clear();
    timer = timer_;
  }
  if (timer != kInvalidTimerId) group_->context->timers().cancel(timer);
  group_->context->finished(*this, &error);
  if (tellOthers) {
    CallOptions options;
    options.timeout = std::chrono::milliseconds(5000);
    for (int r = 0; r < n_; ++r) {
      if (r == rank_) continue;
      try {
        (void)group_->agent->rpcAsyncWith(options, group_->members[static_cast<size_t>(r)], kAbortFunction,
                                          group_->id, seq_, static_cast<int64_t>(error.kind), error.message,
                                          error.worker.empty() ? group_->agent->name() : error.worker);
      } catch (const std::exception&) {
        // Best effort: a member we cannot tell fails on its own deadline or peer-down notification.
      }
    }
  }
  promise_.trySetError(std::move(error));
}

void Op::onTimeout() {
  std::string waiting;
  std::string first;
  size_t unacknowledged;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    for (int r = 0; r < n_; ++r) {
      if (receivedFrom_[static_cast<size_t>(r)] < expectedFrom_[static_cast<size_t>(r)]) {
        const std::string& name = group_->members[static_cast<size_t>(r)];
        waiting += (waiting.empty() ? "" : ", ") + name;
        if (first.empty()) first = name;
      }
    }
    unacknowledged = inFlight_ + queued_.size();
  }
  std::string message = what() + " did not complete within " + std::to_string(group_->timeout().count()) + " ms";
  if (!waiting.empty()) message += "; still waiting for data from " + waiting;
  if (unacknowledged > 0) message += "; " + std::to_string(unacknowledged) + " sent segments not yet consumed";
  fail(Error::timeout(message).onWorker(first.empty() ? group_->agent->name() : first), true);
}

// ---- Ring: reduce-scatter and/or all-gather ----

namespace {

class RingOp final : public Op {
 public:
  RingOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer, bool reduceScatter,
         bool allGather, int offset)
      : Op(std::move(group), std::move(descriptor)), buffer_(std::move(buffer)), offset_(offset) {
    total_ = buffer_.numel();
    base_ = total_ / n_;
    extra_ = total_ % n_;
    segElems_ = std::max<int64_t>(1, static_cast<int64_t>(group_->options.segmentBytes / buffer_.itemSize()));
    rsSteps_ = reduceScatter ? n_ - 1 : 0;
    agSteps_ = allGather ? n_ - 1 : 0;
    owned_ = reduceScatter ? mod(rank_ + 1 + offset_, n_) : rank_;
    next_ = mod(rank_ + 1, n_);
    prev_ = mod(rank_ - 1, n_);
  }

 protected:
  void start() override {
    int64_t expected = 0;
    for (int64_t g = 0; g < rsSteps_ + agSteps_; ++g) expected += segments(recvChunk(g));
    expectReceives(expected);
    expectFrom(prev_, expected);
    if (rsSteps_ == 0 && descriptor_.compression != WireCompression::kNone) {
      roundToWire(descriptor_.compression, static_cast<float*>(buffer_.rawData()) + chunkStart(owned_),
                  chunkLength(owned_));
    }
    const int c = sentChunk(0);
    for (int64_t k = 0; k < segments(c); ++k) {
      send(next_, 0, k, flatView(buffer_, chunkStart(c) + k * segElems_, segmentLength(c, k)));
    }
  }

  Result<void> handle(int64_t step, int64_t segment, int source, Tensor data) override {
    if (step < 0 || step >= rsSteps_ + agSteps_ || source != prev_) {
      return Error::failed(what() + ": unexpected chunk for step " + std::to_string(step) + " from rank " +
                           std::to_string(source));
    }
    const int c = recvChunk(step);
    if (segment < 0 || segment >= segments(c) || data.numel() != segmentLength(c, segment)) {
      return Error::failed(what() + ": chunk for step " + std::to_string(step) + " segment " +
                           std::to_string(segment) + " holds " + std::to_string(data.numel()) + " elements");
    }
    const int64_t offset = chunkStart(c) + segment * segElems_;
    const int64_t length = segmentLength(c, segment);
    void* destination = static_cast<char*>(buffer_.rawData()) + static_cast<size_t>(offset) * buffer_.itemSize();
    if (step < rsSteps_) {
      reduceInto(descriptor_.reduce, descriptor_.dtype, destination, data, length);
      if (step == rsSteps_ - 1) {
        // This member now owns chunk c, fully reduced: finish it before it travels the all-gather.
        if (descriptor_.reduce == ReduceOp::kMean) {
          scaleInPlace(descriptor_.dtype, destination, length, 1.0 / static_cast<double>(n_));
        }
        if (agSteps_ > 0 && descriptor_.compression != WireCompression::kNone) {
          roundToWire(descriptor_.compression, static_cast<float*>(destination), length);
        }
      }
    } else {
      copyInto(descriptor_.dtype, destination, data, length);
    }
    data = Tensor();
    if (step + 1 < rsSteps_ + agSteps_) send(next_, step + 1, segment, flatView(buffer_, offset, length));
    return Result<void>();
  }

 private:
  int sentChunk(int64_t g) const {
    if (g < rsSteps_) return mod(rank_ - g + offset_, n_);
    return mod(owned_ - (g - rsSteps_), n_);
  }
  int recvChunk(int64_t g) const {
    if (g < rsSteps_) return mod(rank_ - g - 1 + offset_, n_);
    return mod(owned_ - (g - rsSteps_) - 1, n_);
  }
  int64_t chunkStart(int c) const { return c * base_ + std::min<int64_t>(c, extra_); }
  int64_t chunkLength(int c) const { return base_ + (c < extra_ ? 1 : 0); }
  int64_t segments(int c) const { return (chunkLength(c) + segElems_ - 1) / segElems_; }
  int64_t segmentLength(int c, int64_t k) const { return std::min(segElems_, chunkLength(c) - k * segElems_); }

  Tensor buffer_;
  int offset_;
  int64_t total_ = 0, base_ = 0, extra_ = 0, segElems_ = 1;
  int64_t rsSteps_ = 0, agSteps_ = 0;
  int owned_ = 0, next_ = 0, prev_ = 0;
};

// ---- Recursive doubling (MPICH's algorithm for any n: the first 2*rem ranks fold pairwise first) ----

class RecursiveDoublingOp final : public Op {
 public:
  RecursiveDoublingOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer)
      : Op(std::move(group), std::move(descriptor)), buffer_(std::move(buffer)) {
    p_ = 1;
    while (p_ * 2 <= n_) p_ *= 2;
    rem_ = n_ - p_;
    rounds_ = 0;
    while ((1 << rounds_) < p_) ++rounds_;
    if (rank_ < 2 * rem_) {
      folded_ = rank_ % 2 == 0;
      virtualRank_ = folded_ ? -1 : rank_ / 2;
    } else {
      virtualRank_ = rank_ - rem_;
    }
  }

 protected:
  void start() override {
    acc_ = buffer_.cloneData();
    quantize(acc_);
    if (folded_) {
      // Step 0: hand our data to rank+1; step rounds+1: the result comes back.
      plan_ = {{rounds_ + 1, rank_ + 1}};
      setExpectations();
      send(rank_ + 1, 0, 0, acc_);
      return;
    }
    if (rank_ < 2 * rem_) plan_.push_back({0, rank_ - 1});
    for (int k = 1; k <= rounds_; ++k) plan_.push_back({k, partner(k)});
    setExpectations();
    if (rank_ >= 2 * rem_) enterRound(1);
  }

  Result<void> handle(int64_t step, int64_t segment, int source, Tensor data) override {
    if (segment != 0 || data.numel() != buffer_.numel()) {
      return Error::failed(what() + ": chunk with " + std::to_string(data.numel()) + " elements for segment " +
                           std::to_string(segment));
    }
    std::lock_guard<std::mutex> lock(stepMutex_);
    auto expected = std::find_if(plan_.begin(), plan_.end(), [&](const auto& s) { return s.first == step; });
    if (expected == plan_.end() || expected->second != source || stash_.count(step) != 0) {
      return Error::failed(what() + ": unexpected chunk for step " + std::to_string(step) + " from rank " +
                           std::to_string(source));
    }
    stash_[step] = std::move(data);
    // Steps complete in order: a partner of a later round may be ahead of the one of this round.
    while (cursor_ < plan_.size() && stash_.count(plan_[cursor_].first) != 0) {
      const int64_t s = plan_[cursor_].first;
      Tensor received = std::move(stash_[s]);
      stash_.erase(s);
      ++cursor_;
      process(s, received);
    }
    return Result<void>();
  }

 private:
  void setExpectations() {
    expectReceives(static_cast<int64_t>(plan_.size()));
    for (const auto& [step, source] : plan_) expectFrom(source, 1);
  }
  int partner(int k) const {
    const int pv = virtualRank_ ^ (1 << (k - 1));
    return pv < rem_ ? 2 * pv + 1 : pv + rem_;
  }
  void quantize(Tensor& t) const {
    if (descriptor_.compression != WireCompression::kNone) {
      roundToWire(descriptor_.compression, static_cast<float*>(t.rawData()), t.numel());
    }
  }
  void process(int64_t step, const Tensor& data) {
    if (folded_) {
      copyInto(descriptor_.dtype, buffer_.rawData(), data, buffer_.numel());
      return;
    }
    // A fresh accumulator each round: the previous one may still be on its way to a partner.
    Tensor next = acc_.cloneData();
    reduceInto(descriptor_.reduce, descriptor_.dtype, next.rawData(), data, next.numel());
    quantize(next);
    acc_ = std::move(next);
    enterRound(static_cast<int>(step) + 1);
  }
  void enterRound(int k) {
    if (k <= rounds_) {
      send(partner(k), k, 0, acc_);
      return;
    }
    Tensor result = acc_.cloneData();
    if (descriptor_.reduce == ReduceOp::kMean) {
      scaleInPlace(descriptor_.dtype, result.rawData(), result.numel(), 1.0 / static_cast<double>(n_));
      quantize(result);
    }
    if (rank_ < 2 * rem_) send(rank_ - 1, rounds_ + 1, 0, result);
    std::memcpy(buffer_.rawData(), result.rawData(), buffer_.nbytes());
  }

  Tensor buffer_;
  Tensor acc_;
  int p_ = 1, rem_ = 0, rounds_ = 0, virtualRank_ = -1;
  bool folded_ = false;
  std::mutex stepMutex_;
  std::vector<std::pair<int64_t, int>> plan_;  // (step, source) in processing order
  size_t cursor_ = 0;                          // GUARDED_BY(stepMutex_)
  std::map<int64_t, Tensor> stash_;            // GUARDED_BY(stepMutex_)
};

// ---- Broadcast: binomial tree or chain, in segments ----

class BroadcastOp final : public Op {
 public:
  BroadcastOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer, bool chain)
      : Op(std::move(group), std::move(descriptor)), buffer_(std::move(buffer)) {
    const int root = static_cast<int>(descriptor_.root);
    const int vr = mod(rank_ - root, n_);
    segElems_ = std::max<int64_t>(1, static_cast<int64_t>(group_->options.segmentBytes / buffer_.itemSize()));
    if (chain) {
      if (vr > 0) parent_ = mod(vr - 1 + root, n_);
      if (vr + 1 < n_) children_.push_back(mod(vr + 1 + root, n_));
    } else {
      int high = 0;
      while (vr > 0 && (2 << high) <= vr) ++high;
      if (vr > 0) parent_ = mod(vr - (1 << high) + root, n_);
      for (int mask = vr == 0 ? 1 : (2 << high); vr + mask < n_; mask <<= 1) {
        children_.push_back(mod(vr + mask + root, n_));
      }
    }
  }

 protected:
  void start() override {
    const int64_t total = buffer_.numel();
    const int64_t segments = (total + segElems_ - 1) / segElems_;
    if (parent_ >= 0) {
      expectReceives(segments);
      expectFrom(parent_, segments);
      return;
    }
    if (descriptor_.compression != WireCompression::kNone) {
      roundToWire(descriptor_.compression, static_cast<float*>(buffer_.rawData()), total);
    }
    for (int64_t k = 0; k < segments; ++k) forward(k);
  }

  Result<void> handle(int64_t step, int64_t segment, int source, Tensor data) override {
    const int64_t total = buffer_.numel();
    if (step != 0 || source != parent_ || segment < 0 || segment * segElems_ >= total ||
        data.numel() != std::min(segElems_, total - segment * segElems_)) {
      return Error::failed(what() + ": unexpected chunk (segment " + std::to_string(segment) + ", " +
                           std::to_string(data.numel()) + " elements) from rank " + std::to_string(source));
    }
    const int64_t offset = segment * segElems_;
    copyInto(descriptor_.dtype, static_cast<char*>(buffer_.rawData()) + static_cast<size_t>(offset) * buffer_.itemSize(),
             data, data.numel());
    forward(segment);
    return Result<void>();
  }

 private:
  void forward(int64_t segment) {
    const int64_t offset = segment * segElems_;
    const int64_t length = std::min(segElems_, buffer_.numel() - offset);
    for (int child : children_) send(child, 0, segment, flatView(buffer_, offset, length));
  }

  Tensor buffer_;
  int64_t segElems_ = 1;
  int parent_ = -1;
  std::vector<int> children_;
};

}  // namespace

std::shared_ptr<Op> makeRingOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer,
                               bool reduceScatter, bool allGather, int ownedShift) {
  return std::make_shared<RingOp>(std::move(group), std::move(descriptor), std::move(buffer), reduceScatter,
                                  allGather, ownedShift);
}

std::shared_ptr<Op> makeRecursiveDoublingOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor,
                                            Tensor buffer) {
  return std::make_shared<RecursiveDoublingOp>(std::move(group), std::move(descriptor), std::move(buffer));
}

std::shared_ptr<Op> makeBroadcastOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer,
                                    bool chain) {
  return std::make_shared<BroadcastOp>(std::move(group), std::move(descriptor), std::move(buffer), chain);
}

}  // namespace distgrad::rpc::collectives::detail
