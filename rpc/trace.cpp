#include "rpc/trace.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tensor/error.h"

namespace distgrad::trace {

namespace {

// Note [Trace buffers]
// Each thread that records owns a ThreadBuffer: a singly linked list of chunks. Only the owner appends,
// always to its tail chunk: it writes events[count], then stores count + 1 with release. When the tail is
// full it links a new chunk with a release store of `next` and never touches the old one again. The writer
// (flush, under gMutex) walks from `head`: it loads `next` (acquire) BEFORE `count` (acquire), so a chunk
// whose next it saw set has its final count; it writes events [readIndex, count) and frees a chunk only
// when it is full, completely written and has a successor (the owner has left it). A thread that exits
// marks its buffer; the writer (or the exiting thread itself, when nothing is left) frees it once drained.
struct Chunk {
  std::atomic<uint32_t> count{0};
  std::atomic<Chunk*> next{nullptr};
  Event events[kChunkEvents];
};

struct ThreadBuffer {
  // Owner thread only.
  Chunk* tail = nullptr;
  // Published by the owner, read by the writer.
  std::atomic<Chunk*> first{nullptr};
  std::atomic<uint64_t> appended{0};  // written only by the owner
  std::atomic<bool> exited{false};
  const int64_t tid;
  // GUARDED_BY(gMutex)
  Chunk* head = nullptr;
  uint32_t readIndex = 0;
  std::string name;
  uint64_t nameVersion = 0;

  explicit ThreadBuffer(int64_t threadId) : tid(threadId) {}
  ~ThreadBuffer() {
    Chunk* chunk = head != nullptr ? head : first.load(std::memory_order_acquire);
    while (chunk != nullptr) {
      Chunk* next = chunk->next.load(std::memory_order_acquire);
      delete chunk;
      chunk = next;
    }
  }
};

struct ClockLine {
  int peerRank = -1;
  int64_t offsetNs = 0;
  int64_t rttNs = 0;
  uint64_t samples = 0;
  bool dirty = false;
};

struct Worker {
  std::string name;
  int rank = 0;
  std::string path;  // empty: this worker writes no file
  int64_t skewNs = 0;
  std::FILE* file = nullptr;
  bool failed = false;  // a write failed: the rest is dropped (reported once)
  uint64_t eventsWritten = 0;
  std::map<std::string, ClockLine> clocks;
  std::map<int64_t, uint64_t> threadsAnnounced;  // tid -> name version written
  std::string pending;                           // lines of the flush in progress
};

// The recorder's state. Leaked on purpose: threads may record (and exit) during static destruction.
struct Recorder {
  std::mutex mutex;
  std::vector<std::unique_ptr<ThreadBuffer>> buffers;  // GUARDED_BY(mutex)
  std::map<WorkerSlot, Worker> workers;                 // GUARDED_BY(mutex)
  WorkerSlot nextSlot = 1;                              // GUARDED_BY(mutex)
  int tracing = 0;                                      // GUARDED_BY(mutex): workers with a file
  bool paused = false;                                  // GUARDED_BY(mutex)
  uint64_t retiredAppended = 0;                         // GUARDED_BY(mutex): events of freed buffers
  uint64_t written = 0;                                 // GUARDED_BY(mutex)
  uint64_t dropped = 0;                                 // GUARDED_BY(mutex)
  std::atomic<uint64_t> chunks{0};
  // The first traced worker: where events of threads bound to no worker go.
  std::atomic<WorkerSlot> defaultWorker{kNoWorker};

