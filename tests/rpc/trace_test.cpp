// The trace recorder (rpc/trace.h) on its own: nothing is recorded when tracing is off; spans recorded from
// several threads at once (while another thread flushes) come out exactly once each, with their nesting,
// times, args, flows and thread names; every line of the file is a flat JSON object (read back with
// tools/flat_json.h, the reader distgrad-trace uses); workers are kept apart by thread binding; interning
// is stable; buffers of exited threads are written and freed; the test skew shifts every time written.
#include "rpc/trace.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tensor/error.h"
#include "tests/rpc/async_test_util.h"
#include "tests/rpc/trace_test_util.h"
#include "tools/flat_json.h"

namespace distgrad::trace {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::readTrace;
using testing::TempDir;
using testing::TraceFile;
using tools::FlatObject;

using testing::named;

TEST(Trace, OffRecordsNothing) {
  ASSERT_FALSE(enabled()) << "a previous test left tracing on";
  // A worker without a directory takes a slot but does not turn recording on.
  const WorkerSlot slot = registerWorker("untraced", 0);
  EXPECT_FALSE(enabled());
  const Stats before = stats();
  const uint64_t chunks = bufferedChunks();
  for (int i = 0; i < 1000; ++i) {
    DG_TRACE_SCOPE("off");
    WorkerScope worker(slot);
    Scope span("span", Category::kRpcClient, i, 2);
    span.setArg(2, 3);
    span.setFlow(callFlowId(0, static_cast<uint64_t>(i)), FlowPhase::kStart);
    EXPECT_FALSE(span.active());
    instant("tick", Category::kTransport, {i});
  }
  const Stats after = stats();
  EXPECT_EQ(after.recorded, before.recorded);
  EXPECT_EQ(bufferedChunks(), chunks);
  EXPECT_EQ(currentWorker(), kNoWorker) << "WorkerScope bound the thread while tracing was off";
  unregisterWorker(slot);
}

TEST(Trace, ConcurrentThreadsRecordNestedSpansExactlyOnceWhileAnotherThreadFlushes) {
  TempDir dir;
  const int64_t registeredAt = nowNs();
  const WorkerSlot slot = registerWorker("nest", 3, dir.path());
  ASSERT_TRUE(enabled());
  const std::string path = workerFile(slot);
  EXPECT_EQ(path, (fs::path(dir.path()) / "nest.trace.jsonl").string());
  const Stats before = stats();

  constexpr int kThreads = 4;
  constexpr int kIterations = 3000;  // 3 events each: several chunks per thread
  std::atomic<int> running{kThreads};
  std::vector<std::thread> threads;
  std::vector<int64_t> tids(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      setCurrentWorker(slot);
      setThreadName("worker-thread-" + std::to_string(t));
      tids[t] = static_cast<int64_t>(::gettid());
      for (int i = 0; i < kIterations; ++i) {
        Scope outer("outer", Category::kUser, t, i);
        {
          Scope inner("inner", Category::kPipeline);
          inner.setArg(1, i);
          inner.setFlow(callFlowId(t, static_cast<uint64_t>(i)), FlowPhase::kStep);
        }
        instant("tick", Category::kTransport, {t, i});
      }
      running.fetch_sub(1);
    });
  }
  // The writer runs concurrently with the recording threads (Note [Trace buffers]).
  uint64_t flushedLines = 0;
  while (running.load() > 0) flushedLines += flush();
  for (auto& thread : threads) thread.join();
  flushedLines += flush();
  EXPECT_EQ(flushedLines, static_cast<uint64_t>(kThreads) * kIterations * 3);
  unregisterWorker(slot);
  EXPECT_FALSE(enabled());
  const Stats after = stats();
  EXPECT_EQ(after.recorded - before.recorded, static_cast<uint64_t>(kThreads) * kIterations * 3);
  EXPECT_EQ(after.written - before.written, static_cast<uint64_t>(kThreads) * kIterations * 3);

  const TraceFile file = readTrace(path);
  EXPECT_EQ(file.header.string("worker"), "nest");
  EXPECT_EQ(file.header.integer("rank"), 3);
  EXPECT_EQ(file.header.integer("pid"), static_cast<int64_t>(::getpid()));
  EXPECT_EQ(file.header.string("clock"), "steady_ns");
  ASSERT_TRUE(file.header.integer("start_ns").has_value());
  EXPECT_GE(*file.header.integer("start_ns"), registeredAt);
  ASSERT_TRUE(file.end.has_value());
  EXPECT_EQ(file.end->integer("events"), static_cast<int64_t>(file.events.size()));
  EXPECT_EQ(file.events.size(), static_cast<size_t>(kThreads) * kIterations * 3);

  // Every thread is named once, with the name it chose.
  std::map<int64_t, std::string> threadNames;
  for (const auto& line : file.threads) {
    EXPECT_TRUE(threadNames.emplace(*line.integer("tid"), *line.string("name")).second) << "a thread named twice";
  }
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(threadNames[tids[t]], "worker-thread-" + std::to_string(t));

  // Exactly once each, with the args, flows, kinds and categories they were recorded with.
  std::map<std::tuple<int, std::string, int64_t>, const FlatObject*> seen;
  std::map<int64_t, int> threadIndex;
  for (int t = 0; t < kThreads; ++t) threadIndex[tids[t]] = t;
  for (const auto& e : file.events) {
    const int t = threadIndex.at(*e.integer("tid"));
    const std::string name = *e.string("name");
    ASSERT_TRUE(e.integer("b") && e.integer("e"));
    EXPECT_LE(*e.integer("b"), *e.integer("e"));
    EXPECT_GE(*e.integer("b"), registeredAt);
    int64_t i = -1;
    if (name == "outer") {
      EXPECT_EQ(e.string("type"), "span");
      EXPECT_EQ(e.string("cat"), "user");
      EXPECT_EQ(e.integer("a0"), t);
      i = *e.integer("a1");
      EXPECT_FALSE(e.has("a2"));
      EXPECT_FALSE(e.has("flow"));
    } else if (name == "inner") {
      EXPECT_EQ(e.string("type"), "span");
      EXPECT_EQ(e.string("cat"), "pipeline");
      EXPECT_EQ(e.integer("a0"), 0) << "args before the highest set one are written as 0";
      i = *e.integer("a1");
      EXPECT_EQ(e.integer("flow"), static_cast<int64_t>(callFlowId(t, static_cast<uint64_t>(i))));
      EXPECT_EQ(e.string("flow_phase"), "step");
    } else if (name == "tick") {
      EXPECT_EQ(e.string("type"), "instant");
      EXPECT_EQ(e.string("cat"), "transport");
      EXPECT_EQ(e.integer("b"), e.integer("e"));
      EXPECT_EQ(e.integer("a0"), t);
      i = *e.integer("a1");
    } else {
      ADD_FAILURE() << "unexpected event " << name;
      continue;
    }
    EXPECT_TRUE(seen.emplace(std::make_tuple(t, name, i), &e).second) << name << " " << t << "/" << i << " twice";
  }
  ASSERT_EQ(seen.size(), static_cast<size_t>(kThreads) * kIterations * 3);
  // Nesting and order on each thread: inner inside outer; the tick after the inner span and inside the
  // outer one; iterations one after another.
  for (int t = 0; t < kThreads; ++t) {
    int64_t previousEnd = 0;
    for (int i = 0; i < kIterations; ++i) {
      const FlatObject& outer = *seen.at({t, "outer", i});
      const FlatObject& inner = *seen.at({t, "inner", i});
      const FlatObject& tick = *seen.at({t, "tick", i});
      EXPECT_EQ(outer.integer("tid"), inner.integer("tid"));
      EXPECT_GE(*outer.integer("b"), previousEnd);
      EXPECT_LE(*outer.integer("b"), *inner.integer("b"));
      EXPECT_LE(*inner.integer("e"), *tick.integer("b"));
      EXPECT_LE(*tick.integer("b"), *outer.integer("e"));
      previousEnd = *outer.integer("e");
    }
  }
}

