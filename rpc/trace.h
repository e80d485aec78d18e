// Tracing: a process-wide recorder of spans, instants and flows that every worker writes to its own
// JSON-lines file, for distgrad-trace to merge into one timeline and explain where a step's time went
// (docs/tracing.md has the file format and every event the library records; ARCHITECTURE §8).
//
//   DG_TRACE_SCOPE("load batch");                              // a user region (a string literal)
//   trace::Scope s("optim.step", trace::Category::kOptimizer, contextId);
//   trace::instant("transport.recv", trace::Category::kTransport, {bytes, peerRank});
//
// Recording is off by default. An Agent started with Options::traceDir (or DISTGRAD_TRACE=dir) registers
// its worker with a file and turns it on; everything above is then recorded until the last such agent
// shuts down, which writes DIR/<worker>.trace.jsonl. Events stay in memory until then (writing a file
// costs far more than recording, so it stays out of the traced run), unless more than the flush threshold
// (default 256 MiB) is buffered: then a background thread ("dg-trace-writer", running while some worker
// traces) writes them out. trace::flush() writes what is buffered at once. When off, a recording site costs
// one relaxed atomic load (trace::enabled()): no allocation, no clock read, no string work.
//
// Why process-wide (STYLE forbids singletons otherwise): DG_TRACE_SCOPE sits in user code and deep in
// layers that have no agent at hand, and "one relaxed load when off" leaves no room for a lookup. Events
// still belong to a worker: each carries the worker slot of the thread that recorded it. An agent's own
// threads are bound to its slot for their lifetime, a thread calling through an agent is bound for the
// call, and any other thread records into the process's first traced worker (the only one, outside tests).
//
// Recording: every thread appends fixed-size events to its own buffer (chunks of kChunkEvents), without
// locks: it writes the event, then publishes the count with a release store; the writer (flush) reads with
// acquire and frees a chunk only once the thread moved on to the next one and every event in it is written.
// Event names are `const char*` that must live for the whole process: a string literal, or intern(text),
// which returns the same stable pointer for equal text (intern once per name, not per event where you can).
// The Agent's RPC sites append one RpcRecord per site instead of one Event per event; the writer expands it
// into the documented events (expandRpc), so a file does not show the difference.
//
// Thread-safety: every function may be called from any thread. Scope and WorkerScope are used on the
// thread that created them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace distgrad::trace {

// What part of the system an event measures; distgrad-trace's report groups time by it.
enum class Category : uint8_t {
  kUser = 0,       // DG_TRACE_SCOPE regions and anything else user code records
  kRpcClient = 1,  // the caller's side of an RPC: serialize, send, wait, deserialize
  kRpcServer = 2,  // the callee's side: deserialize, queue, execute, await, serialize, send
  kTransport = 3,  // bytes that went out / came in, per frame
  kRRef = 4,       // waiting for an RRef's value
  kAutograd = 5,   // distributed backward: a node run in a pass, gradients sent / received
  kOptimizer = 6,  // a LocalOptimizer step
  kPipeline = 7,   // pipeline stages and micro-batches
};
inline constexpr int kCategoryCount = 8;
// "user", "rpc_client", "rpc_server", "transport", "rref", "autograd", "optimizer", "pipeline".
const char* categoryName(Category category);

// The role of an event in a flow (the arrow distgrad-trace draws from a call to its execution and back).
enum class FlowPhase : uint8_t { kNone = 0, kStart = 1, kStep = 2, kEnd = 3 };
// "", "start", "step", "end".
const char* flowPhaseName(FlowPhase phase);

// How an event sits on its thread's track.
enum class EventKind : uint8_t {
  kSpan = 0,     // begin..end on the recording thread; spans of one thread nest
  kInstant = 1,  // a point in time (begin == end)
  kAsync = 2,    // begin..end of something that waited across threads (a queue, a call in flight): does
                 // not nest on the recording thread (the thread that saw it end)
};
const char* eventKindName(EventKind kind);

// A worker slot: which worker's file an event goes to. 0 = none (the thread's default applies).
using WorkerSlot = uint32_t;
inline constexpr WorkerSlot kNoWorker = 0;

inline constexpr int kMaxArgs = 3;

