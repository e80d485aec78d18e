#include "rpc/trace.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tensor/error.h"

namespace distgrad::trace {

namespace {

// Note [Trace buffers]
// Each thread that records owns a ThreadBuffer: a singly linked list of chunks. Only the owner appends,
// always to its tail chunk: it writes record `count` (at the byte offset where the previous one ended),
// then stores count + 1 with release. When the tail is full it links a new chunk with a release store of
// `next` and never touches the old one again. The writer (a flush, under flushMutex) walks from `head`: it
// loads `next` (acquire) BEFORE `count` (acquire), so a chunk whose next it saw set has its final count; it
// writes records [readIndex, count) (each found after the previous one by its kind's size: readOffset) and
// frees a chunk only when it is full, completely written and has a successor (the owner has left it). A
// thread that exits marks its buffer; the next flush (or the exiting thread itself, when nothing is left)
// frees it.
//
// Locks, in order: writerMutex (starting / stopping the writer thread), flushMutex (a whole flush, and
// registering or unregistering a worker), mutex (the buffer list, thread names, the enabled state; only
// ever held briefly, so a recording thread that registers its buffer or names itself never waits for a
// flush writing a file), then the leaves clockMutex and poolMutex.
// What a slot holds (Chunk::kinds).
enum SlotKind : uint8_t { kSlotEvent = 0, kSlotRpc = 1, kSlotPackedRpc = 2, kSlotPackedHandled = 3 };

// Note [Packed RPC records]
// What an RPC costs its threads is mostly the bytes its records take: a traced run keeps them in memory, so
// every record is written into memory the thread has not touched before (a cache miss per line, and memory
// to map in: Note [Ready chunks]). recordRpc therefore stores an RpcRecord in 32 bytes instead of an
// event's 72 when its values fit: t1 and t2 as offsets from t0 (< 2^32 ns, 4.29 s); the call id below 2^39;
// the function as a 16-bit id into the recorder's name table (nameId: the first 65,535 distinct names);
// site, flags and status in one byte; the frame's bytes below 4 GiB; peer and worker slot below 2^16; and a
// flow only if it is the one the site implies (a bit says which: the caller's sites carry
// callFlowId(own rank, call), kServerExecute callFlowId(peer, call)). A record that does not fit (a wait of
// seconds, a huge frame, a foreign flow) is stored whole (kSlotRpc); both expand to the same events, so a
// file does not show the difference. A kServerHandled record (five times) packs into 40 bytes
// (PackedHandled); one that does not fit is stored as its kServerExecute and kServerReply records. (48 bytes
// before, with the name's pointer and the flow's top 16 bits, and no kServerHandled: 240 bytes per traced
// RPC, now 136.)
struct PackedRpc {
  int64_t t0 = 0;
  uint32_t t1Offset = 0;  // t[1] - t[0]
  uint32_t t2Offset = 0;  // t[2] - t[0]
  uint64_t key = 0;       // call | hasFlow | name id | site | flags | status (the kKey* fields below)
  uint32_t bytes = 0;
  uint16_t peer = 0;  // rank + 1 (0: none)
  uint16_t worker = 0;
};
static_assert(sizeof(PackedRpc) == 32, "a packed RPC record takes 32 bytes");

struct PackedHandled {
  PackedRpc base;         // t0..t2 and the rest
  uint32_t t3Offset = 0;  // t[3] - t[0]
  uint32_t t4Offset = 0;  // t[4] - t[0]
};
static_assert(sizeof(PackedHandled) == 40, "a packed kServerHandled record takes 40 bytes");

// A record that does not pack (kSlotRpc): an RpcRecord of a three-time site, stored whole.
struct WholeRpc {
  int64_t t[3] = {0, 0, 0};
  int64_t bytes = 0;
  uint64_t call = 0;
  uint64_t flow = 0;
  const char* function = nullptr;
  int32_t peer = -1;
  WorkerSlot worker = kNoWorker;
  RpcSite site = RpcSite::kClientSend;
  uint8_t status = 0;
  uint8_t flags = 0;
};

// PackedRpc::key, from the low bits up: the call id (39 bits), whether the record has its site's flow (1),
// the name id (16), the site (3), the flags (2) and the status (3).
constexpr int kKeyCallBits = 39;
constexpr int kKeyFlowShift = kKeyCallBits;
constexpr int kKeyNameShift = kKeyFlowShift + 1;
constexpr int kKeySiteShift = kKeyNameShift + 16;
constexpr int kKeyFlagsShift = kKeySiteShift + 3;
constexpr int kKeyStatusShift = kKeyFlagsShift + 2;
static_assert(kKeyStatusShift + 3 == 64, "the key's fields fill 64 bits");
constexpr uint64_t kKeyCallMask = (uint64_t{1} << kKeyCallBits) - 1;
constexpr uint32_t kMaxNameId = 0xFFFF;  // ids 1..kMaxNameId; 0 = no name

// The rank whose callFlowId a record of `site` carries: the worker's own (`ownRank`) at the caller's sites,
// the caller's (`peer`) at kServerExecute; -1 for the sites that carry no flow.
int flowOrigin(RpcSite site, int ownRank, int peer) {
  switch (site) {
    case RpcSite::kClientSend:
    case RpcSite::kClientReply: return ownRank;
    case RpcSite::kServerExecute:
    case RpcSite::kServerHandled: return peer;
    default: return -1;
  }
}

// The record `p` stands for, with `names` (a copy of the name table holding its name id) and `ownRank` (the
// rank of its worker, which its flow may need).
inline RpcRecord unpackRpc(const PackedRpc& p, const std::vector<const char*>& names, int ownRank) {
  RpcRecord r;
  r.t[0] = p.t0;
  r.t[1] = p.t0 + static_cast<int64_t>(p.t1Offset);
  r.t[2] = p.t0 + static_cast<int64_t>(p.t2Offset);
  r.bytes = static_cast<int64_t>(p.bytes);
  r.call = p.key & kKeyCallMask;
  const auto name = static_cast<uint32_t>((p.key >> kKeyNameShift) & 0xFFFF);
  r.function = name < names.size() ? names[name] : nullptr;
  r.peer = static_cast<int32_t>(p.peer) - 1;
  r.worker = p.worker;
  r.site = static_cast<RpcSite>((p.key >> kKeySiteShift) & 7);
  r.flags = static_cast<uint8_t>((p.key >> kKeyFlagsShift) & 3);
  r.status = static_cast<uint8_t>((p.key >> kKeyStatusShift) & 7);
  if (((p.key >> kKeyFlowShift) & 1) != 0) r.flow = callFlowId(flowOrigin(r.site, ownRank, r.peer), r.call);
  return r;
}

inline RpcRecord unpackHandled(const PackedHandled& p, const std::vector<const char*>& names, int ownRank) {
  RpcRecord r = unpackRpc(p.base, names, ownRank);
  r.t[3] = p.base.t0 + static_cast<int64_t>(p.t3Offset);
  r.t[4] = p.base.t0 + static_cast<int64_t>(p.t4Offset);
  return r;
}

// Copies what an RpcRecord and a WholeRpc share (every field; a WholeRpc has three times).
template <typename From, typename To>
void copyRpcFields(const From& from, To& to) {
  for (int i = 0; i < 3; ++i) to.t[i] = from.t[i];
  to.bytes = from.bytes;
  to.call = from.call;
  to.flow = from.flow;
  to.function = from.function;
  to.peer = from.peer;
  to.worker = from.worker;
  to.site = from.site;
  to.status = from.status;
  to.flags = from.flags;
}

inline RpcRecord fromWhole(const WholeRpc& w) {
  RpcRecord r;
  copyRpcFields(w, r);
  return r;
}

// A chunk's storage: kChunkEvents events' worth of bytes, holding records of two sizes (an Event or a
// whole RpcRecord: sizeof(Event); a PackedRpc: 32 bytes), one after the other.
constexpr size_t kChunkBytes = kChunkEvents * sizeof(Event);
constexpr size_t kChunkRecords = kChunkBytes / sizeof(PackedRpc);  // the most a chunk can hold
constexpr uint32_t slotBytes(uint8_t kind) {
  return kind == kSlotPackedRpc       ? static_cast<uint32_t>(sizeof(PackedRpc))
         : kind == kSlotPackedHandled ? static_cast<uint32_t>(sizeof(PackedHandled))
                                      : static_cast<uint32_t>(sizeof(Event));
}
static_assert(sizeof(WholeRpc) <= sizeof(Event), "a whole RPC record takes an event's slot");
static_assert(sizeof(Event) % alignof(Event) == 0 && sizeof(PackedRpc) % alignof(Event) == 0 &&
                  sizeof(PackedHandled) % alignof(Event) == 0,
              "every record starts aligned");

struct Chunk {
  std::atomic<uint32_t> count{0};
  std::atomic<Chunk*> next{nullptr};
  // Raw storage: a record is constructed in place when recorded, so a chunk (allocated with plain
  // `new Chunk`, default-initialised) costs no pass over its bytes. kinds[i] says what record i is (and so
  // its size: the reader finds record i + 1 after it); both are published by the release store of `count`.
  uint8_t kinds[kChunkRecords];
  alignas(64) unsigned char storage[kChunkBytes];

