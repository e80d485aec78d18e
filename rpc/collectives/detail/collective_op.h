// Internals of rpc/collectives: the per-agent mailbox (CollectivesContext, an AgentExtension), group
// state, and the operation state machines (ring, recursive doubling, tree/chain broadcast).
//
// Thread model (docs/collectives.md, "Threads"): an operation is driven entirely by events: the chunk
// handler (an executor thread of the agent, one per arriving segment), the continuation of a sent chunk's
// rpc (an executor thread), the deadline timer (the context's timer thread) and the peer-down notification.
// No thread ever waits for a message. Segments of one operation touch disjoint memory, so their handlers
// run concurrently; an operation's counters and send window are guarded by its own mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rpc/agent.h"
#include "rpc/collectives/process_group.h"
#include "rpc/timer.h"

namespace distgrad::rpc::collectives::detail {

enum class OpKind : uint8_t { kAllReduce = 0, kBroadcast = 1, kAllGather = 2, kReduceScatter = 3, kBarrier = 4 };
const char* opKindName(OpKind kind);

// What every member's call of one collective must agree on. Travels in every chunk's header.
struct OpDescriptor {
  OpKind kind = OpKind::kAllReduce;
  ReduceOp reduce = ReduceOp::kSum;
  tensor::DType dtype = tensor::DType::kFloat32;
  WireCompression compression = WireCompression::kNone;
  int64_t algorithm = 0;  // AllReduceAlgorithm / BroadcastAlgorithm after kAuto was resolved
  int64_t root = 0;
  int64_t numel = 0;
  uint64_t shapeHash = 0;
  // "allReduce(float32, 1000 elements, sum, ring)"
  std::string describe() const;
  friend bool operator==(const OpDescriptor&, const OpDescriptor&) = default;
};

// The header of one chunk message (Note [Collective messages] in collective_op.cpp).
struct ChunkHeader {
  uint64_t group = 0;
  uint64_t seq = 0;
  int64_t step = 0;
  int64_t segment = 0;
  int64_t source = 0;  // the sender's rank in the group
  int64_t kind = 0;
  int64_t reduce = 0;
  int64_t dtype = 0;
  int64_t compression = 0;
  int64_t algorithm = 0;
  int64_t root = 0;
  int64_t numel = 0;
  uint64_t shapeHash = 0;
  template <class V>
  void visitFields(V& v) {
    v("group", group);
    v("seq", seq);
    v("step", step);
    v("segment", segment);
    v("source", source);
    v("kind", kind);
    v("reduce", reduce);
    v("dtype", dtype);
    v("compression", compression);
    v("algorithm", algorithm);
    v("root", root);
    v("numel", numel);
    v("shapeHash", shapeHash);
  }
};

inline const Function<void(ChunkHeader, Tensor)> kChunkFunction{"dg.collectives.chunk"};
// (group, seq, error kind, reason, worker the failure is about)
inline const Function<void(uint64_t, uint64_t, int64_t, std::string, std::string)> kAbortFunction{
    "dg.collectives.abort"};

class CollectivesContext;
class Op;

struct GroupState {
  uint64_t id = 0;
  std::vector<std::string> members;
  int rank = 0;
  ProcessGroupOptions options;
  Agent* agent = nullptr;
  std::shared_ptr<CollectivesContext> context;
  std::string membersText;  // "[worker0, worker1]" for messages
  // Advanced under the context's mutex; atomic so that collectivesStarted() may read it from anywhere.
  std::atomic<uint64_t> nextSeq{0};
  std::optional<Error> broken;  // GUARDED_BY(context->mutex_)

  int rankOf(const std::string& worker) const;
  std::chrono::milliseconds timeout() const;
};

// The agent extension: groups, operations in flight, and chunks that arrived before their operation
// started on this worker ("parked").
class CollectivesContext : public AgentExtension, public std::enable_shared_from_this<CollectivesContext> {
 public:
  static std::shared_ptr<CollectivesContext> of(Agent& agent);
  explicit CollectivesContext(Agent& agent);
  ~CollectivesContext() override;

  // Registers a new group on `members` + tag; the instance number keeps equal member lists apart.
  void registerGroup(GroupState& group);
  void unregisterGroup(uint64_t id);

  // Assigns the operation its sequence number, makes it reachable for chunks, starts it, then feeds it
  // the chunks that were parked for it.
  void run(const std::shared_ptr<GroupState>& group, const std::shared_ptr<Op>& op);
  // The operation ended (with `error` if it failed: later chunks for it are refused with that error, so
  // their senders learn the cause rather than "already ended").
  void finished(const Op& op, const Error* error = nullptr);

  Future<void> deliverChunk(const CallContext& ctx, ChunkHeader header, Tensor data);
  void deliverAbort(uint64_t group, uint64_t seq, Error error);

  void onPeerDown(const std::string& peer, const Error& error) override;
  void onAgentClosed() override;

  TimerQueue& timers() { return timers_; }
  Executor& executor() { return executor_; }

