#include "tools/trace/trace_data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <queue>
#include <set>

#include "tensor/error.h"
#include "tools/flat_json.h"

namespace distgrad::tools::trace {

namespace fs = std::filesystem;

std::string defaultThreadName(int64_t tid) { return "thread-" + std::to_string(tid); }

std::string WorkerTrace::threadName(int64_t tid) const {
  auto it = threads.find(tid);
  return it == threads.end() ? defaultThreadName(tid) : it->second;
}

namespace {

// Times and offsets beyond 2^60 ns (36 years) are not a steady clock's: refusing them keeps every sum of
// a time and a chain of offsets far from int64 overflow.
constexpr int64_t kMaxTimeNs = int64_t{1} << 60;

// Throws "PATH:LINE: what".
[[noreturn]] void fail(const std::string& path, int64_t line, const std::string& what) {
  throw ValueError(path + ":" + std::to_string(line) + ": " + what);
}

int64_t requireInt(const FlatObject& o, const char* key, const std::string& path, int64_t line) {
  auto v = o.integer(key);
  if (!v) fail(path, line, std::string("missing or non-integer field \"") + key + "\"");
  return *v;
}

std::string requireString(const FlatObject& o, const char* key, const std::string& path, int64_t line) {
  auto v = o.string(key);
  if (!v) fail(path, line, std::string("missing or non-string field \"") + key + "\"");
  return *v;
}

Event parseEvent(const FlatObject& o, EventKind kind, const std::string& path, int64_t line) {
  Event ev;
  ev.kind = kind;
  ev.line = line;
  ev.name = requireString(o, "name", path, line);
  ev.cat = requireString(o, "cat", path, line);
  ev.tid = requireInt(o, "tid", path, line);
  ev.b = requireInt(o, "b", path, line);
  ev.e = requireInt(o, "e", path, line);
  if (ev.b < 0 || ev.e > kMaxTimeNs) fail(path, line, "time outside [0, 2^60] ns");
  if (ev.e < ev.b) {
    fail(path, line,
         "event \"" + ev.name + "\" ends (e=" + std::to_string(ev.e) + ") before it begins (b=" + std::to_string(ev.b) +
             ")");
  }
  if (kind == EventKind::kInstant && ev.e != ev.b) fail(path, line, "an instant must have b == e");
  if (o.has("detail")) ev.detail = requireString(o, "detail", path, line);
  static const char* kArgKeys[3] = {"a0", "a1", "a2"};
  for (int i = 0; i < 3; ++i) {
    if (o.has(kArgKeys[i])) {
      ev.args[i] = requireInt(o, kArgKeys[i], path, line);
      ev.argCount = i + 1;
    }
  }
  if (o.has("flow")) {
    const int64_t flow = requireInt(o, "flow", path, line);
    if (flow == 0) fail(path, line, "flow id 0 is reserved for \"no flow\"");
    ev.flow = static_cast<uint64_t>(flow);
    const std::string phase = requireString(o, "flow_phase", path, line);
    if (phase == "start") {
      ev.flowPhase = FlowPhase::kStart;
    } else if (phase == "step") {
      ev.flowPhase = FlowPhase::kStep;
    } else if (phase == "end") {
      ev.flowPhase = FlowPhase::kEnd;
    } else {
      fail(path, line, "flow_phase must be \"start\", \"step\" or \"end\", got \"" + phase + "\"");
    }
  } else if (o.has("flow_phase")) {
    fail(path, line, "flow_phase without a flow id");
  }
  return ev;
}

}  // namespace

WorkerTrace loadTraceFile(const std::string& path, std::vector<std::string>* warnings) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ValueError(path + ": cannot open the file");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw ValueError(path + ": read error");