  std::mutex internMutex;
  std::unordered_set<std::string> interned;  // GUARDED_BY(internMutex); node-based: c_str() is stable
};

Recorder& recorder() {
  static Recorder* instance = new Recorder();
  return *instance;
}

thread_local ThreadBuffer* tBuffer = nullptr;
thread_local WorkerSlot tWorker = kNoWorker;

int64_t currentTid() { return static_cast<int64_t>(::syscall(SYS_gettid)); }

// The thread's chosen name, kept outside the recorder so naming a thread costs the recorder nothing until
// the thread records.
std::string& threadNameSlot() {
  thread_local std::string name;
  return name;
}

void updateEnabledLocked(Recorder& r) {
  r.defaultWorker.store(kNoWorker, std::memory_order_relaxed);
  for (const auto& [slot, worker] : r.workers) {
    if (!worker.path.empty()) {
      r.defaultWorker.store(slot, std::memory_order_relaxed);
      break;
    }
  }
  detail::gEnabled.store(r.tracing > 0 && !r.paused, std::memory_order_relaxed);
}

bool drainedLocked(const ThreadBuffer& buffer) {
  const Chunk* chunk = buffer.head != nullptr ? buffer.head : buffer.first.load(std::memory_order_acquire);
  if (chunk == nullptr) return true;
  if (chunk->next.load(std::memory_order_acquire) != nullptr) return false;
  return buffer.readIndex == chunk->count.load(std::memory_order_acquire);
}

// Runs at thread exit for threads that created a buffer.
struct ThreadExit {
  ~ThreadExit() {
    ThreadBuffer* buffer = tBuffer;
    if (buffer == nullptr) return;
    tBuffer = nullptr;
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mutex);
    buffer->exited.store(true, std::memory_order_release);
    if (!drainedLocked(*buffer)) return;  // the next flush writes the rest, then frees it
    for (auto it = r.buffers.begin(); it != r.buffers.end(); ++it) {
      if (it->get() != buffer) continue;
      r.retiredAppended += buffer->appended.load(std::memory_order_relaxed);
      uint64_t freed = 0;
      for (Chunk* c = buffer->head != nullptr ? buffer->head : buffer->first.load(std::memory_order_acquire);
           c != nullptr; c = c->next.load(std::memory_order_acquire)) {
        ++freed;
      }
      r.chunks.fetch_sub(freed, std::memory_order_relaxed);
      r.buffers.erase(it);
      break;
    }
  }
};

ThreadBuffer* attachThread() {
  thread_local ThreadExit exitHook;
  (void)&exitHook;  // odr-use: constructs it, so its destructor runs when the thread exits
  auto buffer = std::make_unique<ThreadBuffer>(currentTid());
  ThreadBuffer* raw = buffer.get();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  raw->name = threadNameSlot();
  raw->nameVersion = 1;
  r.buffers.push_back(std::move(buffer));
  tBuffer = raw;
  return raw;
}

Chunk* newChunk(ThreadBuffer& buffer) {
  auto* chunk = new Chunk();
  recorder().chunks.fetch_add(1, std::memory_order_relaxed);
  if (buffer.tail == nullptr) {
    buffer.first.store(chunk, std::memory_order_release);
  } else {
    buffer.tail->next.store(chunk, std::memory_order_release);
  }
  buffer.tail = chunk;
  return chunk;
}

// ---- JSON writing ----

void appendEscaped(std::string& out, std::string_view text) {
  out += '"';
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out += escaped;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

void appendInt(std::string& out, int64_t value) {
  char digits[24];
  auto [end, ec] = std::to_chars(digits, digits + sizeof(digits), value);
  (void)ec;
  out.append(digits, end);
}

void appendUint(std::string& out, uint64_t value) {
  char digits[24];
  auto [end, ec] = std::to_chars(digits, digits + sizeof(digits), value);
  (void)ec;
  out.append(digits, end);
}

void appendField(std::string& out, std::string_view key, int64_t value) {
  out += ",\"";
  out += key;
  out += "\":";
  appendInt(out, value);
}

void appendEvent(std::string& out, const Event& e, int64_t tid, int64_t skewNs) {
  out += "{\"type\":\"";
  out += eventKindName(e.kind);
  out += "\",\"name\":";
  appendEscaped(out, e.name != nullptr ? e.name : "");
  out += ",\"cat\":\"";
  out += categoryName(e.category);
  out += '"';
  appendField(out, "tid", tid);
  appendField(out, "b", e.beginNs + skewNs);
  appendField(out, "e", e.endNs + skewNs);
  if (e.flow != 0) {
    out += ",\"flow\":";
    appendUint(out, e.flow);
    if (e.flowPhase != FlowPhase::kNone) {
      out += ",\"flow_phase\":\"";
      out += flowPhaseName(e.flowPhase);
      out += '"';
    }
  }
  static constexpr std::string_view kArgNames[kMaxArgs] = {"a0", "a1", "a2"};
  for (int i = 0; i < e.argCount && i < kMaxArgs; ++i) appendField(out, kArgNames[i], e.args[i]);
  if (e.detail != nullptr) {
    out += ",\"detail\":";
    appendEscaped(out, e.detail);
  }
  out += "}\n";
}

void writePending(Worker& worker) {
  if (worker.pending.empty()) return;
  if (worker.file != nullptr && !worker.failed) {
    const size_t n = std::fwrite(worker.pending.data(), 1, worker.pending.size(), worker.file);
    if (n != worker.pending.size() || std::fflush(worker.file) != 0) {
      worker.failed = true;
      std::fprintf(stderr, "[distgrad] trace: writing %s failed; the rest of worker %s's trace is dropped\n",
                   worker.path.c_str(), worker.name.c_str());
    }
  }
  worker.pending.clear();
}

void appendClockLinesLocked(Worker& worker) {
  for (auto& [peer, clock] : worker.clocks) {
    if (!clock.dirty) continue;
    clock.dirty = false;
    worker.pending += "{\"type\":\"clock\",\"peer\":";
    appendEscaped(worker.pending, peer);
    appendField(worker.pending, "peer_rank", clock.peerRank);
    appendField(worker.pending, "offset_ns", clock.offsetNs);
    appendField(worker.pending, "rtt_ns", clock.rttNs);
    appendField(worker.pending, "samples", static_cast<int64_t>(clock.samples));
    worker.pending += "}\n";
  }
}

// Writes every buffered event to its worker's file and frees what the threads left behind.
uint64_t flushLocked(Recorder& r) {
  uint64_t lines = 0;
  for (auto it = r.buffers.begin(); it != r.buffers.end();) {
    ThreadBuffer& buffer = **it;
    if (buffer.head == nullptr) buffer.head = buffer.first.load(std::memory_order_acquire);
    while (buffer.head != nullptr) {
      Chunk* chunk = buffer.head;
      // `next` before `count`: once the owner linked a successor, the count read after it is final.
      Chunk* next = chunk->next.load(std::memory_order_acquire);
      const uint32_t count = chunk->count.load(std::memory_order_acquire);
      for (uint32_t i = buffer.readIndex; i < count; ++i) {
        const Event& e = chunk->events[i];
        auto worker = r.workers.find(e.worker);
        if (worker == r.workers.end() || worker->second.file == nullptr || worker->second.failed) {
          ++r.dropped;
          continue;
        }
        Worker& w = worker->second;
        auto announced = w.threadsAnnounced.find(buffer.tid);
        if (announced == w.threadsAnnounced.end() || announced->second != buffer.nameVersion) {
          w.threadsAnnounced[buffer.tid] = buffer.nameVersion;
          w.pending += "{\"type\":\"thread\"";
          appendField(w.pending, "tid", buffer.tid);
          w.pending += ",\"name\":";
          appendEscaped(w.pending, buffer.name.empty() ? "thread-" + std::to_string(buffer.tid) : buffer.name);
          w.pending += "}\n";
        }
        appendEvent(w.pending, e, buffer.tid, w.skewNs);
        ++w.eventsWritten;
        ++r.written;
        ++lines;
      }
      buffer.readIndex = count;
      if (next == nullptr) break;
      // Full, written, and the owner moved on: nobody touches this chunk again.
      buffer.head = next;
      buffer.readIndex = 0;
      delete chunk;
      r.chunks.fetch_sub(1, std::memory_order_relaxed);
    }
    if (buffer.exited.load(std::memory_order_acquire) && drainedLocked(buffer)) {
      r.retiredAppended += buffer.appended.load(std::memory_order_relaxed);
      if (buffer.head != nullptr) r.chunks.fetch_sub(1, std::memory_order_relaxed);
      it = r.buffers.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& [slot, worker] : r.workers) {
    if (worker.file == nullptr) continue;
    appendClockLinesLocked(worker);
    writePending(worker);
  }
  return lines;
}

int64_t pid() { return static_cast<int64_t>(::getpid()); }

}  // namespace

const char* categoryName(Category category) {
  switch (category) {
    case Category::kUser:
      return "user";
    case Category::kRpcClient:
      return "rpc_client";
    case Category::kRpcServer:
      return "rpc_server";
    case Category::kTransport:
      return "transport";
    case Category::kRRef:
      return "rref";
    case Category::kAutograd:
      return "autograd";
    case Category::kOptimizer:
      return "optimizer";
    case Category::kPipeline:
      return "pipeline";
  }
  return "unknown";
}

const char* flowPhaseName(FlowPhase phase) {
  switch (phase) {
    case FlowPhase::kNone:
      return "";
    case FlowPhase::kStart:
      return "start";
    case FlowPhase::kStep:
      return "step";
    case FlowPhase::kEnd:
      return "end";
  }
  return "";
}

const char* eventKindName(EventKind kind) {
  switch (kind) {
    case EventKind::kSpan:
      return "span";
    case EventKind::kInstant:
      return "instant";
    case EventKind::kAsync:
      return "async";
  }
  return "span";
}

const char* intern(std::string_view text) {
  // Keys are views of the interned strings themselves, which never move or die.
  thread_local std::unordered_map<std::string_view, const char*> cache;
  auto hit = cache.find(text);
  if (hit != cache.end()) return hit->second;
  Recorder& r = recorder();
  const std::string* stored = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.internMutex);
    stored = &*r.interned.emplace(text).first;
  }
  cache.emplace(std::string_view(*stored), stored->c_str());
  return stored->c_str();
}