TEST(Trace, EventsOfThreadsThatExitedAreWrittenAndTheirBuffersFreed) {
  TempDir dir;
  const uint64_t chunksBefore = bufferedChunks();
  const WorkerSlot slot = registerWorker("exited", 0, dir.path());
  const std::string path = workerFile(slot);
  constexpr int kThreads = 3;
  constexpr int kEvents = static_cast<int>(kChunkEvents) * 2 + 7;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      setThreadName("short-lived-" + std::to_string(t));
      WorkerScope bound(slot);
      for (int i = 0; i < kEvents; ++i) instant("work", Category::kUser, {t, i});
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_GT(bufferedChunks(), chunksBefore) << "the exited threads' events must still be buffered";
  EXPECT_EQ(flush(), static_cast<uint64_t>(kThreads) * kEvents);
  EXPECT_EQ(bufferedChunks(), chunksBefore) << "buffers of exited threads are freed once written";
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  EXPECT_EQ(file.events.size(), static_cast<size_t>(kThreads) * kEvents);
  std::set<std::pair<int64_t, int64_t>> keys;
  for (const auto& e : file.events) keys.emplace(*e.integer("a0"), *e.integer("a1"));
  EXPECT_EQ(keys.size(), static_cast<size_t>(kThreads) * kEvents);
  std::set<std::string> names;
  for (const auto& line : file.threads) names.insert(*line.string("name"));
  EXPECT_EQ(names, (std::set<std::string>{"short-lived-0", "short-lived-1", "short-lived-2"}));
}

TEST(Trace, EachEventGoesToTheWorkerItsThreadIsBoundTo) {
  TempDir dir;
  const WorkerSlot a = registerWorker("wa", 0, dir.path());
  const WorkerSlot b = registerWorker("wb", 1, dir.path());
  const WorkerSlot untraced = registerWorker("wc", 2);  // no file: its events are dropped
  const Stats before = stats();
  std::thread([&] {
    setCurrentWorker(b);
    instant("for-b", Category::kUser);
  }).join();
  std::thread([&] {
    {
      WorkerScope call(a);  // a user thread calling through agent A
      instant("for-a", Category::kUser);
    }
    instant("unbound", Category::kUser);  // the process's first traced worker: a
  }).join();
  std::thread([&] {
    setCurrentWorker(untraced);
    instant("for-c", Category::kUser);
  }).join();
  flush();
  EXPECT_EQ(stats().dropped - before.dropped, 1u);
  const std::string pathA = workerFile(a), pathB = workerFile(b);
  EXPECT_EQ(workerFile(untraced), "");
  unregisterWorker(untraced);
  unregisterWorker(b);
  EXPECT_TRUE(enabled()) << "worker a still traces";
  unregisterWorker(a);
  EXPECT_FALSE(enabled());
  unregisterWorker(a);  // idempotent
  const TraceFile fileA = readTrace(pathA), fileB = readTrace(pathB);
  EXPECT_EQ(fileA.header.string("worker"), "wa");
  EXPECT_EQ(fileB.header.string("worker"), "wb");
  std::multiset<std::string> inA, inB;
  for (const auto& e : fileA.events) inA.insert(*e.string("name"));
  for (const auto& e : fileB.events) inB.insert(*e.string("name"));
  EXPECT_EQ(inA, (std::multiset<std::string>{"for-a", "unbound"}));
  EXPECT_EQ(inB, (std::multiset<std::string>{"for-b"}));
}

// Over the flush threshold the background writer writes the buffered events without anyone calling
// flush(); under it they stay in memory.
TEST(Trace, TheBackgroundWriterWritesOnceTheThresholdIsPassed) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("writer", 0, dir.path());
  const std::string path = workerFile(slot);
  const uint64_t written = stats().written;
  std::thread([&] {
    WorkerScope bound(slot);
    for (int i = 0; i < 100; ++i) instant("small", Category::kUser, {i});
  }).join();
  setFlushThreshold(0);  // every check writes what is buffered
  EXPECT_TRUE(rpc::testing::eventually([&] { return stats().written >= written + 100; }, 10s))
      << "the writer did not write";
  setFlushThreshold(kDefaultFlushThresholdBytes);
  std::ifstream in(path);
  size_t lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  EXPECT_GE(lines, 1u + 1u + 100u) << "header, thread line and the events are in the file before shutdown";
  unregisterWorker(slot);
  EXPECT_EQ(readTrace(path).events.size(), 100u);
}