  // Split into lines, remembering whether the last one ended with a newline.
  std::vector<std::string_view> lines;
  size_t pos = 0;
  bool lastTerminated = true;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) {
      lines.emplace_back(text.data() + pos, text.size() - pos);
      lastTerminated = false;
      break;
    }
    lines.emplace_back(text.data() + pos, nl - pos);
    pos = nl + 1;
  }
  if (lines.empty()) throw ValueError(path + ": empty file (no header line)");

  WorkerTrace trace;
  trace.path = path;
  bool sawEnd = false;
  int64_t eventLines = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const int64_t lineNo = static_cast<int64_t>(i) + 1;
    std::string_view raw = lines[i];
    if (!raw.empty() && raw.back() == '\r') raw.remove_suffix(1);
    if (raw.find_first_not_of(" \t") == std::string_view::npos) continue;  // blank line
    std::string error;
    auto object = parseFlatJson(raw, &error);
    if (!object) {
      // A process killed while writing leaves a cut-off last line: keep everything before it.
      if (i + 1 == lines.size() && !lastTerminated && !sawEnd && i > 0) {
        if (warnings) warnings->push_back(path + ":" + std::to_string(lineNo) + ": cut-off last line ignored");
        break;
      }
      fail(path, lineNo, "not a flat JSON object (" + error + ")");
    }
    if (i == 0) {
      auto version = object->integer("distgrad_trace");
      if (!version) fail(path, lineNo, "the first line is not a distgrad trace header (no \"distgrad_trace\")");
      if (*version != 1) fail(path, lineNo, "unsupported trace format version " + std::to_string(*version));
      trace.worker = requireString(*object, "worker", path, lineNo);
      trace.rank = requireInt(*object, "rank", path, lineNo);
      trace.pid = object->integer("pid").value_or(0);
      trace.startNs = requireInt(*object, "start_ns", path, lineNo);
      if (trace.startNs < 0 || trace.startNs > kMaxTimeNs) fail(path, lineNo, "start_ns outside [0, 2^60]");
      if (auto clock = object->string("clock"); clock && *clock != "steady_ns") {
        fail(path, lineNo, "unsupported clock \"" + *clock + "\"");
      }
      continue;
    }
    if (sawEnd) fail(path, lineNo, "a line after the end line");
    const std::string type = requireString(*object, "type", path, lineNo);
    if (type == "span") {
      trace.events.push_back(parseEvent(*object, EventKind::kSpan, path, lineNo));
      ++eventLines;
    } else if (type == "instant") {
      trace.events.push_back(parseEvent(*object, EventKind::kInstant, path, lineNo));
      ++eventLines;
    } else if (type == "async") {
      trace.events.push_back(parseEvent(*object, EventKind::kAsync, path, lineNo));
      ++eventLines;
    } else if (type == "thread") {
      trace.threads[requireInt(*object, "tid", path, lineNo)] = requireString(*object, "name", path, lineNo);
    } else if (type == "clock") {
      ClockLine c;
      c.peer = requireString(*object, "peer", path, lineNo);
      c.peerRank = object->integer("peer_rank").value_or(-1);
      c.offsetNs = requireInt(*object, "offset_ns", path, lineNo);
      c.rttNs = requireInt(*object, "rtt_ns", path, lineNo);
      if (c.rttNs < 0 || c.rttNs > kMaxTimeNs) fail(path, lineNo, "rtt_ns outside [0, 2^60]");
      if (c.offsetNs < -kMaxTimeNs || c.offsetNs > kMaxTimeNs) fail(path, lineNo, "offset_ns outside [-2^60, 2^60]");
      c.samples = object->integer("samples").value_or(0);
      if (c.peer == trace.worker) fail(path, lineNo, "a clock line about the worker itself");
      trace.clocks[c.peer] = c;  // the last line per peer wins
    } else if (type == "end") {
      sawEnd = true;
      trace.closed = true;
      trace.endNs = requireInt(*object, "end_ns", path, lineNo);
      if (auto count = object->integer("events"); count && *count != eventLines) {
        fail(
            path, lineNo,
            "the end line counts " + std::to_string(*count) + " events but the file has " + std::to_string(eventLines));
      }
    } else {
      if (warnings) {
        warnings->push_back(path + ":" + std::to_string(lineNo) + ": unknown line type \"" + type + "\" ignored");
      }
    }
  }
  if (!trace.closed && warnings) {
    warnings->push_back(path + ": no end line (the process did not shut down cleanly); merged as far as it goes");
  }
  return trace;
}

TraceSet loadTraceDir(const std::string& directory) {
  std::error_code ec;
  if (!fs::is_directory(directory, ec)) throw ValueError(directory + ": not a directory");
  std::vector<std::string> paths;
  for (const auto& entry : fs::directory_iterator(directory, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string suffix = ".trace.jsonl";
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        entry.is_regular_file()) {
      paths.push_back(entry.path().string());
    }
  }
  if (ec) throw ValueError(directory + ": cannot list the directory: " + ec.message());
  if (paths.empty()) throw ValueError(directory + ": no *.trace.jsonl files");
  std::sort(paths.begin(), paths.end());

  TraceSet set;
  set.directory = directory;
  std::set<std::string> names;
  std::set<int64_t> ranks;
  for (const auto& path : paths) {
    try {
      WorkerTrace trace = loadTraceFile(path, &set.warnings);
      if (!names.insert(trace.worker).second || !ranks.insert(trace.rank).second) {
        set.warnings.push_back(path + ": skipped: worker \"" + trace.worker + "\" (rank " + std::to_string(trace.rank) +
                               ") already comes from another file");
        continue;
      }
      set.workers.push_back(std::move(trace));
    } catch (const ValueError& e) {
      set.warnings.push_back(std::string("skipped ") + e.what());
    }
  }
  if (set.workers.empty()) {
    std::string why;
    for (const auto& w : set.warnings) why += "\n  " + w;
    throw ValueError(directory + ": no valid trace file" + why);
  }
  std::sort(set.workers.begin(), set.workers.end(),
            [](const WorkerTrace& a, const WorkerTrace& b) { return a.rank < b.rank; });
  alignClocks(set);
  return set;
}