  template <typename Record>
  void put(uint32_t i, uint32_t offset, SlotKind kind, const Record& record) {
    kinds[i] = kind;
    new (storage + offset) Record(record);
  }
  template <typename Record>
  const Record& at(uint32_t offset) const {
    return *std::launder(reinterpret_cast<const Record*>(storage + offset));
  }
};

void releaseChunk(Chunk* chunk);

struct ThreadBuffer {
  // Owner thread only.
  Chunk* tail = nullptr;
  uint32_t tailBytes = 0;  // bytes of the tail's storage in use
  // Published by the owner, read by the writer.
  std::atomic<Chunk*> first{nullptr};
  std::atomic<uint64_t> appended{0};  // events (an RpcRecord counts as its events); written only by the owner
  std::atomic<uint64_t> records{0};   // slots used; written only by the owner
  std::atomic<bool> exited{false};
  const int64_t tid;
  // GUARDED_BY(flushMutex): the writer's position.
  Chunk* head = nullptr;
  uint32_t readIndex = 0;
  uint32_t readOffset = 0;  // where record readIndex starts in head's storage
  // GUARDED_BY(mutex)
  std::string name;
  uint64_t nameVersion = 0;

  explicit ThreadBuffer(int64_t threadId) : tid(threadId) {}
  ~ThreadBuffer() {
    Chunk* chunk = head != nullptr ? head : first.load(std::memory_order_acquire);
    while (chunk != nullptr) {
      Chunk* next = chunk->next.load(std::memory_order_acquire);
      releaseChunk(chunk);
      chunk = next;
    }
  }
};

// The lines of a flush in progress: a growable byte buffer written through raw pointers (an event line is
// formatted in place, without a string append per field: the writer's cost per event is what a long traced
// run pays for its file). A flush writes it out whenever it holds kWriteBytes, so it stays that small
// however much was buffered (a flush at shutdown formats everything the run recorded).
class OutBuffer {
 public:
  // A pointer to at least `n` writable bytes at the end; commit() how many were used.
  char* reserve(size_t n) {
    if (size_ + n > capacity_) {
      const size_t capacity = std::max(capacity_ * 2, size_ + n + 4096);
      auto grown = std::make_unique_for_overwrite<char[]>(capacity);  // no pass over fresh bytes
      if (size_ != 0) std::memcpy(grown.get(), data_.get(), size_);
      data_ = std::move(grown);
      capacity_ = capacity;
    }
    return data_.get() + size_;
  }
  void commit(const char* end) { size_ = static_cast<size_t>(end - data_.get()); }
  void append(std::string_view text) {
    char* p = reserve(text.size());
    std::memcpy(p, text.data(), text.size());
    size_ += text.size();
  }
  const char* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  void clear() { size_ = 0; }

 private:
  std::unique_ptr<char[]> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

struct ClockLine {
  int peerRank = -1;
  int64_t offsetNs = 0;
  int64_t rttNs = 0;
  uint64_t samples = 0;
  bool dirty = false;
};

// A registered worker. The map of workers changes only under flushMutex and mutex together, so either
// lock makes reading it safe; the fields below `path` are the flush's (flushMutex), except `clocks`.
struct Worker {
  std::string name;
  int rank = 0;
  std::string path;  // empty: this worker writes no file
  int64_t skewNs = 0;
  std::FILE* file = nullptr;
  bool failed = false;  // a write failed: the rest is dropped (reported once)
  uint64_t eventsWritten = 0;
  std::map<int64_t, uint64_t> threadsAnnounced;  // tid -> name version written
  OutBuffer pending;                             // lines of the flush in progress
  std::map<std::string, ClockLine> clocks;       // GUARDED_BY(clockMutex)
};

// The recorder's state. Leaked on purpose: threads may record (and exit) during static destruction.
struct Recorder {
  std::mutex flushMutex;
  std::mutex mutex;
  std::mutex clockMutex;
  std::vector<std::unique_ptr<ThreadBuffer>> buffers;  // GUARDED_BY(mutex); freed only under flushMutex too
  std::map<WorkerSlot, Worker> workers;                // see Worker
  WorkerSlot nextSlot = 1;                             // GUARDED_BY(mutex)
  int tracing = 0;                                     // GUARDED_BY(mutex): workers with a file
  bool paused = false;                                 // GUARDED_BY(mutex)
  uint64_t retiredAppended = 0;                        // GUARDED_BY(mutex): events of freed buffers
  uint64_t retiredRecords = 0;                         // GUARDED_BY(mutex): records of freed buffers
  std::atomic<uint64_t> written{0};
  std::atomic<uint64_t> dropped{0};
  std::atomic<uint64_t> chunks{0};
  std::atomic<uint64_t> flushChunks{std::max<uint64_t>(1, kDefaultFlushThresholdBytes / sizeof(Chunk))};
  // The background writer runs while some worker traces (Note [Trace writer]).
  std::mutex writerMutex;              // serialises starting and stopping it
  std::thread writer;                  // GUARDED_BY(writerMutex)
  std::condition_variable writerWake;  // with `mutex`
  bool writerStop = false;             // GUARDED_BY(mutex)
  // Note [Idle flusher]: the writer's flushes, made at idle priority by the flusher thread.
  std::condition_variable flusherWake;  // with `mutex`
  bool flushRequested = false;          // GUARDED_BY(mutex)
  std::atomic<int> flushWaiters{0};     // threads other than the flusher waiting for flushMutex (FlushLock)
  std::atomic<uint64_t> catchUpFlushes{0};
  // The first traced worker: where events of threads bound to no worker go.
  std::atomic<WorkerSlot> defaultWorker{kNoWorker};

