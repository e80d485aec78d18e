// GradientAggregator: the synchronous parameter server's batched update (models/optim/gradient_aggregator.h).
#include "models/optim/gradient_aggregator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/nn/batch_norm.h"
#include "models/optim/sgd.h"
#include "rpc/executor.h"
#include "tensor/random.h"

namespace distgrad::models::optim {
namespace {

using namespace std::chrono_literals;

Tensor filled(const Shape& shape, double value, DType dtype = DType::kFloat32) {
  return Tensor::full(shape, value, dtype);
}

// What apply saw, for the checks; returned as the round's answer (the round number).
struct Recorder {
  std::mutex mutex;
  std::vector<std::vector<Tensor>> averages;
  std::vector<int64_t> rounds;
  std::atomic<int> concurrent{0};
  std::atomic<int> maxConcurrent{0};
  int64_t operator()(std::vector<Tensor> avg, int64_t round) {
    const int now = ++concurrent;
    maxConcurrent = std::max(maxConcurrent.load(), now);
    std::this_thread::sleep_for(1ms);  // widen the window in which a second apply could overlap
    {
      std::lock_guard<std::mutex> lock(mutex);
      averages.push_back(std::move(avg));
      rounds.push_back(round);
    }
    --concurrent;
    return round;
  }
};

TEST(GradientAggregatorTest, CompletesEveryContributorOnlyWhenTheRoundIsFull) {
  rpc::Executor executor(2);
  Recorder rec;
  GradientAggregator<int64_t> agg(3,
                                  [&](std::vector<Tensor> avg, int64_t round) { return rec(std::move(avg), round); });
  auto f0 = agg.submit(executor, 0, 0, {filled({2}, 1.0)});
  auto f2 = agg.submit(executor, 2, 0, {filled({2}, 5.0)});
  EXPECT_FALSE(f0.wait(50ms));
  EXPECT_FALSE(f2.isReady());
  EXPECT_EQ(agg.arrived(), 2);
  EXPECT_TRUE(rec.rounds.empty()) << "apply ran before the round was full";
  auto f1 = agg.submit(executor, 1, 0, {filled({2}, 3.0)});
  EXPECT_EQ(f0.get(), 0);
  EXPECT_EQ(f1.get(), 0);
  EXPECT_EQ(f2.get(), 0);
  ASSERT_EQ(rec.averages.size(), 1u);
  EXPECT_EQ(rec.averages[0][0].toVector<float>(), (std::vector<float>{3.0f, 3.0f}));
  EXPECT_EQ(agg.round(), 1);
  EXPECT_EQ(agg.arrived(), 0);
}

TEST(GradientAggregatorTest, WeightsByBatchSizeSoTheAverageIsTheMeanOverAllSamples) {
  rpc::Executor executor(2);
  GradientAggregator<std::vector<Tensor>> agg(2, [](std::vector<Tensor> avg, int64_t) { return avg; });
  // Worker 0 averaged 30 samples to 1.0, worker 1 averaged 10 samples to 5.0: the mean of the 40 is 2.0.
  auto f0 = agg.submit(executor, 0, 0, {filled({3}, 1.0, DType::kFloat64)}, 30.0);
  auto f1 = agg.submit(executor, 1, 0, {filled({3}, 5.0, DType::kFloat64)}, 10.0);
  std::vector<Tensor> avg = f0.get();
  EXPECT_EQ(avg[0].dtype(), DType::kFloat64);
  for (double v : avg[0].toVector<double>()) EXPECT_DOUBLE_EQ(v, 2.0);
  EXPECT_TRUE(f1.get()[0].sameAs(avg[0])) << "every contributor gets the same result";
}

TEST(GradientAggregatorTest, ResultDoesNotDependOnArrivalOrder) {
  // Values whose float32 sum depends on the order of addition: summing in contributor order, not arrival
  // order, makes every arrival order give the same bits.
  tensor::Generator gen(7);
  std::vector<std::vector<Tensor>> grads;
  for (int k = 0; k < 4; ++k) {
    Tensor g = tensor::normal({1000}, 0.0, 1e3 * (k + 1), gen, DType::kFloat32);
    grads.push_back({g});
  }
  std::vector<int> order = {0, 1, 2, 3};
  std::vector<float> first;
  rpc::Executor executor(2);
  do {
    GradientAggregator<std::vector<Tensor>> agg(4, [](std::vector<Tensor> avg, int64_t) { return avg; });
    std::vector<rpc::Future<std::vector<Tensor>>> futures;
    for (int k : order) futures.push_back(agg.submit(executor, k, 0, grads[static_cast<size_t>(k)], 16.0 + k));
    std::vector<float> got = futures[0].get()[0].toVector<float>();
    if (first.empty()) {
      first = got;
    } else {
      ASSERT_EQ(std::memcmp(first.data(), got.data(), first.size() * sizeof(float)), 0)
          << "order " << order[0] << order[1] << order[2] << order[3];
    }
  } while (std::next_permutation(order.begin(), order.end()));
  // And it is the weighted mean.
  const std::vector<float> g0 = grads[0][0].toVector<float>();
  const double expected = [&] {
    double s = 0;
    for (int k = 0; k < 4; ++k) s += (16.0 + k) * grads[static_cast<size_t>(k)][0].toVector<float>()[0];
    return s / (16 + 17 + 18 + 19);
  }();
  EXPECT_NEAR(first[0], expected, 1e-3 * std::abs(expected) + 1e-3);
}

TEST(GradientAggregatorTest, UndefinedGradientsCountAsZerosAndStayUndefinedWhenNobodyHasOne) {
  rpc::Executor executor(2);
  GradientAggregator<std::vector<Tensor>> agg(2, [](std::vector<Tensor> avg, int64_t) { return avg; });
  auto f0 = agg.submit(executor, 0, 0, {Tensor(), filled({2}, 4.0), Tensor()});
  auto f1 = agg.submit(executor, 1, 0, {filled({2}, 2.0), filled({2}, 2.0), Tensor()});
  std::vector<Tensor> avg = f0.get();
  ASSERT_EQ(avg.size(), 3u);
  EXPECT_EQ(avg[0].toVector<float>(), (std::vector<float>{1.0f, 1.0f}));
  EXPECT_EQ(avg[1].toVector<float>(), (std::vector<float>{3.0f, 3.0f}));
  EXPECT_FALSE(avg[2].defined());
  f1.get();
}

TEST(GradientAggregatorTest, RunsRoundAfterRoundAndAppliesOneAtATime) {
  constexpr int kContributors = 4;
  constexpr int kRounds = 50;
  rpc::Executor executor(4);
  Recorder rec;
  GradientAggregator<int64_t> agg(kContributors,
                                  [&](std::vector<Tensor> avg, int64_t round) { return rec(std::move(avg), round); });
  std::vector<std::thread> workers;
  std::atomic<int> failures{0};
  for (int c = 0; c < kContributors; ++c) {
    workers.emplace_back([&, c] {
      for (int64_t r = 0; r < kRounds; ++r) {
        // Each contributor sends r + c; the mean over contributors is r + 1.5.
        const int64_t answer = agg.submit(executor, c, r, {filled({8}, static_cast<double>(r + c))}).get();
        if (answer != r) ++failures;
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0);
  ASSERT_EQ(rec.rounds.size(), static_cast<size_t>(kRounds));
  for (int64_t r = 0; r < kRounds; ++r) {
    EXPECT_EQ(rec.rounds[static_cast<size_t>(r)], r);
    EXPECT_FLOAT_EQ(rec.averages[static_cast<size_t>(r)][0].toVector<float>()[0], static_cast<float>(r) + 1.5f);
  }
  EXPECT_EQ(rec.maxConcurrent.load(), 1);
  EXPECT_EQ(agg.round(), kRounds);
}

// The server's handlers run on an RPC executor: a submission must return at once (the waiting is in the
// future), or a pool smaller than the number of trainers would deadlock. One executor thread serves four
// contributors here, each submitting from a task on that very thread.
TEST(GradientAggregatorTest, NoExecutorThreadWaitsForTheRound) {
  rpc::Executor executor(1);
  GradientAggregator<int64_t> agg(4, [](std::vector<Tensor>, int64_t round) { return round; });
  std::vector<rpc::Future<int64_t>> futures(4);
  std::mutex mutex;
  std::condition_variable posted;
  int submitted = 0;
  for (int c = 0; c < 4; ++c) {
    ASSERT_TRUE(executor.post([&, c] {
      auto f = agg.submit(executor, c, 0, {filled({1}, c)});
      std::lock_guard<std::mutex> lock(mutex);
      futures[static_cast<size_t>(c)] = std::move(f);
      ++submitted;
      posted.notify_all();
    }));
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    ASSERT_TRUE(posted.wait_for(lock, 10s, [&] { return submitted == 4; })) << "a submission blocked its thread";
  }
  for (auto& f : futures) EXPECT_EQ(f.get(), 0);
}

TEST(GradientAggregatorTest, RejectsBadSubmissionsAndKeepsTheRoundOpen) {
  rpc::Executor executor(2);
  GradientAggregator<int64_t> agg(2, [](std::vector<Tensor>, int64_t round) { return round; });
  auto expectRejected = [&](rpc::Future<int64_t> f, const std::string& needle) {
    auto r = f.result();
    ASSERT_FALSE(r.ok()) << "expected a rejection mentioning '" << needle << "'";
    EXPECT_EQ(r.error().kind, rpc::ErrorKind::kFailed);
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  expectRejected(agg.submit(executor, 2, 0, {filled({2}, 1)}), "no such contributor");
  expectRejected(agg.submit(executor, -1, 0, {filled({2}, 1)}), "no such contributor");
  expectRejected(agg.submit(executor, 0, 1, {filled({2}, 1)}), "at round 0");
  expectRejected(agg.submit(executor, 0, 0, {filled({2}, 1)}, 0.0), "weight");
  expectRejected(agg.submit(executor, 0, 0, {Tensor::zeros({2}, DType::kInt64)}), "float32 or float64");
  auto ok0 = agg.submit(executor, 0, 0, {filled({2}, 1), Tensor()});
  expectRejected(agg.submit(executor, 0, 0, {filled({2}, 1), Tensor()}), "submitted twice");
  expectRejected(agg.submit(executor, 1, 0, {filled({2}, 1)}), "1 gradients, expected 2");
  expectRejected(agg.submit(executor, 1, 0, {filled({3}, 1), Tensor()}), "shape [3], expected [2]");
  expectRejected(agg.submit(executor, 1, 0, {filled({2}, 1, DType::kFloat64), Tensor()}), "expected float32");
  EXPECT_FALSE(ok0.isReady());
  EXPECT_EQ(agg.arrived(), 1);
  auto ok1 = agg.submit(executor, 1, 0, {filled({2}, 3), filled({4}, 1)});
  EXPECT_EQ(ok0.get(), 0);
  EXPECT_EQ(ok1.get(), 0);
  EXPECT_FALSE(agg.aborted());
}

TEST(GradientAggregatorTest, AbortFailsTheWaitingAndEveryLaterSubmission) {
  rpc::Executor executor(2);
  int applied = 0;
  GradientAggregator<int64_t> agg(3, [&](std::vector<Tensor>, int64_t round) {
    ++applied;
    return round;
  });
  auto f0 = agg.submit(executor, 0, 0, {filled({1}, 1)});
  auto f1 = agg.submit(executor, 1, 0, {filled({1}, 1)});
  rpc::Error down = rpc::Error::disconnected("trainer worker3 went down");
  agg.abort(down);
  for (auto* f : {&f0, &f1}) {
    auto r = f->result();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().kind, rpc::ErrorKind::kDisconnected);
    EXPECT_EQ(r.error().message, "trainer worker3 went down");
  }
  auto late = agg.submit(executor, 2, 0, {filled({1}, 1)}).result();
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.error().message, "trainer worker3 went down");
  EXPECT_EQ(applied, 0);
  EXPECT_TRUE(agg.aborted());
  agg.abort(rpc::Error::failed("second"));  // the first abort wins, no crash
  EXPECT_EQ(agg.submit(executor, 0, 0, {filled({1}, 1)}).result().error().message, "trainer worker3 went down");
}

// A contributor dies while the round's step is being applied: nobody may take that round's answer as good.
TEST(GradientAggregatorTest, AbortDuringApplyFailsTheRoundBeingApplied) {
  rpc::Executor executor(2);
  std::mutex mutex;
  std::condition_variable cv;
  bool inApply = false, mayFinish = false;
  GradientAggregator<int64_t> agg(2, [&](std::vector<Tensor>, int64_t round) {
    std::unique_lock<std::mutex> lock(mutex);
    inApply = true;
    cv.notify_all();
    cv.wait(lock, [&] { return mayFinish; });
    return round;
  });
  auto f0 = agg.submit(executor, 0, 0, {filled({1}, 1)});
  std::thread last([&] { (void)agg.submit(executor, 1, 0, {filled({1}, 1)}); });  // runs apply
  {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return inApply; });
  }
  EXPECT_NE(agg.submit(executor, 0, 1, {filled({1}, 1)}).result().error().message.find("being applied"),
            std::string::npos);
  agg.abort(rpc::Error::disconnected("worker2 left"));
  EXPECT_FALSE(f0.isReady()) << "the promises of the round being applied belong to the applying thread";
  {
    std::lock_guard<std::mutex> lock(mutex);
    mayFinish = true;
  }
  cv.notify_all();
  last.join();
  auto r = f0.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message, "worker2 left");
  EXPECT_EQ(agg.round(), 0);
}

TEST(GradientAggregatorTest, AFailingApplyFailsTheRoundAndAbortsTheAggregator) {
  rpc::Executor executor(2);
  GradientAggregator<int64_t> agg(
      2, [](std::vector<Tensor>, int64_t) -> int64_t { throw std::runtime_error("optimizer exploded"); });
  auto f0 = agg.submit(executor, 0, 0, {filled({1}, 1)});
  auto f1 = agg.submit(executor, 1, 0, {filled({1}, 1)});
  for (auto* f : {&f0, &f1}) {
    auto r = f->result();
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find("optimizer exploded"), std::string::npos);
  }
  EXPECT_TRUE(agg.aborted());
  EXPECT_EQ(agg.round(), 0);
  EXPECT_FALSE(agg.submit(executor, 0, 1, {filled({1}, 1)}).result().ok());
}