void record(Event event) {
  if (event.worker == kNoWorker) {
    event.worker = tWorker != kNoWorker ? tWorker : recorder().defaultWorker.load(std::memory_order_relaxed);
  }
  ThreadBuffer* buffer = tBuffer;
  if (buffer == nullptr) buffer = attachThread();
  Chunk* chunk = buffer->tail;
  uint32_t n = chunk != nullptr ? chunk->count.load(std::memory_order_relaxed) : 0;
  if (chunk == nullptr || n == kChunkEvents) {
    chunk = newChunk(*buffer);
    n = 0;
  }
  chunk->events[n] = event;
  chunk->count.store(n + 1, std::memory_order_release);
  buffer->appended.store(buffer->appended.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

namespace {
Event makeEvent(const char* name, Category category, EventKind kind, int64_t beginNs, int64_t endNs,
                std::initializer_list<int64_t> args, uint64_t flow, FlowPhase phase, const char* detail) {
  Event e;
  e.name = name;
  e.detail = detail;
  e.category = category;
  e.kind = kind;
  e.beginNs = beginNs;
  e.endNs = endNs;
  e.flow = flow;
  e.flowPhase = flow != 0 ? phase : FlowPhase::kNone;
  for (int64_t a : args) {
    if (e.argCount == kMaxArgs) break;
    e.args[e.argCount++] = a;
  }
  return e;
}
}  // namespace

void recordSpan(const char* name, Category category, int64_t beginNs, int64_t endNs,
                std::initializer_list<int64_t> args, uint64_t flow, FlowPhase phase, const char* detail) {
  record(makeEvent(name, category, EventKind::kSpan, beginNs, endNs, args, flow, phase, detail));
}

void recordAsync(const char* name, Category category, int64_t beginNs, int64_t endNs,
                 std::initializer_list<int64_t> args, uint64_t flow, const char* detail) {
  record(makeEvent(name, category, EventKind::kAsync, beginNs, endNs, args, flow, FlowPhase::kNone, detail));
}

void recordInstant(const char* name, Category category, int64_t atNs, std::initializer_list<int64_t> args,
                   const char* detail) {
  record(makeEvent(name, category, EventKind::kInstant, atNs, atNs, args, 0, FlowPhase::kNone, detail));
}

void instant(const char* name, Category category, std::initializer_list<int64_t> args, const char* detail) {
  if (!enabled()) return;
  const int64_t now = nowNs();
  record(makeEvent(name, category, EventKind::kInstant, now, now, args, 0, FlowPhase::kNone, detail));
}

void Scope::end() {
  if (!active_) return;
  active_ = false;
  event_.endNs = nowNs();
  record(event_);
}

WorkerSlot registerWorker(const std::string& name, int rank, const std::string& directory, int64_t clockSkewNs) {
  Worker worker;
  worker.name = name;
  worker.rank = rank;
  worker.skewNs = clockSkewNs;
  if (!directory.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(directory, ec);
    DG_CHECK(!ec, "trace directory '", directory, "' cannot be created: ", ec.message());
    worker.path = (std::filesystem::path(directory) / (name + ".trace.jsonl")).string();
    worker.file = std::fopen(worker.path.c_str(), "w");
    DG_CHECK(worker.file != nullptr, "trace file '", worker.path, "' cannot be opened for writing");
    std::string header = "{\"distgrad_trace\":1,\"worker\":";
    appendEscaped(header, name);
    appendField(header, "rank", rank);
    appendField(header, "pid", pid());
    header += ",\"clock\":\"steady_ns\"";
    appendField(header, "start_ns", nowNs() + clockSkewNs);
    header += "}\n";
    worker.pending = std::move(header);
    writePending(worker);
    DG_CHECK(!worker.failed, "trace file '", worker.path, "' cannot be written");
  }
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  const WorkerSlot slot = r.nextSlot++;
  if (worker.file != nullptr) ++r.tracing;
  r.workers.emplace(slot, std::move(worker));
  updateEnabledLocked(r);
  return slot;
}

void unregisterWorker(WorkerSlot slot) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.workers.find(slot);
  if (it == r.workers.end()) return;
  flushLocked(r);
  Worker& worker = it->second;
  if (worker.file != nullptr) {
    worker.pending += "{\"type\":\"end\"";
    appendField(worker.pending, "end_ns", nowNs() + worker.skewNs);
    appendField(worker.pending, "events", static_cast<int64_t>(worker.eventsWritten));
    worker.pending += "}\n";
    writePending(worker);
    std::fclose(worker.file);
    --r.tracing;
  }
  r.workers.erase(it);
  updateEnabledLocked(r);
}

std::string workerFile(WorkerSlot slot) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.workers.find(slot);
  return it == r.workers.end() ? std::string() : it->second.path;
}