  // Chunks ready for a recording thread: written and freed ones kept for reuse, and fresh ones the writer
  // mapped in ahead (Note [Ready chunks]); at most kPooledChunks.
  std::mutex poolMutex;                  // a leaf
  std::vector<Chunk*> pool;              // GUARDED_BY(poolMutex)
  std::atomic<uint64_t> chunksTaken{0};  // chunks recording threads started, for the writer's refill

  std::mutex internMutex;
  std::unordered_set<std::string> interned;  // GUARDED_BY(internMutex); node-based: c_str() is stable

  // The name table of packed RPC records (Note [Packed RPC records]): id -> name (names[0] = none), and back.
  std::mutex nameMutex;                               // a leaf
  std::vector<const char*> names{nullptr};            // GUARDED_BY(nameMutex); only grows
  std::unordered_map<const char*, uint32_t> nameIds;  // GUARDED_BY(nameMutex)
};

Recorder& recorder() {
  static Recorder* instance = new Recorder();
  return *instance;
}

// flushMutex for every thread but the flusher, which stops between chunks while one waits here (Note [Idle
// flusher]): a waiter woken when the flusher let go would mostly lose the mutex to it again.
class FlushLock {
 public:
  explicit FlushLock(Recorder& r) : r_(r) {
    r_.flushWaiters.fetch_add(1, std::memory_order_relaxed);
    r_.flushMutex.lock();
    r_.flushWaiters.fetch_sub(1, std::memory_order_relaxed);
  }
  ~FlushLock() { r_.flushMutex.unlock(); }
  FlushLock(const FlushLock&) = delete;
  FlushLock& operator=(const FlushLock&) = delete;

