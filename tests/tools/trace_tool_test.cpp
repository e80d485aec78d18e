// distgrad-trace on hand-written trace directories (its library, tools/trace/, and the real binary):
// - clock alignment: two workers with a known offset line up (whichever side wrote the clock line, the last
//   line per peer winning), a worker reaches the reference through a chain, one with no offset is kept with
//   a warning;
// - merge: the document parses back, every flow has a start and an end with the same id, every async "b"
//   has its "e", spans are "X" events with named args, processes and threads are named;
// - malformed input: errors name the file and line, a bad file is skipped, no valid file is an error (exit
//   status 1), a cut-off last line of a process that died is tolerated;
// - report: each worker's fractions sum to 100% and have the exact values of a constructed 2-stage,
//   2-micro-batch RPC pipeline, whose bubble / overhead shares and verdict are known;
// - plot: the layout has one box per op of the step, the SVG holds that many boxes of each colour family,
//   the PNG has the PNG signature and the layout's size.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tests/tools/json_value.h"
#include "tools/trace/merge.h"
#include "tools/trace/plot.h"
#include "tools/trace/report.h"
#include "tools/trace/trace_data.h"

#ifndef DG_DISTGRAD_TRACE_PATH
#error "DG_DISTGRAD_TRACE_PATH must name the distgrad-trace binary"
#endif

namespace distgrad::tools::trace {
namespace {

namespace fs = std::filesystem;
using testing::JsonValue;
using testing::parseJson;

constexpr int64_t kMs = 1'000'000;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dg-trace-tool-XXXXXX").string();
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Writes one worker's trace file line by line, in the recorder's format (docs/tracing.md). Times are given
// in ms on the *reference* clock and written on the worker's own clock (reference time + `skewNs` + base).
class FileWriter {
 public:
  FileWriter(std::string worker, int rank, int64_t skewNs) : worker_(std::move(worker)), rank_(rank), skew_(skewNs) {
    lines_.push_back("{\"distgrad_trace\":1,\"worker\":\"" + worker_ + "\",\"rank\":" + std::to_string(rank_) +
                     ",\"pid\":" + std::to_string(1000 + rank_) +
                     ",\"clock\":\"steady_ns\",\"start_ns\":" + std::to_string(ns(0)) + "}");
  }
  int64_t ns(double ms) const { return kBase + skew_ + static_cast<int64_t>(std::llround(ms * kMs)); }
  // t_peer = t_this + offset.
  FileWriter& clock(const std::string& peer, int peerRank, int64_t offsetNs, int64_t rttNs = 40'000) {
    lines_.push_back("{\"type\":\"clock\",\"peer\":\"" + peer + "\",\"peer_rank\":" + std::to_string(peerRank) +
                     ",\"offset_ns\":" + std::to_string(offsetNs) + ",\"rtt_ns\":" + std::to_string(rttNs) +
                     ",\"samples\":4}");
    return *this;
  }
  FileWriter& thread(int64_t tid, const std::string& name) {
    lines_.push_back("{\"type\":\"thread\",\"tid\":" + std::to_string(tid) + ",\"name\":\"" + name + "\"}");
    return *this;
  }
  FileWriter& event(const std::string& type, const std::string& name, const std::string& cat, int64_t tid, double b,
                    double e, std::vector<int64_t> args = {}, uint64_t flow = 0, const std::string& phase = "",
                    const std::string& detail = "") {
    std::string line = "{\"type\":\"" + type + "\",\"name\":\"" + name + "\",\"cat\":\"" + cat +
                       "\",\"tid\":" + std::to_string(tid) + ",\"b\":" + std::to_string(ns(b)) +
                       ",\"e\":" + std::to_string(ns(e));
    if (flow != 0) line += ",\"flow\":" + std::to_string(flow) + ",\"flow_phase\":\"" + phase + "\"";
    for (size_t i = 0; i < args.size(); ++i) line += ",\"a" + std::to_string(i) + "\":" + std::to_string(args[i]);
    if (!detail.empty()) line += ",\"detail\":\"" + detail + "\"";
    lines_.push_back(line + "}");
    ++events_;
    return *this;
  }
  FileWriter& span(const std::string& name, const std::string& cat, int64_t tid, double b, double e,
                   std::vector<int64_t> args = {}, const std::string& detail = "") {
    return event("span", name, cat, tid, b, e, std::move(args), 0, "", detail);
  }
  FileWriter& raw(const std::string& line) {
    lines_.push_back(line);
    return *this;
  }
  // Writes DIR/<worker>.trace.jsonl, with the end line unless `closed` is false.
  std::string write(const std::string& dir, bool closed = true) {
    std::string path = dir + "/" + worker_ + ".trace.jsonl";
    std::ofstream out(path);
    for (const auto& l : lines_) out << l << "\n";
    if (closed) out << "{\"type\":\"end\",\"end_ns\":" << ns(1000) << ",\"events\":" << events_ << "}\n";
    return path;
  }

