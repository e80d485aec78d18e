// The agent's tracing and clock offsets, in one process (inproc and tcp):
// - two agents with a known test skew between their clocks estimate it within 1 ms, at the handshake and
//   after heartbeats refreshed it (the two-process loopback check is in agent_process_test.cpp);
// - with Options::traceDir each agent writes its own file at shutdown: every call is traced on both sides
//   (serialize, send, wait, deserialize / deserialize, queue, execute, await, serialize, send) with the
//   function name, transport bytes, a flow from the call to its execution and back (nested calls, calls to
//   itself and failing calls included), threads named, clock lines, spans nested per thread, and a user
//   region inside a handler lands in the callee's file inside its execute span;
// - without it nothing is recorded; a trace directory that cannot be created fails start naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "rpc/trace.h"
#include "tests/rpc/agent_test_util.h"
#include "tests/rpc/trace_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rpc {
namespace {

using namespace testing;  // the shared agent test setup (agent_test_util.h)
using tools::FlatObject;
using trace::testing::named;
using trace::testing::readTrace;
using trace::testing::TempDir;
using trace::testing::TraceFile;

inline const Function<int64_t(int64_t)> kTracedRegion{"traced_region"};
inline const Function<int64_t(int64_t)> kGated{"gated"};  // answers when the test opens the gate

// The handler of kGated returns a future the test completes. With one executor thread the completion's
// continuation can only run after the handler's task finished, so the future is still pending when the
// handler returns: the callee's await span is certain.
struct Gate {
  std::mutex mutex;
  std::shared_ptr<Promise<int64_t>> promise;
  Event started;
};

class AgentClockTest : public AgentFixture {};

// An estimate from one round trip is off by at most half its round trip (the two one-way delays differ by
// at most their sum): the handshake's sample must satisfy that exactly. The 1 ms bound the issue asks for
// needs a round trip under 2 ms: heartbeats keep the best of the last 16, which on loopback gets there
// even on a loaded machine.
void expectEstimate(const std::optional<ClockOffset>& estimate, int64_t truth, const char* who) {
  ASSERT_TRUE(estimate.has_value()) << who << ": no estimate";
  EXPECT_GE(estimate->rttNs, 0) << who;
  EXPECT_LE(std::abs(estimate->offsetNs - truth), estimate->rttNs / 2 + 1)
      << who << ": offset " << estimate->offsetNs << " ns, rtt " << estimate->rttNs << " ns, truth " << truth;
}

TEST_P(AgentClockTest, AKnownSkewBetweenTwoAgentsIsEstimatedWithin1MsAndHeartbeatsKeepItThere) {
  constexpr auto kSkew = std::chrono::milliseconds(37);
  constexpr int64_t kSkewNs = 37'000'000;
  ClusterSpec spec;
  spec.heartbeatInterval = 50ms;
  spec.clockSkews = {0ns, kSkew};  // worker1's clock reads 37 ms later than worker0's
  start(spec);
  // The handshake's sample, on both ends (the acceptor adopts the connector's, negated).
  expectEstimate(agent(0).clockOffset("worker1"), kSkewNs, "worker0 after the handshake");
  expectEstimate(agent(1).clockOffset("worker0"), -kSkewNs, "worker1 after the handshake");
  EXPECT_EQ(agent(0).clockOffset("worker1")->rttNs, agent(1).clockOffset("worker0")->rttNs);
  // Heartbeats (every 50 ms) add samples on both sides until the best round trip is under 2 ms.
  EXPECT_TRUE(eventually(
      [&] {
        auto at0 = agent(0).clockOffset("worker1");
        auto at1 = agent(1).clockOffset("worker0");
        return at0->samples >= 4 && at1->samples >= 4 && at0->rttNs < 2'000'000 && at1->rttNs < 2'000'000;
      },
      20s))
      << "rtt " << agent(0).clockOffset("worker1")->rttNs << " / " << agent(1).clockOffset("worker0")->rttNs;
  auto at0 = agent(0).clockOffset("worker1");
  auto at1 = agent(1).clockOffset("worker0");
  expectEstimate(at0, kSkewNs, "worker0 after heartbeats");
  expectEstimate(at1, -kSkewNs, "worker1 after heartbeats");
  EXPECT_NEAR(static_cast<double>(at0->offsetNs), static_cast<double>(kSkewNs), 1e6) << "rtt " << at0->rttNs;
  EXPECT_NEAR(static_cast<double>(at1->offsetNs), static_cast<double>(-kSkewNs), 1e6) << "rtt " << at1->rttNs;
  EXPECT_FALSE(agent(0).clockOffset("worker0").has_value());
  EXPECT_FALSE(agent(0).clockOffset("nobody").has_value());
}

INSTANTIATE_TEST_SUITE_P(Transports, AgentClockTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

class AgentTraceTest : public AgentFixture {
 protected:
  void shutdownAll() {
    // A graceful shutdown meets every worker at the store's barriers: all at once.
    std::vector<std::thread> threads;
    for (auto& a : cluster_.agents) threads.emplace_back([&a] { a->shutdown(); });
    for (auto& t : threads) t.join();
  }
};

const FlatObject& only(const TraceFile& file, const std::string& name, const std::string& detail) {
  std::vector<const FlatObject*> found;
  for (const FlatObject* e : named(file, name)) {
    if (e->string("detail") == detail) found.push_back(e);
  }
  EXPECT_EQ(found.size(), 1u) << name << " / " << detail;
  static const FlatObject kMissing;
  return found.empty() ? kMissing : *found.front();
}

int64_t b(const FlatObject& e) { return e.integer("b").value_or(-1); }
int64_t e(const FlatObject& ev) { return ev.integer("e").value_or(-1); }

// Spans of one thread must nest (Chrome/Perfetto draw them as a stack): sorted by begin (longest first on
// ties), each one ends before the enclosing one does.
void expectSpansNestPerThread(const TraceFile& file, const std::string& who) {
  std::map<int64_t, std::vector<const FlatObject*>> byThread;
  for (const auto& ev : file.events) {
    if (ev.string("type") == "span") byThread[*ev.integer("tid")].push_back(&ev);
  }
  for (auto& [tid, spans] : byThread) {
    std::sort(spans.begin(), spans.end(),
              [](const FlatObject* x, const FlatObject* y) { return b(*x) != b(*y) ? b(*x) < b(*y) : e(*x) > e(*y); });
    std::vector<const FlatObject*> stack;
    for (const FlatObject* span : spans) {
      while (!stack.empty() && e(*stack.back()) <= b(*span)) stack.pop_back();
      if (!stack.empty()) {
        EXPECT_LE(e(*span), e(*stack.back()))
            << who << " thread " << tid << ": " << *span->string("name") << " [" << b(*span) << ", " << e(*span)
            << "] overlaps " << *stack.back()->string("name") << " [" << b(*stack.back()) << ", " << e(*stack.back())
            << "] without nesting";
      }
      stack.push_back(span);
    }
  }
}

TEST_P(AgentTraceTest, EveryCallIsTracedOnBothSidesWithFlowsAndEachAgentWritesItsOwnFile) {
  TempDir dir;
  ClusterSpec spec;
  spec.traceDir = dir.path();
  spec.executorThreads = 1;  // see Gate
  Gate gate;
  start(spec, [&gate](Registry& registry) {
    registry.bind(kTracedRegion, [](int64_t n) {
      DG_TRACE_SCOPE("handler region");
      return n + 1;
    });
    registry.bind(kGated, [&gate](int64_t n) -> Future<int64_t> {
      auto promise = std::make_shared<Promise<int64_t>>(*Executor::current());
      Future<int64_t> future = promise->getFuture().then([n](int64_t v) { return v + n; });
      {
        std::lock_guard<std::mutex> lock(gate.mutex);
        gate.promise = promise;
      }
      gate.started.set();
      return future;
    });
  });
  ASSERT_TRUE(trace::enabled());
  EXPECT_EQ(agent(0).rpcSync("worker1", kEcho, std::string("hi")), "hi from worker1 to worker0");
  EXPECT_EQ(agent(0).rpcSync("worker1", kNested, int64_t{4}), 50);  // worker1 calls worker0 back
  EXPECT_EQ(errorOf([&] { agent(0).rpcSync("worker1", kThrow, int64_t{1}); }).kind, ErrorKind::kRemote);
  EXPECT_EQ(agent(0).rpcSync("worker0", kScale, std::vector<double>{1.0}, 2.0), std::vector<double>{2.0});
  EXPECT_EQ(agent(0).rpcSync("worker1", kTracedRegion, int64_t{1}), 2);
  Future<int64_t> gated = agent(0).rpcAsync("worker1", kGated, int64_t{5});
  ASSERT_TRUE(gate.started.waitFor());
  {
    std::lock_guard<std::mutex> lock(gate.mutex);
    gate.promise->setValue(1);
    gate.promise.reset();
  }
  EXPECT_EQ(gated.get(), 6);
  shutdownAll();
  EXPECT_FALSE(trace::enabled()) << "the last tracing agent turned recording off";

  const TraceFile w0 = readTrace(dir.path() + "/worker0.trace.jsonl");
  const TraceFile w1 = readTrace(dir.path() + "/worker1.trace.jsonl");
  EXPECT_EQ(w0.header.string("worker"), "worker0");
  EXPECT_EQ(w1.header.string("worker"), "worker1");
  EXPECT_EQ(w1.header.integer("rank"), 1);
  for (const TraceFile* file : {&w0, &w1}) {
    ASSERT_TRUE(file->end.has_value()) << "no end line: the file was not closed";
    EXPECT_EQ(file->end->integer("events"), static_cast<int64_t>(file->events.size()));
  }
  expectSpansNestPerThread(w0, "worker0");
  expectSpansNestPerThread(w1, "worker1");

  // A plain call: the caller's four spans, the callee's five, one flow through them, in time order.
  const FlatObject& serialize = only(w0, "rpc.client.serialize", "echo");
  const FlatObject& send = only(w0, "rpc.client.send", "echo");
  const FlatObject& wait = only(w0, "rpc.client.wait", "echo");
  const FlatObject& reply = only(w0, "rpc.client.deserialize", "echo");
  const FlatObject& arrived = only(w1, "rpc.server.deserialize", "echo");
  const FlatObject& queued = only(w1, "rpc.server.queue", "echo");
  const FlatObject& executed = only(w1, "rpc.server.execute", "echo");
  const FlatObject& encoded = only(w1, "rpc.server.serialize", "echo");
  const FlatObject& answered = only(w1, "rpc.server.send", "echo");
  const auto flow = send.integer("flow");
  ASSERT_TRUE(flow.has_value());
  EXPECT_EQ(*flow >> 48, 1) << "flow ids carry the caller's rank + 1";
  EXPECT_EQ(send.string("flow_phase"), "start");
  EXPECT_EQ(executed.integer("flow"), flow);
  EXPECT_EQ(executed.string("flow_phase"), "step");
  EXPECT_EQ(reply.integer("flow"), flow);
  EXPECT_EQ(reply.string("flow_phase"), "end");
  EXPECT_GT(*serialize.integer("a0"), 0) << "bytes";
  EXPECT_EQ(serialize.integer("a0"), send.integer("a0"));
  EXPECT_EQ(send.integer("a1"), 1) << "the callee's rank";
  EXPECT_EQ(arrived.integer("a0"), send.integer("a0")) << "the callee received what the caller sent";
  EXPECT_EQ(arrived.integer("a1"), 0) << "the caller's rank";
  EXPECT_EQ(executed.integer("a0"), 0);
  EXPECT_EQ(wait.string("type"), "async");
  EXPECT_EQ(queued.string("type"), "async");
  EXPECT_EQ(wait.integer("a2"), 0) << "a reply came";
  EXPECT_EQ(encoded.integer("a0"), answered.integer("a0"));
  EXPECT_EQ(reply.integer("a0"), answered.integer("a0")) << "the caller received what the callee sent";
  // One clock (no skew): the call's events follow one another in time.
  EXPECT_LE(e(serialize), b(send));
  EXPECT_LE(b(send), b(arrived));
  EXPECT_LE(e(arrived), e(queued) + 1);
  EXPECT_LE(e(queued), b(executed) + 1);
  EXPECT_LE(e(executed), b(encoded));
  EXPECT_LE(e(encoded), b(answered) + 1);
  EXPECT_LE(b(answered), b(reply));
  EXPECT_LE(e(wait), b(reply) + 1);
  EXPECT_GE(b(wait), b(send));
  // Each frame's transport instants are part of its call's records (trace::RpcRecord): the call's frame
  // was queued at the end of its send span, on the sending thread, and arrived as the callee began
  // decoding it; the reply likewise. Exactly one instant of each at those times, with the frame's bytes.
  auto instantAt = [](const TraceFile& file, const char* name, int64_t at, int64_t tid) {
    std::vector<const FlatObject*> found;
    for (const FlatObject* ev : named(file, name)) {
      if (b(*ev) == at && (tid < 0 || ev->integer("tid") == tid)) found.push_back(ev);
    }
    EXPECT_EQ(found.size(), 1u) << name << " at " << at;
    static const FlatObject kMissing;
    return found.empty() ? kMissing : *found.front();
  };
  EXPECT_EQ(instantAt(w0, "transport.send", e(send), *send.integer("tid")).integer("a0"), send.integer("a0"));
  EXPECT_EQ(instantAt(w1, "transport.recv", b(arrived), *arrived.integer("tid")).integer("a0"), arrived.integer("a0"));
  EXPECT_EQ(instantAt(w1, "transport.send", e(answered), *answered.integer("tid")).integer("a0"),
            answered.integer("a0"));
  EXPECT_EQ(instantAt(w0, "transport.recv", b(reply), *reply.integer("tid")).integer("a0"), reply.integer("a0"));

  // The nested call goes the other way: worker1's call of add_int runs on worker0.
  const FlatObject& nestedSend = only(w1, "rpc.client.send", "add_int");
  const auto nestedFlow = nestedSend.integer("flow");
  ASSERT_TRUE(nestedFlow.has_value());
  EXPECT_EQ(*nestedFlow >> 48, 2);
  EXPECT_EQ(only(w0, "rpc.server.execute", "add_int").integer("flow"), nestedFlow);
  EXPECT_EQ(only(w1, "rpc.client.deserialize", "add_int").integer("flow"), nestedFlow);
  // The handler made the call and returned its future, which may or may not have completed by then: if
  // it had not, the await starts after the send and ends after the nested reply was handled.
  const auto nestedAwait = named(w1, "rpc.server.await");
  for (const FlatObject* awaited : nestedAwait) {
    if (awaited->string("detail") != "nested") continue;
    EXPECT_GE(b(*awaited), e(nestedSend));
    EXPECT_GE(e(*awaited), b(only(w1, "rpc.client.deserialize", "add_int")));
  }
  // A handler whose future was certainly pending: executed, then awaited until the gate opened, then its
  // reply was encoded.
  const FlatObject& gatedRun = only(w1, "rpc.server.execute", "gated");
  const FlatObject& awaited = only(w1, "rpc.server.await", "gated");
  EXPECT_EQ(awaited.string("type"), "async");
  EXPECT_GE(b(awaited), e(gatedRun));
  EXPECT_LE(e(awaited), b(only(w1, "rpc.server.serialize", "gated")));
  EXPECT_EQ(awaited.integer("a0"), 0);

  // The failing call's wait ends with its error kind.
  EXPECT_EQ(only(w0, "rpc.client.wait", "throw").integer("a2"), 1 + static_cast<int64_t>(ErrorKind::kRemote));
  // A call to itself is all in the caller's file, one flow from start to end, and never touches the
  // transport: no transport instant at its send's end or its arrival.
  const auto selfFlow = only(w0, "rpc.client.send", "scale").integer("flow");
  for (const FlatObject* ev : named(w0, "transport.send")) {
    EXPECT_NE(b(*ev), e(only(w0, "rpc.client.send", "scale"))) << "a self call's frame is not sent";
  }
  for (const FlatObject* ev : named(w0, "transport.recv")) {
    EXPECT_NE(b(*ev), b(only(w0, "rpc.server.deserialize", "scale"))) << "a self call's frame is not received";
  }
  EXPECT_EQ(only(w0, "rpc.server.execute", "scale").integer("flow"), selfFlow);
  EXPECT_EQ(only(w0, "rpc.client.deserialize", "scale").integer("flow"), selfFlow);
  EXPECT_EQ(named(w1, "rpc.server.execute").size(), 5u) << "echo, nested, throw, traced_region, gated ran on worker1";

  // Every flow that starts has exactly one step and one end, across both files.
  std::map<int64_t, std::multiset<std::string>> phases;
  for (const TraceFile* file : {&w0, &w1}) {
    for (const auto& ev : file->events) {
      if (auto f = ev.integer("flow")) phases[*f].insert(*ev.string("flow_phase"));
    }
  }
  EXPECT_EQ(phases.size(), 7u) << "echo, nested, add_int back, throw, scale, traced_region, gated";
  for (const auto& [f, seen] : phases) {
    EXPECT_EQ(seen, (std::multiset<std::string>{"end", "start", "step"})) << "flow " << f;
  }

  // A user region inside a handler lands in the callee's file, inside its execute span, on its thread.
  const FlatObject& region = *named(w1, "handler region").at(0);
  const FlatObject& regionCall = only(w1, "rpc.server.execute", "traced_region");
  EXPECT_EQ(region.string("cat"), "user");
  EXPECT_EQ(region.integer("tid"), regionCall.integer("tid"));
  EXPECT_GE(b(region), b(regionCall));
  EXPECT_LE(e(region), e(regionCall));
  EXPECT_TRUE(named(w0, "handler region").empty());

  // Transport bytes, per frame, with the peer's rank.
  for (const auto& [file, peer] : {std::make_pair(&w0, 1), std::make_pair(&w1, 0)}) {
    for (const char* name : {"transport.send", "transport.recv"}) {
      auto events = named(*file, name);
      EXPECT_FALSE(events.empty()) << name;
      for (const FlatObject* ev : events) {
        EXPECT_EQ(ev->string("type"), "instant");
        EXPECT_GT(*ev->integer("a0"), 0);
        EXPECT_EQ(ev->integer("a1"), peer);
      }
    }
  }

  // The agent's threads are named; the clock line names the peer and says the clocks agree.
  std::set<std::string> threadNames;
  for (const auto& line : w1.threads) threadNames.insert(*line.string("name"));
  EXPECT_TRUE(threadNames.count("dg-" + GetParam() + "-loop")) << "loop thread unnamed";
  EXPECT_TRUE(std::any_of(threadNames.begin(), threadNames.end(), [](const std::string& n) {
    return n.rfind("dg-agent-", 0) == 0;
  })) << "executor threads unnamed";
  ASSERT_FALSE(w0.clocks.empty());
  EXPECT_EQ(w0.clocks.back().string("peer"), "worker1");
  EXPECT_EQ(w0.clocks.back().integer("peer_rank"), 1);
  // One clock: the offset is 0 to within half the round trip of its sample (AgentClockTest checks 1 ms).
  EXPECT_LE(std::abs(*w0.clocks.back().integer("offset_ns")), *w0.clocks.back().integer("rtt_ns") / 2 + 1);
  ASSERT_FALSE(w1.clocks.empty());
  EXPECT_EQ(w1.clocks.back().string("peer"), "worker0");
}

// Note [Serving reader] (tcp): with one call at a time, every call after the first is read (its
// rpc.server.deserialize recorded) by the executor worker that answered the one before, not by the loop;
// with serveReadWindow 0 the loop reads them all. inproc refuses the read: its loop reads all.
TEST_P(AgentTraceTest, OneCallAtATimeIsReadByTheWorkerThatAnsweredThePreviousOne) {
  TempDir dir;
  ClusterSpec spec;
  spec.traceDir = dir.path();
  start(spec);
  for (int64_t i = 0; i < 20; ++i) EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, i, int64_t{1}), i + 1);
  agent(1).setServeReadWindow(std::chrono::microseconds(0));
  std::this_thread::sleep_for(20ms);  // the serving worker's 2 ms window passes
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(agent(0).rpcSync("worker1", kEcho, std::string("x")), "x from worker1 to worker0");
  }
  shutdownAll();
  const TraceFile w1 = readTrace(dir.path() + "/worker1.trace.jsonl");
  std::map<int64_t, std::string> threadNames;
  for (const auto& thread : w1.threads) threadNames[*thread.integer("tid")] = thread.string("name").value_or("");
  auto readByWorkers = [&](const std::string& function) {
    int onWorkers = 0, all = 0;
    for (const FlatObject* ev : named(w1, "rpc.server.deserialize")) {
      if (ev->string("detail") != function) continue;
      ++all;
      if (threadNames[*ev->integer("tid")].rfind("dg-agent", 0) == 0) ++onWorkers;
    }
    EXPECT_EQ(all, 20) << function;
    return onWorkers;
  };
  if (GetParam() == "tcp") {
    EXPECT_GE(readByWorkers("add_int"), 15) << "one call at a time: the answering worker reads the next";
  } else if (GetParam() == "inproc") {
    EXPECT_EQ(readByWorkers("add_int"), 0);
  }  // ucx: the caller's thread and the serving worker both drive the one worker of this process: either reads
  EXPECT_EQ(readByWorkers("echo"), 0) << "serveReadWindow 0: the loop reads every call";
}