 private:
  Recorder& r_;
};

constexpr size_t kPooledChunks = 64;

void releaseChunk(Chunk* chunk) {
  Recorder& r = recorder();
  {
    std::lock_guard<std::mutex> lock(r.poolMutex);
    if (r.pool.size() < kPooledChunks) {
      r.pool.push_back(chunk);
      return;
    }
  }
  delete chunk;
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
    // flushMutex: a flush in progress may be reading this buffer (the thread's exit waits for it).
    FlushLock flushLock(r);
    std::lock_guard<std::mutex> lock(r.mutex);
    buffer->exited.store(true, std::memory_order_release);
    if (!drainedLocked(*buffer)) return;  // the next flush writes the rest, then frees it
    for (auto it = r.buffers.begin(); it != r.buffers.end(); ++it) {
      if (it->get() != buffer) continue;
      r.retiredAppended += buffer->appended.load(std::memory_order_relaxed);
      r.retiredRecords += buffer->records.load(std::memory_order_relaxed);
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

// Note [Populated chunks]: a fresh chunk's pages are mapped in by one madvise(MADV_POPULATE_WRITE) when it
// is allocated, instead of by a page fault at the first record written into each of its 36 pages: the
// kernel does the same work (zeroed pages) without a trap per page, which is most of what fresh memory
// costs a recording thread (a traced run keeps its records in memory, so nearly every chunk is fresh).
// Best effort: a kernel without it (before Linux 5.14) faults the pages in as they are written.
void populate(Chunk* chunk) {
#ifdef MADV_POPULATE_WRITE
  const auto pageSize = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(chunk) + pageSize - 1) & ~(pageSize - 1);
  const auto end = (reinterpret_cast<uintptr_t>(chunk) + sizeof(Chunk)) & ~(pageSize - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
#else
  (void)chunk;
#endif
}

Chunk* newPopulatedChunk() {
  auto* chunk = new Chunk;  // default-initialised: the storage stays untouched
  populate(chunk);
  return chunk;
}

// Note [Ready chunks]: what a traced RPC costs its threads is mostly the fresh memory its records go to
// (a traced run keeps them in memory). Mapping a chunk in costs far more than writing records into it: on
// the 2-vCPU VM of bench_trace, a no-op call flood on one core took +0.8 us of CPU per call traced into
// fresh chunks and +0.3 us into reused ones (a page the hypervisor has not backed yet costs microseconds
// to touch, zeroing aside). So the writer thread, which wakes every kWriterPeriod while anything traces,
// tops the pool up with fresh chunks mapped in ahead: twice what the recording threads took in the last
// period (at least kMinReadyChunks, at most kPooledChunks), and a recording thread maps a chunk in itself
// only when a burst emptied the pool. The mapping is then done on the writer's thread, off the threads
// that do the job's work.
constexpr size_t kMinReadyChunks = 2;

void refillPool(Recorder& r, size_t target) {
  target = std::min(target, kPooledChunks);
  while (true) {
    {
      std::lock_guard<std::mutex> lock(r.poolMutex);
      if (r.pool.size() >= target) return;
    }
    Chunk* chunk = newPopulatedChunk();  // outside the lock: recording threads take chunks meanwhile
    std::lock_guard<std::mutex> lock(r.poolMutex);
    r.pool.push_back(chunk);
  }
}

// Frees the pool's chunks (the writer stopped: nothing traces).
void drainPool(Recorder& r) {
  std::vector<Chunk*> pool;
  {
    std::lock_guard<std::mutex> lock(r.poolMutex);
    pool.swap(r.pool);
  }
  for (Chunk* chunk : pool) delete chunk;
}

Chunk* newChunk(ThreadBuffer& buffer) {
  Recorder& r = recorder();
  Chunk* chunk = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.poolMutex);  // once per kChunkEvents events
    if (!r.pool.empty()) {
      chunk = r.pool.back();
      r.pool.pop_back();
    }
  }
  if (chunk == nullptr) {
    chunk = newPopulatedChunk();
  } else {
    // Not yet published: plain stores (relaxed) suffice; the release store that links it publishes them.
    chunk->count.store(0, std::memory_order_relaxed);
    chunk->next.store(nullptr, std::memory_order_relaxed);
  }
  r.chunks.fetch_add(1, std::memory_order_relaxed);
  r.chunksTaken.fetch_add(1, std::memory_order_relaxed);
  if (buffer.tail == nullptr) {
    buffer.first.store(chunk, std::memory_order_release);
  } else {
    buffer.tail->next.store(chunk, std::memory_order_release);
  }
  buffer.tail = chunk;
  buffer.tailBytes = 0;
  return chunk;
}

// ---- JSON writing ----

// Room an event line needs besides its name and detail (each escapes to at most 6 bytes per byte).
constexpr size_t kEventLineFixed = 320;

char* putText(char* p, std::string_view text) {
  std::memcpy(p, text.data(), text.size());
  return p + text.size();
}

char* putInt(char* p, int64_t value) { return std::to_chars(p, p + 24, value).ptr; }

// `text` as a JSON string (quotes included); `p` has room for 2 + 6 * text.size() bytes.
char* putEscaped(char* p, std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  *p++ = '"';
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c != '"' && c != '\\') {
      *p++ = ch;
      continue;
    }
    *p++ = '\\';
    switch (c) {
      case '"': *p++ = '"'; break;
      case '\\': *p++ = '\\'; break;
      case '\n': *p++ = 'n'; break;
      case '\r': *p++ = 'r'; break;
      case '\t': *p++ = 't'; break;
      default:
        p = putText(p, "u00");
        *p++ = kHex[c >> 4];
        *p++ = kHex[c & 15];
    }
  }
  *p++ = '"';
  return p;
}

void appendEscaped(OutBuffer& out, std::string_view text) {
  out.commit(putEscaped(out.reserve(2 + 6 * text.size()), text));
}

template <typename Out>
void appendField(Out& out, std::string_view key, int64_t value) {
  char text[64];
  char* p = putText(text, ",\"");
  p = putText(p, key);
  p = putText(p, "\":");
  p = putInt(p, value);
  out.append(std::string_view(text, static_cast<size_t>(p - text)));
}

void appendEvent(OutBuffer& out, const Event& e, int64_t tid, int64_t skewNs) {
  const std::string_view name = e.name != nullptr ? std::string_view(e.name) : std::string_view();
  const std::string_view detail = e.detail != nullptr ? std::string_view(e.detail) : std::string_view();
  char* p = out.reserve(kEventLineFixed + 6 * (name.size() + detail.size()));
  p = putText(p, "{\"type\":\"");
  p = putText(p, eventKindName(e.kind));
  p = putText(p, "\",\"name\":");
  p = putEscaped(p, name);
  p = putText(p, ",\"cat\":\"");
  p = putText(p, categoryName(e.category));
  p = putText(p, "\",\"tid\":");
  p = putInt(p, tid);
  p = putText(p, ",\"b\":");
  p = putInt(p, e.beginNs + skewNs);
  p = putText(p, ",\"e\":");
  p = putInt(p, e.endNs + skewNs);
  if (e.flow != 0) {
    p = putText(p, ",\"flow\":");
    p = std::to_chars(p, p + 24, e.flow).ptr;
    if (e.flowPhase != FlowPhase::kNone) {
      p = putText(p, ",\"flow_phase\":\"");
      p = putText(p, flowPhaseName(e.flowPhase));
      *p++ = '"';
    }
  }
  static constexpr std::string_view kArgKeys[kMaxArgs] = {",\"a0\":", ",\"a1\":", ",\"a2\":"};
  for (int i = 0; i < e.argCount && i < kMaxArgs; ++i) {
    p = putText(p, kArgKeys[i]);
    p = putInt(p, e.args[i]);
  }
  if (e.detail != nullptr) {
    p = putText(p, ",\"detail\":");
    p = putEscaped(p, detail);
  }
  p = putText(p, "}\n");
  out.commit(p);
}

// Bytes of lines a flush formats before it writes them to the worker's file.
constexpr size_t kWriteBytes = size_t{1} << 20;

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

// Caller holds flushMutex and clockMutex.
void appendClockLinesLocked(Worker& worker) {
  for (auto& [peer, clock] : worker.clocks) {
    if (!clock.dirty) continue;
    clock.dirty = false;
    worker.pending.append("{\"type\":\"clock\",\"peer\":");
    appendEscaped(worker.pending, peer);
    appendField(worker.pending, "peer_rank", clock.peerRank);
    appendField(worker.pending, "offset_ns", clock.offsetNs);
    appendField(worker.pending, "rtt_ns", clock.rttNs);
    appendField(worker.pending, "samples", static_cast<int64_t>(clock.samples));
    worker.pending.append("}\n");
  }
}

// Writes every buffered event to its worker's file and frees what the threads left behind; with a budget, stops
// once it wrote and released `maxChunks` full chunks (a slice: Note [Idle flusher]) and returns false in
// `finished`. Caller holds flushMutex (and not mutex: it is taken briefly, to list the buffers and to free
// exited ones).
uint64_t flushLocked(Recorder& r, uint64_t maxChunks = UINT64_MAX, bool* finished = nullptr) {
  struct Item {
    ThreadBuffer* buffer;
    std::string name;
    uint64_t nameVersion;
  };
  std::vector<Item> items;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    items.reserve(r.buffers.size());
    for (const auto& buffer : r.buffers) items.push_back({buffer.get(), buffer->name, buffer->nameVersion});
  }
  uint64_t lines = 0;
  uint64_t dropped = 0;
  uint64_t released = 0;
  std::vector<const char*> names;  // the packed records' name table, copied when a record needs more of it
  for (const Item& item : items) {
    if (released >= maxChunks) break;
    ThreadBuffer& buffer = *item.buffer;
    // A thread's events mostly belong to one worker: the lookup (and the thread line check) is redone
    // only when the worker changes from one event to the next.
    WorkerSlot cachedSlot = kNoWorker;
    Worker* cached = nullptr;
    bool first = true;
    if (buffer.head == nullptr) buffer.head = buffer.first.load(std::memory_order_acquire);
    while (buffer.head != nullptr && released < maxChunks) {
      Chunk* chunk = buffer.head;
      // `next` before `count`: once the owner linked a successor, the count read after it is final.
      Chunk* next = chunk->next.load(std::memory_order_acquire);
      const uint32_t count = chunk->count.load(std::memory_order_acquire);
      for (uint32_t i = buffer.readIndex; i < count; ++i) {
        // The record's events: itself, or what its RpcRecord stands for.
        const uint8_t kind = chunk->kinds[i];
        const uint32_t offset = buffer.readOffset;
        buffer.readOffset += slotBytes(kind);
        // Every packed kind starts with a PackedRpc.
        const WorkerSlot worker = kind == kSlotEvent ? chunk->at<Event>(offset).worker
                                  : kind == kSlotRpc ? chunk->at<WholeRpc>(offset).worker
                                                     : chunk->at<PackedRpc>(offset).worker;
        if (first || worker != cachedSlot) {
          first = false;
          cachedSlot = worker;
          auto found = r.workers.find(worker);
          cached = found == r.workers.end() || found->second.file == nullptr || found->second.failed ? nullptr
                                                                                                     : &found->second;
          if (cached != nullptr) {
            auto announced = cached->threadsAnnounced.find(buffer.tid);
            if (announced == cached->threadsAnnounced.end() || announced->second != item.nameVersion) {
              cached->threadsAnnounced[buffer.tid] = item.nameVersion;
              cached->pending.append("{\"type\":\"thread\"");
              appendField(cached->pending, "tid", buffer.tid);
              cached->pending.append(",\"name\":");
              appendEscaped(cached->pending, item.name.empty() ? "thread-" + std::to_string(buffer.tid) : item.name);
              cached->pending.append("}\n");
            }
          }
        }
        Event expanded[kRpcMaxEvents];
        const Event* events = &chunk->at<Event>(offset);
        int eventCount = 1;
        if (kind != kSlotEvent) {
          if (kind != kSlotRpc && ((chunk->at<PackedRpc>(offset).key >> kKeyNameShift) & 0xFFFF) >= names.size()) {
            // A name registered since the copy (before its record was published, so the lock sees it).
            std::lock_guard<std::mutex> lock(r.nameMutex);
            names = r.names;
          }
          const int rank = cached != nullptr ? cached->rank : -1;
          const RpcRecord rpc = kind == kSlotRpc         ? fromWhole(chunk->at<WholeRpc>(offset))
                                : kind == kSlotPackedRpc ? unpackRpc(chunk->at<PackedRpc>(offset), names, rank)
                                                         : unpackHandled(chunk->at<PackedHandled>(offset), names, rank);
          eventCount = cached == nullptr ? rpcEventCount(rpc) : expandRpc(rpc, expanded);
          events = expanded;
        }
        if (cached == nullptr) {
          dropped += static_cast<uint64_t>(eventCount);
          continue;
        }
        for (int k = 0; k < eventCount; ++k) appendEvent(cached->pending, events[k], buffer.tid, cached->skewNs);
        cached->eventsWritten += static_cast<uint64_t>(eventCount);
        lines += static_cast<uint64_t>(eventCount);
        if (cached->pending.size() >= kWriteBytes) writePending(*cached);
      }
      buffer.readIndex = count;
      if (next == nullptr) break;
      // Full, written, and the owner moved on: nobody touches this chunk again.
      buffer.head = next;
      buffer.readIndex = 0;
      buffer.readOffset = 0;
      releaseChunk(chunk);
      r.chunks.fetch_sub(1, std::memory_order_relaxed);
      ++released;
    }
  }
  if (finished != nullptr) *finished = released < maxChunks;
  r.dropped.fetch_add(dropped, std::memory_order_relaxed);
  {
    // Buffers of threads that exited, now written: freed (only here and in ThreadExit, both under
    // flushMutex, so no flush is reading them).
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto it = r.buffers.begin(); it != r.buffers.end();) {
      ThreadBuffer& buffer = **it;
      if (buffer.exited.load(std::memory_order_acquire) && drainedLocked(buffer)) {
        r.retiredAppended += buffer.appended.load(std::memory_order_relaxed);
        r.retiredRecords += buffer.records.load(std::memory_order_relaxed);
        if (buffer.head != nullptr) r.chunks.fetch_sub(1, std::memory_order_relaxed);
        it = r.buffers.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [slot, worker] : r.workers) {
    if (worker.file == nullptr) continue;
    {
      std::lock_guard<std::mutex> lock(r.clockMutex);
      appendClockLinesLocked(worker);
    }
    writePending(worker);
  }
  // Counted once in the files, not when formatted: a reader that saw the count and opened a file found the
  // last lines still in memory (Trace.TheBackgroundWriterWritesOnceTheThresholdIsPassed, 1 run in ~10).
  r.written.fetch_add(lines, std::memory_order_relaxed);
  return lines;
}

int64_t pid() { return static_cast<int64_t>(::getpid()); }

// Note [Trace writer]: a traced run keeps its events in memory (recording is cheap, writing JSON is not:
// see bench_trace) unless more than the flush threshold is buffered. This thread checks every 50 ms and
// then has everything buffered written (Note [Idle flusher]), off the threads that do the job's work. It
// runs from the first traced worker's registration to the last one's unregistration (so a process that
// traces nothing has no extra thread, and a fork after tracing ended forks no writer).
constexpr std::chrono::milliseconds kWriterPeriod{50};

// Note [Idle flusher]: formatting the buffered records as JSON lines is most of what a traced run costs
// beyond recording (bench_trace's flush_per_event, ~55 ns an event, 13 events per RPC). Done by the writer
// at the job's own priority, it took a core from the job's threads whenever it ran: bench_trace's no-op
// rpcAsync at 8 in flight lost 5-18% of its throughput (median 6.5%) with the writer writing every 50 ms,
// against 0-2% with the events kept in memory; with this flusher -2.5 to 1.8% (median -1.1%). So the writer hands
// its flushes to a flusher thread that runs at SCHED_IDLE: it formats on CPU time the job leaves idle, and
// any thread of the job preempts it at once. On a machine the job keeps busy (every core computing) it
// would fall behind for ever, so:
// - it writes a chunk at a time, taking flushMutex per chunk, and stops while another thread waits for the
//   mutex (FlushLock: trace::flush(), a worker's registration, a thread's exit, the writer below), which
//   thus waits for one chunk, not for the backlog (without it, a waiter woken when the starved flusher let
//   go mostly lost the mutex to it again: the catch-up test took 8-65 s under ThreadSanitizer);
// - the writer itself (at the job's priority) flushes everything once more than kCatchUpChunks beyond the
//   flush threshold is buffered (Stats::catchUpFlushes counts these): memory stays bounded and the file
//   fills, at the cost the writer had before.
// A thread may lower its priority but, without CAP_SYS_NICE, not raise it again (sched(7): leaving
// SCHED_IDLE needs RLIMIT_NICE room): hence two threads. Where SCHED_IDLE is refused the flusher runs at
// the writer's priority (what the writer did before).
constexpr uint64_t kCatchUpChunks = 64;

void flusherLoop(Recorder& r) {
  pthread_setname_np(pthread_self(), "dg-trace-flush");
  sched_param none{};
  (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
  std::unique_lock<std::mutex> lock(r.mutex);
  while (true) {
    r.flusherWake.wait(lock, [&] { return r.writerStop || r.flushRequested; });
    if (r.writerStop) return;
    r.flushRequested = false;
    // Chunk by chunk until everything is written, tracing stops (unregistration writes the rest) or another
    // thread waits for flushMutex (the writer asks again at its next pass while the threshold is passed;
    // below it the rest stays buffered, as any run below the threshold does).
    bool finished = false;
    while (!finished && !r.writerStop && r.flushWaiters.load(std::memory_order_relaxed) == 0) {
      lock.unlock();
      {
        std::lock_guard<std::mutex> flushLock(r.flushMutex);
        flushLocked(r, 1, &finished);
      }
      lock.lock();
    }
  }
}

// Note [TSC trace clock]: an RPC traced reads the clock nine times, and clock_gettime (the vDSO's
// CLOCK_MONOTONIC) was its largest single cost: ~17 ns a read on the 2-vCPU VM, ~160 ns per RPC of the
// ~420 ns that tracing added to a no-op call (perf, one core). Where the kernel itself keeps CLOCK_MONOTONIC
// on the time-stamp counter (clocksource "tsc": an invariant counter, synchronised across cores), nowNs()
// reads the counter (rdtsc: a span's two reads and append took 34-37 ns instead of 48-55) and converts it with an
// anchor (detail::gTscAnchor) that this thread keeps on the steady clock while anything traces:
// - each pass pairs a counter read with a steady-clock read (the closest of a few tries); the first pass
//   only takes a base, the second (one period later) turns the counter on with the rate measured between
//   them, and every later one measures the rate from the base (the baseline grows, so the rate's error
//   shrinks below 1e-8 within seconds);
// - a new anchor continues the old line where it is now (no step), with a rate that slews the line back to
//   the steady clock over the next period (at most 1e-3 faster or slower): the clock stays within
//   microseconds of the steady clock, as NTP slews one. An error beyond 1 ms (a suspended VM) re-anchors
//   on the steady clock at once;
// - nowNs() never returns less than its thread's previous reading (a new anchor or the switch between the
//   two clocks may be a few nanoseconds behind).
// When the writer stops (nothing traces) nowNs() reads the steady clock again. DISTGRAD_TRACE_CLOCK=steady
// keeps it on the steady clock throughout.
class TscCalibrator {
 public:
  // Takes the base; false when the counter is not to be used here.
  bool start() {
#if defined(__x86_64__)
    if (!usable()) return false;
    base_ = pairedRead();
    return true;
#else
    return false;
#endif
  }

  // One pass (every kWriterPeriod).
  void update() {
#if defined(__x86_64__)
    const Pair now = pairedRead();
    if (now.tsc <= base_.tsc || now.ns <= base_.ns) return;
    const double rate = static_cast<double>(now.ns - base_.ns) / static_cast<double>(now.tsc - base_.tsc);
    if (!(rate > 1e-3 && rate < 1e3)) {  // ns per tick: a counter from 1 MHz to 1 THz
      stop();
      return;
    }
    if (!detail::gTscClock.load(std::memory_order_relaxed)) {
      publish(now.tsc, now.ns, rate);
      detail::gTscClock.store(true, std::memory_order_release);
      return;
    }
    const int64_t line = detail::tscNowAt(now.tsc);
    const auto error = static_cast<double>(line - now.ns);
    const double period = std::chrono::duration<double, std::nano>(kWriterPeriod).count();
    if (std::fabs(error) > 1e6) {
      publish(now.tsc, now.ns, rate);
    } else {
      publish(now.tsc, line, rate * (1.0 - std::clamp(error / period, -1e-3, 1e-3)));
    }
#endif
  }

  static void stop() { detail::gTscClock.store(false, std::memory_order_release); }

 private:
  struct Pair {
    uint64_t tsc = 0;
    int64_t ns = 0;
  };

#if defined(__x86_64__)
  static bool usable() {
    if (const char* clock = std::getenv("DISTGRAD_TRACE_CLOCK"); clock != nullptr && std::string(clock) == "steady") {
      return false;
    }
    std::ifstream in("/sys/devices/system/clocksource/clocksource0/current_clocksource");
    std::string source;
    in >> source;
    return source == "tsc";
  }

  static Pair pairedRead() {
    Pair best;
    uint64_t window = UINT64_MAX;
    for (int i = 0; i < 5; ++i) {
      const uint64_t before = __rdtsc();
      const int64_t ns = detail::steadyNs();
      const uint64_t after = __rdtsc();
      if (after >= before && after - before < window) {
        window = after - before;
        best = {before + (after - before) / 2, ns};
      }
    }
    return best;
  }

  static void publish(uint64_t tsc, int64_t ns, double nsPerTick) {
    auto& a = detail::gTscAnchor;
    const uint32_t seq = a.seq.load(std::memory_order_relaxed);
    // Release stores of the fields (free on x86): a reader that sees one sees the odd `seq` before it.
    a.seq.store(seq + 1, std::memory_order_relaxed);
    a.tsc.store(tsc, std::memory_order_release);
    a.ns.store(ns, std::memory_order_release);
    a.mult.store(static_cast<uint64_t>(std::llround(nsPerTick * 4294967296.0)), std::memory_order_release);
    a.seq.store(seq + 2, std::memory_order_release);
  }
#endif

  Pair base_;
};

void writerLoop(Recorder& r) {
  pthread_setname_np(pthread_self(), "dg-trace-writer");
  std::thread flusher;
  try {
    flusher = std::thread([&r] { flusherLoop(r); });
  } catch (const std::system_error&) {
    // The writer flushes itself (below).
  }
  struct JoinFlusher {
    std::thread& thread;
    ~JoinFlusher() {
      if (thread.joinable()) thread.join();  // it returns once it sees writerStop
    }
  } joinFlusher{flusher};
  uint64_t taken = r.chunksTaken.load(std::memory_order_relaxed);
  TscCalibrator clock;
  const bool tsc = clock.start();
  struct StopClock {
    ~StopClock() { TscCalibrator::stop(); }
  } stopClock;
  while (true) {
    refillPool(r, std::max<size_t>(kMinReadyChunks, 2 * (r.chunksTaken.load(std::memory_order_relaxed) - taken)));
    taken = r.chunksTaken.load(std::memory_order_relaxed);
    {
      std::unique_lock<std::mutex> lock(r.mutex);
      r.writerWake.wait_for(lock, kWriterPeriod, [&] { return r.writerStop; });
      if (r.writerStop) return;
    }
    if (tsc) clock.update();
    const uint64_t chunks = r.chunks.load(std::memory_order_relaxed);
    const uint64_t threshold = r.flushChunks.load(std::memory_order_relaxed);
    if (chunks < threshold) continue;
    if (flusher.joinable() && chunks < threshold + kCatchUpChunks) {
      {
        std::lock_guard<std::mutex> lock(r.mutex);
        r.flushRequested = true;
      }
      r.flusherWake.notify_one();
      continue;
    }
    if (flusher.joinable()) r.catchUpFlushes.fetch_add(1, std::memory_order_relaxed);
    FlushLock flushLock(r);
    flushLocked(r);
  }
}

}  // namespace

const char* clockName() { return detail::gTscClock.load(std::memory_order_relaxed) ? "tsc" : "steady"; }

const char* categoryName(Category category) {
  switch (category) {
    case Category::kUser: return "user";
    case Category::kRpcClient: return "rpc_client";
    case Category::kRpcServer: return "rpc_server";
    case Category::kTransport: return "transport";
    case Category::kRRef: return "rref";
    case Category::kAutograd: return "autograd";
    case Category::kOptimizer: return "optimizer";
    case Category::kPipeline: return "pipeline";
  }
  return "unknown";
}

const char* flowPhaseName(FlowPhase phase) {
  switch (phase) {
    case FlowPhase::kNone: return "";
    case FlowPhase::kStart: return "start";
    case FlowPhase::kStep: return "step";
    case FlowPhase::kEnd: return "end";
  }
  return "";
}

const char* eventKindName(EventKind kind) {
  switch (kind) {
    case EventKind::kSpan: return "span";
    case EventKind::kInstant: return "instant";
    case EventKind::kAsync: return "async";
  }
  return "span";
}

const char* intern(std::string_view text) {
  // The text this thread interned last: a thread that traces RPCs mostly meets the same few function
  // names in a row (a loop thread serving one call after another), and comparing with the last one costs a
  // fraction of hashing the text for the map.
  thread_local std::string_view last;
  thread_local const char* lastInterned = nullptr;
  if (lastInterned != nullptr && text == last) return lastInterned;
  // Keys are views of the interned strings themselves, which never move or die.
  thread_local std::unordered_map<std::string_view, const char*> cache;
  auto hit = cache.find(text);
  if (hit != cache.end()) {
    last = hit->first;
    lastInterned = hit->second;
    return hit->second;
  }
  Recorder& r = recorder();
  const std::string* stored = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.internMutex);
    stored = &*r.interned.emplace(text).first;
  }
  cache.emplace(std::string_view(*stored), stored->c_str());
  last = std::string_view(*stored);
  lastInterned = stored->c_str();
  return stored->c_str();
}