namespace {
// The id of this process's thread named `name`, or -1.
pid_t threadNamed(const std::string& name) {
  for (const auto& task : fs::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) return static_cast<pid_t>(std::stol(task.path().filename()));
  }
  return -1;
}
}  // namespace

// Note [Idle flusher] (rpc/trace.cpp): the writer's flushes are formatted by a thread at SCHED_IDLE; when
// the job keeps its core busy and that thread falls behind, the writer writes the backlog itself.
TEST(Trace, TheFlusherRunsAtIdlePriorityAndTheWriterCatchesUpWhenItStarves) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("idle", 0, dir.path());
  pid_t flusher = -1;
  ASSERT_TRUE(rpc::testing::eventually([&] { return (flusher = threadNamed("dg-trace-flush")) > 0; }, 10s));
  EXPECT_EQ(sched_getscheduler(flusher), SCHED_IDLE);
  // Starve it: the flusher and a thread that spins at the job's priority share one CPU.
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &allowed)) ++cpu;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  ASSERT_EQ(sched_setaffinity(flusher, sizeof(one), &one), 0);
  std::atomic<bool> spin{true};
  std::thread spinner([&] {
    EXPECT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    while (spin.load(std::memory_order_relaxed)) {
    }
  });
  const Stats before = stats();
  setFlushThreshold(0);  // every check writes what is buffered
  // Over kCatchUpChunks (64) chunks, recorded faster than the writer's 50 ms period.
  constexpr uint64_t kEvents = 100 * kChunkEvents;
  std::thread([&] {
    WorkerScope bound(slot);
    for (uint64_t i = 0; i < kEvents; ++i) instant("starved", Category::kUser);
  }).join();
  EXPECT_TRUE(rpc::testing::eventually([&] { return stats().written >= before.written + kEvents; }, 20s))
      << "written " << stats().written - before.written << " of " << kEvents;
  EXPECT_GT(stats().catchUpFlushes, before.catchUpFlushes) << "the writer caught up";
  spin = false;
  spinner.join();
  setFlushThreshold(kDefaultFlushThresholdBytes);
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  EXPECT_EQ(readTrace(path).events.size(), kEvents);
  EXPECT_EQ(threadNamed("dg-trace-flush"), -1) << "the flusher stops with the writer";
}

// Note [Ready chunks] (rpc/trace.cpp): while a worker traces, the writer keeps fresh chunks mapped in for
// the recording threads, about twice what they took in its last period; once nothing traces they are freed.
TEST(Trace, TheWriterKeepsChunksReadyWhileTracingAndFreesThemAfter) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("ready", 0, dir.path());
  EXPECT_TRUE(rpc::testing::eventually([] { return stats().readyChunks >= 2; }, 10s))
      << "the writer keeps at least 2 chunks ready: " << stats().readyChunks;
  // A thread that takes 8 chunks at once: the writer's next pass tops the pool up to what it took.
  constexpr uint64_t kChunks = 8;
  const uint64_t before = bufferedChunks();
  std::thread([&] {
    WorkerScope bound(slot);
    for (uint64_t i = 0; i < kChunks * kChunkEvents; ++i) instant("ready.event", Category::kUser);
  }).join();
  EXPECT_EQ(bufferedChunks() - before, kChunks);
  // At least half of them (a writer's pass in the middle of the 8 can leave 7 for a while).
  EXPECT_TRUE(rpc::testing::eventually([] { return stats().readyChunks >= kChunks / 2; }, 10s))
      << "after 8 chunks were taken the writer keeps at least 4 ready: " << stats().readyChunks;
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  EXPECT_EQ(stats().readyChunks, 0u) << "nothing traces: the ready chunks are freed";
  EXPECT_EQ(readTrace(path).events.size(), kChunks * kChunkEvents);
}

// Note [TSC trace clock] (rpc/trace.cpp): where the kernel keeps CLOCK_MONOTONIC on the time-stamp counter,
// nowNs() reads the counter while something traces (from the writer's second pass on), stays within
// microseconds of the steady clock across the writer's re-anchoring, never goes back on a thread, and reads
// the steady clock again once nothing traces.
TEST(Trace, TheTraceClockFollowsTheSteadyClockAndNeverGoesBack) {
  std::string source;
  std::ifstream("/sys/devices/system/clocksource/clocksource0/current_clocksource") >> source;
#if defined(__x86_64__)
  const bool tsc = source == "tsc" && std::getenv("DISTGRAD_TRACE_CLOCK") == nullptr;
#else
  const bool tsc = false;
#endif
  EXPECT_STREQ(clockName(), "steady");
  TempDir dir;
  const WorkerSlot slot = registerWorker("clock", 0, dir.path());
  if (tsc) {
    EXPECT_TRUE(rpc::testing::eventually([] { return std::string(clockName()) == "tsc"; }, 10s));
  }
  auto steady = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  // Two threads for 400 ms (eight re-anchorings): each reading within 20 us of the steady clock read around
  // it, and never less than the thread's previous one.
  std::atomic<int64_t> worstError{0}, backwards{0}, reads{0};
  auto sample = [&] {
    int64_t previous = 0, worst = 0, back = 0, n = 0;
    for (const int64_t end = steady() + 400'000'000; steady() < end; ++n) {
      const int64_t before = steady();
      const int64_t now = nowNs();
      const int64_t after = steady();
      worst = std::max({worst, before - now, now - after});
      if (now < previous) ++back;
      previous = now;
    }
    worstError.store(std::max(worstError.load(), worst));
    backwards += back;
    reads += n;
  };
  std::thread other(sample);
  sample();
  other.join();
  EXPECT_LT(worstError.load(), 20'000) << "ns off the steady clock, over " << reads.load() << " reads";
  EXPECT_EQ(backwards.load(), 0);
  unregisterWorker(slot);
  EXPECT_STREQ(clockName(), "steady");
  const int64_t last = nowNs();
  EXPECT_GE(nowNs(), last);
}

TEST(Trace, InterningGivesOneStablePointerPerText) {
  std::string text = "rpc.fn.";
  text += "interned";
  const char* first = intern(text);
  text.assign(64, 'x');  // the caller's buffer changes: the interned copy does not
  EXPECT_STREQ(first, "rpc.fn.interned");
  EXPECT_EQ(intern("rpc.fn.interned"), first);
  EXPECT_NE(intern("rpc.fn.other"), first);
  const char* fromAnotherThread = nullptr;
  std::thread([&] { fromAnotherThread = intern(std::string_view("rpc.fn.interned")); }).join();
  EXPECT_EQ(fromAnotherThread, first);
  // Many threads interning the same new texts at once agree on one pointer per text.
  std::vector<std::vector<const char*>> results(4);
  std::vector<std::thread> threads;
  for (auto& out : results) {
    threads.emplace_back([&out] {
      for (int i = 0; i < 200; ++i) out.push_back(intern("concurrent-" + std::to_string(i)));
    });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& out : results) EXPECT_EQ(out, results[0]);
}

TEST(Trace, PausedRecordingRecordsNothing) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("paused", 0, dir.path());
  ASSERT_TRUE(enabled());
  setPaused(true);
  EXPECT_FALSE(enabled());
  const uint64_t recorded = stats().recorded;
  { DG_TRACE_SCOPE("while paused"); }
  EXPECT_EQ(stats().recorded, recorded);
  setPaused(false);
  EXPECT_TRUE(enabled());
  {
    WorkerScope bound(slot);
    DG_TRACE_SCOPE("after");
  }
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  ASSERT_EQ(file.events.size(), 1u);
  EXPECT_EQ(file.events[0].string("name"), "after");
}

