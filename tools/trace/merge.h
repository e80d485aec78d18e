// distgrad-trace merge: one Chrome / Perfetto trace-event JSON document from a loaded, aligned TraceSet
// (docs/tracing.md, "distgrad-trace"). A process per worker (pid = its rank), a thread track per thread
// (named), spans as complete events "X", async events as "b"/"e" pairs (Perfetto draws them on tracks of
// their own under the process), instants "i", and each RPC's flow as "s" -> "t" -> "f" events bound to the
// enclosing slices, so the arrows go call -> execution -> reply. Times are microseconds from the earliest
// event, on the reference worker's clock. Args a0..a2 get the names docs/tracing.md gives them.
// Thread-safety: pure functions.
#pragma once

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "tools/trace/trace_data.h"

namespace distgrad::tools::trace {

// The names of an event's args a0..a2 ("" = not meaningful for it, written as "aN" if set).
std::vector<std::string> argNames(const Event& event);

struct MergeStats {
  size_t events = 0;        // trace events written (metadata excluded)
  size_t flows = 0;         // flows drawn (a start and an end, or a start and a step)
  size_t flowsDropped = 0;  // flows with a single event (the other side is in a missing file)
};

// Writes the trace JSON to `out`, one trace event per line.
MergeStats writeChromeTrace(const TraceSet& set, std::ostream& out);

// JSON string escaping (quotes included).
std::string jsonString(const std::string& text);

}  // namespace distgrad::tools::trace