// One recorded event (fixed size, so a buffer is an array). `args` are int64 values whose meaning each
// event name documents (docs/tracing.md): bytes, a peer's rank, a call id, a context id, a micro-batch...
struct Event {
  int64_t beginNs = 0;  // trace::nowNs() of the recording process (not yet shifted by a test skew)
  int64_t endNs = 0;
  const char* name = nullptr;    // literal or intern()ed
  const char* detail = nullptr;  // optional: literal or intern()ed (e.g. the RPC function's name)
  uint64_t flow = 0;             // flow id, 0 = none
  int64_t args[kMaxArgs] = {0, 0, 0};
  WorkerSlot worker = kNoWorker;  // kNoWorker: filled in by record() from the thread's binding
  Category category = Category::kUser;
  FlowPhase flowPhase = FlowPhase::kNone;
  EventKind kind = EventKind::kSpan;
  uint8_t argCount = 0;  // args[0..argCount) are set
};

// The RPC sites of the Agent (rpc/agent.cpp) record one RpcRecord each instead of two or three Events: the
// site's clock reads and ids, expanded into the documented events (docs/tracing.md, "Events the library
// records") when the file is written. A traced RPC appends 4 records (for its 13 events; 5 when its handler
// returns a future) instead of 13 events, and reads the clock 9 times instead of 13: what it stores (fresh
// buffer memory), the appends and the clock reads on the RPC's threads drop by a half or more (bench_trace).
// Times are trace::nowNs(); t0 <= t1 <= ... as read in that order on the recording thread.
enum class RpcSite : uint8_t {
  // Calling thread. t0 encoding began, t1 encoded (= send began), t2 the frame was queued.
  // -> rpc.client.serialize [t0, t1], rpc.client.send [t1, t2] (flow start), transport.send at t2
  // (kRpcToTransport).
  kClientSend = 0,
  // The thread that saw the reply arrive. t0 the wait began, t1 the reply arrived, t2 it was decoded and the
  // caller's future completed. -> transport.recv at t1 (kRpcFromTransport), rpc.client.wait [t0, t1]
  // (async, a2 = status), rpc.client.deserialize [t1, t2] (flow end).
  kClientReply = 1,
  // Loop thread (or the caller's, for a call to itself). t0 the frame arrived, t1 decoded and queued for the
  // executor. -> transport.recv at t0 (kRpcFromTransport), rpc.server.deserialize [t0, t1].
  kServerArrive = 2,
  // Executor thread. t0 queued, t1 picked up, t2 the handler returned. -> rpc.server.queue [t0, t1] (async),
  // rpc.server.execute [t1, t2] (flow step).
  kServerExecute = 3,
  // Executor thread. t0 encoding the reply began, t1 encoded, t2 the frame was queued.
  // -> rpc.server.serialize [t0, t1], rpc.server.send [t1, t2], transport.send at t2 (kRpcToTransport).
  kServerReply = 4,
  // Executor thread, a handler that returned its value (kServerExecute and kServerReply in one record).
  // t0 queued, t1 picked up, t2 the handler returned and encoding the reply began, t3 encoded, t4 the frame
  // was queued. -> rpc.server.queue [t0, t1] (async), rpc.server.execute [t1, t2] (flow step),
  // rpc.server.serialize [t2, t3], rpc.server.send [t3, t4], transport.send at t4 (kRpcToTransport).
  kServerHandled = 5,
};
inline constexpr int kRpcSiteCount = 6;
// RpcRecord::flags. kRpcFromTransport (kClientReply, kServerArrive): the frame came through the transport
// (not a call of an agent to itself), so the record also stands for its transport.recv at the arrival.
// kRpcToTransport (kClientSend, kServerReply, kServerHandled): the frame was queued on a link, so the record
// also stands for its transport.send at its last time (on the recording thread, when queued).
inline constexpr uint8_t kRpcFromTransport = 1;
inline constexpr uint8_t kRpcToTransport = 2;

inline constexpr int kRpcMaxTimes = 5;
struct RpcRecord {
  int64_t t[kRpcMaxTimes] = {0, 0, 0, 0, 0};  // trace::nowNs() (see RpcSite: t[3], t[4] kServerHandled's)
  int64_t bytes = 0;                          // the frame's bytes (a0 of the events that carry bytes)
  uint64_t call = 0;                          // the call id (per caller)
  uint64_t flow = 0;                          // the call's flow id (callFlowId), for the sites that carry it
  const char* function = nullptr;             // the RPC function's name (the events' detail): literal or intern()ed
  int32_t peer = -1;                          // the other worker's rank
  WorkerSlot worker = kNoWorker;              // kNoWorker: filled in from the thread's binding, as for record()
  RpcSite site = RpcSite::kClientSend;
  uint8_t status = 0;  // kClientReply: rpc.client.wait's a2 (0 = a reply came, else 1 + ErrorKind)
  uint8_t flags = 0;   // kRpcFromTransport
};

