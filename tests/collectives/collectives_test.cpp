// Collectives among 2, 3 and 4 agents of one process, over inproc and tcp: every operation and reduction
// against a reference computed here, odd sizes (fewer elements than members, not divisible, many
// segments), sub-groups, concurrent collectives, and the failures (mismatched calls, a dead member, a
// member that never joins, bad arguments).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "collectives_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rpc::collectives::testing {
namespace {

// Small segments and window so that even modest tensors take many pipelined segments per ring step.
ProcessGroupOptions smallSegments() {
  ProcessGroupOptions options;
  options.segmentBytes = 256;
  options.maxSegmentsInFlight = 3;
  options.timeout = 20s;
  return options;
}

double reduceReference(ReduceOp op, const std::vector<std::vector<double>>& inputs, size_t i) {
  double acc = inputs[0][i];
  for (size_t r = 1; r < inputs.size(); ++r) {
    const double v = inputs[r][i];
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kMean: acc += v; break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kProduct: acc *= v; break;
    }
  }
  if (op == ReduceOp::kMean) acc /= static_cast<double>(inputs.size());
  return acc;
}

// Runs one all-reduce on every member and checks each result against the reference (and that all
// members hold bitwise equal tensors).
void checkAllReduce(Job& job, int64_t numel, DType dtype, AllReduceOptions options, double tolerance) {
  const int n = job.size();
  const bool product = options.op == ReduceOp::kProduct;
  std::vector<Tensor> tensors;
  std::vector<std::vector<double>> inputs;
  for (int r = 0; r < n; ++r) {
    tensors.push_back(rankInput(r, numel, dtype, product));
    inputs.push_back(asDoubles(tensors.back()));
  }
  std::vector<Future<void>> futures;
  for (int r = 0; r < n; ++r) futures.push_back(job.group(r).allReduce(tensors[static_cast<size_t>(r)], options));
  for (auto& f : futures) f.get();
  const std::string where = "n=" + std::to_string(n) + " numel=" + std::to_string(numel) + " dtype=" +
                            tensor::dtypeName(dtype) + " op=" + reduceOpName(options.op) + " algorithm=" +
                            std::to_string(static_cast<int>(options.algorithm));
  for (int r = 0; r < n; ++r) {
    const auto got = asDoubles(tensors[static_cast<size_t>(r)]);
    for (int64_t i = 0; i < numel; ++i) {
      const double want = reduceReference(options.op, inputs, static_cast<size_t>(i));
      ASSERT_NEAR(got[static_cast<size_t>(i)], want, tolerance * std::max(1.0, std::abs(want)))
          << where << " rank " << r << " element " << i;
    }
    if (numel > 0) {
      ASSERT_EQ(std::memcmp(tensors[static_cast<size_t>(r)].rawData(), tensors[0].rawData(), tensors[0].nbytes()), 0)
          << where << ": rank " << r << " differs bitwise from rank 0";
    }
  }
}

class Collectives : public ::testing::TestWithParam<std::string> {};

TEST_P(Collectives, AllReduceEveryOpDtypeAlgorithmAndOddSize) {
  for (int n : {2, 3, 4}) {
    auto job = startJob(GetParam(), n, smallSegments());
    for (auto algorithm : {AllReduceAlgorithm::kRing, AllReduceAlgorithm::kRecursiveDoubling}) {
      for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{n - 1}, int64_t{7}, int64_t{1001}}) {
        for (auto op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProduct}) {
          checkAllReduce(*job, numel, DType::kFloat32, {op, WireCompression::kNone, algorithm}, 1e-5);
          checkAllReduce(*job, numel, DType::kFloat64, {op, WireCompression::kNone, algorithm}, 1e-12);
          if (op != ReduceOp::kMean && op != ReduceOp::kProduct) {
            checkAllReduce(*job, numel, DType::kInt64, {op, WireCompression::kNone, algorithm}, 0.0);
          }
        }
      }
    }
    // kAuto on both sides of smallTensorBytes (64 KiB): 100 and 40,000 float32 elements.
    checkAllReduce(*job, 100, DType::kFloat32, {}, 1e-5);
    checkAllReduce(*job, 40'000, DType::kFloat32, {ReduceOp::kMean}, 1e-5);
  }
}