 private:
  static constexpr int64_t kBase = 7'000'000'000;
  std::string worker_;
  int rank_;
  int64_t skew_;
  std::vector<std::string> lines_;
  int64_t events_ = 0;
};

uint64_t flowId(int rank, uint64_t call) { return (static_cast<uint64_t>(rank + 1) << 48) | call; }

// The constructed pipeline (times in ms on worker0's clock; worker1's clock reads 1 s later):
// a GPipe step of 2 stages and 2 micro-batches driven by worker0 (stage 0 on its thread 101, the driver on
// thread 100) with stage 1 on worker1:
//   stage 0: F0 [1,3] F1 [3,5]            B0 [12,14] B1 [15,17] opt [17.5,18.5]
//   stage 1: F0 [4,6] F1 [6,8] B0 [8,11] B1 [11,14]            opt [15,16]
//   step [0, 20].
// idealMakespan with these compute times: stage 0 F 0-2, 2-4; stage 1 F 2-4, 4-6, B 6-9, 9-12; stage 0 B
// 9-11, 12-14 -> 14 ms, plus the longest optimizer (1 ms): ideal 15 ms. compute: stage 0 9 ms, stage 1
// 11 ms; bubble = ideal - compute: 6 and 4 ms; overhead = 20 - 15 = 5 ms (25%).
// One RPC from the driver to worker1 (call 1): serialize [3.2,3.4], send [3.4,3.5] (flow start), wait
// [3.45,8.5] ended on the loop thread 102, deserialize [8.5,8.6] (flow end); on worker1: queue [3.7,3.9],
// execute [3.9,8.2] (flow step) around its forwards.
void writePipeline(const std::string& dir, bool worker1Closed = true) {
  FileWriter w0("worker0", 0, 0);
  w0.clock("worker1", 1, 1000 * kMs).thread(100, "main").thread(101, "stage0").thread(102, "dg-tcp-loop");
  w0.span("pipeline.step", "pipeline", 100, 0, 20, {0, 2, 2}, "gpipe");
  w0.span("pipeline.forward", "pipeline", 101, 1, 3, {0, 0, 0}, "rpc");
  w0.span("pipeline.forward", "pipeline", 101, 3, 5, {0, 1, 0}, "rpc");
  w0.span("pipeline.backward", "pipeline", 101, 12, 14, {0, 0, 0}, "rpc");
  w0.span("pipeline.backward", "pipeline", 101, 15, 17, {0, 1, 0}, "rpc");
  w0.span("pipeline.optimizer", "pipeline", 101, 17.5, 18.5, {0, 0, 0});
  w0.span("rpc.client.serialize", "rpc_client", 100, 3.2, 3.4, {100, 1, 1}, "stage_forward");
  w0.event("span", "rpc.client.send", "rpc_client", 100, 3.4, 3.5, {100, 1, 1}, flowId(0, 1), "start");
  w0.event("instant", "transport.send", "transport", 102, 3.5, 3.5, {140, 1});
  w0.event("async", "rpc.client.wait", "rpc_client", 102, 3.45, 8.5, {1, 1, 0});
  w0.event("instant", "transport.recv", "transport", 102, 8.45, 8.45, {90, 1});
  w0.event("span", "rpc.client.deserialize", "rpc_client", 102, 8.5, 8.6, {50, 1, 1}, flowId(0, 1), "end");
  w0.write(dir);
  FileWriter w1("worker1", 1, 1000 * kMs);
  w1.thread(200, "dg-agent-0");
  w1.event("async", "rpc.server.queue", "rpc_server", 200, 3.7, 3.9, {0, 1});
  w1.event("span", "rpc.server.execute", "rpc_server", 200, 3.9, 8.2, {0, 1}, flowId(0, 1), "step", "stage_forward");
  w1.span("pipeline.forward", "pipeline", 200, 4, 6, {1, 0, 0}, "rpc");
  w1.span("pipeline.forward", "pipeline", 200, 6, 8, {1, 1, 0}, "rpc");
  w1.span("pipeline.backward", "pipeline", 200, 8, 11, {1, 0, 0}, "rpc");
  w1.span("pipeline.backward", "pipeline", 200, 11, 14, {1, 1, 0}, "rpc");
  w1.span("pipeline.optimizer", "pipeline", 200, 15, 16, {1, 0, 0});
  w1.write(dir, worker1Closed);
}

bool contains(const std::vector<std::string>& warnings, const std::string& text) {
  return std::any_of(warnings.begin(), warnings.end(),
                     [&](const std::string& w) { return w.find(text) != std::string::npos; });
}

struct ToolRun {
  int status = -1;
  std::string out;  // stdout and stderr
};
ToolRun runTool(const std::string& args) {
  ToolRun run;
  const std::string command = std::string(DG_DISTGRAD_TRACE_PATH) + " " + args + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  if (pipe == nullptr) return run;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) run.out.append(buf, n);
  const int status = ::pclose(pipe);
  run.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- clock alignment ----

TEST(TraceClocks, TwoWorkersWithAKnownOffsetLineUpWhicheverSideWroteTheClockLine) {
  for (bool onReference : {true, false}) {
    TempDir dir;
    FileWriter w0("worker0", 0, 0), w1("worker1", 1, 250 * kMs);  // worker1's clock reads 250 ms later
    if (onReference) {
      w0.clock("worker1", 1, 999);  // superseded: the last line per peer wins
      w0.clock("worker1", 1, 250 * kMs);
    } else {
      w1.clock("worker0", 0, -250 * kMs);
    }
    w0.span("a", "user", 1, 10, 12);
    w1.span("b", "user", 2, 10, 12);
    w0.write(dir.path());
    w1.write(dir.path());
    TraceSet set = loadTraceDir(dir.path());
    ASSERT_EQ(set.workers.size(), 2u);
    EXPECT_TRUE(set.workers[1].aligned);
    EXPECT_EQ(set.workers[1].offsetToReferenceNs, -250 * kMs);
    EXPECT_EQ(set.workers[0].events[0].b, set.workers[1].events[0].b) << "clock line on worker0: " << onReference;
    EXPECT_EQ(set.workers[0].events[0].e, set.workers[1].events[0].e);
    EXPECT_EQ(set.originNs, set.workers[0].events[0].b);
    EXPECT_TRUE(set.warnings.empty()) << set.warnings.front();
  }
}

TEST(TraceClocks, AWorkerWithoutADirectOffsetReachesTheReferenceThroughAChainAndOneWithNoneIsKeptWithAWarning) {
  TempDir dir;
  // worker2 knows only worker1, which knows worker0 only through worker0's own line; worker3 knows nobody.
  FileWriter w0("worker0", 0, 0), w1("worker1", 1, 40 * kMs), w2("worker2", 2, -13 * kMs), w3("worker3", 3, 5000 * kMs);
  w0.clock("worker1", 1, 40 * kMs);
  w2.clock("worker1", 1, 53 * kMs);  // t1 = t2 + 53 ms
  // A direct but much worse estimate from worker2 to worker0 (a large round trip) loses to the chain.
  w2.clock("worker0", 0, 99 * kMs, 50 * kMs);
  for (auto* w : {&w0, &w1, &w2, &w3}) w->span("x", "user", 1, 3, 4);
  for (auto* w : {&w0, &w1, &w2, &w3}) w->write(dir.path());
  TraceSet set = loadTraceDir(dir.path());
  ASSERT_EQ(set.workers.size(), 4u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(set.workers[i].aligned) << i;
    EXPECT_EQ(set.workers[i].events[0].b, set.workers[0].events[0].b) << set.workers[i].worker;
  }
  EXPECT_EQ(set.workers[2].offsetToReferenceNs, 13 * kMs);
  EXPECT_FALSE(set.workers[3].aligned);
  // Aligned by its start time: its header's start_ns is 0 ms on its own clock, like the reference's.
  EXPECT_EQ(set.workers[3].events[0].b, set.workers[0].events[0].b);
  EXPECT_TRUE(contains(set.warnings, "worker \"worker3\"")) << ::testing::PrintToString(set.warnings);
}

// ---- malformed input ----

TEST(TraceLoad, MalformedLinesAreErrorsNamingFileAndLine) {
  TempDir dir;
  struct Case {
    std::string line, expect;
  };
  const std::vector<Case> cases = {
      {"{\"type\":\"span\",\"name\":\"x\",\"cat\":\"user\",\"tid\":1,\"b\":5,\"e\":4}", "ends (e=4) before it begins"},
      {"{\"type\":\"span\",\"name\":\"x\",\"cat\":\"user\",\"tid\":1,\"b\":5}", "missing or non-integer field \"e\""},
      {"{\"type\":\"span\",\"name\":\"x\",\"cat\":\"user\",\"tid\":1,\"b\":5,\"e\":6,\"flow\":3,\"flow_phase\":\"up\"}",
       "flow_phase must be"},
      {"{\"type\":\"span\",\"name\":\"x\",\"cat\":\"user\",\"tid\":1,\"b\":5,\"e\":6,\"flow\":0,\"flow_phase\":"
       "\"start\"}",
       "flow id 0"},
      {"{\"type\":\"instant\",\"name\":\"x\",\"cat\":\"user\",\"tid\":1,\"b\":5,\"e\":6}", "b == e"},
      {"{\"type\":\"span\",\"name\":\"x\",\"args\":[1]}", "not a flat JSON object"},
      {"not json at all", "not a flat JSON object"},
      {"{\"type\":\"clock\",\"peer\":\"worker1\",\"offset_ns\":1}", "rtt_ns"},
  };
  for (const auto& c : cases) {
    FileWriter w("worker0", 0, 0);
    w.thread(1, "t").raw(c.line);
    const std::string path = w.write(dir.path());
    try {
      loadTraceFile(path, nullptr);
      ADD_FAILURE() << "accepted: " << c.line;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(path + ":3: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << e.what();
    }
  }
  // A first line that is not a header.
  {
    std::ofstream(dir.file("worker0.trace.jsonl")) << "{\"type\":\"end\",\"end_ns\":1,\"events\":0}\n";
    EXPECT_THROW(
        {
          try {
            loadTraceFile(dir.file("worker0.trace.jsonl"), nullptr);
          } catch (const ValueError& e) {
            EXPECT_NE(std::string(e.what()).find(":1: the first line is not a distgrad trace header"),
                      std::string::npos)
                << e.what();
            throw;
          }
        },
        ValueError);
  }
  // An end line whose count disagrees with the file.
  {
    FileWriter w("worker0", 0, 0);
    w.span("x", "user", 1, 1, 2).raw("{\"type\":\"end\",\"end_ns\":1,\"events\":5}");
    const std::string path = w.write(dir.path(), false);
    EXPECT_THROW(loadTraceFile(path, nullptr), ValueError);
  }
}

TEST(TraceLoad, ABadFileIsSkippedWithItsLineAndNoValidFileIsAnError) {
  TempDir dir;
  FileWriter good("worker0", 0, 0);
  good.span("x", "user", 1, 1, 2);
  good.write(dir.path());
  FileWriter bad("worker1", 1, 0);
  bad.span("x", "user", 1, 1, 2).raw("{\"type\":\"span\",");
  const std::string badPath = bad.write(dir.path());
  TraceSet set = loadTraceDir(dir.path());
  ASSERT_EQ(set.workers.size(), 1u);
  EXPECT_EQ(set.workers[0].worker, "worker0");
  EXPECT_TRUE(contains(set.warnings, badPath + ":3:")) << ::testing::PrintToString(set.warnings);

  fs::remove(dir.file("worker0.trace.jsonl"));
  try {
    loadTraceDir(dir.path());
    ADD_FAILURE() << "a directory of bad files was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("no valid trace file"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(badPath + ":3:"), std::string::npos) << e.what();
  }
  // The binary: exit status 1 and the same message, for every command.
  std::vector<std::string> commands = {"merge " + dir.path() + " -o " + dir.file("out.json"), "report " + dir.path()};
  if (plotSupported()) commands.push_back("plot " + dir.path() + " -o " + dir.file("p.svg"));
  for (const std::string& command : commands) {
    ToolRun run = runTool(command);
    EXPECT_EQ(run.status, 1) << command << ": " << run.out;
    EXPECT_NE(run.out.find(badPath + ":3:"), std::string::npos) << run.out;
  }
  TempDir empty;
  EXPECT_THROW(loadTraceDir(empty.path()), ValueError);
  EXPECT_THROW(loadTraceDir(empty.file("missing")), ValueError);
  ToolRun run = runTool("report " + empty.path());
  EXPECT_EQ(run.status, 1) << run.out;
  EXPECT_NE(run.out.find("no *.trace.jsonl files"), std::string::npos) << run.out;
  // Usage errors: status 2.
  EXPECT_EQ(runTool("").status, 2);
  EXPECT_EQ(runTool("frobnicate " + dir.path()).status, 2);
  EXPECT_EQ(runTool("merge " + dir.path()).status, 2);  // no -o
  EXPECT_EQ(runTool("report " + dir.path() + " --bogus").status, 2);
  EXPECT_EQ(runTool("plot " + dir.path() + " -o x.svg --step nine").status, 2);
}

TEST(TraceLoad, AFileWithoutItsEndLineIsMergedWithAWarningAndACutOffLastLineIsDropped) {
  TempDir dir;
  writePipeline(dir.path(), /*worker1Closed=*/false);
  {
    std::ofstream out(dir.file("worker1.trace.jsonl"), std::ios::app);
    out << "{\"type\":\"span\",\"name\":\"pipeline.forw";  // the process died mid-line
  }
  TraceSet set = loadTraceDir(dir.path());
  ASSERT_EQ(set.workers.size(), 2u);
  EXPECT_FALSE(set.workers[1].closed);
  EXPECT_EQ(set.workers[1].events.size(), 7u);
  EXPECT_TRUE(contains(set.warnings, "worker1.trace.jsonl: no end line")) << ::testing::PrintToString(set.warnings);
  EXPECT_TRUE(contains(set.warnings, "worker1.trace.jsonl:10: cut-off last line ignored"))
      << ::testing::PrintToString(set.warnings);
  ToolRun run = runTool("merge " + dir.path() + " -o " + dir.file("m.json"));
  EXPECT_EQ(run.status, 0) << run.out;
  EXPECT_NE(run.out.find("warning:"), std::string::npos) << run.out;
  EXPECT_NO_THROW(parseJson(readFile(dir.file("m.json"))));
}

// ---- merge ----

// Checks the structure every merged trace must have; returns the trace events.
std::vector<JsonValue> checkMerged(const std::string& text) {
  JsonValue doc = parseJson(text);
  EXPECT_EQ(doc.type, JsonValue::Type::kObject);
  const auto& events = doc["traceEvents"].array;
  std::map<std::string, std::vector<std::string>> flowPhases;  // id -> phases in order of appearance
  std::map<std::string, int> asyncOpen;                        // cat/name/id -> b minus e
  for (const auto& ev : events) {
    const std::string ph = ev.str("ph");
    EXPECT_TRUE(ph == "M" || ph == "X" || ph == "i" || ph == "b" || ph == "e" || ph == "s" || ph == "t" || ph == "f")
        << ph;
    if (ph != "M") {
      EXPECT_GE(ev.num("ts"), 0.0);
    }
    if (ph == "X") {
      EXPECT_GE(ev.num("dur"), 0.0);
    }
    if (ph == "s" || ph == "t" || ph == "f") flowPhases[ev.str("id")].push_back(ph);
    if (ph == "b") ++asyncOpen[ev.str("cat") + "/" + ev.str("name") + "/" + ev.str("id")];
    if (ph == "e") --asyncOpen[ev.str("cat") + "/" + ev.str("name") + "/" + ev.str("id")];
  }
  for (const auto& [id, phases] : flowPhases) {
    EXPECT_EQ(phases.front(), "s") << id;
    EXPECT_EQ(phases.back(), "f") << id;
    EXPECT_EQ(std::count(phases.begin(), phases.end(), "s"), 1) << id;
    EXPECT_EQ(std::count(phases.begin(), phases.end(), "f"), 1) << id;
  }
  for (const auto& [key, open] : asyncOpen) EXPECT_EQ(open, 0) << key;
  return events;
}

TEST(TraceMerge, OneDocumentWithNamedTracksMatchedAsyncPairsAndEachCallsFlowFromCallToExecutionToReply) {
  TempDir dir;
  writePipeline(dir.path());
  TraceSet set = loadTraceDir(dir.path());
  std::ostringstream out;
  MergeStats stats = writeChromeTrace(set, out);
  EXPECT_EQ(stats.flows, 1u);
  EXPECT_EQ(stats.flowsDropped, 0u);
  const auto events = checkMerged(out.str());
  std::map<std::string, const JsonValue*> flow;  // ph -> event
  std::set<std::string> processes, threads;
  int spans = 0, asyncBegins = 0, instants = 0;
  const JsonValue* execute = nullptr;
  for (const auto& ev : events) {
    const std::string ph = ev.str("ph");
    if (ph == "M" && ev.str("name") == "process_name") processes.insert(ev["args"].str("name"));
    if (ph == "M" && ev.str("name") == "thread_name") threads.insert(ev["args"].str("name"));
    if (ph == "X") ++spans;
    if (ph == "b") ++asyncBegins;
    if (ph == "i") ++instants;
    if (ph == "s" || ph == "t" || ph == "f") flow[ph] = &ev;
    if (ph == "X" && ev.str("name") == "rpc.server.execute") execute = &ev;
  }
  EXPECT_EQ(processes, (std::set<std::string>{"worker0 (rank 0)", "worker1 (rank 1)"}));
  EXPECT_EQ(threads, (std::set<std::string>{"main", "stage0", "dg-tcp-loop", "dg-agent-0"}));
  EXPECT_EQ(spans, 15);
  EXPECT_EQ(asyncBegins, 2);
  EXPECT_EQ(instants, 2);
  ASSERT_EQ(flow.size(), 3u);
  // Call (worker0's send, thread 100) -> execution (worker1, thread 200) -> reply (worker0, thread 102),
  // each inside its span on the reference clock: worker1's 1 s skew is gone.
  EXPECT_EQ(flow["s"]->num("pid"), 0);
  EXPECT_EQ(flow["s"]->num("tid"), 100);
  EXPECT_NEAR(flow["s"]->num("ts"), 3450.0, 1e-6);
  EXPECT_EQ(flow["t"]->num("pid"), 1);
  EXPECT_EQ(flow["t"]->num("tid"), 200);
  EXPECT_NEAR(flow["t"]->num("ts"), 6050.0, 1e-6);
  EXPECT_EQ(flow["f"]->num("tid"), 102);
  EXPECT_EQ(flow["f"]->str("bp"), "e");
  EXPECT_EQ(flow["s"]->str("id"), flow["f"]->str("id"));
  ASSERT_NE(execute, nullptr);
  EXPECT_NEAR(execute->num("ts"), 3900.0, 1e-6);
  EXPECT_NEAR(execute->num("dur"), 4300.0, 1e-6);
  EXPECT_EQ((*execute)["args"].num("peer"), 0);
  EXPECT_EQ((*execute)["args"].num("call"), 1);
  EXPECT_EQ((*execute)["args"].str("detail"), "stage_forward");
  for (const auto& ev : events) {
    if (ev.str("ph") == "X" && ev.str("name") == "pipeline.forward" && ev.num("pid") == 1 &&
        ev["args"].num("micro_batch") == 1) {
      EXPECT_NEAR(ev.num("ts"), 6000.0, 1e-6);
      EXPECT_EQ(ev["args"].num("stage"), 1);
      EXPECT_EQ(ev["args"].num("step"), 0);
    }
  }
  // The binary writes the same document.
  ToolRun run = runTool("merge " + dir.path() + " -o " + dir.file("merged.json"));
  ASSERT_EQ(run.status, 0) << run.out;
  EXPECT_EQ(readFile(dir.file("merged.json")), out.str());
}

TEST(TraceMerge, AFlowWithOneEndIsDroppedAndACallThatTimedOutIsDrawnToItsExecution) {
  TempDir dir;
  FileWriter w0("worker0", 0, 0), w1("worker1", 1, 0);
  w0.clock("worker1", 1, 0);
  w0.event("span", "rpc.client.send", "rpc_client", 1, 1, 2, {10, 1, 7}, flowId(0, 7), "start");  // timed out
  w0.event("span", "rpc.client.send", "rpc_client", 1, 3, 4, {10, 1, 8}, flowId(0, 8), "start");  // refused
  w1.event("span", "rpc.server.execute", "rpc_server", 2, 2, 3, {0, 7}, flowId(0, 7), "step");
  w1.event("span", "rpc.server.execute", "rpc_server", 2, 5, 6, {0, 9}, flowId(0, 9), "step");  // caller's file lost
  w0.write(dir.path());
  w1.write(dir.path());
  std::ostringstream out;
  MergeStats stats = writeChromeTrace(loadTraceDir(dir.path()), out);
  EXPECT_EQ(stats.flows, 1u);
  EXPECT_EQ(stats.flowsDropped, 2u);
  int flowEvents = 0;
  for (const auto& ev : checkMerged(out.str())) {
    const std::string ph = ev.str("ph");
    flowEvents += ph == "s" || ph == "t" || ph == "f";
  }
  EXPECT_EQ(flowEvents, 2);
}

// ---- report ----

TEST(TraceReport, FractionsSumTo100PercentWithExactValuesAndThePipelineVerdictOfAConstructedStep) {
  TempDir dir;
  writePipeline(dir.path());
  TraceSet set = loadTraceDir(dir.path());
  Report report = analyze(set);
  ASSERT_EQ(report.workers.size(), 2u);
  for (const auto& w : report.workers) {
    double sum = 0;
    int64_t ns = 0;
    for (int a = 0; a < kActivityCount; ++a) {
      sum += w.fraction(static_cast<Activity>(a));
      ns += w.ns[static_cast<size_t>(a)];
    }
    EXPECT_NEAR(sum, 1.0, 0.005) << w.worker;
    EXPECT_EQ(ns, w.wallNs()) << w.worker;
  }
  auto ms = [](const WorkerBreakdown& w, Activity a) {
    return static_cast<double>(w.ns[static_cast<size_t>(a)]) / 1e6;
  };
  // worker0 over [0, 20]: compute = stage 0's spans (9 ms); the call is in flight on the driver from the
  // end of its send (3.5) to the reply (8.5), of which 3.5-5 is under stage 0's compute: 3.5 ms; the
  // serialize (3.2-3.4) hides under compute, the reply's deserialize (8.5-8.6) does not: 0.1 ms; send
  // (3.4-3.5) hides under compute too. Idle: the rest, 7.4 ms.
  const auto& w0 = report.workers[0];
  EXPECT_EQ(w0.wallNs(), 20 * kMs);
  EXPECT_NEAR(ms(w0, Activity::kCompute), 9.0, 1e-9);
  EXPECT_NEAR(ms(w0, Activity::kInFlight), 3.5, 1e-9);
  EXPECT_NEAR(ms(w0, Activity::kSerialization), 0.1, 1e-9);
  EXPECT_NEAR(ms(w0, Activity::kTransport), 0.0, 1e-9);
  EXPECT_NEAR(ms(w0, Activity::kIdle), 7.4, 1e-9);
  EXPECT_EQ(w0.callsMade, 1);
  EXPECT_EQ(w0.framesSent, 1);
  EXPECT_EQ(w0.bytesSent, 140);
  EXPECT_EQ(w0.bytesReceived, 90);
  // worker1 over [3.7, 16]: queueing 3.7-3.9, compute = execute 3.9-8.2 and the spans to 14, optimizer
  // 15-16: 11.1 ms; idle 14-15.
  const auto& w1 = report.workers[1];
  EXPECT_EQ(w1.wallNs(), 12'300'000);
  EXPECT_NEAR(ms(w1, Activity::kQueueing), 0.2, 1e-9);
  EXPECT_NEAR(ms(w1, Activity::kCompute), 11.1, 1e-9);
  EXPECT_NEAR(ms(w1, Activity::kIdle), 1.0, 1e-9);
  EXPECT_EQ(w1.callsServed, 1);

  const auto& p = report.pipeline;
  ASSERT_TRUE(p.present);
  EXPECT_TRUE(p.rpc);
  EXPECT_EQ(p.schedule, "gpipe");
  EXPECT_EQ(p.stages, 2);
  EXPECT_EQ(p.microBatches, 2);
  ASSERT_EQ(p.steps.size(), 1u);
  EXPECT_NEAR(p.steps[0].wallMs, 20.0, 1e-9);
  EXPECT_NEAR(p.steps[0].idealMs, 15.0, 1e-9);
  ASSERT_EQ(p.stageSummaries.size(), 2u);
  const double expected[2][3] = {{0.45, 0.30, 0.25}, {0.55, 0.20, 0.25}};
  for (int s = 0; s < 2; ++s) {
    const auto& st = p.stageSummaries[static_cast<size_t>(s)];
    EXPECT_EQ(st.worker, s == 0 ? "worker0" : "worker1");
    EXPECT_NEAR(st.computeShare, expected[s][0], 1e-9) << s;
    EXPECT_NEAR(st.bubbleShare, expected[s][1], 1e-9) << s;
    EXPECT_NEAR(st.overheadShare, expected[s][2], 1e-9) << s;
    EXPECT_NEAR(st.computeShare + st.bubbleShare + st.overheadShare, 1.0, 1e-9);
  }
  EXPECT_NEAR(p.overheadPercent, 25.0, 1e-9);
  EXPECT_NEAR(p.gainMs, 5.0, 1e-9);
  EXPECT_NEAR(p.gainPercent, 25.0, 1e-9);
  EXPECT_EQ(p.verdict, "RPC overhead is 25.0% of the step; local pipelining would gain 5.00 ms per step (25.0%)");

  const std::string text = formatText(report, set);
  EXPECT_NE(
      text.find("VERDICT: RPC overhead is 25.0% of the step; local pipelining would gain 5.00 ms per step (25.0%)"),
      std::string::npos)
      << text;
  // The binary, text and JSON.
  ToolRun run = runTool("report " + dir.path());
  EXPECT_EQ(run.status, 0);
  EXPECT_EQ(run.out, text);
  run = runTool("report " + dir.path() + " --json");
  ASSERT_EQ(run.status, 0) << run.out;
  std::istringstream lines(run.out);
  std::string line;
  std::map<std::string, int> types;
  while (std::getline(lines, line)) {
    JsonValue v = parseJson(line);
    ++types[v.str("type")];
    if (v.str("type") == "worker") {
      double sum = 0;
      for (const char* a : {"compute", "serialization", "transport", "queueing", "rref_wait", "in_flight", "idle"}) {
        sum += v.num(a);
      }
      EXPECT_NEAR(sum, 1.0, 0.005) << line;
    }
    if (v.str("type") == "pipeline") {
      EXPECT_EQ(v.num("gain_ms"), 5.0);
      EXPECT_EQ(v.num("overhead_percent"), 25.0);
      EXPECT_EQ(v.str("verdict"), p.verdict);
    }
    if (v.str("type") == "stage" && v.num("stage") == 1) {
      EXPECT_NEAR(v.num("bubble"), 0.2, 1e-6);
    }
  }
  EXPECT_EQ(types, (std::map<std::string, int>{{"worker", 2}, {"stage", 2}, {"step", 1}, {"pipeline", 1}}));
}

TEST(TraceReport, ALocalPipelineInOneFileAndOverlappingSpansOfSeveralThreads) {
  TempDir dir;
  // A local 1F1B pipeline of 2 stages, 1 micro-batch, on threads 11 and 12 of one worker, driven by 10;
  // the ideal is F0 (1) + F1 (1) + B1 (2) + B0 (2) = 6 ms; the step takes 8 ms.
  FileWriter w("worker0", 0, 0);
  w.span("pipeline.step", "pipeline", 10, 0, 8, {3, 1, 2}, "1f1b");
  w.span("pipeline.forward", "pipeline", 11, 0.5, 1.5, {0, 0, 3}, "local");
  w.span("pipeline.forward", "pipeline", 12, 2, 3, {1, 0, 3}, "local");
  w.span("pipeline.backward", "pipeline", 12, 3.5, 5.5, {1, 0, 3}, "local");
  w.span("pipeline.backward", "pipeline", 11, 5.5, 7.5, {0, 0, 3}, "local");
  // A user region overlapping a forward on another thread: counted once.
  w.span("load batch", "user", 10, 0.25, 1.0);
  w.write(dir.path());
  TraceSet set = loadTraceDir(dir.path());
  Report report = analyze(set);
  const auto& p = report.pipeline;
  ASSERT_TRUE(p.present);
  EXPECT_FALSE(p.rpc);
  EXPECT_EQ(p.schedule, "1f1b");
  EXPECT_NEAR(p.meanIdealMs, 6.0, 1e-9);
  EXPECT_NEAR(p.gainMs, 2.0, 1e-9);
  EXPECT_NE(p.verdict.find("Pipeline overhead (a local pipeline"), std::string::npos) << p.verdict;
  const auto& w0 = report.workers[0];
  EXPECT_EQ(w0.wallNs(), 8 * kMs);
  // compute: 0.25-1.5, 2-3, 3.5-7.5 = 1.25 + 1 + 4 = 6.25; the rest idle.
  EXPECT_EQ(w0.ns[static_cast<size_t>(Activity::kCompute)], 6'250'000);
  EXPECT_EQ(w0.ns[static_cast<size_t>(Activity::kIdle)], 1'750'000);
}

// ---- plot ----

// The fill colours of an SVG cairo wrote, as "fill:rgb(R%,G%,B%)" (percentages, possibly fractional).
std::vector<std::array<double, 3>> svgFills(const std::string& svg) {
  std::vector<std::array<double, 3>> fills;
  static const std::regex kFill(R"(fill:rgb\(([0-9.]+)%,([0-9.]+)%,([0-9.]+)%\))");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), kFill); it != std::sregex_iterator(); ++it) {
    fills.push_back({std::stod((*it)[1]) / 100, std::stod((*it)[2]) / 100, std::stod((*it)[3]) / 100});
  }
  return fills;
}

