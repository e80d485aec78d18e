#include "tools/trace/merge.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>

namespace distgrad::tools::trace {

std::string jsonString(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::vector<std::string> argNames(const Event& ev) {
  const std::string& n = ev.name;
  if (n == "rpc.client.serialize" || n == "rpc.client.send" || n == "rpc.client.deserialize" ||
      n == "rpc.server.deserialize" || n == "rpc.server.serialize" || n == "rpc.server.send") {
    return {"bytes", "peer", "call"};
  }
  if (n == "rpc.client.wait") return {"peer", "call", "status"};
  if (n == "rpc.server.queue" || n == "rpc.server.execute" || n == "rpc.server.await") return {"peer", "call", ""};
  if (n == "transport.send" || n == "transport.recv") return {"bytes", "peer", ""};
  if (n == "rref.wait") return {"owner", "local_id", ""};
  if (n == "autograd.send_gradients" || n == "autograd.recv_gradients") return {"context", "message", "bytes"};
  if (n == "optim.step") return {"parameters", "", ""};
  if (n == "pipeline.step") return {"step", "micro_batches", "stages"};
  if (n == "pipeline.forward" || n == "pipeline.backward") return {"stage", "micro_batch", "step"};
  if (n == "pipeline.optimizer") return {"stage", "", "step"};
  if (ev.cat == "autograd") return {"context", "pass", ""};  // a node run in a backward pass
  return {"", "", ""};
}

namespace {

std::string micros(int64_t ns) {
  // Microseconds with nanosecond precision: exact, unlike a double formatted with %g.
  char buf[48];
  const int64_t whole = ns / 1000;
  int64_t frac = ns % 1000;
  if (ns < 0 && frac != 0) {
    // Never happens for times relative to the earliest event; kept correct anyway.
    std::snprintf(buf, sizeof buf, "-%" PRId64 ".%03" PRId64, -ns / 1000, -ns % 1000);
    return buf;
  }
  std::snprintf(buf, sizeof buf, "%" PRId64 ".%03" PRId64, whole, frac);
  return buf;
}

std::string argsJson(const Event& ev) {
  std::string out = "{";
  bool first = true;
  auto add = [&](const std::string& key, const std::string& value) {
    if (!first) out += ",";
    first = false;
    out += jsonString(key) + ":" + value;
  };
  const auto names = argNames(ev);
  for (int i = 0; i < ev.argCount; ++i) {
    static const char* const kPlain[3] = {"a0", "a1", "a2"};
    const std::string& named = names[static_cast<size_t>(i)];
    const std::string key = named.empty() ? std::string(kPlain[i]) : named;
    add(key, std::to_string(ev.args[i]));
  }
  if (!ev.detail.empty()) add("detail", jsonString(ev.detail));
  return out + "}";
}

}  // namespace

MergeStats writeChromeTrace(const TraceSet& set, std::ostream& out) {
  MergeStats stats;
  out << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"tool\":\"distgrad-trace\",\"reference_clock\":"
      << jsonString(set.reference().worker) << "},\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const std::string& line) {
    if (!first) out << ",\n";
    first = false;
    out << line;
  };
  const int64_t origin = set.originNs;

  // Flows: gather every flow's events first, so that only flows with both ends are drawn (an arrow with
  // one end is a malformed trace for Perfetto).
  struct FlowPoint {
    const WorkerTrace* worker;
    const Event* event;
  };
  std::map<uint64_t, std::vector<FlowPoint>> flows;
  for (const auto& w : set.workers) {
    for (const auto& ev : w.events) {
      if (ev.flow != 0 && ev.flowPhase != FlowPhase::kNone) flows[ev.flow].push_back({&w, &ev});
    }
  }

  for (const auto& w : set.workers) {
    const std::string pid = std::to_string(w.rank);
    std::string label = w.worker + " (rank " + std::to_string(w.rank) + ")";
    if (!w.aligned) label += " [clock not aligned]";
    if (!w.closed) label += " [no end line]";
    emit("{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" + pid + ",\"args\":{\"name\":" + jsonString(label) + "}}");
    emit("{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" + pid + ",\"args\":{\"sort_index\":" + pid + "}}");
    std::map<int64_t, std::string> threads = w.threads;
    for (const auto& ev : w.events) threads.emplace(ev.tid, defaultThreadName(ev.tid));
    for (const auto& [tid, name] : threads) {
      emit("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" + pid + ",\"tid\":" + std::to_string(tid) +
           ",\"args\":{\"name\":" + jsonString(name) + "}}");
    }
    uint64_t asyncId = 0;
    for (const auto& ev : w.events) {
      const std::string common = "\"name\":" + jsonString(ev.name) + ",\"cat\":" + jsonString(ev.cat) +
                                 ",\"pid\":" + pid + ",\"tid\":" + std::to_string(ev.tid);
      const std::string ts = micros(ev.b - origin);
      switch (ev.kind) {
        case EventKind::kSpan:
          emit("{\"ph\":\"X\"," + common + ",\"ts\":" + ts + ",\"dur\":" + micros(ev.duration()) +
               ",\"args\":" + argsJson(ev) + "}");
          break;
        case EventKind::kInstant:
          emit("{\"ph\":\"i\",\"s\":\"t\"," + common + ",\"ts\":" + ts + ",\"args\":" + argsJson(ev) + "}");
          break;
        case EventKind::kAsync: {
          // Ids are per process and category+name in Chrome's format: the worker's rank keeps them apart.
          const std::string id = "\"id\":\"0x" + [&] {
            char buf[40];
            std::snprintf(buf, sizeof buf, "%" PRIx64 "%012" PRIx64, static_cast<uint64_t>(w.rank) + 1, ++asyncId);
            return std::string(buf);
          }() + "\"";
          emit("{\"ph\":\"b\"," + common + "," + id + ",\"ts\":" + ts + ",\"args\":" + argsJson(ev) + "}");
          emit("{\"ph\":\"e\"," + common + "," + id + ",\"ts\":" + micros(ev.e - origin) + ",\"args\":{}}");
          ++stats.events;
          break;
        }
      }
      ++stats.events;
    }
  }

  for (auto& [flow, points] : flows) {
    std::sort(points.begin(), points.end(), [](const FlowPoint& a, const FlowPoint& b) {
      if (a.event->flowPhase != b.event->flowPhase) return a.event->flowPhase < b.event->flowPhase;
      return a.event->b < b.event->b;
    });
    const bool hasStart = points.front().event->flowPhase == FlowPhase::kStart;
    if (!hasStart || points.size() < 2) {
      ++stats.flowsDropped;
      continue;
    }
    char idBuf[40];
    std::snprintf(idBuf, sizeof idBuf, "\"0x%" PRIx64 "\"", flow);
    for (size_t i = 0; i < points.size(); ++i) {
      const Event& ev = *points[i].event;
      // A flow event binds to the slice enclosing its time on its thread: the middle of the span leaves no
      // doubt about which one (at its begin, a viewer may bind it to the parent).
      // The last point ends the flow ("f", bound to its enclosing slice with bp "e"), whatever its recorded
      // phase: a call that timed out has only a start and a step, and is drawn call -> execution.
      const char* ph = i == 0 ? "s" : (i + 1 == points.size() ? "f" : "t");
      std::string line = std::string("{\"ph\":\"") + ph + "\",\"name\":\"rpc\",\"cat\":\"rpc.flow\",\"id\":" + idBuf +
                         ",\"pid\":" + std::to_string(points[i].worker->rank) + ",\"tid\":" + std::to_string(ev.tid) +
                         ",\"ts\":" + micros(ev.b + ev.duration() / 2 - origin);
      if (i + 1 == points.size()) line += ",\"bp\":\"e\"";
      emit(line + "}");
    }
    ++stats.flows;
  }
  out << "\n]}\n";
  return stats;
}

}  // namespace distgrad::tools::trace