// The use the aggregator exists for: two workers with half batches each, averaged and stepped once, land on
// exactly the parameters one worker with the whole batch reaches (the SSGD = large-batch SGD identity).
TEST(GradientAggregatorTest, OneStepOfTwoHalfBatchesEqualsOneStepOfTheWholeBatch) {
  rpc::Executor executor(2);
  Tensor p = Tensor::full({4}, 1.0);
  p.setRequiresGrad();
  SGD sgd({p}, {.learningRate = 0.5});
  GradientAggregator<std::vector<Tensor>> agg(2, [&](std::vector<Tensor> avg, int64_t) {
    sgd.step(avg);
    return std::vector<Tensor>{p.cloneData()};
  });
  // Per-sample gradients 1, 2, 3, 4 (worker 0) and 5, 6, 7, 8 (worker 1): each worker's mean, weighted by 4.
  auto f0 = agg.submit(executor, 0, 0, {filled({4}, 2.5)}, 4);
  auto f1 = agg.submit(executor, 1, 0, {filled({4}, 6.5)}, 4);
  std::vector<float> after = f0.get()[0].toVector<float>();
  f1.get();
  for (float v : after) EXPECT_FLOAT_EQ(v, 1.0f - 0.5f * 4.5f);  // whole-batch mean gradient 4.5
}