TEST_P(Collectives, AllReduceLargeTensorManySegments) {
  ProcessGroupOptions options;
  options.segmentBytes = 64 << 10;
  options.maxSegmentsInFlight = 2;
  auto job = startJob(GetParam(), 3, options);
  checkAllReduce(*job, (4 << 20) / 4 + 3, DType::kFloat32, {ReduceOp::kSum, WireCompression::kNone,
                                                            AllReduceAlgorithm::kRing}, 1e-5);
}

TEST_P(Collectives, AllReduceCompressedOnTheWire) {
  for (int n : {2, 3}) {
    auto job = startJob(GetParam(), n, smallSegments());
    for (auto compression : {WireCompression::kFloat16, WireCompression::kBFloat16}) {
      for (auto algorithm : {AllReduceAlgorithm::kRing, AllReduceAlgorithm::kRecursiveDoubling}) {
        // bfloat16 keeps 8 bits of mantissa: relative error up to ~n * 2^-8 after the partial sums.
        const double tolerance = compression == WireCompression::kFloat16 ? 5e-3 : 3e-2;
        checkAllReduce(*job, 501, DType::kFloat32, {ReduceOp::kSum, compression, algorithm}, tolerance);
        checkAllReduce(*job, 501, DType::kFloat32, {ReduceOp::kMean, compression, algorithm}, tolerance);
      }
    }
  }
}

TEST_P(Collectives, BroadcastFromEveryRootTreeAndChain) {
  for (int n : {2, 3, 4}) {
    auto job = startJob(GetParam(), n, smallSegments());
    for (auto algorithm : {BroadcastAlgorithm::kTree, BroadcastAlgorithm::kChain}) {
      for (int root = 0; root < n; ++root) {
        for (int64_t numel : {int64_t{1}, int64_t{5}, int64_t{333}}) {
          std::vector<Tensor> tensors;
          for (int r = 0; r < n; ++r) tensors.push_back(rankInput(r, numel, DType::kFloat64));
          const auto want = asDoubles(tensors[static_cast<size_t>(root)]);
          std::vector<Future<void>> futures;
          for (int r = 0; r < n; ++r) {
            futures.push_back(job->group(r).broadcast(tensors[static_cast<size_t>(r)], root, {WireCompression::kNone, algorithm}));
          }
          for (auto& f : futures) f.get();
          for (int r = 0; r < n; ++r) {
            EXPECT_EQ(asDoubles(tensors[static_cast<size_t>(r)]), want) << "n=" << n << " root=" << root << " rank=" << r;
          }
        }
      }
    }
    // Compressed: every member, root included, ends with the float16-rounded values.
    std::vector<Tensor> tensors;
    for (int r = 0; r < n; ++r) tensors.push_back(Tensor::full({9}, 0.1 * (r + 1)));
    std::vector<Future<void>> futures;
    for (int r = 0; r < n; ++r) futures.push_back(job->group(r).broadcast(tensors[static_cast<size_t>(r)], n - 1, {WireCompression::kFloat16}));
    for (auto& f : futures) f.get();
    const float rounded = tensor::halfToFloat(tensor::floatToHalf(static_cast<float>(0.1 * n)));
    for (int r = 0; r < n; ++r) EXPECT_EQ(tensors[static_cast<size_t>(r)].toVector<float>(), std::vector<float>(9, rounded));
  }
}