namespace {
// The worker a record of this thread belongs to when it names none (see the header comment).
inline WorkerSlot threadWorker() {
  return tWorker != kNoWorker ? tWorker : recorder().defaultWorker.load(std::memory_order_relaxed);
}

// The packed-record id of `name` (a stable pointer: a literal or intern()ed), 0 for none; above kMaxNameId
// when the table is full. Locks only the first time this thread meets a name.
uint32_t nameId(const char* name) {
  if (name == nullptr) return 0;
  thread_local const char* lastName = nullptr;
  thread_local uint32_t lastId = 0;
  if (name == lastName) return lastId;
  thread_local std::unordered_map<const char*, uint32_t> cache;
  auto hit = cache.find(name);
  if (hit == cache.end()) {
    Recorder& r = recorder();
    uint32_t id = kMaxNameId + 1;
    {
      std::lock_guard<std::mutex> lock(r.nameMutex);
      auto found = r.nameIds.find(name);
      if (found != r.nameIds.end()) {
        id = found->second;
      } else if (r.names.size() <= kMaxNameId) {
        id = static_cast<uint32_t>(r.names.size());
        r.names.push_back(name);
        r.nameIds.emplace(name, id);
      }
    }
    hit = cache.emplace(name, id).first;
  }
  lastName = name;
  lastId = hit->second;
  return lastId;
}

// The rank `slot` registered with, -1 for a slot not registered. Locks only the first time this thread
// meets a slot (a slot's rank never changes; slots are not reused).
int workerRank(WorkerSlot slot) {
  thread_local WorkerSlot lastSlot = kNoWorker;
  thread_local int lastRank = -1;
  if (slot == lastSlot) return lastRank;
  thread_local std::unordered_map<WorkerSlot, int> cache;
  auto hit = cache.find(slot);
  if (hit == cache.end()) {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto found = r.workers.find(slot);
    if (found == r.workers.end()) return -1;  // unregistered: its records are dropped anyway
    hit = cache.emplace(slot, found->second.rank).first;
  }
  lastSlot = slot;
  lastRank = hit->second;
  return lastRank;
}

// Packs `r` (for `worker`) into `out`; false when a value does not fit (Note [Packed RPC records]).
inline bool packRpc(const RpcRecord& r, WorkerSlot worker, PackedRpc& out) {
  const auto d1 = static_cast<uint64_t>(r.t[1]) - static_cast<uint64_t>(r.t[0]);
  const auto d2 = static_cast<uint64_t>(r.t[2]) - static_cast<uint64_t>(r.t[0]);
  if (r.t[1] < r.t[0] || r.t[2] < r.t[0] || d1 > UINT32_MAX || d2 > UINT32_MAX || r.bytes < 0 ||
      static_cast<uint64_t>(r.bytes) > UINT32_MAX || r.call > kKeyCallMask || r.peer < -1 || r.peer >= 0xFFFF ||
      worker > 0xFFFF || r.status > 7 || r.flags > 3 || static_cast<uint8_t>(r.site) >= kRpcSiteCount) {
    return false;
  }
  bool hasFlow = false;
  if (r.flow != 0) {
    const int origin = flowOrigin(r.site, r.site == RpcSite::kServerExecute ? -1 : workerRank(worker), r.peer);
    if (origin < 0 || r.flow != callFlowId(origin, r.call)) return false;
    hasFlow = true;
  }
  const uint32_t name = nameId(r.function);
  if (name > kMaxNameId) return false;
  out.t0 = r.t[0];
  out.t1Offset = static_cast<uint32_t>(d1);
  out.t2Offset = static_cast<uint32_t>(d2);
  out.key = r.call | (uint64_t{hasFlow} << kKeyFlowShift) | (uint64_t{name} << kKeyNameShift) |
            (uint64_t{static_cast<uint8_t>(r.site)} << kKeySiteShift) | (uint64_t{r.flags} << kKeyFlagsShift) |
            (uint64_t{r.status} << kKeyStatusShift);
  out.bytes = static_cast<uint32_t>(r.bytes);
  out.peer = static_cast<uint16_t>(r.peer + 1);
  out.worker = static_cast<uint16_t>(worker);
  return true;
}

// Appends `value` (an Event, an RpcRecord or a PackedRpc, standing for `events` events) to this thread's
// buffer (Note [Trace buffers]).
template <typename Record>
inline void append(const Record& value, SlotKind kind, uint64_t events) {
  static_assert(sizeof(Record) <= sizeof(Event), "a record fits its slot");
  ThreadBuffer* buffer = tBuffer;
  if (buffer == nullptr) buffer = attachThread();
  Chunk* chunk = buffer->tail;
  uint32_t n = 0;
  // Every record takes at least sizeof(PackedRpc) bytes, so a chunk never holds more than kChunkRecords.
  const uint32_t size = slotBytes(kind);
  if (chunk == nullptr || buffer->tailBytes + size > kChunkBytes) {
    chunk = newChunk(*buffer);
  } else {
    n = chunk->count.load(std::memory_order_relaxed);
  }
  const uint32_t offset = buffer->tailBytes;
  chunk->put(n, offset, kind, value);
  buffer->tailBytes = offset + size;
  chunk->count.store(n + 1, std::memory_order_release);
  // Two lines ahead, for writing: recording sites are microseconds apart, so the line is in cache by then
  // instead of costing a miss on the recording thread.
  if (offset + 128 < kChunkBytes) __builtin_prefetch(chunk->storage + offset + 128, 1, 3);
  buffer->appended.store(buffer->appended.load(std::memory_order_relaxed) + events, std::memory_order_relaxed);
  buffer->records.store(buffer->records.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}
}  // namespace

void record(Event event) {
  if (event.worker == kNoWorker) event.worker = threadWorker();
  append(event, kSlotEvent, 1);
}

void recordRpc(const RpcRecord& record) {
  const WorkerSlot worker = record.worker != kNoWorker ? record.worker : threadWorker();
  const auto events = static_cast<uint64_t>(rpcEventCount(record));
  if (record.site == RpcSite::kServerHandled) {
    PackedHandled packed;
    const auto d3 = static_cast<uint64_t>(record.t[3]) - static_cast<uint64_t>(record.t[0]);
    const auto d4 = static_cast<uint64_t>(record.t[4]) - static_cast<uint64_t>(record.t[0]);
    if (record.t[3] >= record.t[0] && record.t[4] >= record.t[0] && d3 <= UINT32_MAX && d4 <= UINT32_MAX &&
        packRpc(record, worker, packed.base)) {
      packed.t3Offset = static_cast<uint32_t>(d3);
      packed.t4Offset = static_cast<uint32_t>(d4);
      append(packed, kSlotPackedHandled, events);
      return;
    }
    // Its two records, which expand to the same events.
    RpcRecord execute = record;
    execute.site = RpcSite::kServerExecute;
    execute.worker = worker;
    execute.bytes = 0;
    execute.flags = 0;
    RpcRecord reply = execute;
    reply.site = RpcSite::kServerReply;
    reply.t[0] = record.t[2];
    reply.t[1] = record.t[3];
    reply.t[2] = record.t[4];
    reply.bytes = record.bytes;
    reply.flow = 0;
    reply.flags = record.flags;
    recordRpc(execute);
    recordRpc(reply);
    return;
  }
  PackedRpc packed;
  if (packRpc(record, worker, packed)) {
    append(packed, kSlotPackedRpc, events);
    return;
  }
  WholeRpc whole;
  copyRpcFields(record, whole);
  whole.worker = worker;
  append(whole, kSlotRpc, events);
}

int rpcEventCount(const RpcRecord& record) {
  const int fromTransport = (record.flags & kRpcFromTransport) != 0 ? 1 : 0;
  const int toTransport = (record.flags & kRpcToTransport) != 0 ? 1 : 0;
  switch (record.site) {
    case RpcSite::kClientSend: return 2 + toTransport;
    case RpcSite::kClientReply: return 2 + fromTransport;
    case RpcSite::kServerArrive: return 1 + fromTransport;
    case RpcSite::kServerExecute: return 2;
    case RpcSite::kServerReply: return 2 + toTransport;
    case RpcSite::kServerHandled: return 4 + toTransport;
  }
  return 0;
}

int expandRpc(const RpcRecord& r, Event (&out)[kRpcMaxEvents]) {
  int n = 0;
  // An event of the record: its worker, detail (the function) and kind; args set by the caller.
  auto add = [&](const char* name, Category category, EventKind kind, int64_t begin, int64_t end) -> Event& {
    Event& e = out[n++];
    e = Event();
    e.name = name;
    e.detail = r.function;
    e.worker = r.worker;
    e.category = category;
    e.kind = kind;
    e.beginNs = begin;
    e.endNs = end;
    return e;
  };
  auto args = [](Event& e, std::initializer_list<int64_t> values) {
    for (int64_t v : values) e.args[e.argCount++] = v;
  };
  auto flow = [&r](Event& e, FlowPhase phase) {
    e.flow = r.flow;
    e.flowPhase = r.flow != 0 ? phase : FlowPhase::kNone;
  };
  const auto call = static_cast<int64_t>(r.call);
  const bool fromTransport = (r.flags & kRpcFromTransport) != 0;
  // The frame queued at `at` (the end of the send span): a transport.send instant after it.
  auto sent = [&](int64_t at) {
    if ((r.flags & kRpcToTransport) == 0) return;
    Event& e = add("transport.send", Category::kTransport, EventKind::kInstant, at, at);
    e.detail = nullptr;
    args(e, {r.bytes, r.peer});
  };
  switch (r.site) {
    case RpcSite::kClientSend: {
      args(add("rpc.client.serialize", Category::kRpcClient, EventKind::kSpan, r.t[0], r.t[1]),
           {r.bytes, r.peer, call});
      Event& send = add("rpc.client.send", Category::kRpcClient, EventKind::kSpan, r.t[1], r.t[2]);
      args(send, {r.bytes, r.peer, call});
      flow(send, FlowPhase::kStart);
      sent(r.t[2]);
      break;
    }
    case RpcSite::kClientReply: {
      if (fromTransport) {
        Event& recv = add("transport.recv", Category::kTransport, EventKind::kInstant, r.t[1], r.t[1]);
        recv.detail = nullptr;
        args(recv, {r.bytes, r.peer});
      }
      args(add("rpc.client.wait", Category::kRpcClient, EventKind::kAsync, r.t[0], r.t[1]), {r.peer, call, r.status});
      Event& reply = add("rpc.client.deserialize", Category::kRpcClient, EventKind::kSpan, r.t[1], r.t[2]);
      args(reply, {r.bytes, r.peer, call});
      flow(reply, FlowPhase::kEnd);
      break;
    }
    case RpcSite::kServerArrive: {
      if (fromTransport) {
        Event& recv = add("transport.recv", Category::kTransport, EventKind::kInstant, r.t[0], r.t[0]);
        recv.detail = nullptr;
        args(recv, {r.bytes, r.peer});
      }
      args(add("rpc.server.deserialize", Category::kRpcServer, EventKind::kSpan, r.t[0], r.t[1]),
           {r.bytes, r.peer, call});
      break;
    }
    case RpcSite::kServerExecute:
    case RpcSite::kServerHandled: {
      args(add("rpc.server.queue", Category::kRpcServer, EventKind::kAsync, r.t[0], r.t[1]), {r.peer, call});
      Event& execute = add("rpc.server.execute", Category::kRpcServer, EventKind::kSpan, r.t[1], r.t[2]);
      args(execute, {r.peer, call});
      flow(execute, FlowPhase::kStep);
      if (r.site == RpcSite::kServerExecute) break;
      args(add("rpc.server.serialize", Category::kRpcServer, EventKind::kSpan, r.t[2], r.t[3]),
           {r.bytes, r.peer, call});
      args(add("rpc.server.send", Category::kRpcServer, EventKind::kSpan, r.t[3], r.t[4]), {r.bytes, r.peer, call});
      sent(r.t[4]);
      break;
    }
    case RpcSite::kServerReply: {
      args(add("rpc.server.serialize", Category::kRpcServer, EventKind::kSpan, r.t[0], r.t[1]),
           {r.bytes, r.peer, call});
      args(add("rpc.server.send", Category::kRpcServer, EventKind::kSpan, r.t[1], r.t[2]), {r.bytes, r.peer, call});
      sent(r.t[2]);
      break;
    }
  }
  return n;
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
  event().endNs = nowNs();
  record(event());
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
    worker.pending.append("{\"distgrad_trace\":1,\"worker\":");
    appendEscaped(worker.pending, name);
    appendField(worker.pending, "rank", rank);
    appendField(worker.pending, "pid", pid());
    worker.pending.append(",\"clock\":\"steady_ns\"");
    appendField(worker.pending, "start_ns", nowNs() + clockSkewNs);
    worker.pending.append("}\n");
    writePending(worker);
    DG_CHECK(!worker.failed, "trace file '", worker.path, "' cannot be written");
  }
  Recorder& r = recorder();
  std::lock_guard<std::mutex> writerLock(r.writerMutex);
  WorkerSlot slot = kNoWorker;
  bool traced = false;
  {
    FlushLock flushLock(r);
    std::lock_guard<std::mutex> lock(r.mutex);
    slot = r.nextSlot++;
    traced = worker.file != nullptr;
    if (traced) ++r.tracing;
    r.workers.emplace(slot, std::move(worker));
    updateEnabledLocked(r);
  }
  if (traced && !r.writer.joinable()) {
    try {
      r.writer = std::thread([&r] { writerLoop(r); });
    } catch (const std::system_error& e) {
      // Tracing still works: everything is written by trace::flush() and at unregistration.
      std::fprintf(stderr,
                   "[distgrad] trace: the background writer cannot start (%s); events are written at "
                   "shutdown\n",
                   e.what());
    }
  }
  return slot;
}