// Buffers: floating ones averaged with the gradients' weights in contributor order, integer ones (counters)
// the maximum; whatever the arrival order.
TEST(GradientAggregatorTest, MergesBuffersWeightedInContributorOrderAndCountersByMax) {
  rpc::Executor executor(2);
  std::vector<Tensor> seen;
  GradientAggregator<int64_t> agg(2, GradientAggregator<int64_t>::ApplyWithBuffers(
                                         [&](std::vector<Tensor>, std::vector<Tensor> buffers, int64_t round) {
                                           seen = std::move(buffers);
                                           return round;
                                         }));
  auto f1 = agg.submit(executor, 1, 0, {filled({2}, 1.0)}, 3,
                       {filled({2}, 5.0), Tensor::full({}, 7, DType::kInt64), filled({1}, 2.0, DType::kFloat64)});
  auto f0 = agg.submit(executor, 0, 0, {filled({2}, 1.0)}, 1,
                       {filled({2}, 1.0), Tensor::full({}, 9, DType::kInt64), filled({1}, 6.0, DType::kFloat64)});
  ASSERT_TRUE(f0.result().ok()) << f0.result().error().message;
  ASSERT_TRUE(f1.result().ok());
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].dtype(), DType::kFloat32);
  for (float v : seen[0].toVector<float>()) EXPECT_FLOAT_EQ(v, 0.25f * 1 + 0.75f * 5);
  EXPECT_EQ(seen[1].dtype(), DType::kInt64);
  EXPECT_EQ(seen[1].toVector<int64_t>(), std::vector<int64_t>{9});
  EXPECT_EQ(seen[2].dtype(), DType::kFloat64);
  EXPECT_DOUBLE_EQ(seen[2].toVector<double>()[0], 0.25 * 6 + 0.75 * 2);
  // Without buffers, apply sees none.
  auto g0 = agg.submit(executor, 0, 1, {filled({2}, 1.0)});
  auto g1 = agg.submit(executor, 1, 1, {filled({2}, 1.0)});
  ASSERT_TRUE(g1.result().ok());
  EXPECT_TRUE(seen.empty());
}