inline constexpr int kRpcMaxEvents = 5;
// The number of events `record` stands for in a file.
int rpcEventCount(const RpcRecord& record);
// The events `record` stands for, in the order they are written (what the writer writes for it). Returns
// how many were stored in `out`.
int expandRpc(const RpcRecord& record, Event (&out)[kRpcMaxEvents]);

namespace detail {
// True while some registered worker traces and recording is not paused. The only state a recording site
// reads when tracing is off.
inline std::atomic<bool> gEnabled{false};
}  // namespace detail

// True when events are being recorded. One relaxed load: check it before doing any work for an event.
inline bool enabled() { return detail::gEnabled.load(std::memory_order_relaxed); }

namespace detail {
inline int64_t steadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Note [TSC trace clock] (rpc/trace.cpp): while something traces, nowNs() reads the CPU's time-stamp counter
// and converts it with an anchor the writer thread keeps on the steady clock. The anchor is a seqlock:
// `seq` is odd while the writer changes it.
struct TscAnchor {
  std::atomic<uint32_t> seq{0};
  std::atomic<uint64_t> tsc{0};   // the counter at the anchor
  std::atomic<int64_t> ns{0};     // the steady clock at the anchor
  std::atomic<uint64_t> mult{0};  // nanoseconds per tick, << 32
};
inline TscAnchor gTscAnchor;
inline std::atomic<bool> gTscClock{false};

#if defined(__x86_64__)
// The anchor's line at counter value `at`.
inline int64_t tscNowAt(uint64_t at) {
  uint32_t seq;
  uint64_t tsc, mult;
  int64_t ns;
  // Acquire loads (free on x86) keep the second load of `seq` after the fields', without a fence (which
  // ThreadSanitizer does not support).
  do {
    seq = gTscAnchor.seq.load(std::memory_order_acquire);
    tsc = gTscAnchor.tsc.load(std::memory_order_acquire);
    ns = gTscAnchor.ns.load(std::memory_order_acquire);
    mult = gTscAnchor.mult.load(std::memory_order_acquire);
  } while ((seq & 1) != 0 || seq != gTscAnchor.seq.load(std::memory_order_relaxed));
  const auto ticks = static_cast<int64_t>(at - tsc);
  // A counter read on another core may be a few ticks behind the anchor's: never before it.
  if (ticks <= 0) return ns;
  return ns + static_cast<int64_t>((static_cast<unsigned __int128>(ticks) * mult) >> 32);
}
inline int64_t tscNowNs() { return tscNowAt(__rdtsc()); }
#endif
}  // namespace detail

// The trace clock in nanoseconds: std::chrono::steady_clock (CLOCK_MONOTONIC on Linux), read through the
// time-stamp counter while something traces where the kernel itself keeps CLOCK_MONOTONIC on it (Note [TSC
// trace clock]: cheaper than a clock_gettime, and an RPC reads it nine times). Monotonic on each
// thread; within microseconds of the steady clock (the anchor follows it every 50 ms), so its times may be
// mixed with the steady clock's (deadlines, liveness) but not subtracted from them for short spans.
inline int64_t nowNs() {
#if defined(__x86_64__)
  // Acquire: the anchor was published before the counter was turned on.
  const int64_t now = detail::gTscClock.load(std::memory_order_acquire) ? detail::tscNowNs() : detail::steadyNs();
#else
  const int64_t now = detail::steadyNs();
#endif
  // Never before this thread's last read: a new anchor, or the switch between the two clocks, may be a few
  // nanoseconds behind the previous reading.
  thread_local int64_t last = 0;
  if (now > last) last = now;
  return last;
}
// What nowNs() reads now: "tsc" or "steady".
const char* clockName();

// A stable pointer to a copy of `text`: equal text gives the same pointer, valid until the process exits
// (the table only grows). Takes a lock the first time a thread meets a text, then a thread-local lookup.
const char* intern(std::string_view text);

