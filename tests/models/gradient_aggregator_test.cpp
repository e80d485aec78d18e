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

}  // namespace
}  // namespace distgrad::models::optim
