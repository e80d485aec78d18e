// The transport interface every transport implements (inproc, tcp, ucx): framed, asynchronous,
// ordered delivery of messages between two endpoints.
//
// A frame on the wire (see docs/wire_protocol.md):
//   FramePrefix (24 bytes) | payloadCount x uint64 payload sizes | envelope bytes | pad to 64 |
//   payload 0 | pad to 64 | payload 1 | ... | pad to 64
// The transport knows nothing of the envelope's schema: it moves the envelope bytes and the payload
// buffers. The receiver decides where each payload lands (PayloadAllocator: it parses the envelope, checks
// it and allocates tensor storage), so tensor bytes are read straight into their destination; inproc
// skips even that and hands over the sender's buffers (reference semantics).
//
// Threads: each Context owns one loop thread; every callback (accept, connect, send completion, frame,
// close) runs on it, exactly once where stated, except the frames a waiting thread reads itself
// (Connection::beginWaitingRead). Methods may be called from any thread (they post to the
// loop). Callbacks must not block.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rpc/error.h"

namespace distgrad::rpc::transport {

inline constexpr uint32_t kFrameMagic = 0x44474652;  // "DGFR"
// 3: clock-offset times in handshake and heartbeats; 4: CUDA device count and device map in the handshake,
// the envelope's device map and CUDA tensor descriptors (docs/cuda.md).
inline constexpr uint16_t kProtocolVersion = 4;
inline constexpr size_t kPayloadAlignment = 64;

// Fixed-size start of every frame, little-endian on the wire.
struct FramePrefix {
  uint32_t magic = kFrameMagic;
  uint16_t version = kProtocolVersion;
  uint16_t flags = 0;
  uint32_t envelopeBytes = 0;
  uint32_t payloadCount = 0;
  uint64_t payloadBytes = 0;  // sum of payload sizes (without padding)
};
static_assert(sizeof(FramePrefix) == 24, "the frame prefix is 24 bytes on the wire");

// Limits a receiver enforces before allocating anything; a frame beyond them closes the connection.
struct FrameLimits {
  uint32_t maxEnvelopeBytes = 64u << 20;
  uint32_t maxPayloadCount = 1u << 16;
  uint64_t maxPayloadBytes = 16ull << 30;
};

// Bytes to send; `owner` keeps them alive until the send completes (e.g. a tensor Storage).
struct SendBuffer {
  const void* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> owner;
};

// Where a received payload is (or was written): `owner` keeps the memory alive.
struct PayloadBuffer {
  void* data = nullptr;
  size_t size = 0;
  std::shared_ptr<void> owner;
};

struct OutgoingFrame {
  uint16_t flags = 0;
  std::vector<uint8_t> envelope;
  std::vector<SendBuffer> payloads;
  // A hint, not on the wire: the sender is about to wait for this frame's answer, so a transport may write
  // it from the sending thread when nothing is queued ahead of it (tcp: Note [Sender writes]) instead of
  // handing it to its loop thread. Order and completion are as for any frame.
  bool fromSender = false;
};

struct IncomingFrame {
  uint16_t flags = 0;
  std::vector<uint8_t> envelope;
  std::vector<PayloadBuffer> payloads;
};

// Called on the loop thread (or a waiting reader: Connection::beginWaitingRead) once a frame's envelope and
// payload sizes are in; returns one buffer per payload with exactly that size, or an Error (the connection
// is then closed with it).
using PayloadAllocator =
    std::function<Result<std::vector<PayloadBuffer>>(std::span<const uint8_t> envelope, std::span<const uint64_t> sizes)>;
using SendCallback = std::function<void(const Result<void>&)>;
using FrameCallback = std::function<void(IncomingFrame&&)>;
using CloseCallback = std::function<void(const Error&)>;

class Connection {
 public:
  virtual ~Connection() = default;
  // Queues a frame. Frames are delivered in order. `done` runs once: success when the bytes left this
  // process (the payload buffers may then be reused), or the error that closed the connection.
  virtual void send(OutgoingFrame frame, SendCallback done) = 0;
  // Starts reading. Must be called once. `onClosed` runs once, after the last onFrame, when the peer closes,
  // the connection fails, a frame is malformed, or close() is called.
  virtual void start(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) = 0;
  // Closes the connection; pending sends fail with `disconnected`. Idempotent.
  virtual void close() = 0;
  virtual std::string peerAddress() const = 0;
  // Note [Waiting reader] (tcp, rpc/transport/tcp/connection.cpp): a thread about to send a frame and then
  // block for its answer may read this connection itself meanwhile, so that the answer needs no wake-up of
  // the loop thread and then of this one. beginWaitingRead, before the send: true when this thread is now
  // the connection's reader (the loop no longer reads it); the thread must then call endWaitingRead, after
  // at most one readWhileWaiting. readWhileWaiting reads until `done()` holds, `window` passed or the
  // connection closes; frames read are handed to onFrame (and the PayloadAllocator runs) on this thread, in
  // order with the loop's, never concurrently with them (ucx: the thread drives the whole worker, Note
  // [Driving threads]). False (the default: inproc) when the
  // transport does not do this, the connection is not reading yet or is closing, another thread reads it,
  // or this is the loop thread or a thread that reads another connection already.
  virtual bool beginWaitingRead() { return false; }
  virtual void readWhileWaiting(const std::function<bool()>& done, std::chrono::microseconds window) {
    (void)done;
    (void)window;
  }
  virtual void endWaitingRead() {}
  // Any thread: makes a readWhileWaiting in progress (or the next one, if none is) check `done()` again now,
  // e.g. because what it waits for came from elsewhere. A spurious call costs that one check.
  virtual void interruptWaitingRead() {}
  // Diagnostics: how many frames so far a sending thread wrote itself (the fromSender hint taken; tcp: Note
  // [Sender writes]) instead of the loop thread.
  virtual uint64_t framesWrittenBySender() const { return 0; }
  // Diagnostics: how the transport carries this connection's bytes where it chooses among several ways
  // (ucx: the lanes ucp picked, e.g. "cm; sysv/memory (am am_bw#0 keepalive); cma/memory (rma_bw#0)"); ""
  // for transports with one way, or once closed. May wait for the loop thread (not while holding a lock
  // the loop's callbacks take).
  virtual std::string lanes() { return ""; }
};

class Listener {
 public:
  virtual ~Listener() = default;
  // The bound address in the form connect() takes (with the real port when port 0 was asked for).
  virtual std::string address() const = 0;
  virtual void close() = 0;
};

using AcceptCallback = std::function<void(std::shared_ptr<Connection>)>;
using ConnectCallback = std::function<void(Result<std::shared_ptr<Connection>>)>;

class Context {
 public:
  virtual ~Context() = default;
  virtual const std::string& name() const = 0;
  // Binds and listens ("127.0.0.1:0" for tcp, any name for inproc). Errors (address in use, bad address)
  // come back as an Error.
  virtual Result<std::unique_ptr<Listener>> listen(const std::string& address, AcceptCallback onAccept) = 0;
  virtual void connect(const std::string& address, ConnectCallback done) = 0;
  // Runs fn on the loop thread, later (never inline).
  virtual void defer(std::function<void()> fn) = 0;
  // Whether this is the loop's own thread (not a thread that reads or drives for it meanwhile: Note
  // [Waiting reader] in tcp, Note [Driving threads] in ucx).
  virtual bool inLoop() const = 0;
  // Closes every listener and connection and joins the loop thread. Idempotent; also run by the destructor.
  virtual void close() = 0;
  virtual const FrameLimits& limits() const = 0;
};

struct ContextOptions {
  FrameLimits limits;
  // tcp: coalesce frames queued in the same loop iteration into one vectored write.
  bool coalesceWrites = true;
  // ucx: the loop spins in ucp_worker_progress instead of sleeping on the worker's event fd: the lowest
  // latency, at the price of one core kept at 100% for the Context's lifetime.
  bool ucxBusyPoll = false;
};

// Creates a transport by name: "inproc", "tcp" or "ucx". Unknown names are an Error naming the known ones;
// "ucx" is an Error (kUnimplemented, saying why) when the build has no UCX or UCX cannot be initialised.
Result<std::unique_ptr<Context>> createContext(const std::string& name, const ContextOptions& options = {});

// Wire helpers shared by transports.
size_t paddingTo64(size_t n);
// Checks a received prefix against the limits; the message names the offending field and value.
Result<void> validatePrefix(const FramePrefix& prefix, const FrameLimits& limits);

// For transports, inside a catch block: a callback the transport does not own (a frame handler, a send or
// close completion, an accept callback, a posted task) threw. Logs "distgrad: <what> threw: <message>;
// <consequence>" and returns "<what> threw: <message>" for the Error that closes the connection concerned.
std::string reportCallbackException(const std::string& what, const char* consequence);

// The transports that can run here, for tests and benchmarks: "inproc", "tcp", and "ucx" when a ucx
// Context can be created (checked once per process).
std::vector<std::string> viableTransports();
// Why "ucx" is not among viableTransports() ("" when it is).
std::string ucxUnavailableReason();

}  // namespace distgrad::rpc::transport