WorkerSlot currentWorker() { return tWorker; }

void setCurrentWorker(WorkerSlot slot) { tWorker = slot; }

void setThreadName(std::string_view name) {
  threadNameSlot().assign(name);
  ThreadBuffer* buffer = tBuffer;
  if (buffer == nullptr) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  buffer->name.assign(name);
  ++buffer->nameVersion;
}

void setClockOffset(WorkerSlot slot, const std::string& peer, int peerRank, int64_t offsetNs, int64_t rttNs,
                    uint64_t samples) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.workers.find(slot);
  if (it == r.workers.end() || it->second.file == nullptr) return;
  ClockLine& line = it->second.clocks[peer];
  line.peerRank = peerRank;
  line.offsetNs = offsetNs;
  line.rttNs = rttNs;
  line.samples = samples;
  line.dirty = true;
}

uint64_t flush() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return flushLocked(r);
}

void setPaused(bool paused) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.paused = paused;
  updateEnabledLocked(r);
}

Stats stats() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  Stats s;
  s.recorded = r.retiredAppended;
  for (const auto& buffer : r.buffers) s.recorded += buffer->appended.load(std::memory_order_relaxed);
  s.written = r.written;
  s.dropped = r.dropped;
  s.bufferedChunks = r.chunks.load(std::memory_order_relaxed);
  return s;
}

uint64_t bufferedChunks() { return recorder().chunks.load(std::memory_order_relaxed); }

}  // namespace distgrad::trace
