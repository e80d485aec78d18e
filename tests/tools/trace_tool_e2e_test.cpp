// distgrad-trace end to end: two agents over tcp on loopback trace a small hand-made RPC pipeline
// (Options::traceDir; worker1's clock skewed by 20 ms through the test hook), with the pipeline events
// recorded by hand through trace::Scope as the pipelines record them (the pipeline-events contract): the
// driver on worker0 runs stage 0 itself and stage 1 on worker1 by RPC, 2 steps of 4 micro-batches. Then the
// tool's library and binary merge and report the directory the agents wrote: the clocks line up (every
// call's execution on worker1 lies between its call and its reply on worker0), every flow is complete,
// the fractions sum to 100% and the pipeline verdict is there with the figures it is computed from.
#include <gtest/gtest.h>

#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "rpc/agent.h"
#include "rpc/store.h"
#include "rpc/trace.h"
#include "rpc/transport/inproc/context.h"
#include "tests/tools/json_value.h"
#include "tools/trace/merge.h"
#include "tools/trace/report.h"
#include "tools/trace/trace_data.h"

#ifndef DG_DISTGRAD_TRACE_PATH
#error "DG_DISTGRAD_TRACE_PATH must name the distgrad-trace binary"
#endif

namespace distgrad::tools::trace {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using distgrad::trace::Category;

constexpr int kMicroBatches = 4;
constexpr int kSteps = 2;

inline const rpc::Function<int64_t(int64_t, int64_t)> kStageForward{"stage1_forward"};
inline const rpc::Function<int64_t(int64_t, int64_t)> kStageBackward{"stage1_backward"};
inline const rpc::Function<int64_t(int64_t)> kStageOptimizer{"stage1_optimizer"};

// Stands in for a stage's compute: keeps the thread busy (it is what is measured, not a synchronisation).
void compute(std::chrono::microseconds duration) {
  const auto until = std::chrono::steady_clock::now() + duration;
  volatile uint64_t x = 0;
  while (std::chrono::steady_clock::now() < until) x = x + 1;
}

TEST(TraceToolEndToEnd, TwoAgentsTraceAnRpcPipelineAndTheToolMergesAndExplainsIt) {
  std::string pattern = (fs::temp_directory_path() / "dg-trace-e2e-XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string dir = pattern;
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};

  // Stage 1 computes one micro-batch at a time, as a real stage does (its compute token): with four executor
  // threads, forwards arriving together would otherwise overlap, and on a loaded machine their spans,
  // stretched by preemption, replayed one after another gave an ideal step longer than the measured one.
  // Taken before the span opens, so a span never counts the wait for another.
  static std::mutex stageCompute;
  rpc::Registry registry;
  registry.bind(kStageForward, [](int64_t step, int64_t microBatch) {
    std::lock_guard<std::mutex> computing(stageCompute);
    distgrad::trace::Scope span("pipeline.forward", Category::kPipeline, int64_t{1}, microBatch, step);
    span.setDetail("rpc");
    compute(400us);
    return microBatch;
  });
  registry.bind(kStageBackward, [](int64_t step, int64_t microBatch) {
    std::lock_guard<std::mutex> computing(stageCompute);
    distgrad::trace::Scope span("pipeline.backward", Category::kPipeline, int64_t{1}, microBatch, step);
    span.setDetail("rpc");
    compute(600us);
    return microBatch;
  });
  registry.bind(kStageOptimizer, [](int64_t step) {
    std::lock_guard<std::mutex> computing(stageCompute);
    distgrad::trace::Scope span("pipeline.optimizer", Category::kPipeline, int64_t{1}, int64_t{0}, step);
    compute(200us);
    return step;
  });

  auto store = rpc::StoreServer::start("127.0.0.1:0");
  std::vector<std::unique_ptr<rpc::Agent>> agents(2);
  std::vector<std::string> errors(2);
  {
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        rpc::Options options;
        options.rank = rank;
        options.worldSize = 2;
        options.storeAddr = store->address();
        options.transport = "tcp";
        options.executorThreads = 4;
        options.secret = "e2e";
        options.heartbeatInterval = 50ms;
        options.heartbeatTimeout = 5000ms;
        options.rendezvousTimeout = 20s;
        options.defaultTimeout = 20s;
        options.traceDir = dir;
        rpc::AgentConfig config;
        config.shutdownTimeout = 10s;
        if (rank == 1) config.clockSkewForTesting = 20ms;  // worker1's clock reads 20 ms later
        try {
          agents[static_cast<size_t>(rank)] = rpc::Agent::start(options, registry, config);
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(rank)] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  ASSERT_TRUE(agents[0] && agents[1]) << errors[0] << " / " << errors[1];
  rpc::Agent& driver = *agents[0];

  {
    // The test's thread is the driver: its events go to worker0's file.
    distgrad::trace::WorkerScope bind(driver.traceWorker());
    for (int64_t step = 0; step < kSteps; ++step) {
      distgrad::trace::Scope stepSpan("pipeline.step", Category::kPipeline, step, int64_t{kMicroBatches}, int64_t{2});
      stepSpan.setDetail("gpipe");
      std::vector<rpc::Future<int64_t>> forwards;
      for (int64_t m = 0; m < kMicroBatches; ++m) {
        {
          distgrad::trace::Scope span("pipeline.forward", Category::kPipeline, int64_t{0}, m, step);
          span.setDetail("rpc");
          compute(300us);
        }
        forwards.push_back(driver.rpcAsync("worker1", kStageForward, step, m));
      }
      for (int64_t m = 0; m < kMicroBatches; ++m) EXPECT_EQ(forwards[static_cast<size_t>(m)].get(), m);
      for (int64_t m = 0; m < kMicroBatches; ++m) {
        EXPECT_EQ(driver.rpcSync("worker1", kStageBackward, step, m), m);
        distgrad::trace::Scope span("pipeline.backward", Category::kPipeline, int64_t{0}, m, step);
        span.setDetail("rpc");
        compute(500us);
      }
      auto remoteStep = driver.rpcAsync("worker1", kStageOptimizer, step);
      {
        distgrad::trace::Scope span("pipeline.optimizer", Category::kPipeline, int64_t{0}, int64_t{0}, step);
        compute(200us);
      }
      EXPECT_EQ(remoteStep.get(), step);
    }
  }
  {
    std::vector<std::thread> threads;
    for (auto& a : agents) threads.emplace_back([&a] { a->shutdown(); });
    for (auto& t : threads) t.join();
  }
  agents.clear();

  // Load and align.
  TraceSet set = loadTraceDir(dir);
  ASSERT_EQ(set.workers.size(), 2u) << ::testing::PrintToString(set.warnings);
  EXPECT_TRUE(set.warnings.empty()) << ::testing::PrintToString(set.warnings);
  for (const auto& w : set.workers) {
    EXPECT_TRUE(w.closed) << w.worker;
    EXPECT_TRUE(w.aligned) << w.worker;
  }
  // worker1's 20 ms are found again. The estimate's error is at most half the round trip of its best
  // sample: 1 ms on loopback, unless the machine is so loaded that no heartbeat came back within 2 ms (then
  // the bound is the estimate's own, which is still checked).
  int64_t rttNs = 0;
  for (const auto& w : set.workers)
    for (const auto& [peer, line] : w.clocks) rttNs = std::max(rttNs, line.rttNs);
  const int64_t toleranceNs = std::max<int64_t>(1'000'000, rttNs / 2 + 1);
  EXPECT_NEAR(static_cast<double>(set.workers[1].offsetToReferenceNs), -20e6, static_cast<double>(toleranceNs))
      << "best round trip " << rttNs << " ns";

  // Every call worker0 made: its execution on worker1 lies inside [send begin, reply deserialized] on the
  // reference clock (within the estimate's tolerance).
  std::map<uint64_t, const Event*> send, reply, execute;
  for (const auto& ev : set.workers[0].events) {
    if (ev.name == "rpc.client.send") send[ev.flow] = &ev;
    if (ev.name == "rpc.client.deserialize") reply[ev.flow] = &ev;
  }
  for (const auto& ev : set.workers[1].events) {
    if (ev.name == "rpc.server.execute" && ev.flow >> 48 == 1) execute[ev.flow] = &ev;
  }
  const size_t calls = kSteps * (2 * kMicroBatches + 1);
  EXPECT_GE(execute.size(), calls);
  for (const auto& [flow, ex] : execute) {
    ASSERT_TRUE(send.count(flow) && reply.count(flow)) << flow;
    EXPECT_GE(ex->b, send[flow]->b - toleranceNs) << flow;
    EXPECT_LE(ex->e, reply[flow]->e + toleranceNs) << flow;
  }

  // Merge: valid JSON, every flow complete, every async pair matched.
  std::ostringstream merged;
  MergeStats stats = writeChromeTrace(set, merged);
  EXPECT_GE(stats.flows, calls);
  EXPECT_EQ(stats.flowsDropped, 0u);
  const testing::JsonValue doc = testing::parseJson(merged.str());
  std::map<std::string, std::string> flowFirst, flowLast;
  std::map<std::string, int> asyncOpen;
  for (const auto& ev : doc["traceEvents"].array) {
    const std::string ph = ev.str("ph");
    if (ph == "s" || ph == "t" || ph == "f") {
      flowFirst.emplace(ev.str("id"), ph);
      flowLast[ev.str("id")] = ph;
    }
    if (ph == "b") ++asyncOpen[ev.str("name") + ev.str("id")];
    if (ph == "e") --asyncOpen[ev.str("name") + ev.str("id")];
  }
  EXPECT_EQ(flowFirst.size(), stats.flows);
  for (const auto& [id, ph] : flowFirst) EXPECT_EQ(ph, "s") << id;
  for (const auto& [id, ph] : flowLast) EXPECT_EQ(ph, "f") << id;
  for (const auto& [key, open] : asyncOpen) EXPECT_EQ(open, 0) << key;

  // Report.
  Report report = analyze(set);
  for (const auto& w : report.workers) {
    double sum = 0;
    for (int a = 0; a < kActivityCount; ++a) sum += w.fraction(static_cast<Activity>(a));
    EXPECT_NEAR(sum, 1.0, 0.005) << w.worker;
    EXPECT_GT(w.fraction(Activity::kCompute), 0.0) << w.worker;
  }
  EXPECT_GE(report.workers[0].callsMade, static_cast<int64_t>(calls));
  EXPECT_GE(report.workers[1].callsServed, static_cast<int64_t>(calls));
  EXPECT_GT(report.workers[0].bytesSent, 0);
  const auto& p = report.pipeline;
  ASSERT_TRUE(p.present) << ::testing::PrintToString(report.warnings);
  EXPECT_TRUE(p.rpc);
  EXPECT_EQ(p.stages, 2);
  EXPECT_EQ(p.microBatches, kMicroBatches);
  ASSERT_EQ(p.steps.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(p.stageSummaries.size(), 2u);
  EXPECT_EQ(p.stageSummaries[0].worker, "worker0");
  EXPECT_EQ(p.stageSummaries[1].worker, "worker1");
  for (const auto& st : p.steps) {
    // Stage 1's compute is at least its spin time: 4 x (0.4 + 0.6) + 0.2 ms; the ideal at least that.
    EXPECT_GE(st.computeMs[1], 4.2) << st.step;
    EXPECT_GE(st.idealMs, st.computeMs[1]) << st.step;
    // The driver ran the backwards one RPC at a time: the step is longer than the ideal schedule.
    EXPECT_GT(st.wallMs, st.idealMs) << st.step;
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_NEAR(st.computeMs[s] + st.bubbleMs[s] + st.overheadMs[s], st.wallMs, 1e-9);
    }
  }
  for (const auto& s : p.stageSummaries) {
    EXPECT_NEAR(s.computeShare + s.bubbleShare + s.overheadShare, 1.0, 1e-9);
  }
  EXPECT_GT(p.gainMs, 0.0);
  EXPECT_NEAR(p.gainMs, p.meanStepMs - p.meanIdealMs, 1e-9);
  EXPECT_EQ(p.verdict.rfind("RPC overhead is ", 0), 0u) << p.verdict;

  // The binary on the same directory.
  const std::string command = std::string(DG_DISTGRAD_TRACE_PATH) + " report " + dir + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int status = ::pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("VERDICT: " + p.verdict), std::string::npos) << out;
  EXPECT_NE(out.find("stage 1   worker1"), std::string::npos) << out;
}

}  // namespace
}  // namespace distgrad::tools::trace