// Appends `event` to this thread's buffer (no lock, no allocation except a new chunk every kChunkEvents
// events). A kNoWorker event gets the thread's worker (see the header comment). Call it only when enabled()
// returned true; events recorded for a worker that writes no file are dropped when the buffers are flushed.
void record(Event event);

// Appends one RpcRecord (an Agent's RPC site) to this thread's buffer, like record(). Call it only when
// enabled() returned true.
void recordRpc(const RpcRecord& record);

// A finished span measured by hand (begin captured earlier), recorded on this thread.
void recordSpan(const char* name, Category category, int64_t beginNs, int64_t endNs,
                std::initializer_list<int64_t> args = {}, uint64_t flow = 0, FlowPhase phase = FlowPhase::kNone,
                const char* detail = nullptr);
// The same for something that waited across threads (EventKind::kAsync).
void recordAsync(const char* name, Category category, int64_t beginNs, int64_t endNs,
                 std::initializer_list<int64_t> args = {}, uint64_t flow = 0, const char* detail = nullptr);
// A point event at `atNs` (e.g. when a frame arrived), recorded on this thread.
void recordInstant(const char* name, Category category, int64_t atNs, std::initializer_list<int64_t> args = {},
                   const char* detail = nullptr);
// A point event now. Checks enabled() itself.
void instant(const char* name, Category category, std::initializer_list<int64_t> args = {},
             const char* detail = nullptr);

// The flow id of call `callId` made by the worker of rank `callerRank`: unique in a job (call ids are per
// caller), never 0.
inline uint64_t callFlowId(int callerRank, uint64_t callId) {
  return (static_cast<uint64_t>(callerRank + 1) << 48) | (callId & ((uint64_t{1} << 48) - 1));
}

// A span from construction to destruction (or end()) on this thread. When tracing is off the constructor
// does one relaxed load and nothing else.
class Scope {
 public:
  explicit Scope(const char* name, Category category = Category::kUser) noexcept : active_(enabled()) {
    if (active_) begin(name, category);
  }
  // Up to kMaxArgs integer args (a0, a1, a2 in the file).
  // (The installed clang-format mangles requires-clauses.)
  // clang-format off
  template <typename... A>
    requires(sizeof...(A) >= 1 && sizeof...(A) <= kMaxArgs && (std::is_integral_v<A> && ...))
  Scope(const char* name, Category category, A... args) noexcept : active_(enabled()) {
    // clang-format on
    if (active_) {
      begin(name, category);
      ((event().args[event().argCount++] = static_cast<int64_t>(args)), ...);
    }
  }
  ~Scope() {
    if (active_) end();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  bool active() const { return active_; }
  // Sets arg `index` (< kMaxArgs; the args up to it count as set), e.g. a size known only at the end.
  void setArg(int index, int64_t value) {
    if (!active_ || index < 0 || index >= kMaxArgs) return;
    event().args[index] = value;
    if (event().argCount < index + 1) event().argCount = static_cast<uint8_t>(index + 1);
  }
  void setFlow(uint64_t flow, FlowPhase phase) {
    if (!active_) return;
    event().flow = flow;
    event().flowPhase = phase;
  }
  void setDetail(const char* detail) {
    if (active_) event().detail = detail;
  }
  // Ends the span now (the destructor then does nothing).
  void end();

 private:
  void begin(const char* name, Category category) {
    new (&storage_.event) Event();
    event().name = name;
    event().category = category;
    event().beginNs = nowNs();
  }
  Event& event() { return storage_.event; }
  // The event is constructed only when recording (begin): when off, a Scope initialises nothing but
  // active_.
  union Storage {
    Storage() {}
    Event event;
  };
  bool active_;
  Storage storage_;
};

#define DG_TRACE_CONCAT_INNER(a, b) a##b
#define DG_TRACE_CONCAT(a, b) DG_TRACE_CONCAT_INNER(a, b)
// A user region named by a string literal ("" name refuses anything else at compile time), recorded until
// the end of the enclosing block.
#define DG_TRACE_SCOPE(name) \
  ::distgrad::trace::Scope DG_TRACE_CONCAT(dgTraceScope_, __LINE__)("" name, ::distgrad::trace::Category::kUser)

// ---- workers ----

// Registers a worker: `name` and `rank` identify it in its file. With a non-empty `directory` (created if
// missing) its events go to `directory/<name>.trace.jsonl`, truncated and opened now (its header line is
// written at once), and recording turns on; with an empty one the worker only gets a slot (its threads'
// events are then dropped). `clockSkewNs` is TEST-ONLY: added to every time this worker writes, so that
// one process can pretend its workers' clocks differ. Throws ValueError if the file cannot be created.
// Agents call it; so does a process that traces without an agent (a LocalPipeline, a training loop): its
// threads, bound to no worker, then record into this one, until unregisterWorker writes the file
// (docs/tracing.md, "A process without an agent").
WorkerSlot registerWorker(const std::string& name, int rank, const std::string& directory = {},
                          int64_t clockSkewNs = 0);
// Writes what is buffered for the worker, a last line, closes its file and frees the slot (events recorded
// for it later are dropped). Recording turns off when no registered worker traces any more. Idempotent.
void unregisterWorker(WorkerSlot slot);
// The file of a worker that traces, else "".
std::string workerFile(WorkerSlot slot);

// The worker the calling thread records for (kNoWorker: the process's first traced worker).
WorkerSlot currentWorker();
// Binds the calling thread to `slot` (an agent's own threads, for their lifetime).
void setCurrentWorker(WorkerSlot slot);

// Binds the calling thread to a worker for a block (a user thread calling through an agent). When tracing
// is off it does nothing (one relaxed load).
class WorkerScope {
 public:
  explicit WorkerScope(WorkerSlot slot) noexcept : WorkerScope(slot, enabled()) {}
  // For a caller that already read enabled() (one load per site): binds only when `active`.
  WorkerScope(WorkerSlot slot, bool active) noexcept : active_(active) {
    if (active_) {
      previous_ = currentWorker();
      setCurrentWorker(slot);
    }
  }
  ~WorkerScope() {
    if (active_) setCurrentWorker(previous_);
  }
  WorkerScope(const WorkerScope&) = delete;
  WorkerScope& operator=(const WorkerScope&) = delete;