TEST_P(Collectives, AllGatherConcatenatesInRankOrder) {
  for (int n : {2, 3, 4}) {
    auto job = startJob(GetParam(), n, smallSegments());
    for (const tensor::Shape& shape : {tensor::Shape{3, 2}, tensor::Shape{1}, tensor::Shape{}, tensor::Shape{101, 3}}) {
      std::vector<Tensor> inputs;
      std::vector<Future<Tensor>> futures;
      for (int r = 0; r < n; ++r) {
        inputs.push_back(rankInput(r, tensor::numelOf(shape), DType::kInt64));
        inputs.back() = Tensor::fromStorage(inputs.back().storage(), shape, tensor::contiguousStrides(shape), 0, DType::kInt64);
        futures.push_back(job->group(r).allGather(inputs.back()));
      }
      std::vector<int64_t> want;
      for (int r = 0; r < n; ++r) {
        auto v = inputs[static_cast<size_t>(r)].toVector<int64_t>();
        want.insert(want.end(), v.begin(), v.end());
      }
      tensor::Shape wantShape = shape.empty() ? tensor::Shape{n} : shape;
      if (!shape.empty()) wantShape[0] *= n;
      for (int r = 0; r < n; ++r) {
        Tensor out = futures[static_cast<size_t>(r)].get();
        EXPECT_EQ(out.shape(), wantShape);
        EXPECT_EQ(out.toVector<int64_t>(), want) << "n=" << n << " rank " << r;
      }
    }
  }
}

TEST_P(Collectives, ReduceScatterGivesEachRankItsReducedSlice) {
  for (int n : {2, 3, 4}) {
    auto job = startJob(GetParam(), n, smallSegments());
    for (auto op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax}) {
      const tensor::Shape shape{n * 37, 3};
      std::vector<Tensor> inputs;
      std::vector<std::vector<double>> values;
      std::vector<Future<Tensor>> futures;
      for (int r = 0; r < n; ++r) {
        Tensor flat = rankInput(r, tensor::numelOf(shape), DType::kFloat32);
        inputs.push_back(Tensor::fromStorage(flat.storage(), shape, tensor::contiguousStrides(shape), 0, DType::kFloat32));
        values.push_back(asDoubles(flat));
        futures.push_back(job->group(r).reduceScatter(inputs.back(), {op}));
      }
      for (int r = 0; r < n; ++r) {
        Tensor out = futures[static_cast<size_t>(r)].get();
        ASSERT_EQ(out.shape(), (tensor::Shape{37, 3}));
        const auto got = asDoubles(out);
        for (size_t i = 0; i < got.size(); ++i) {
          const double want = reduceReference(op, values, static_cast<size_t>(r) * got.size() + i);
          ASSERT_NEAR(got[i], want, 1e-5 * std::max(1.0, std::abs(want))) << "n=" << n << " rank " << r << " i " << i;
        }
        // The input is left as it was.
        EXPECT_EQ(asDoubles(inputs[static_cast<size_t>(r)]), values[static_cast<size_t>(r)]);
      }
    }
    EXPECT_THROW(job->group(0).reduceScatter(Tensor::zeros({n * 2 + 1})), ValueError);
  }
}

TEST_P(Collectives, BarrierWaitsForEveryMember) {
  auto job = startJob(GetParam(), 3);
  Future<void> first = job->group(0).barrier();
  Future<void> second = job->group(1).barrier();
  // Rank 2 has not arrived: neither may pass (a bounded check, not a synchronisation).
  EXPECT_FALSE(first.wait(100ms));
  EXPECT_FALSE(second.isReady());
  Future<void> third = job->group(2).barrier();
  first.get();
  second.get();
  third.get();
}

