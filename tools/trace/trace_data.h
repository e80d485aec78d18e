// The analysis library behind tools/distgrad-trace: loads a trace directory (one JSON-lines file per worker,
// docs/tracing.md "File format"), checks every line, and maps every worker's times onto one reference clock
// (the lowest rank's) through the clock lines, so that the merger, the report and the plot work on one
// timeline. Tests call it directly.
//
// Clock alignment: a clock line of worker A about peer P says t_P = t_A + offset_ns (the last line per peer
// wins). The lines of all files form a graph whose nodes are workers (and peers that wrote no file), each
// edge weighted by its round trip; every worker is mapped onto the reference along the path of smallest
// total round trip (Dijkstra), so a worker with no direct estimate to the reference reaches it through a
// chain of others. A worker with no path at all is kept with a warning and aligned by its header's
// start_ns to the reference's (agents start together at the rendezvous, so that is right within the
// start-up skew).
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace distgrad::tools::trace {

enum class EventKind { kSpan, kInstant, kAsync };
enum class FlowPhase { kNone, kStart, kStep, kEnd };

struct Event {
  std::string name;
  std::string cat;
  std::string detail;
  EventKind kind = EventKind::kSpan;
  int64_t tid = 0;
  int64_t b = 0;  // ns: the worker's own clock after loading; the reference clock after alignClocks()
  int64_t e = 0;
  uint64_t flow = 0;
  FlowPhase flowPhase = FlowPhase::kNone;
  int64_t args[3] = {0, 0, 0};
  int argCount = 0;
  int64_t line = 0;  // line number in its file (1-based), for messages

  int64_t arg(int i) const { return i < argCount ? args[i] : 0; }
  int64_t duration() const { return e - b; }
};

struct ClockLine {
  std::string peer;
  int64_t peerRank = -1;
  int64_t offsetNs = 0;  // add to this worker's time to get the peer's
  int64_t rttNs = 0;
  int64_t samples = 0;
};

struct WorkerTrace {
  std::string path;
  std::string worker;
  int64_t rank = 0;
  int64_t pid = 0;
  int64_t startNs = 0;
  bool closed = false;  // the end line was there
  int64_t endNs = 0;
  std::map<int64_t, std::string> threads;   // tid -> name (last wins)
  std::map<std::string, ClockLine> clocks;  // peer -> last line
  std::vector<Event> events;                // spans, instants, async; in file order
  // After alignClocks(): add to this worker's own times to get the reference clock's.
  int64_t offsetToReferenceNs = 0;
  bool aligned = false;  // reached the reference through clock lines (or is it)

  std::string threadName(int64_t tid) const;
};

// A trace directory loaded and aligned. Workers are sorted by rank.
struct TraceSet {
  std::string directory;
  std::vector<WorkerTrace> workers;
  std::vector<std::string> warnings;  // files skipped, unclosed files, unaligned workers, ignored lines
  int64_t referenceIndex = 0;         // index in workers of the reference (lowest rank)
  int64_t originNs = 0;               // earliest event begin on the reference clock

  const WorkerTrace& reference() const { return workers.at(static_cast<size_t>(referenceIndex)); }
};

// Parses one trace file. Throws distgrad::ValueError "PATH:LINE: what" for a line that is not a flat JSON
// object of a documented type with the documented fields (a header first, e >= b, a flow phase with a
// flow id, ...). A last line cut off by a process that died (no end line, no newline at the end) is dropped
// with a warning instead; lines of an unknown type are ignored with a warning (a newer recorder).
WorkerTrace loadTraceFile(const std::string& path, std::vector<std::string>* warnings);

// Loads every DIR/*.trace.jsonl. A malformed file is skipped with a warning naming the file and line;
// two files of the same rank or worker keep the first. Throws ValueError when DIR is not a directory or
// no file could be loaded. Aligns the clocks (alignClocks) before returning.
TraceSet loadTraceDir(const std::string& directory);

// Maps every worker's events onto the reference clock (see the header comment), fills offsetToReferenceNs,
// aligned and originNs, and adds a warning per worker that could not be aligned. Idempotent only on a
// freshly loaded set (it shifts the events).
void alignClocks(TraceSet& set);

// The name of a thread as docs/tracing.md names it when the file has no thread line for it.
std::string defaultThreadName(int64_t tid);

}  // namespace distgrad::tools::trace