 private:
  struct Parked {
    struct Chunk {
      ChunkHeader header;
      std::string sender;
      Tensor data;
      std::shared_ptr<Promise<void>> ack;
    };
    std::vector<Chunk> chunks;
    std::optional<Error> abort;
  };
  Agent* agent_;
  Executor& executor_;
  std::mutex mutex_;
  std::map<uint64_t, GroupState*> groups_;                                // GUARDED_BY(mutex_)
  std::map<std::string, uint64_t> instances_;                             // GUARDED_BY(mutex_)
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Op>> active_;   // GUARDED_BY(mutex_)
  std::map<std::pair<uint64_t, uint64_t>, Parked> parked_;                // GUARDED_BY(mutex_)
  std::map<std::pair<uint64_t, uint64_t>, Error> failures_;              // GUARDED_BY(mutex_)
  std::deque<std::pair<uint64_t, uint64_t>> failureOrder_;                // GUARDED_BY(mutex_), bounded
  bool closed_ = false;                                                   // GUARDED_BY(mutex_)
  TimerQueue timers_;
  friend struct GroupState;
};

// One collective on this worker. Subclasses define which messages it sends and expects.
class Op : public std::enable_shared_from_this<Op> {
 public:
  Op(std::shared_ptr<GroupState> group, OpDescriptor descriptor);
  virtual ~Op() = default;

  const OpDescriptor& descriptor() const { return descriptor_; }
  uint64_t groupId() const { return group_->id; }
  uint64_t seq() const { return seq_; }
  void setSeq(uint64_t seq) { seq_ = seq; }
  Future<void> future();

  // Called by the context with the begin lock held (see CollectivesContext::run).
  void begin();
  std::mutex& beginMutex() { return beginMutex_; }
  // A chunk for this operation; returns the error to answer the sender with, if the chunk was refused.
  Result<void> onChunk(const ChunkHeader& header, const std::string& sender, Tensor data);
  // Ends the operation with `error` (once); `tellOthers` sends an abort to every other member.
  void fail(Error error, bool tellOthers);
  // "collective #3 allReduce(float32, 1000 elements, sum, ring) on group [worker0, worker1]"
  std::string what() const;
  bool involves(const std::string& worker) const;

 protected:
  virtual void start() = 0;
  // Validated (step, segment, source) in range; returns an error message to refuse the chunk.
  virtual Result<void> handle(int64_t step, int64_t segment, int source, Tensor data) = 0;

  void expectReceives(int64_t count);
  void send(int destination, int64_t step, int64_t segment, Tensor data);
  // Call after handling a received chunk, once the sends it causes are queued.
  void received();
  // For operations with nothing to send or receive.
  void checkDone();
  Error mismatch(const std::string& peer, const std::string& what) const;

  std::shared_ptr<GroupState> group_;
  OpDescriptor descriptor_;
  int n_;
  int rank_;

 private:
  struct PendingSend {
    int destination;
    int64_t step;
    int64_t segment;
    Tensor data;
  };
  void issue(PendingSend send);
  void onSent(int destination, Result<void> result);
  void onTimeout();
  bool doneLocked();  // marks the operation done when nothing is left; caller holds mutex_
  void succeed();

  uint64_t seq_ = 0;
  std::mutex beginMutex_;
  std::mutex mutex_;
  Promise<void> promise_;
  Future<void> future_;
  bool begun_ = false;              // GUARDED_BY(mutex_)
  bool done_ = false;               // GUARDED_BY(mutex_)
  std::optional<Error> failure_;    // GUARDED_BY(mutex_): why it failed, for chunks arriving after
  int64_t expected_ = 0;            // GUARDED_BY(mutex_)
  int64_t receivedCount_ = 0;       // GUARDED_BY(mutex_)
  size_t inFlight_ = 0;             // GUARDED_BY(mutex_)
  std::deque<PendingSend> queued_;  // GUARDED_BY(mutex_)
  std::vector<int64_t> receivedFrom_;  // GUARDED_BY(mutex_): per rank, for timeout messages
  std::vector<int64_t> expectedFrom_;  // set by subclasses through expectFrom()
  TimerId timer_ = kInvalidTimerId;

 protected:
  void expectFrom(int source, int64_t count) { expectedFrom_[static_cast<size_t>(source)] += count; }
};

// Factories (collective_op.cpp).
std::shared_ptr<Op> makeRingOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer,
                               bool reduceScatter, bool allGather, int ownedShift);
std::shared_ptr<Op> makeRecursiveDoublingOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer);
std::shared_ptr<Op> makeBroadcastOp(std::shared_ptr<GroupState> group, OpDescriptor descriptor, Tensor buffer,
                                    bool chain);

// Kernels (reduce.cpp).
void reduceInto(ReduceOp op, tensor::DType dtype, void* destination, const Tensor& source, int64_t count);
void copyInto(tensor::DType dtype, void* destination, const Tensor& source, int64_t count);
void scaleInPlace(tensor::DType dtype, void* data, int64_t count, double factor);
void roundToWire(WireCompression compression, float* data, int64_t count);
// A tensor of `count` elements aliasing `base` from element `offset` (keeps base's storage alive; its own
// storage is exactly those bytes, so the codec sends it without compacting).
Tensor flatView(const Tensor& base, int64_t offset, int64_t count);
// The wire form of a float32/float64/int64 view: itself, or a float16/bfloat16 copy.
Tensor toWire(const Tensor& view, WireCompression compression);
tensor::DType wireDType(tensor::DType dtype, WireCompression compression);

}  // namespace distgrad::rpc::collectives::detail