TEST_P(Collectives, SubgroupsRankByPositionAndRunConcurrently) {
  auto job = startJob(GetParam(), 4, smallSegments());
  // {3, 1} (worker3 is rank 0 there) and {0, 2}, created only on their members.
  auto a3 = job->group(3).subgroup({3, 1});
  auto a1 = job->group(1).subgroup({3, 1});
  auto b0 = job->group(0).subgroup({0, 2});
  auto b2 = job->group(2).subgroup({0, 2});
  EXPECT_EQ(a3.rank(), 0);
  EXPECT_EQ(a1.rank(), 1);
  EXPECT_EQ(a1.members(), (std::vector<std::string>{"worker3", "worker1"}));
  std::vector<Tensor> t;
  for (int r = 0; r < 4; ++r) t.push_back(Tensor::full({50}, r + 1.0));
  Future<void> fa3 = a3.allReduce(t[3]);
  Future<void> fb0 = b0.allReduce(t[0], {ReduceOp::kMax});
  Future<void> fa1 = a1.allReduce(t[1]);
  Future<void> fb2 = b2.allReduce(t[2], {ReduceOp::kMax});
  fa3.get();
  fa1.get();
  fb0.get();
  fb2.get();
  EXPECT_EQ(t[1].toVector<float>(), std::vector<float>(50, 6.0f));
  EXPECT_EQ(t[3].toVector<float>(), std::vector<float>(50, 6.0f));
  EXPECT_EQ(t[0].toVector<float>(), std::vector<float>(50, 3.0f));
  EXPECT_EQ(t[2].toVector<float>(), std::vector<float>(50, 3.0f));
  // A root named by rank in the sub-group: worker1 (rank 1 of a).
  Tensor x3 = Tensor::zeros({4});
  Tensor x1 = Tensor::full({4}, 9.0);
  Future<void> g3 = a3.broadcast(x3, 1);
  Future<void> g1 = a1.broadcast(x1, 1);
  g3.get();
  g1.get();
  EXPECT_EQ(x3.toVector<float>(), std::vector<float>(4, 9.0f));
  // A second group on the same members is a separate group (the instance number keeps them apart).
  auto c3 = job->group(3).subgroup({3, 1});
  auto c1 = job->group(1).subgroup({3, 1});
  Tensor y3 = Tensor::ones({3});
  Tensor y1 = Tensor::ones({3});
  Future<void> h1 = c1.allReduce(y1);
  Future<void> h3 = c3.allReduce(y3);
  h1.get();
  h3.get();
  EXPECT_EQ(y3.toVector<float>(), std::vector<float>(3, 2.0f));
  EXPECT_THROW(job->group(0).subgroup({1, 2}), ValueError);  // worker0 is not a member
}

TEST_P(Collectives, ManyCollectivesInFlightOnOneGroup) {
  for (int n : {2, 4}) {
    auto job = startJob(GetParam(), n, smallSegments());
    constexpr int kOps = 12;
    std::vector<std::vector<Tensor>> tensors(kOps);
    std::vector<std::vector<Future<void>>> futures(kOps);
    // Each rank issues all twelve before anyone waits; sizes alternate between the two algorithms.
    for (int r = 0; r < n; ++r) {
      for (int k = 0; k < kOps; ++k) {
        tensors[k].push_back(Tensor::full({k % 2 == 0 ? 3 : 777}, static_cast<double>(r + k)));
        AllReduceOptions options;
        options.algorithm = k % 3 == 0 ? AllReduceAlgorithm::kRing : AllReduceAlgorithm::kAuto;
        futures[k].push_back(job->group(r).allReduce(tensors[k].back(), options));
      }
    }
    // Waited in reverse order.
    for (int k = kOps - 1; k >= 0; --k) {
      for (auto& f : futures[k]) f.get();
      const double want = n * k + n * (n - 1) / 2.0;
      for (int r = 0; r < n; ++r) {
        const auto v = tensors[k][static_cast<size_t>(r)].toVector<float>();
        ASSERT_TRUE(std::all_of(v.begin(), v.end(), [&](float x) { return x == static_cast<float>(want); }))
            << "collective " << k << " rank " << r;
      }
    }
    EXPECT_EQ(job->group(0).collectivesStarted(), static_cast<uint64_t>(kOps));
  }
}

