// Shared setup of the collectives tests: n agents in this process (inproc or tcp on 127.0.0.1) with the
// collectives installed, one ProcessGroup per agent, and helpers to issue a collective on every rank from
// the test thread (handles are asynchronous, so one thread can drive all members).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../rpc/agent_test_util.h"
#include "rpc/collectives/process_group.h"

namespace distgrad::rpc::collectives::testing {

using namespace std::chrono_literals;
using rpc::testing::Cluster;
using rpc::testing::ClusterSpec;
using rpc::testing::World;
using tensor::DType;
using tensor::Tensor;

struct Job {
  World world;
  Registry registry;
  Cluster cluster;
  std::vector<std::unique_ptr<ProcessGroup>> groups;  // world groups, one per rank (destroyed first)

  ~Job() { groups.clear(); }
  Agent& agent(int rank) { return *cluster.agents.at(static_cast<size_t>(rank)); }
  ProcessGroup& group(int rank) { return *groups.at(static_cast<size_t>(rank)); }
  int size() const { return static_cast<int>(groups.size()); }
};

inline std::unique_ptr<Job> startJob(const std::string& transport, int size, ProcessGroupOptions options = {},
                                     ClusterSpec spec = {}) {
  auto job = std::make_unique<Job>();
  job->registry = rpc::testing::makeRegistry(job->world);
  install(job->registry);
  spec.transport = transport;
  spec.size = size;
  rpc::testing::startCluster(job->cluster, spec, job->world, job->registry);
  for (int r = 0; r < size; ++r) {
    if (job->cluster.errors[static_cast<size_t>(r)]) std::rethrow_exception(job->cluster.errors[static_cast<size_t>(r)]);
  }
  for (int r = 0; r < size; ++r) job->groups.push_back(std::make_unique<ProcessGroup>(ProcessGroup::world(job->agent(r), options)));
  return job;
}

// The error of a future that must fail (bounded wait).
inline Error failureOf(Future<void>& future) {
  EXPECT_TRUE(future.wait(rpc::testing::kTestTimeout)) << "the collective did not end";
  Result<void> result = future.result();
  EXPECT_FALSE(result.ok()) << "the collective succeeded";
  return result.ok() ? Error::failed("no error") : result.error();
}

// Deterministic per-rank inputs whose sums, maxima and products stay well inside float range.
inline Tensor rankInput(int rank, int64_t numel, DType dtype, bool forProduct = false) {
  std::vector<double> values(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) {
    const double v = static_cast<double>((i * 7 + rank * 13) % 23) - 11.0;
    values[static_cast<size_t>(i)] = forProduct ? 1.0 + v / 64.0 : (dtype == DType::kInt64 ? v : v / 4.0 + 0.125 * rank);
  }
  Tensor t = Tensor::fromVector(values, {numel});
  return t.toDType(dtype).cloneData();
}

inline std::vector<double> asDoubles(const Tensor& t) { return t.toDType(DType::kFloat64).toVector<double>(); }

}  // namespace distgrad::rpc::collectives::testing