namespace {
// False when `slot` is not registered. Caller holds flushMutex (not mutex).
bool unregisterLocked(Recorder& r, WorkerSlot slot) {
  auto it = r.workers.find(slot);
  if (it == r.workers.end()) return false;
  flushLocked(r);
  Worker& worker = it->second;
  const bool traced = worker.file != nullptr;
  if (traced) {
    worker.pending.append("{\"type\":\"end\"");
    appendField(worker.pending, "end_ns", nowNs() + worker.skewNs);
    appendField(worker.pending, "events", static_cast<int64_t>(worker.eventsWritten));
    worker.pending.append("}\n");
    writePending(worker);
    std::fclose(worker.file);
    worker.file = nullptr;
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  if (traced) --r.tracing;
  r.workers.erase(it);
  updateEnabledLocked(r);
  return true;
}
}  // namespace

void unregisterWorker(WorkerSlot slot) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> writerLock(r.writerMutex);
  {
    FlushLock flushLock(r);
    if (!unregisterLocked(r, slot)) return;
  }
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.tracing > 0 || !r.writer.joinable()) return;
    r.writerStop = true;
  }
  r.writerWake.notify_all();
  r.flusherWake.notify_all();
  r.writer.join();
  drainPool(r);
  std::lock_guard<std::mutex> lock(r.mutex);
  r.writerStop = false;
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
  // Never waits for a flush writing a file (the agent calls this under its own mutex).
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.workers.find(slot);
  if (it == r.workers.end() || it->second.file == nullptr) return;
  std::lock_guard<std::mutex> clockLock(r.clockMutex);
  ClockLine& line = it->second.clocks[peer];
  line.peerRank = peerRank;
  line.offsetNs = offsetNs;
  line.rttNs = rttNs;
  line.samples = samples;
  line.dirty = true;
}

uint64_t flush() {
  Recorder& r = recorder();
  FlushLock lock(r);
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
  s.records = r.retiredRecords;
  for (const auto& buffer : r.buffers) {
    s.recorded += buffer->appended.load(std::memory_order_relaxed);
    s.records += buffer->records.load(std::memory_order_relaxed);
  }
  s.written = r.written.load(std::memory_order_relaxed);
  s.dropped = r.dropped.load(std::memory_order_relaxed);
  s.bufferedChunks = r.chunks.load(std::memory_order_relaxed);
  s.catchUpFlushes = r.catchUpFlushes.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> poolLock(r.poolMutex);
  s.readyChunks = r.pool.size();
  return s;
}

uint64_t bufferedChunks() { return recorder().chunks.load(std::memory_order_relaxed); }

void setFlushThreshold(uint64_t bytes) {
  recorder().flushChunks.store(bytes / sizeof(Chunk), std::memory_order_relaxed);
}

}  // namespace distgrad::trace