TEST_P(Collectives, MismatchedCallsFailEveryMemberNamingTheWorker) {
  auto job = startJob(GetParam(), 3, smallSegments());
  // worker1 passes one element fewer.
  std::vector<Future<void>> futures;
  for (int r = 0; r < 3; ++r) futures.push_back(job->group(r).allReduce(Tensor::ones({r == 1 ? 999 : 1000})));
  for (int r = 0; r < 3; ++r) {
    Error error = failureOf(futures[static_cast<size_t>(r)]);
    EXPECT_NE(error.message.find("members disagree"), std::string::npos) << error.describe();
    EXPECT_NE(error.describe().find("worker1"), std::string::npos) << error.describe();
    EXPECT_NE(error.message.find("999 elements"), std::string::npos) << error.describe();
  }
  // The group stays usable: the next collective (sequence numbers still agree) succeeds.
  checkAllReduce(*job, 10, DType::kFloat32, {}, 1e-6);
  // dtype mismatch, and an operation kind mismatch (broadcast against all-reduce).
  futures.clear();
  for (int r = 0; r < 3; ++r) futures.push_back(job->group(r).allReduce(Tensor::ones({8}, r == 2 ? DType::kFloat64 : DType::kFloat32)));
  for (int r = 0; r < 3; ++r) {
    Error error = failureOf(futures[static_cast<size_t>(r)]);
    EXPECT_NE(error.message.find("float64"), std::string::npos) << error.describe();
    EXPECT_NE(error.describe().find("worker2"), std::string::npos) << error.describe();
  }
  futures.clear();
  futures.push_back(job->group(0).broadcast(Tensor::ones({8}), 0));
  futures.push_back(job->group(1).allReduce(Tensor::ones({8})));
  futures.push_back(job->group(2).allReduce(Tensor::ones({8})));
  for (int r = 0; r < 3; ++r) {
    Error error = failureOf(futures[static_cast<size_t>(r)]);
    EXPECT_NE(error.message.find("broadcast"), std::string::npos) << error.describe();
  }
  // Same element count, other shape.
  futures.clear();
  for (int r = 0; r < 3; ++r) futures.push_back(job->group(r).allReduce(Tensor::ones(r == 0 ? tensor::Shape{2, 3} : tensor::Shape{3, 2})));
  for (int r = 0; r < 3; ++r) {
    Error error = failureOf(futures[static_cast<size_t>(r)]);
    EXPECT_NE(error.message.find("another shape"), std::string::npos) << error.describe();
  }
}

TEST_P(Collectives, DeadMemberFailsCollectivesInsteadOfHanging) {
  ClusterSpec spec;
  spec.heartbeatInterval = 50ms;
  spec.heartbeatTimeout = 1000ms;
  auto job = startJob(GetParam(), 3, smallSegments(), spec);
  Future<void> f0 = job->group(0).allReduce(Tensor::ones({1000}));
  Future<void> f1 = job->group(1).allReduce(Tensor::ones({1000}));
  // worker2 dies without joining.
  job->groups[2].reset();
  job->agent(2).shutdown(false);
  for (Future<void>* f : {&f0, &f1}) {
    Error error = failureOf(*f);
    EXPECT_EQ(error.worker, "worker2") << error.describe();
    EXPECT_NE(error.message.find("worker2"), std::string::npos) << error.describe();
  }
  // The group is broken for good: the next collective fails at once, naming the dead member.
  Future<void> next = job->group(0).allReduce(Tensor::ones({4}));
  Error error = failureOf(next);
  EXPECT_EQ(error.kind, ErrorKind::kDisconnected) << error.describe();
  EXPECT_EQ(error.worker, "worker2");
  // A group without worker2 still works.
  auto pair0 = job->group(0).subgroup({0, 1});
  auto pair1 = job->group(1).subgroup({0, 1});
  Tensor a = Tensor::ones({5});
  Tensor b = Tensor::ones({5});
  Future<void> fa = pair0.allReduce(a);
  Future<void> fb = pair1.allReduce(b);
  fa.get();
  fb.get();
  EXPECT_EQ(a.toVector<float>(), std::vector<float>(5, 2.0f));
}