TEST(Trace, TheTestSkewShiftsEveryTimeAndClockLinesAndOddNamesAreWrittenExactly) {
  TempDir dir;
  constexpr int64_t kSkew = 5'000'000'000;
  const int64_t before = nowNs();
  const WorkerSlot slot = registerWorker("skewed", 2, dir.path(), kSkew);
  const char* odd = intern("we\"ird\\ name\nwith\tcontrol \x01 chars");
  {
    WorkerScope bound(slot);
    recordSpan("manual", Category::kAutograd, 100, 250, {7, -8, 9}, 42, FlowPhase::kEnd, odd);
    recordAsync("waited", Category::kRRef, 300, 400, {1});
    recordInstant("at", Category::kTransport, 500, {2, 3});
  }
  setClockOffset(slot, "peer-0", 0, -123, 456, 7);
  setClockOffset(slot, "peer-0", 0, -120, 400, 8);  // the latest estimate replaces the earlier one
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  EXPECT_GE(*file.header.integer("start_ns"), before + kSkew);
  ASSERT_EQ(file.events.size(), 3u);
  const FlatObject& manual = *named(file, "manual").at(0);
  EXPECT_EQ(manual.integer("b"), 100 + kSkew);
  EXPECT_EQ(manual.integer("e"), 250 + kSkew);
  EXPECT_EQ(manual.string("cat"), "autograd");
  EXPECT_EQ(manual.integer("a0"), 7);
  EXPECT_EQ(manual.integer("a1"), -8);
  EXPECT_EQ(manual.integer("a2"), 9);
  EXPECT_EQ(manual.integer("flow"), 42);
  EXPECT_EQ(manual.string("flow_phase"), "end");
  EXPECT_EQ(manual.string("detail"), std::string(odd));
  const FlatObject& waited = *named(file, "waited").at(0);
  EXPECT_EQ(waited.string("type"), "async");
  EXPECT_EQ(waited.string("cat"), "rref");
  EXPECT_EQ(waited.integer("b"), 300 + kSkew);
  const FlatObject& at = *named(file, "at").at(0);
  EXPECT_EQ(at.string("type"), "instant");
  EXPECT_EQ(at.integer("b"), 500 + kSkew);
  EXPECT_EQ(at.integer("e"), 500 + kSkew);
  ASSERT_EQ(file.clocks.size(), 1u) << "one clock line per flush with a new estimate";
  EXPECT_EQ(file.clocks[0].string("peer"), "peer-0");
  EXPECT_EQ(file.clocks[0].integer("peer_rank"), 0);
  EXPECT_EQ(file.clocks[0].integer("offset_ns"), -120);
  EXPECT_EQ(file.clocks[0].integer("rtt_ns"), 400);
  EXPECT_EQ(file.clocks[0].integer("samples"), 8);
  ASSERT_TRUE(file.end.has_value());
  EXPECT_GE(*file.end->integer("end_ns"), before + kSkew);
}

