// ProcessGroup: collective communication (all-reduce, broadcast, all-gather, reduce-scatter, barrier) among
// an ordered list of workers of one Agent's job, over the agent's existing connections (any transport).
//
//   rpc::Registry reg;
//   rpc::collectives::install(reg);                       // before Agent::start, on every worker
//   auto agent = rpc::Agent::start(options, reg);
//   auto world = rpc::collectives::ProcessGroup::world(*agent);       // every worker, ranks = agent ranks
//   world.allReduce(grad, {.op = ReduceOp::kMean}).get();               // in place, async handle
//   auto pair = world.subgroup({0, 2});                                 // only workers 0 and 2 call this
//
// Ranks are positions in the member list. Every member must issue the same collectives on a group in the
// same order (like NCCL and torch.distributed); the n-th collective a worker starts on a group meets the
// n-th of every other member, so several may be in flight at once. Chunks travel as tensor payloads of the
// registered rpc function "dg.collectives.chunk", whose handler deposits them into the operation they
// belong to (docs/collectives.md: algorithms, message protocol, failure behaviour, threads).
//
// Failures complete every member's handle with an Error (no hang): a member that dies (the agent's
// heartbeats / connection close) fails every collective in flight on groups containing it and breaks
// those groups (later collectives fail at once); a member whose call disagrees (kind, dtype, element
// count, shape, reduction, root, algorithm, compression) fails the collective on every member with a
// message naming it and both calls; a collective not complete within ProcessGroupOptions::timeout fails
// with `timeout` naming the members it still waits for.
//
// Thread-safety: a ProcessGroup may be used from any thread; collectives issued concurrently from several
// threads are ordered by whichever starts first, so a program that needs a particular order across
// workers issues them from one thread. The tensors passed in must not be touched until the handle
// completes. The group must not outlive its Agent; handles are bound to the agent's executor.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rpc/agent.h"
#include "rpc/future.h"
#include "rpc/registry.h"
#include "tensor/tensor.h"

namespace distgrad::rpc::collectives {

using tensor::Tensor;

enum class ReduceOp : uint8_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3, kProduct = 4 };
const char* reduceOpName(ReduceOp op);

// Element type on the wire for float32 tensors: halves the bytes moved at the cost of precision. The
// result is rounded to the wire type on every member (also on the one whose values never travelled), so
// all members end with bitwise equal tensors.
enum class WireCompression : uint8_t { kNone = 0, kFloat16 = 1, kBFloat16 = 2 };
const char* wireCompressionName(WireCompression compression);

enum class AllReduceAlgorithm : uint8_t {
  kAuto = 0,               // recursive doubling up to ProcessGroupOptions::smallTensorBytes, ring above
  kRing = 1,               // reduce-scatter + all-gather in segments: 2(n-1)/n of the bytes per member
  kRecursiveDoubling = 2,  // log2(n) rounds exchanging the whole tensor: fewest messages, for small ones
};
enum class BroadcastAlgorithm : uint8_t {
  kAuto = 0,   // binomial tree up to smallTensorBytes, pipelined chain above
  kTree = 1,   // binomial tree: log2(n) hops
  kChain = 2,  // root -> root+1 -> ... in segments: every link carries the tensor once
};

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  WireCompression compression = WireCompression::kNone;
  AllReduceAlgorithm algorithm = AllReduceAlgorithm::kAuto;
};
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  WireCompression compression = WireCompression::kNone;
};
struct BroadcastOptions {
  WireCompression compression = WireCompression::kNone;
  BroadcastAlgorithm algorithm = BroadcastAlgorithm::kAuto;
};
struct AllGatherOptions {
  WireCompression compression = WireCompression::kNone;
};

struct ProcessGroupOptions {
  // Distinguishes groups with the same members (with the same tag, the k-th group a worker creates on a
  // member list meets the k-th of the others).
  std::string tag;
  // Bound on one collective from its start on this worker: 0 = the agent's Options::defaultTimeout;
  // negative = none (a member that is alive but never joins then hangs the collective, as in NCCL).
  std::chrono::milliseconds timeout{0};
  // Ring and chain collectives move tensors in segments of at most this many bytes, pipelined, so a
  // 256 MB all-reduce never holds more than maxSegmentsInFlight extra segments per member.
  size_t segmentBytes = size_t{1} << 20;
  // Segments one collective may have sent and not yet seen consumed (its window).
  size_t maxSegmentsInFlight = 8;
  // kAuto picks the latency-optimal algorithm for tensors up to this many bytes.
  size_t smallTensorBytes = size_t{64} << 10;
};

namespace detail {
struct GroupState;
}

// Binds the functions collectives use ("dg.collectives.chunk", "dg.collectives.abort"). Call it on every
// worker's registry before Agent::start.
void install(Registry& registry);

class ProcessGroup {
 public:
  // `members` are worker names of agent's job, in rank order, without duplicates, including agent.name().
  // Throws ValueError otherwise, or when install() was not called on the agent's registry.
  ProcessGroup(Agent& agent, std::vector<std::string> members, ProcessGroupOptions options = {});
  // Every worker of the job, ranked as the agent ranks them.
  static ProcessGroup world(Agent& agent, ProcessGroupOptions options = {});
  ~ProcessGroup();
  ProcessGroup(ProcessGroup&&) noexcept;
  ProcessGroup& operator=(ProcessGroup&&) noexcept;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // A group of some of this group's members (ranks in this group, in the new group's order). Only those
  // members call it; the options default to this group's (tag aside).
  ProcessGroup subgroup(const std::vector<int>& ranks, const std::string& tag = {}) const;

  int rank() const;
  int size() const;
  const std::vector<std::string>& members() const;
  const ProcessGroupOptions& options() const;
  Agent& agent() const;

  // All-reduce `tensor` (contiguous, CPU, float32/float64/int64; kMean needs a float type) in place.
  Future<void> allReduce(Tensor tensor, AllReduceOptions options = {});
  // Overwrite `tensor` on every member with root's (same shape and dtype everywhere).
  Future<void> broadcast(Tensor tensor, int root, BroadcastOptions options = {});
  // Members' tensors (same shape everywhere) concatenated along dimension 0 in rank order (a 0-d tensor
  // gives shape [size()]).
  Future<Tensor> allGather(Tensor tensor, AllGatherOptions options = {});
  // Reduces `input` (dimension 0 divisible by size()) across members and returns this member's slice of
  // the result along dimension 0 (rows [rank*k, (rank+1)*k) for k = dim0 / size()). `input` is not changed.
  Future<Tensor> reduceScatter(Tensor input, ReduceScatterOptions options = {});
  // Completes once every member has called barrier() (as its same-numbered collective).
  Future<void> barrier();

  // Blocking forms: wait and rethrow the Error as RpcError.
  void allReduceSync(Tensor tensor, AllReduceOptions options = {}) { allReduce(std::move(tensor), options).get(); }
  void broadcastSync(Tensor tensor, int root, BroadcastOptions options = {}) {
    broadcast(std::move(tensor), root, options).get();
  }
  Tensor allGatherSync(Tensor tensor, AllGatherOptions options = {}) { return allGather(std::move(tensor), options).get(); }
  Tensor reduceScatterSync(Tensor input, ReduceScatterOptions options = {}) {
    return reduceScatter(std::move(input), options).get();
  }
  void barrierSync() { barrier().get(); }

  // Collectives this worker has started on the group (its sequence number for the next one).
  uint64_t collectivesStarted() const;

 private:
  explicit ProcessGroup(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::GroupState> state_;
};

}  // namespace distgrad::rpc::collectives