TEST_P(Collectives, MemberThatNeverJoinsTimesOut) {
  ProcessGroupOptions options;
  options.timeout = 300ms;
  auto job = startJob(GetParam(), 3, options);
  Future<void> f0 = job->group(0).allReduce(Tensor::ones({100'000}));
  Future<void> f1 = job->group(1).allReduce(Tensor::ones({100'000}));
  Error e0 = failureOf(f0);
  Error e1 = failureOf(f1);
  EXPECT_EQ(e0.kind, ErrorKind::kTimeout) << e0.describe();
  EXPECT_EQ(e1.kind, ErrorKind::kTimeout) << e1.describe();
  // worker0 receives from worker2 in the ring: it names it.
  EXPECT_NE(e0.describe().find("worker2"), std::string::npos) << e0.describe();
}

TEST_P(Collectives, BadArgumentsAreValueErrors) {
  auto job = startJob(GetParam(), 2);
  ProcessGroup& g = job->group(0);
  EXPECT_THROW(g.allReduce(Tensor()), ValueError);
  EXPECT_THROW(g.allReduce(Tensor::ones({4}, DType::kInt64), {ReduceOp::kMean}), ValueError);
  EXPECT_THROW(g.allReduce(Tensor::ones({4}, DType::kFloat64), {ReduceOp::kSum, WireCompression::kFloat16}), ValueError);
  EXPECT_THROW(g.allReduce(Tensor::ones({4}).toDType(DType::kBFloat16)), ValueError);
  EXPECT_THROW(g.broadcast(Tensor::ones({4}), 2), ValueError);
  EXPECT_THROW(ProcessGroup(job->agent(0), {"worker0", "worker9"}), ValueError);
  EXPECT_THROW(ProcessGroup(job->agent(0), {"worker0", "worker0"}), ValueError);
  EXPECT_THROW(ProcessGroup(job->agent(0), {"worker1"}), ValueError);
  // No check passed the wrong calls to the peers: the group still works.
  Tensor a = Tensor::ones({3});
  Tensor b = Tensor::ones({3});
  Future<void> fa = job->group(0).allReduce(a);
  Future<void> fb = job->group(1).allReduce(b);
  fa.get();
  fb.get();
  EXPECT_EQ(a.toVector<float>(), std::vector<float>(3, 2.0f));
}

TEST(CollectivesSetup, GroupNeedsInstall) {
  World world;
  Registry registry = rpc::testing::makeRegistry(world);  // no install()
  Cluster cluster;
  ClusterSpec spec;
  spec.size = 1;
  rpc::testing::startCluster(cluster, spec, world, registry);
  ASSERT_TRUE(cluster.agents[0]);
  try {
    ProcessGroup::world(*cluster.agents[0]);
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("install"), std::string::npos) << e.what();
  }
}

TEST(CollectivesSetup, SingleMemberGroupIsIdentity) {
  auto job = startJob("inproc", 1);
  Tensor t = Tensor::full({3}, 2.0);
  job->group(0).allReduceSync(t, {ReduceOp::kMean});
  EXPECT_EQ(t.toVector<float>(), std::vector<float>(3, 2.0f));
  EXPECT_EQ(job->group(0).allGatherSync(t).shape(), (tensor::Shape{3}));
  EXPECT_EQ(job->group(0).reduceScatterSync(t).toVector<float>(), std::vector<float>(3, 2.0f));
  job->group(0).barrierSync();
}

INSTANTIATE_TEST_SUITE_P(Transports, Collectives, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace distgrad::rpc::collectives::testing