// The Agent's RPC sites record one RpcRecord each (rpc/trace.h); the writer expands it into the documented
// events (docs/tracing.md): here every site, with and without its transport.recv, written with the test
// skew, must come out as exactly those events: names, kinds, categories, times (begin <= end, each span
// starting where the previous one of the record ended), args, detail and flow phases; the counters and the
// end line count events, not records.
TEST(Trace, RpcRecordsAreWrittenAsTheDocumentedEventsInTimeOrderWithTheirFlows) {
  TempDir dir;
  constexpr int64_t kSkew = 1'000;
  const WorkerSlot slot = registerWorker("rpc-records", 3, dir.path(), kSkew);
  const char* fn = intern("remote_fn");
  struct Case {
    RpcSite site;
    uint8_t flags;
    uint64_t flow;
  };
  const std::vector<Case> cases = {
      {RpcSite::kClientSend, kRpcToTransport, callFlowId(3, 10)},
      {RpcSite::kClientReply, kRpcFromTransport, callFlowId(3, 11)},
      {RpcSite::kClientReply, 0, callFlowId(3, 12)},
      {RpcSite::kServerArrive, kRpcFromTransport, 0},
      {RpcSite::kServerArrive, 0, 0},
      {RpcSite::kServerExecute, 0, callFlowId(1, 15)},
      {RpcSite::kServerReply, kRpcToTransport, 0},
      {RpcSite::kServerHandled, kRpcToTransport, callFlowId(1, 17)},
  };
  const Stats before = stats();
  int expectedEvents = 0;
  {
    WorkerScope bound(slot);
    for (size_t i = 0; i < cases.size(); ++i) {
      RpcRecord record;
      record.site = cases[i].site;
      record.flags = cases[i].flags;
      const auto base = static_cast<int64_t>(1000 * (i + 1));
      record.t[0] = base;
      record.t[1] = base + 100;
      record.t[2] = base + 300;
      record.t[3] = base + 350;  // kServerHandled's
      record.t[4] = base + 500;
      record.bytes = 64 + static_cast<int64_t>(i);
      record.call = 10 + i;
      record.flow = cases[i].flow;
      record.function = fn;
      record.peer = 1;
      record.status = record.site == RpcSite::kClientReply ? 8 : 0;
      expectedEvents += rpcEventCount(record);
      Event expanded[kRpcMaxEvents];
      EXPECT_EQ(expandRpc(record, expanded), rpcEventCount(record));
      recordRpc(record);
    }
  }
  const Stats after = stats();
  EXPECT_EQ(after.records - before.records, cases.size());
  EXPECT_EQ(after.recorded - before.recorded, static_cast<uint64_t>(expectedEvents));
  EXPECT_EQ(expectedEvents, 3 + 3 + 2 + 2 + 1 + 2 + 3 + 5);
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  ASSERT_EQ(file.events.size(), static_cast<size_t>(expectedEvents));
  ASSERT_TRUE(file.end.has_value());
  EXPECT_EQ(file.end->integer("events"), expectedEvents);

  // The events of case i, in file order (a record's events are written together, in the documented order).
  std::map<int64_t, std::vector<const FlatObject*>> byCall;  // call id -> events
  for (const auto& ev : file.events) {
    EXPECT_LE(*ev.integer("b"), *ev.integer("e")) << *ev.string("name");
    const bool recv = ev.string("name") == "transport.recv";
    const bool sent = ev.string("name") == "transport.send";
    if (!recv && !sent) {
      EXPECT_EQ(ev.string("detail"), "remote_fn") << *ev.string("name");
    }
    // The transport instants carry no call id: grouped apart (-1 received, -2 sent), in file order.
    byCall[recv ? -1
           : sent
               ? -2
               : *ev.integer(ev.string("type") == "async" || ev.string("name") == "rpc.server.execute" ? "a1" : "a2")]
        .push_back(&ev);
  }
  auto names = [&](int64_t call) {
    std::vector<std::string> out;
    for (const FlatObject* ev : byCall[call]) out.push_back(*ev->string("name"));
    return out;
  };
  auto at = [&](int64_t call, size_t k) -> const FlatObject& { return *byCall[call].at(k); };
  auto t = [&](size_t i, int k) {
    static constexpr int64_t kOffsets[] = {0, 100, 300, 350, 500};
    return static_cast<int64_t>(1000 * (i + 1)) + kOffsets[k] + kSkew;
  };

  // kClientSend: serialize [t0, t1], send [t1, t2] starting the flow; both with bytes, peer, call.
  EXPECT_EQ(names(10), (std::vector<std::string>{"rpc.client.serialize", "rpc.client.send"}));
  EXPECT_EQ(at(10, 0).integer("b"), t(0, 0));
  EXPECT_EQ(at(10, 0).integer("e"), t(0, 1));
  EXPECT_EQ(at(10, 1).integer("b"), t(0, 1));
  EXPECT_EQ(at(10, 1).integer("e"), t(0, 2));
  EXPECT_EQ(at(10, 0).integer("a0"), 64);
  EXPECT_EQ(at(10, 0).integer("a1"), 1);
  EXPECT_FALSE(at(10, 0).integer("flow").has_value());
  EXPECT_EQ(at(10, 1).integer("flow"), static_cast<int64_t>(callFlowId(3, 10)));
  EXPECT_EQ(at(10, 1).string("flow_phase"), "start");
  EXPECT_EQ(at(10, 1).string("cat"), "rpc_client");
  // kClientReply: wait [t0, t1] (async, status), deserialize [t1, t2] ending the flow; with the transport,
  // a transport.recv at t1 (bytes, peer).
  EXPECT_EQ(names(11), (std::vector<std::string>{"rpc.client.wait", "rpc.client.deserialize"}));
  EXPECT_EQ(names(12), names(11));
  for (auto [call, i] : {std::make_pair(11, 1), std::make_pair(12, 2)}) {
    EXPECT_EQ(at(call, 0).string("type"), "async");
    EXPECT_EQ(at(call, 0).integer("b"), t(static_cast<size_t>(i), 0));
    EXPECT_EQ(at(call, 0).integer("e"), t(static_cast<size_t>(i), 1));
    EXPECT_EQ(at(call, 0).integer("a0"), 1);
    EXPECT_EQ(at(call, 0).integer("a2"), 8) << "status";
    EXPECT_EQ(at(call, 1).string("type"), "span");
    EXPECT_EQ(at(call, 1).integer("b"), t(static_cast<size_t>(i), 1));
    EXPECT_EQ(at(call, 1).integer("e"), t(static_cast<size_t>(i), 2));
    EXPECT_EQ(at(call, 1).integer("a0"), 64 + i);
    EXPECT_EQ(at(call, 1).integer("flow"), static_cast<int64_t>(callFlowId(3, static_cast<uint64_t>(call))));
    EXPECT_EQ(at(call, 1).string("flow_phase"), "end");
  }
  // kServerArrive: deserialize [t0, t1]; kServerExecute: queue [t0, t1] (async), execute [t1, t2] (flow step);
  // kServerReply: serialize [t0, t1], send [t1, t2].
  EXPECT_EQ(names(13), (std::vector<std::string>{"rpc.server.deserialize"}));
  EXPECT_EQ(names(14), names(13));
  EXPECT_EQ(at(13, 0).integer("b"), t(3, 0));
  EXPECT_EQ(at(13, 0).integer("e"), t(3, 1));
  EXPECT_EQ(at(13, 0).integer("a0"), 67);
  EXPECT_EQ(at(13, 0).string("cat"), "rpc_server");
  EXPECT_EQ(names(15), (std::vector<std::string>{"rpc.server.queue", "rpc.server.execute"}));
  EXPECT_EQ(at(15, 0).string("type"), "async");
  EXPECT_EQ(at(15, 0).integer("e"), at(15, 1).integer("b"));
  EXPECT_EQ(at(15, 1).integer("e"), t(5, 2));
  EXPECT_EQ(at(15, 1).integer("a0"), 1) << "the caller's rank";
  EXPECT_EQ(at(15, 1).integer("flow"), static_cast<int64_t>(callFlowId(1, 15)));
  EXPECT_EQ(at(15, 1).string("flow_phase"), "step");
  EXPECT_EQ(names(16), (std::vector<std::string>{"rpc.server.serialize", "rpc.server.send"}));
  EXPECT_EQ(at(16, 0).integer("e"), at(16, 1).integer("b"));
  EXPECT_EQ(at(16, 1).integer("a0"), 70);
  // kServerHandled: kServerExecute's events then kServerReply's, over its five times.
  EXPECT_EQ(names(17), (std::vector<std::string>{"rpc.server.queue", "rpc.server.execute", "rpc.server.serialize",
                                                 "rpc.server.send"}));
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(at(17, static_cast<size_t>(k)).integer("b"), t(7, k));
    EXPECT_EQ(at(17, static_cast<size_t>(k)).integer("e"), t(7, k + 1));
  }
  EXPECT_EQ(at(17, 0).string("type"), "async");
  EXPECT_EQ(at(17, 1).integer("flow"), static_cast<int64_t>(callFlowId(1, 17)));
  EXPECT_EQ(at(17, 1).string("flow_phase"), "step");
  EXPECT_FALSE(at(17, 2).integer("flow").has_value());
  EXPECT_EQ(at(17, 2).integer("a0"), 71);
  EXPECT_EQ(at(17, 3).integer("a0"), 71);
  // The two transport.recv instants: the client reply's at its arrival (t1), the server arrival's at t0.
  ASSERT_EQ(byCall[-1].size(), 2u);
  EXPECT_EQ(at(-1, 0).string("type"), "instant");
  EXPECT_EQ(at(-1, 0).string("cat"), "transport");
  EXPECT_EQ(at(-1, 0).integer("b"), t(1, 1));
  EXPECT_EQ(at(-1, 0).integer("a0"), 65);
  EXPECT_EQ(at(-1, 0).integer("a1"), 1);
  EXPECT_FALSE(at(-1, 0).string("detail").has_value());
  EXPECT_EQ(at(-1, 1).integer("b"), t(3, 0));
  EXPECT_EQ(at(-1, 1).integer("a0"), 67);
  // The transport.send instants: when the call's and the replies' frames were queued (t2; t4 handled).
  ASSERT_EQ(byCall[-2].size(), 3u);
  EXPECT_EQ(at(-2, 0).string("type"), "instant");
  EXPECT_EQ(at(-2, 0).string("cat"), "transport");
  EXPECT_EQ(at(-2, 0).integer("b"), t(0, 2));
  EXPECT_EQ(at(-2, 0).integer("e"), t(0, 2));
  EXPECT_EQ(at(-2, 0).integer("a0"), 64);
  EXPECT_EQ(at(-2, 0).integer("a1"), 1);
  EXPECT_FALSE(at(-2, 0).string("detail").has_value());
  EXPECT_EQ(at(-2, 1).integer("b"), t(6, 2));
  EXPECT_EQ(at(-2, 1).integer("a0"), 70);
  EXPECT_EQ(at(-2, 2).integer("b"), t(7, 4));
  EXPECT_EQ(at(-2, 2).integer("a0"), 71);
}