 private:
  bool active_;
  WorkerSlot previous_ = kNoWorker;
};

// Names the calling thread in every trace file it appears in ("dg-agent-0", "dg-timer", ...). Cheap and
// allocation-free for the recorder until the thread records its first event.
void setThreadName(std::string_view name);

// The latest clock offset estimate of worker `slot` to `peer`: add offsetNs to this worker's times to get
// the peer's (docs/wire_protocol.md, "Clock offsets"). Written to the file as a clock line at the next flush.
void setClockOffset(WorkerSlot slot, const std::string& peer, int peerRank, int64_t offsetNs, int64_t rttNs,
                    uint64_t samples);

// Writes every event buffered so far to its worker's file (appending). Returns the number of event lines
// written. Thread-safe; events being recorded meanwhile are written by the next flush.
uint64_t flush();

// Pauses (or resumes) recording without unregistering anything: e.g. to trace only some steps.
void setPaused(bool paused);

// Counters since the process started (for tests and the benchmark).
struct Stats {
  uint64_t recorded = 0;        // events recorded (an RpcRecord counts as the events it stands for)
  uint64_t records = 0;         // records appended (slots used: an Event or an RpcRecord each)
  uint64_t written = 0;         // event lines written to files
  uint64_t dropped = 0;         // events of workers that write no file (or whose file failed)
  uint64_t bufferedChunks = 0;  // chunks allocated and not yet freed
  uint64_t readyChunks = 0;     // chunks waiting in the pool for a recording thread (written ones kept
                                // for reuse, fresh ones the writer mapped in ahead); 0 when nothing traces
  uint64_t catchUpFlushes = 0;  // flushes the writer made itself because the idle-priority flusher fell
                                // behind (Note [Idle flusher] in trace.cpp)
};
Stats stats();
// Chunks allocated and not yet freed (one atomic load).
uint64_t bufferedChunks();

// Bytes of buffered events above which the background writer writes them to the files (it checks every
// 50 ms). Default kDefaultFlushThresholdBytes; 0 writes whatever is buffered at every check.
inline constexpr uint64_t kDefaultFlushThresholdBytes = uint64_t{256} << 20;
void setFlushThreshold(uint64_t bytes);

// Events per buffer chunk (a chunk is one allocation of kChunkEvents * sizeof(Event) bytes).
inline constexpr size_t kChunkEvents = 2048;

}  // namespace distgrad::trace