void alignClocks(TraceSet& set) {
  if (set.workers.empty()) return;
  set.referenceIndex = 0;  // sorted by rank: the lowest
  // Nodes: worker names from files and every peer named in a clock line.
  std::map<std::string, int> node;
  auto nodeOf = [&](const std::string& name) {
    auto [it, inserted] = node.emplace(name, static_cast<int>(node.size()));
    return it->second;
  };
  for (const auto& w : set.workers) nodeOf(w.worker);
  struct Edge {
    int to;
    int64_t offset;  // t_to = t_from + offset
    int64_t rtt;
  };
  std::vector<std::vector<Edge>> edges;
  auto addEdge = [&](int from, int to, int64_t offset, int64_t rtt) {
    if (static_cast<int>(edges.size()) <= std::max(from, to)) edges.resize(static_cast<size_t>(std::max(from, to)) + 1);
    edges[static_cast<size_t>(from)].push_back({to, offset, rtt});
  };
  for (const auto& w : set.workers) {
    const int from = nodeOf(w.worker);
    for (const auto& [peer, c] : w.clocks) {
      const int to = nodeOf(peer);
      addEdge(from, to, c.offsetNs, c.rttNs);
      addEdge(to, from, -c.offsetNs, c.rttNs);
    }
  }
  edges.resize(node.size());
  // Dijkstra from the reference on round trips; toRef[n]: add to n's time to get the reference's.
  const int ref = node.at(set.reference().worker);
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> cost(node.size(), kInf), toRef(node.size(), 0);
  using Item = std::pair<int64_t, int>;
  std::priority_queue<Item, std::vector<Item>, std::greater<>> queue;
  cost[static_cast<size_t>(ref)] = 0;
  queue.push({0, ref});
  while (!queue.empty()) {
    auto [c, n] = queue.top();
    queue.pop();
    if (c != cost[static_cast<size_t>(n)]) continue;
    // Edges out of n go n -> m with t_m = t_n + offset, so t_ref = t_n + toRef[n] = t_m - offset + toRef[n].
    for (const Edge& edge : edges[static_cast<size_t>(n)]) {
      int64_t next = 0, offset = 0;
      // A chain of extreme (but individually valid) offsets could overflow: such a path is no path.
      if (__builtin_add_overflow(c, edge.rtt, &next) ||
          __builtin_sub_overflow(toRef[static_cast<size_t>(n)], edge.offset, &offset) || offset < -4 * kMaxTimeNs ||
          offset > 4 * kMaxTimeNs) {
        continue;
      }
      if (next < cost[static_cast<size_t>(edge.to)]) {
        cost[static_cast<size_t>(edge.to)] = next;
        toRef[static_cast<size_t>(edge.to)] = offset;
        queue.push({next, edge.to});
      }
    }
  }
  const int64_t refStart = set.reference().startNs;
  for (auto& w : set.workers) {
    const int n = node.at(w.worker);
    if (cost[static_cast<size_t>(n)] != kInf) {
      w.aligned = true;
      w.offsetToReferenceNs = toRef[static_cast<size_t>(n)];
    } else {
      w.aligned = false;
      w.offsetToReferenceNs = refStart - w.startNs;
      set.warnings.push_back("worker \"" + w.worker + "\" (" + w.path + ") has no clock offset to the reference " +
                             set.reference().worker +
                             ", direct or through other workers: aligned by its start time only");
    }
    for (auto& ev : w.events) {
      ev.b += w.offsetToReferenceNs;
      ev.e += w.offsetToReferenceNs;
    }
  }
  int64_t origin = kInf;
  for (const auto& w : set.workers) {
    for (const auto& ev : w.events) origin = std::min(origin, ev.b);
  }
  set.originNs = origin == kInf ? refStart : origin;
}

}  // namespace distgrad::tools::trace