// Note [Reading for the answer] (tcp): kForwardHang's handler on worker1 calls kHang on worker0 and returns
// that call's future; the test answers each hanging call 20 ms after it started, by which time worker1's
// worker is reading for it: the answer (its rpc.client.deserialize on worker1) is read by that executor
// worker, not by the loop (ucx: that worker drives the process's ucx worker, Note [Driving threads]). With
// serveReadWindow 0 the loop reads them all; inproc refuses the read.
TEST_P(AgentTraceTest, AHandlersForwardedCallIsAnsweredToTheWorkerThatRanIt) {
  TempDir dir;
  ClusterSpec spec;
  spec.traceDir = dir.path();
  start(spec);
  constexpr int kRound = 10;
  auto forwardAndAnswer = [&](int64_t k) {
    Future<int64_t> forwarded = agent(0).rpcAsync("worker1", kForwardHang, k);
    ASSERT_TRUE(eventually([&] {
      std::lock_guard<std::mutex> lock(world_.mutex);
      return world_.hanging.size() == static_cast<size_t>(k + 1);
    }));
    std::this_thread::sleep_for(20ms);
    world_.completeHanging(static_cast<size_t>(k), k * 3);
    EXPECT_EQ(forwarded.get(), k * 3);
  };
  agent(1).setServeReadWindow(std::chrono::seconds(30));
  for (int64_t k = 0; k < kRound; ++k) forwardAndAnswer(k);
  // Every agent's: with ucx, the threads of every agent of this process drive its one worker (Note
  // [Driving threads]), so worker0's serving reader could read worker1's answers too.
  for (int rank = 0; rank < 2; ++rank) agent(rank).setServeReadWindow(std::chrono::microseconds(0));
  std::this_thread::sleep_for(20ms);  // no worker reads any more: each read ended with its answer
  for (int64_t k = kRound; k < 2 * kRound; ++k) forwardAndAnswer(k);
  shutdownAll();
  const TraceFile w1 = readTrace(dir.path() + "/worker1.trace.jsonl");
  std::map<int64_t, std::string> threadNames;
  for (const auto& thread : w1.threads) threadNames[*thread.integer("tid")] = thread.string("name").value_or("");
  // Per round (in time: the file is written thread by thread), the answers read on worker1's executor workers.
  std::vector<const FlatObject*> answers;
  for (const FlatObject* ev : named(w1, "rpc.client.deserialize")) {
    if (ev->string("detail") == "hang") answers.push_back(ev);
  }
  ASSERT_EQ(answers.size(), 2u * kRound);
  std::sort(answers.begin(), answers.end(), [](const FlatObject* x, const FlatObject* y) { return b(*x) < b(*y); });
  int onWorkers[2] = {0, 0};
  for (size_t i = 0; i < answers.size(); ++i) {
    if (threadNames[*answers[i]->integer("tid")].rfind("dg-agent", 0) == 0) ++onWorkers[i / kRound];
  }
  if (GetParam() != "inproc") {
    EXPECT_GE(onWorkers[0], kRound - 2) << "the worker that ran the handler reads the answer it awaits";
  } else {
    EXPECT_EQ(onWorkers[0], 0);
  }
  EXPECT_EQ(onWorkers[1], 0) << "serveReadWindow 0: the loop reads every answer";
}

TEST_P(AgentTraceTest, WithoutATraceDirectoryNothingIsRecorded) {
  start();
  EXPECT_FALSE(trace::enabled());
  const uint64_t recorded = trace::stats().recorded;
  for (int i = 0; i < 50; ++i) EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, i, 1), i + 1);
  EXPECT_EQ(agent(1).rpcSync("worker1", kAddInt, 1, 1), 2);
  EXPECT_EQ(trace::stats().recorded, recorded);
}

INSTANTIATE_TEST_SUITE_P(Transports, AgentTraceTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

TEST(AgentTraceOptions, ATraceDirectoryThatCannotBeCreatedFailsStartNamingIt) {
  TempDir dir;
  const std::string file = dir.path() + "/not-a-directory";
  std::ofstream(file) << "x";
  Options options;
  options.transport = "inproc";
  options.traceDir = file + "/traces";
  AgentConfig config;
  config.inprocHub = std::make_shared<transport::inproc::InprocHub>();
  try {
    Agent::start(options, Registry{}, config);
    FAIL() << "expected a ValueError";
  } catch (const ValueError& error) {
    EXPECT_NE(std::string(error.what()).find(file + "/traces"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(trace::enabled());
}

}  // namespace
}  // namespace distgrad::rpc