// Note [Packed RPC records] (rpc/trace.cpp): a record is stored in 32 bytes when its values fit, whole
// otherwise. Records on either side of every limit come out with exactly the values recorded.
TEST(Trace, RpcRecordsBeyondThePackedLimitsAreWrittenExactly) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("rpc-limits", 3, dir.path());
  const char* fn = intern("limits_fn");
  constexpr int64_t kSecond = 1'000'000'000;
  constexpr int64_t kMaxOffset = 4'294'967'295;  // the largest t1 - t0 (and t2 - t0) that packs, in ns
  struct Case {
    RpcSite site;
    int64_t t[3];
    int64_t bytes;
    uint64_t call;
    uint64_t flow;
  };
  const int64_t base = 7 * kSecond;
  const std::vector<Case> cases = {
      {RpcSite::kClientSend, {base, base + 10, base + kMaxOffset}, 100, 1, callFlowId(3, 1)},  // packs
      {RpcSite::kClientSend, {base, base + 10, base + kMaxOffset + 1}, 100, 2, callFlowId(3, 2)},
      {RpcSite::kClientReply, {base, base + 5 * kSecond, base + 5 * kSecond + 7}, 100, 3, callFlowId(3, 3)},
      {RpcSite::kClientSend, {base, base + 1, base + 2}, int64_t{5} << 30, 4, callFlowId(3, 4)},
      {RpcSite::kClientSend, {base, base + 1, base + 2}, 4'294'967'295, 5, callFlowId(3, 5)},  // packs
      // A flow that is not callFlowId(rank, call) of the record's call.
      {RpcSite::kServerExecute, {base, base + 1, base + 2}, 0, 6, 0xabcdef},
      // Flows of another origin than the site's: the caller's sites carry their own worker's (rank 3),
      // kServerExecute its peer's (1).
      {RpcSite::kClientSend, {base, base + 1, base + 2}, 0, 11, callFlowId(1, 11)},
      {RpcSite::kClientReply, {base, base + 1, base + 2}, 0, 12, callFlowId(3, 13)},
      {RpcSite::kServerExecute, {base, base + 1, base + 2}, 0, 14, callFlowId(3, 14)},
      // Call ids up to 39 bits pack; beyond 48 bits the flow keeps their low 48.
      {RpcSite::kServerExecute,
       {base, base + 1, base + 2},
       0,
       (uint64_t{1} << 39) - 1,
       callFlowId(1, (uint64_t{1} << 39) - 1)},
      {RpcSite::kServerExecute, {base, base + 1, base + 2}, 0, uint64_t{1} << 39, callFlowId(1, uint64_t{1} << 39)},
      {RpcSite::kServerExecute, {base, base + 1, base + 2}, 0, (uint64_t{1} << 50) + 7, callFlowId(1, 7)},
      // Times out of order (t1 before t0), negative times.
      {RpcSite::kServerReply, {base, base - 5, base + 3}, 9, 9, 0},
      {RpcSite::kServerReply, {-20, -10, -5}, 10, 10, 0},
  };
  int expectedEvents = 0;
  {
    WorkerScope bound(slot);
    for (const Case& c : cases) {
      RpcRecord record;
      record.site = c.site;
      record.t[0] = c.t[0];
      record.t[1] = c.t[1];
      record.t[2] = c.t[2];
      record.bytes = c.bytes;
      record.call = c.call;
      record.flow = c.flow;
      record.function = fn;
      record.peer = 1;
      expectedEvents += rpcEventCount(record);
      recordRpc(record);
    }
  }
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  ASSERT_EQ(file.events.size(), static_cast<size_t>(expectedEvents));
  // Each record's events in file order: its first and last event span t0..t2, and its bytes, call and flow
  // are the recorded ones.
  size_t next = 0;
  for (const Case& c : cases) {
    RpcRecord record;
    record.site = c.site;
    const int n = rpcEventCount(record);
    ASSERT_LE(next + static_cast<size_t>(n), file.events.size());
    const FlatObject& first = file.events[next];
    const FlatObject& last = file.events[next + static_cast<size_t>(n) - 1];
    next += static_cast<size_t>(n);
    SCOPED_TRACE("call " + std::to_string(c.call));
    EXPECT_EQ(first.integer("b"), c.t[0]);
    EXPECT_EQ(first.integer("e"), c.t[1]);
    EXPECT_EQ(last.integer("b"), c.t[1]);
    EXPECT_EQ(last.integer("e"), c.t[2]);
    // Serialize spans carry bytes, peer, call; rpc.client.wait and rpc.server.queue peer, call.
    const bool withBytes = c.site == RpcSite::kClientSend || c.site == RpcSite::kServerReply;
    if (withBytes) {
      EXPECT_EQ(first.integer("a0"), c.bytes);
    }
    EXPECT_EQ(first.integer(withBytes ? "a2" : "a1"), static_cast<int64_t>(c.call));
    if (c.site != RpcSite::kServerReply) {
      EXPECT_EQ(last.integer("flow"), static_cast<int64_t>(c.flow));
    } else {
      EXPECT_FALSE(last.integer("flow").has_value());
    }
  }
}