TEST(GradientAggregatorTest, RejectsBuffersThatDoNotMatchTheRoundsAndKeepsTheRoundOpen) {
  rpc::Executor executor(2);
  GradientAggregator<int64_t> agg(2, [](std::vector<Tensor>, int64_t round) { return round; });
  auto f0 = agg.submit(executor, 0, 0, {filled({2}, 1.0)}, 1, {filled({3}, 0.0), Tensor::full({}, 1, DType::kInt64)});
  auto count = agg.submit(executor, 1, 0, {filled({2}, 1.0)}, 1, {filled({3}, 0.0)});
  auto shape =
      agg.submit(executor, 1, 0, {filled({2}, 1.0)}, 1, {filled({4}, 0.0), Tensor::full({}, 1, DType::kInt64)});
  auto dtype = agg.submit(executor, 1, 0, {filled({2}, 1.0)}, 1, {filled({3}, 0.0), Tensor::full({}, 1.0)});
  auto undefined = agg.submit(executor, 1, 0, {filled({2}, 1.0)}, 1, {filled({3}, 0.0), Tensor()});
  for (auto* bad : {&count, &shape, &dtype, &undefined}) {
    auto result = bad->result();
    ASSERT_FALSE(result.ok());
    EXPECT_NE(result.error().message.find("buffer"), std::string::npos) << result.error().message;
  }
  EXPECT_EQ(agg.arrived(), 1);
  auto f1 = agg.submit(executor, 1, 0, {filled({2}, 1.0)}, 1, {filled({3}, 0.0), Tensor::full({}, 1, DType::kInt64)});
  EXPECT_TRUE(f1.result().ok());
  EXPECT_TRUE(f0.result().ok());
  EXPECT_THROW(averageBuffers({{filled({1}, 1.0)}, {filled({1}, 1.0, DType::kFloat64)}}, {1, 1}), ValueError);
}