int countColour(const std::vector<std::array<double, 3>>& fills, const std::array<double, 3>& colour) {
  return static_cast<int>(std::count_if(fills.begin(), fills.end(), [&](const auto& f) {
    return std::abs(f[0] - colour[0]) < 0.006 && std::abs(f[1] - colour[1]) < 0.006 &&
           std::abs(f[2] - colour[2]) < 0.006;
  }));
}

TEST(TracePlot, ThePipelineStepAsBoxesPerStageInSvgAndPng) {
  TempDir dir;
  writePipeline(dir.path());
  TraceSet set = loadTraceDir(dir.path());
  PlotLayout layout = layoutPlot(set, PlotOptions{});
  EXPECT_TRUE(layout.pipeline);
  EXPECT_EQ(layout.rows, (std::vector<std::string>{"stage 0 (worker0)", "stage 1 (worker1)"}));
  ASSERT_EQ(layout.boxes.size(), 10u);
  EXPECT_NEAR(layout.spanMs, 20.0, 1e-9);
  ASSERT_EQ(layout.markers.size(), 1u);
  EXPECT_EQ(layout.markers[0].first, 0.0);
  EXPECT_EQ(layout.markers[0].second, "step 0");
  int forward = 0, backward = 0, optimizer = 0;
  for (const auto& box : layout.boxes) {
    forward += box.kind == BoxKind::kForward;
    backward += box.kind == BoxKind::kBackward;
    optimizer += box.kind == BoxKind::kOptimizer;
    if (box.kind == BoxKind::kBackward && box.row == 1 && box.microBatch == 1) {
      EXPECT_NEAR(box.beginMs, 11.0, 1e-9);
      EXPECT_NEAR(box.endMs, 14.0, 1e-9);
      EXPECT_EQ(box.label, "1");
    }
  }
  EXPECT_EQ(forward, 4);
  EXPECT_EQ(backward, 4);
  EXPECT_EQ(optimizer, 2);
  PlotOptions missingStep;
  missingStep.step = 5;
  EXPECT_THROW(layoutPlot(set, missingStep), ValueError);

  if (!plotSupported()) GTEST_SKIP() << "built without cairo: rendering is not available";
  ToolRun run = runTool("plot " + dir.path() + " -o " + dir.file("t.svg") + " --step 0");
  ASSERT_EQ(run.status, 0) << run.out;
  const auto fills = svgFills(readFile(dir.file("t.svg")));
  // Every box plus one legend swatch per family (micro-batch 0's colour).
  EXPECT_EQ(
      countColour(fills, boxColour(BoxKind::kForward, 0, "")) + countColour(fills, boxColour(BoxKind::kForward, 1, "")),
      forward + 1);
  EXPECT_EQ(countColour(fills, boxColour(BoxKind::kBackward, 0, "")) +
                countColour(fills, boxColour(BoxKind::kBackward, 1, "")),
            backward + 1);
  EXPECT_EQ(countColour(fills, boxColour(BoxKind::kOptimizer, -1, "")), optimizer + 1);

  run = runTool("plot " + dir.path() + " -o " + dir.file("t.png") + " --width 1000");
  ASSERT_EQ(run.status, 0) << run.out;
  const std::string png = readFile(dir.file("t.png"));
  ASSERT_GT(png.size(), 33u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  auto be32 = [&](size_t at) {
    return (static_cast<uint32_t>(static_cast<uint8_t>(png[at])) << 24) |
           (static_cast<uint32_t>(static_cast<uint8_t>(png[at + 1])) << 16) |
           (static_cast<uint32_t>(static_cast<uint8_t>(png[at + 2])) << 8) | static_cast<uint8_t>(png[at + 3]);
  };
  EXPECT_EQ(be32(16), 1000u);
  EXPECT_GT(be32(20), 100u);
  EXPECT_LT(be32(20), 400u);

  EXPECT_EQ(runTool("plot " + dir.path() + " -o " + dir.file("t.gif")).status, 1);
  EXPECT_EQ(runTool("plot " + dir.path() + " -o " + dir.file("t.svg") + " --step 3").status, 1);
  EXPECT_EQ(runTool("plot " + dir.path() + " -o " + dir.file("no/such/dir/t.png")).status, 1);
}

TEST(TracePlot, WithoutPipelineEventsEveryThreadIsARowOfItsOutermostSpans) {
  TempDir dir;
  FileWriter w0("worker0", 0, 0), w1("worker1", 1, 3 * kMs);
  w0.clock("worker1", 1, 3 * kMs).thread(1, "main");
  w0.span("train", "user", 1, 0, 10).span("inner", "user", 1, 1, 2).span("eval", "user", 1, 11, 12);
  w1.span("rpc.server.execute", "rpc_server", 5, 2, 4, {0, 1}).span("MmBackward", "autograd", 6, 5, 6, {1, 1});
  w0.write(dir.path());
  w1.write(dir.path());
  TraceSet set = loadTraceDir(dir.path());
  PlotLayout layout = layoutPlot(set, PlotOptions{});
  EXPECT_FALSE(layout.pipeline);
  EXPECT_EQ(layout.rows, (std::vector<std::string>{"worker0 / main", "worker1 / thread-5", "worker1 / thread-6"}));
  ASSERT_EQ(layout.boxes.size(), 4u);  // "inner" is nested in "train"
  EXPECT_NEAR(layout.spanMs, 12.0, 1e-9);
  PlotOptions step0;
  step0.step = 0;
  EXPECT_THROW(layoutPlot(set, step0), ValueError);
  if (!plotSupported()) GTEST_SKIP() << "built without cairo";
  ToolRun run = runTool("plot " + dir.path() + " -o " + dir.file("s.svg"));
  ASSERT_EQ(run.status, 0) << run.out;
  const auto fills = svgFills(readFile(dir.file("s.svg")));
  EXPECT_EQ(countColour(fills, boxColour(BoxKind::kSpan, -1, "user")), 2 + 1);
  EXPECT_EQ(countColour(fills, boxColour(BoxKind::kSpan, -1, "autograd")), 1 + 1);
}

}  // namespace
}  // namespace distgrad::tools::trace