// A kServerHandled record packs into 40 bytes when its five times fit (Note [Packed RPC records]), and is
// stored as its kServerExecute and kServerReply records otherwise: either way the file holds exactly the
// events expandRpc gives for it.
TEST(Trace, HandledRecordsComeOutAsTheirEventsWhetherPackedOrSplit) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("rpc-handled", 0, dir.path());
  const char* fn = intern("handled_fn");
  constexpr int64_t kBase = 3'000'000'000;
  constexpr int64_t kMaxOffset = 4'294'967'295;
  struct Case {
    int64_t t[5];
    uint64_t flow;
    uint8_t flags;
    uint64_t records;  // what it takes: 1 packed, 2 split
  };
  const std::vector<Case> cases = {
      {{kBase, kBase + 1, kBase + 2, kBase + 3, kBase + kMaxOffset}, callFlowId(4, 1), kRpcToTransport, 1},
      {{kBase, kBase + 1, kBase + 2, kBase + 3, kBase + kMaxOffset + 1}, callFlowId(4, 2), kRpcToTransport, 2},
      {{kBase, kBase + 1, kBase + 2, kBase - 3, kBase + 4}, callFlowId(4, 3), 0, 2},                // t3 before t0
      {{kBase, kBase + 1, kBase + 2, kBase + 3, kBase + 4}, callFlowId(5, 4), kRpcToTransport, 2},  // foreign flow
      {{kBase, kBase + 1, kBase + 2, kBase + 3, kBase + 4}, 0, 0, 1},
  };
  std::vector<RpcRecord> records;
  {
    WorkerScope bound(slot);
    for (size_t i = 0; i < cases.size(); ++i) {
      RpcRecord record;
      record.site = RpcSite::kServerHandled;
      for (int k = 0; k < kRpcMaxTimes; ++k) record.t[k] = cases[i].t[k];
      record.bytes = 100 + static_cast<int64_t>(i);
      record.call = i + 1;
      record.flow = cases[i].flow;
      record.function = fn;
      record.peer = 4;
      record.flags = cases[i].flags;
      const uint64_t before = stats().records;
      recordRpc(record);
      EXPECT_EQ(stats().records - before, cases[i].records) << "case " << i;
      record.worker = slot;
      records.push_back(record);
    }
  }
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  size_t next = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    Event expected[kRpcMaxEvents];
    const int n = expandRpc(records[i], expected);
    EXPECT_EQ(n, 4 + (cases[i].flags != 0 ? 1 : 0));
    for (int k = 0; k < n; ++k, ++next) {
      SCOPED_TRACE("case " + std::to_string(i) + ", event " + std::to_string(k));
      ASSERT_LT(next, file.events.size());
      const FlatObject& ev = file.events[next];
      EXPECT_EQ(ev.string("name"), expected[k].name);
      EXPECT_EQ(ev.integer("b"), expected[k].beginNs);
      EXPECT_EQ(ev.integer("e"), expected[k].endNs);
      static const char* const kArgs[kMaxArgs] = {"a0", "a1", "a2"};
      for (int a = 0; a < expected[k].argCount; ++a) EXPECT_EQ(ev.integer(kArgs[a]), expected[k].args[a]);
      EXPECT_EQ(ev.integer("flow").value_or(0), static_cast<int64_t>(expected[k].flow));
    }
  }
  EXPECT_EQ(next, file.events.size());
}