// What the parameter server (examples/parameter_server.cpp) does with a BatchNorm model: two trainers, each a
// replica of the server's model, run a training forward on half a batch and submit gradients and buffers; the
// server steps and adopts the merged buffers; the trainers load the reply. Afterwards the server's buffers
// equal every trainer's, its running mean and counter equal those of one model that saw the whole batch, and
// its running variance is the trainers' average.
TEST(GradientAggregatorTest, ServerBuffersEqualTheTrainersAfterAStep) {
  rpc::Executor executor(2);
  struct Snapshot {
    std::vector<Tensor> params, buffers;
  };
  BatchNorm2d server(3), whole(3);
  std::vector<std::unique_ptr<BatchNorm2d>> trainers;
  for (int i = 0; i < 2; ++i) trainers.push_back(std::make_unique<BatchNorm2d>(3));
  SGD sgd(server.parameters(), {.learningRate = 0.1});
  GradientAggregator<Snapshot> agg(2, GradientAggregator<Snapshot>::ApplyWithBuffers(
                                          [&](std::vector<Tensor> avg, std::vector<Tensor> buffers, int64_t) {
                                            sgd.step(avg);
                                            std::vector<Tensor> mine = server.buffers();
                                            EXPECT_EQ(buffers.size(), mine.size());
                                            for (size_t i = 0; i < mine.size(); ++i) mine[i].copyFrom(buffers[i]);
                                            Snapshot out;
                                            for (const Tensor& t : server.parameters())
                                              out.params.push_back(t.cloneData());
                                            for (const Tensor& t : server.buffers())
                                              out.buffers.push_back(t.cloneData());
                                            return out;
                                          }));
  tensor::Generator gen(3);
  const Tensor batch = tensor::normal({8, 3}, 0.5, 2.0, gen);
  const Tensor halves[2] = {narrow(batch, 0, 0, 4), narrow(batch, 0, 4, 4)};
  std::vector<rpc::Future<Snapshot>> replies;
  for (int i = 1; i >= 0; --i) {  // the second trainer first: the order must not matter
    BatchNorm2d& t = *trainers[static_cast<size_t>(i)];
    t.zeroGrad();
    distgrad::backward(sum(mul(t.forward(halves[i]), halves[i])));
    std::vector<Tensor> grads;
    for (const Tensor& p : t.parameters()) grads.push_back(p.grad());
    replies.push_back(agg.submit(executor, i, 0, grads, 4, t.buffers()));
  }
  for (size_t r = 0; r < replies.size(); ++r) {
    BatchNorm2d& t = *trainers[1 - r];
    const Snapshot reply = replies[r].get();
    for (size_t i = 0; i < reply.params.size(); ++i) t.parameters()[i].copyFrom(reply.params[i]);
    for (size_t i = 0; i < reply.buffers.size(); ++i) t.buffers()[i].copyFrom(reply.buffers[i]);
  }
  whole.forward(batch);
  for (const auto& t : trainers) {
    for (size_t i = 0; i < server.buffers().size(); ++i) {
      const Tensor mine = server.buffers()[i], theirs = t->buffers()[i];
      ASSERT_EQ(mine.dtype(), theirs.dtype());
      ASSERT_EQ(mine.numel(), theirs.numel());
      EXPECT_EQ(std::memcmp(mine.rawData(), theirs.rawData(), static_cast<size_t>(mine.nbytes())), 0)
          << "buffer " << i << " differs between the server and a trainer";
    }
  }
  EXPECT_EQ(server.numBatchesTracked(), 1);
  const std::vector<float> mean = server.runningMean().toVector<float>(), want = whole.runningMean().toVector<float>();
  for (size_t c = 0; c < mean.size(); ++c) EXPECT_NEAR(mean[c], want[c], 1e-6);
  const std::vector<float> v0 = BatchNorm2d(3).runningVar().toVector<float>();
  const std::vector<float> var = server.runningVar().toVector<float>();
  for (size_t c = 0; c < var.size(); ++c) EXPECT_NE(var[c], v0[c]) << "the running variance never moved";
}

}  // namespace
}  // namespace distgrad::models::optim