namespace distgrad::tools::trace {
namespace {

// Damaged files (cut at every line boundary and mid-line, bytes overwritten with JSON-significant
// characters and digits) never crash the tool: each is loaded or refused with a ValueError, and whatever
// loads goes through merge, report and plot layout with at most a ValueError.
TEST(TraceLoad, DamagedFilesAreLoadedOrRefusedWithAValueErrorNeverACrash) {
  TempDir source;
  writePipeline(source.path());
  const std::string original0 = readFile(source.file("worker0.trace.jsonl"));
  const std::string original1 = readFile(source.file("worker1.trace.jsonl"));
  uint64_t seed = 12345;
  auto next = [&seed] {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
  };
  const std::string alphabet = "{}[]\":,-0123456789e.9x ";
  int loaded = 0, refused = 0;
  for (int variant = 0; variant < 400; ++variant) {
    std::string damaged = original0;
    if (variant % 4 == 0) {
      damaged.resize(next() % damaged.size());  // cut anywhere
    } else {
      for (int k = 0; k < 1 + variant % 3; ++k) {
        damaged[next() % damaged.size()] = alphabet[next() % alphabet.size()];
      }
    }
    TempDir dir;
    std::ofstream(dir.file("worker0.trace.jsonl"), std::ios::binary) << damaged;
    std::ofstream(dir.file("worker1.trace.jsonl"), std::ios::binary) << original1;
    bool fileLoads = true;
    try {
      loadTraceFile(dir.file("worker0.trace.jsonl"), nullptr);
    } catch (const ValueError&) {
      fileLoads = false;
    }
    (fileLoads ? loaded : refused) += 1;
    try {
      TraceSet set = loadTraceDir(dir.path());  // worker1's intact file keeps the directory usable
      if (!fileLoads) {
        EXPECT_EQ(set.workers.size(), 1u) << "variant " << variant;
      }
      std::ostringstream merged;
      writeChromeTrace(set, merged);
      EXPECT_NO_THROW(parseJson(merged.str())) << "variant " << variant;
      Report report = analyze(set);
      for (const auto& w : report.workers) {
        int64_t sum = 0;
        for (int64_t ns : w.ns) sum += ns;
        EXPECT_EQ(sum, w.wallNs()) << "variant " << variant;
      }
      formatText(report, set);
      formatJsonLines(report, set);
      try {
        layoutPlot(set, PlotOptions{});
      } catch (const ValueError&) {
      }
    } catch (const ValueError& e) {
      ADD_FAILURE() << "variant " << variant
                    << ": the directory was refused although worker1's file is intact: " << e.what();
    }
  }
  // Both outcomes occur.
  EXPECT_GT(loaded, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace distgrad::tools::trace