// A packed record takes 32 bytes (a chunk of kChunkEvents * sizeof(Event) bytes holds that many of them),
// and its narrow fields come out exactly at their limits: peers -1 (none) to 65534, status 0 to 7, no
// function; one past a limit (peer 65535, status 8) is stored whole and comes out the same.
TEST(Trace, PackedRpcRecordsTake32BytesAndKeepTheirValuesAtEveryLimit) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("rpc-packed", 2, dir.path());
  const char* fn = intern("packed_fn");
  constexpr uint64_t kPerChunk = kChunkEvents * sizeof(Event) / 32;
  struct Case {
    int32_t peer;
    uint8_t status;
    const char* function;
  };
  const std::vector<Case> edges = {{-1, 0, fn}, {65534, 7, fn}, {0, 3, nullptr}, {65535, 0, fn}, {5, 8, fn}};
  uint64_t chunksAfterOne = 0, chunksAfterFull = 0, chunksAfterNext = 0;
  // A thread of its own: its buffer starts empty, so its chunks are what these records took.
  std::thread recorder([&] {
    WorkerScope bound(slot);
    const uint64_t chunks = bufferedChunks();
    for (uint64_t i = 0; i < kPerChunk + 1 + edges.size(); ++i) {
      RpcRecord record;
      record.site = RpcSite::kClientReply;
      record.t[0] = 1000 + static_cast<int64_t>(i);
      record.t[1] = record.t[0] + 1;
      record.t[2] = record.t[0] + 2;
      record.call = i;
      record.flow = callFlowId(2, i);
      record.function = fn;
      record.peer = 1;
      if (i > kPerChunk) {
        const Case& edge = edges[i - kPerChunk - 1];
        record.peer = edge.peer;
        record.status = edge.status;
        record.function = edge.function;
      }
      recordRpc(record);
      if (i == 0) chunksAfterOne = bufferedChunks() - chunks;
      if (i + 1 == kPerChunk) chunksAfterFull = bufferedChunks() - chunks;
      if (i == kPerChunk) chunksAfterNext = bufferedChunks() - chunks;
    }
  });
  recorder.join();
  EXPECT_EQ(chunksAfterOne, 1u);
  EXPECT_EQ(chunksAfterFull, 1u) << kPerChunk << " packed records fill one chunk";
  EXPECT_EQ(chunksAfterNext, 2u);
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  ASSERT_EQ(file.events.size(), 2 * (kPerChunk + 1 + edges.size()));  // wait and deserialize each
  for (size_t i = 0; i < edges.size(); ++i) {
    const FlatObject& wait = file.events[2 * (kPerChunk + 1 + i)];
    const FlatObject& deserialize = file.events[2 * (kPerChunk + 1 + i) + 1];
    SCOPED_TRACE("edge " + std::to_string(i));
    EXPECT_EQ(wait.string("name"), "rpc.client.wait");
    EXPECT_EQ(wait.integer("a0"), edges[i].peer);
    EXPECT_EQ(wait.integer("a1"), static_cast<int64_t>(kPerChunk + 1 + i));
    EXPECT_EQ(wait.integer("a2"), edges[i].status);
    EXPECT_EQ(deserialize.string("detail").has_value(), edges[i].function != nullptr);
    EXPECT_EQ(deserialize.integer("flow"), static_cast<int64_t>(callFlowId(2, kPerChunk + 1 + i)));
  }
  EXPECT_EQ(file.events.front().string("detail"), "packed_fn");
}

// Records of both sizes (events and whole RPC records: 72 bytes; packed RPC records: 32) mixed on one thread
// over several chunks, flushed while recorded: each comes out once, in order, with its values.
TEST(Trace, MixedRecordSizesAcrossChunksComeOutInOrder) {
  TempDir dir;
  const WorkerSlot slot = registerWorker("mixed", 0, dir.path());
  const char* fn = intern("mixed_fn");
  constexpr int kRecords = static_cast<int>(kChunkEvents) * 4 + 11;
  int expectedEvents = 0;
  {
    WorkerScope bound(slot);
    for (int i = 0; i < kRecords; ++i) {
      const auto t = static_cast<int64_t>(i) * 1000;
      switch (i % 3) {
        case 0:
          recordSpan("mixed.span", Category::kUser, t, t + 1, {i});
          expectedEvents += 1;
          break;
        default: {
          RpcRecord record;
          record.site = RpcSite::kServerExecute;
          record.t[0] = t;
          record.t[1] = t + 1;
          // i % 3 == 2: an execution of 5 s, which does not pack.
          record.t[2] = i % 3 == 1 ? t + 2 : t + 5'000'000'000;
          record.call = static_cast<uint64_t>(i);
          record.flow = callFlowId(1, record.call);
          record.function = fn;
          record.peer = 1;
          recordRpc(record);
          expectedEvents += 2;
        }
      }
      if (i % 1500 == 0) flush();
    }
  }
  const std::string path = workerFile(slot);
  unregisterWorker(slot);
  const TraceFile file = readTrace(path);
  ASSERT_EQ(file.events.size(), static_cast<size_t>(expectedEvents));
  size_t next = 0;
  for (int i = 0; i < kRecords; ++i) {
    const FlatObject& first = file.events[next];
    const auto t = static_cast<int64_t>(i) * 1000;
    ASSERT_EQ(first.integer("b"), t) << "record " << i;
    if (i % 3 == 0) {
      EXPECT_EQ(first.string("name"), "mixed.span");
      EXPECT_EQ(first.integer("a0"), i);
      next += 1;
    } else {
      const FlatObject& execute = file.events[next + 1];
      EXPECT_EQ(first.string("name"), "rpc.server.queue");
      EXPECT_EQ(first.integer("a1"), i);
      EXPECT_EQ(execute.integer("e"), i % 3 == 1 ? t + 2 : t + 5'000'000'000);
      EXPECT_EQ(execute.integer("flow"), static_cast<int64_t>(callFlowId(1, static_cast<uint64_t>(i))));
      next += 2;
    }
  }
}

TEST(Trace, ADirectoryThatCannotBeCreatedIsRefusedNamingIt) {
  TempDir dir;
  const std::string notADirectory = dir.path() + "/plain-file";
  std::ofstream(notADirectory) << "x";
  try {
    registerWorker("refused", 0, notADirectory + "/traces");
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(notADirectory + "/traces"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(enabled());
}

TEST(Trace, TheFlatJsonReaderRefusesWhatTheFormatForbids) {
  EXPECT_TRUE(tools::parseFlatJson(R"({"a":1,"b":-2.5e3,"c":"x\u00e9\n","d":true,"e":null})").has_value());
  const auto big = tools::parseFlatJson(R"({"t":9007199254740993})");  // 2^53 + 1: exact as an integer
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->integer("t"), 9007199254740993LL);
  EXPECT_EQ(tools::parseFlatJson(R"({"c":"x\u00e9"})")->string("c"), "x\xc3\xa9");
  for (const char* bad : {R"({"a":{"b":1}})", R"({"a":[1]})", R"({"a":1,"a":2})", R"({"a":1} x)", R"({"a":01})",
                          R"({"a":1,})", R"({a:1})", "{\"a\":\"raw\ttab\"}", R"({"a":"\q"})", ""}) {
    std::string error;
    EXPECT_FALSE(tools::parseFlatJson(bad, &error).has_value()) << bad;
    EXPECT_FALSE(error.empty()) << bad;
  }
}

}  // namespace
}  // namespace distgrad::trace
