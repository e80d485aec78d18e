// LoopConnection: what the connections of the loop-thread transports (tcp, ucx) share, so that each
// transport's connection class holds only what is particular to its wire: the callbacks start() installs,
// the started/closing/closed state, moving the public calls (send, start, close) onto the loop thread,
// closed-before-start reporting, the bookkeeping of the frame being received with its checks (the size
// table against the prefix and the limits, the PayloadAllocator's answer against the size table), the
// guarded runs of user callbacks (frame handler, send completions) and reporting a close to onClosed once.
// Every message and log line names the transport ("tcp connection to ...", "distgrad ucx: ...").
//
// Why a template on the connection type and its loop: the loops (TcpLoop, UcxLoop) share no base class
// (their task queues differ where it matters for latency), and the connection must hand out
// shared_ptr<Derived> (enable_shared_from_this<Derived>) to the loop's bookkeeping. The transport-specific
// steps are the virtual hooks below.
//
// What Loop provides: post(fn) (false once shutdown began, unless called on the loop thread), inLoop(),
// deferFromLoop(fn) (runs fn later on the loop, never inline), removeFromLoop(Derived*) and options().
//
// Thread-safety: send, start, close and peerAddress may be called from any thread; everything else, hooks
// and protected members included, is loop-thread only, with one exception: a transport whose waiting
// threads read their connection (tcp, Note [Waiting reader]) runs the receive helpers (the size-table and
// allocator checks, handFrameFromLoop, failFromLoop, readingStopped) on whichever thread holds its reader
// lock; they touch only the frame being received, allocate_ and onFrame_ (set before reading begins,
// cleared only after the reader let go) and closing_ (atomic), and their close goes through the
// transport's closeFromLoop, which defers it to the loop.
#pragma once

#include <atomic>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "rpc/transport/loop_context.h"
#include "rpc/transport/transport.h"

namespace distgrad::rpc::transport {

// The allocator used when start() gets none: 64-byte aligned heap buffers; `transport` names the transport
// in the Error.
Result<std::vector<PayloadBuffer>> defaultAllocate(const char* transport, std::span<const uint64_t> sizes);

// True when the frame's envelope size and payload count fit the wire's 32-bit prefix fields.
inline bool fitsWirePrefix(const OutgoingFrame& frame) {
  return frame.envelope.size() <= std::numeric_limits<uint32_t>::max() &&
         frame.payloads.size() <= std::numeric_limits<uint32_t>::max();
}

// Checks a received size table against its prefix and the limits: "" when it is consistent, else what is
// wrong with it.
std::string sizeTableProblem(const FramePrefix& prefix, std::span<const uint64_t> sizes, const FrameLimits& limits);

template <class Derived, class Loop>
class LoopConnection : public Connection, public std::enable_shared_from_this<Derived> {
 public:
  void send(OutgoingFrame frame, SendCallback done) override;
  void start(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) final;
  void close() final;
  std::string peerAddress() const final { return peerAddress_; }

  // Loop thread only. Closes the connection with `error` (a no-op once closing); the transport tears down
  // its handle or endpoint, fails what it has queued and ends with reportClosedFromLoop. Idempotent.
  virtual void closeFromLoop(const Error& error) = 0;

 protected:
  LoopConnection(const char* transport, std::shared_ptr<Loop> loop, std::string peerAddress)
      : transport_(transport), loop_(std::move(loop)), peerAddress_(std::move(peerAddress)) {}

  // Hooks. Queues a frame on an open connection (refuseSendFromLoop has not refused it).
  virtual void sendFromLoop(OutgoingFrame frame, SendCallback done) = 0;
  // start() on a connection that is not closing: start delivering what arrives.
  virtual void beginReadingFromLoop() = 0;
  // True once the frame being received must be dropped: the connection is closing (tcp: or its reader
  // failed, Note [Waiting reader]).
  virtual bool readingStopped() const { return closing_; }

  // True (and `done` failed later on the loop, never inline) when the frame cannot be sent: the connection
  // is `closed`, or the envelope or payload count does not fit the wire's 32-bit fields.
  bool refuseSendFromLoop(const OutgoingFrame& frame, SendCallback& done, bool closed);
  // Runs a send callback; one that throws is logged and closes this connection.
  void completeSendFromLoop(SendCallback& done, const Result<void>& result);
  // Malformed input: log and close with a `failed` Error naming the peer.
  void failFromLoop(const std::string& problem);
  // Checks sizes_ against prefix_ and the limits; false (and closed) when they disagree.
  bool checkSizeTableFromLoop();
  // Asks the allocator (or defaultAllocate) for current_'s payload buffers and checks its answer against
  // sizes_; false (and closed) when it threw, refused or answered wrongly.
  bool allocatePayloadsFromLoop();
  // Hands a complete frame to onFrame; a handler that throws is logged and closes this connection.
  void handFrameFromLoop(IncomingFrame frame);
  // The transport's teardown is done: marks the connection closed, unregisters it from the loop and
  // returns the self reference (the caller keeps it until it returns).
  std::shared_ptr<Derived> markClosedFromLoop();
  // Drops the frame in progress and the callbacks, then runs onClosed (once; a throw is logged).
  void reportClosedFromLoop(const Error& error);
  // "<transport> connection to <peer>" for messages.
  std::string describe() const { return std::string(transport_) + " connection to " + peerAddress_; }

  const char* const transport_;  // "tcp", "ucx"
  std::shared_ptr<Loop> loop_;
  std::string peerAddress_;
  std::shared_ptr<Derived> self_;  // the connection keeps itself alive while open (set by the transport)
  // Loop-thread state.
  bool started_ = false;
  // Written on the loop thread only; atomic because a thread reading in readWhileWaiting (tcp) checks it.
  std::atomic<bool> closing_{false};
  bool closed_ = false;
  std::optional<Error> closeError_;
  PayloadAllocator allocate_;
  FrameCallback onFrame_;
  CloseCallback onClosed_;
  // The frame being received.
  FramePrefix prefix_;
  std::vector<uint64_t> sizes_;
  IncomingFrame current_;

 private:
  struct PostedSend {
    OutgoingFrame frame;
    SendCallback done;
  };
  void startFromLoop(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed);
  // Hands the frames other threads sent (posted_) to sendFromLoop, in order.
  void sendPostedFromLoop();

  std::mutex postedMutex_;
  std::vector<PostedSend> posted_;       // GUARDED_BY(postedMutex_): sent from other threads, not yet handed over
  std::vector<PostedSend> postedSpare_;  // loop: sendPostedFromLoop's batch storage, kept between batches
};

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::send(OutgoingFrame frame, SendCallback done) {
  if (loop_->inLoop()) {
    sendFromLoop(std::move(frame), std::move(done));
    return;
  }
  // Frames sent from other threads wait in posted_; the first one of a batch posts the task that hands
  // them all to sendFromLoop, so a burst of sends (every reply of an executor batch, every call of a
  // window) costs one loop task and no allocation per frame once the vectors are warm. The task's only
  // capture is one shared_ptr, which std::function stores in place.
  {
    std::lock_guard<std::mutex> lock(postedMutex_);
    const bool first = posted_.empty();
    posted_.push_back(PostedSend{std::move(frame), std::move(done)});
    if (!first) return;  // the task of this batch is on its way
  }
  std::shared_ptr<LoopConnection> self = this->shared_from_this();  // the base: sendFromLoop may be private
  if (!loop_->post([self] { self->sendPostedFromLoop(); })) {
    // The context is closed and its loop thread is gone: fail what waits here (this batch, and frames
    // other threads added behind it, counting on this task), once.
    std::vector<PostedSend> failed;
    {
      std::lock_guard<std::mutex> lock(postedMutex_);
      failed.swap(posted_);
    }
    for (auto& posted : failed) {
      if (posted.done) posted.done(Error::disconnected(describe() + ": the context is closed"));
    }
  }
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::sendPostedFromLoop() {
  // Swapped with a vector kept for the purpose: neither side allocates per batch once warm.
  std::vector<PostedSend> batch;
  batch.swap(postedSpare_);
  {
    std::lock_guard<std::mutex> lock(postedMutex_);
    batch.swap(posted_);
  }
  for (auto& posted : batch) sendFromLoop(std::move(posted.frame), std::move(posted.done));
  batch.clear();
  if (postedSpare_.capacity() < batch.capacity()) postedSpare_.swap(batch);
}

template <class Derived, class Loop>
bool LoopConnection<Derived, Loop>::refuseSendFromLoop(const OutgoingFrame& frame, SendCallback& done, bool closed) {
  auto failLater = [&](Error error) {
    if (!done) return;
    loop_->deferFromLoop([done = std::move(done), error = std::move(error)] { done(error); });
  };
  if (closed) {
    failLater(closeError_ ? Error::disconnected(describe() + " is closed: " + closeError_->message)
                          : Error::disconnected(describe() + " is closed"));
    return true;
  }
  if (!fitsWirePrefix(frame)) {
    failLater(Error::failed(std::string(transport_) + " send: a frame's envelope and payload count must fit 32 bits"));
    return true;
  }
  return false;
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::completeSendFromLoop(SendCallback& done, const Result<void>& result) {
  try {
    done(result);
  } catch (...) {
    // The connection cannot tell what state its owner is in after that: close it (a no-op if closing).
    std::string message = reportCallbackException("a send callback of the " + describe(), "closing the connection");
    closeFromLoop(Error::failed(message));
  }
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::start(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) {
  DG_CHECK(onFrame && onClosed, "Connection::start: onFrame and onClosed must be set");
  if (loop_->inLoop()) {
    startFromLoop(std::move(allocate), std::move(onFrame), std::move(onClosed));
    return;
  }
  auto self = this->shared_from_this();
  bool posted = loop_->post([self, allocate = std::move(allocate), onFrame = std::move(onFrame),
                             onClosed = std::move(onClosed)]() mutable {
    self->startFromLoop(std::move(allocate), std::move(onFrame), std::move(onClosed));
  });
  if (!posted) std::fprintf(stderr, "distgrad %s: Connection::start after the context closed; ignored\n", transport_);
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::startFromLoop(PayloadAllocator allocate, FrameCallback onFrame,
                                                  CloseCallback onClosed) {
  DG_CHECK(!started_, "Connection::start called twice on the ", describe());
  started_ = true;
  allocate_ = std::move(allocate);
  onFrame_ = std::move(onFrame);
  onClosed_ = std::move(onClosed);
  if (closed_) {
    // Closed before start: report it, later, on the loop.
    auto self = this->shared_from_this();
    loop_->deferFromLoop([self] {
      if (auto cb = std::move(self->onClosed_)) cb(*self->closeError_);
      self->onFrame_ = nullptr;
    });
    return;
  }
  if (closing_) return;  // the transport's teardown ends in reportClosedFromLoop
  beginReadingFromLoop();
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::close() {
  auto self = this->shared_from_this();
  // Refused only when the context already closed every connection.
  runOnLoop(*loop_, [self] { self->closeFromLoop(Error::disconnected(self->describe() + " closed locally")); });
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::failFromLoop(const std::string& problem) {
  Error error = Error::failed("malformed frame from " + peerAddress_ + ": " + problem);
  std::fprintf(stderr, "distgrad %s: closing connection to %s: %s\n", transport_, peerAddress_.c_str(),
               error.message.c_str());
  closeFromLoop(error);
}

template <class Derived, class Loop>
bool LoopConnection<Derived, Loop>::checkSizeTableFromLoop() {
  std::string problem = sizeTableProblem(prefix_, sizes_, loop_->options().limits);
  if (problem.empty()) return true;
  failFromLoop(problem);
  return false;
}

template <class Derived, class Loop>
bool LoopConnection<Derived, Loop>::allocatePayloadsFromLoop() {
  current_.payloads.clear();
  if (sizes_.empty()) return true;
  std::span<const uint8_t> envelope(current_.envelope.data(), current_.envelope.size());
  std::span<const uint64_t> sizes(sizes_.data(), sizes_.size());
  std::optional<Result<std::vector<PayloadBuffer>>> result;
  try {
    result.emplace(allocate_ ? allocate_(envelope, sizes) : defaultAllocate(transport_, sizes));
  } catch (const std::exception& e) {
    failFromLoop(std::string("the payload allocator threw: ") + e.what());
    return false;
  } catch (...) {
    failFromLoop("the payload allocator threw a non-standard exception");
    return false;
  }
  if (readingStopped()) return false;  // the allocator closed the connection
  if (!result->ok()) {
    Error error = result->error();
    std::fprintf(stderr, "distgrad %s: closing connection to %s: payload allocation refused: %s\n", transport_,
                 peerAddress_.c_str(), error.message.c_str());
    closeFromLoop(error);
    return false;
  }
  auto buffers = std::move(*result).value();
  if (buffers.size() != sizes_.size()) {
    failFromLoop("the payload allocator returned " + std::to_string(buffers.size()) + " buffers for " +
                 std::to_string(sizes_.size()) + " payloads");
    return false;
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].size != sizes_[i] || (buffers[i].data == nullptr && sizes_[i] > 0)) {
      failFromLoop("the payload allocator returned a buffer of " + std::to_string(buffers[i].size) +
                   " bytes for payload " + std::to_string(i) + " of " + std::to_string(sizes_[i]) + " bytes");
      return false;
    }
  }
  current_.payloads = std::move(buffers);
  return true;
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::handFrameFromLoop(IncomingFrame frame) {
  if (!onFrame_) return;
  try {
    onFrame_(std::move(frame));
  } catch (...) {
    // The handler's state is unknown after it threw mid-frame: drop this connection, keep the loop.
    std::string message = reportCallbackException("the frame handler of the " + describe(), "closing the connection");
    closeFromLoop(Error::failed(message));
  }
}

template <class Derived, class Loop>
std::shared_ptr<Derived> LoopConnection<Derived, Loop>::markClosedFromLoop() {
  auto keep = std::move(self_);
  closed_ = true;
  loop_->removeFromLoop(static_cast<Derived*>(this));
  return keep;
}

template <class Derived, class Loop>
void LoopConnection<Derived, Loop>::reportClosedFromLoop(const Error& error) {
  current_ = IncomingFrame{};
  sizes_.clear();
  allocate_ = nullptr;
  onFrame_ = nullptr;
  if (auto onClosed = std::move(onClosed_)) {
    try {
      onClosed(error);
    } catch (...) {
      reportCallbackException("the close callback of the " + describe(), "ignored");
    }
  }
}

}  // namespace distgrad::rpc::transport
