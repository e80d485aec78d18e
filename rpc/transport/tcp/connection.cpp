#include "rpc/transport/tcp/connection.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

namespace distgrad::rpc::transport::tcp {

// The prefix and size table are copied to and from the wire as native structs.
static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

namespace {

constexpr uint8_t kZeros[kPayloadAlignment] = {};
// Envelopes up to this size are copied next to the frame header so a small frame is one contiguous iovec.
constexpr size_t kInlineEnvelopeBytes = 4096;
}  // namespace

struct TcpConnection::WriteRequest {
  uv_write_t req{};
  std::shared_ptr<TcpConnection> connection;
  std::vector<QueuedFrame> frames;  // keeps envelopes and payload owners alive until the write completes
  std::vector<uint8_t> inlineBytes;
  std::vector<uv_buf_t> buffers;
};

TcpConnection::TcpConnection(std::shared_ptr<TcpLoop> loop, std::string peerAddress)
    : LoopConnection("tcp", std::move(loop), std::move(peerAddress)) {
  handle_.data = this;
}

TcpConnection::~TcpConnection() {
  if (kickFd_ >= 0) ::close(kickFd_);
}

void TcpConnection::initFromLoop() {
  uv_tcp_init(loop_->uvLoop(), &handle_);
  initialized_ = true;
  self_ = shared_from_this();
  loop_->addFromLoop(this);
  scratch_.resize(kScratchBytes);
  beginStage(Stage::kPrefix, &prefix_, sizeof(FramePrefix));
}

void TcpConnection::connectedFromLoop() {
  uv_tcp_nodelay(&handle_, 1);
  uv_os_fd_t fd = -1;
  if (closing_ || uv_fileno(reinterpret_cast<uv_handle_t*>(&handle_), &fd) != 0) return;
  std::lock_guard<std::mutex> lock(writeMutex_);
  fd_ = fd;  // Note [Sender writes]
}

void TcpConnection::sendFromLoop(OutgoingFrame frame, SendCallback done) {
  if (refuseSendFromLoop(frame, done, closing_)) return;
  queue_.push_back({std::move(frame), std::move(done)});
  if (!dirty_) {
    dirty_ = true;
    loop_->markDirtyFromLoop(shared_from_this());
  }
}

void TcpConnection::flushFromLoop() {
  dirty_ = false;
  if (closing_ || (queue_.empty() && !partialPending_.load())) return;
  std::vector<QueuedFrame> frames;
  frames.swap(queue_);
  if (loop_->options().coalesceWrites || frames.empty()) {  // empty: only a sender's partial frame
    writeFromLoop(std::move(frames));
  } else {
    for (auto& frame : frames) {
      std::vector<QueuedFrame> one;
      one.push_back(std::move(frame));
      writeFromLoop(std::move(one));
      if (closing_) break;
    }
  }
}

namespace {

// Appends the wire bytes of `f` in order: inline pieces (offset into `bytes`; offsets, not pointers, so
// `bytes` may grow) and external ones (pointers into the frame's own memory: payloads are never copied).
template <class Piece>
void layOutFrame(const OutgoingFrame& f, std::vector<uint8_t>& bytes, std::vector<Piece>& pieces) {
  auto addInline = [&](const void* data, size_t size) {
    if (size == 0) return;
    size_t offset = bytes.size();
    bytes.insert(bytes.end(), static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + size);
    if (!pieces.empty() && pieces.back().external == nullptr && pieces.back().offset + pieces.back().size == offset) {
      pieces.back().size += size;
    } else {
      pieces.push_back({nullptr, offset, size});
    }
  };
  auto addExternal = [&](const void* data, size_t size) {
    if (size > 0) pieces.push_back({static_cast<const uint8_t*>(data), 0, size});
  };
  FramePrefix prefix;
  prefix.flags = f.flags;
  prefix.envelopeBytes = static_cast<uint32_t>(f.envelope.size());
  prefix.payloadCount = static_cast<uint32_t>(f.payloads.size());
  uint64_t total = 0;
  for (const auto& p : f.payloads) total += p.size;
  prefix.payloadBytes = total;
  addInline(&prefix, sizeof(prefix));
  for (const auto& p : f.payloads) {
    uint64_t size = p.size;
    addInline(&size, sizeof(size));
  }
  size_t head = sizeof(FramePrefix) + 8 * f.payloads.size() + f.envelope.size();
  if (f.envelope.size() <= kInlineEnvelopeBytes) {
    addInline(f.envelope.data(), f.envelope.size());
  } else {
    addExternal(f.envelope.data(), f.envelope.size());
  }
  addExternal(kZeros, paddingTo64(head));
  for (const auto& p : f.payloads) {
    addExternal(p.data, p.size);  // straight from the sender's storage: no copy
    addExternal(kZeros, paddingTo64(p.size));
  }
}

// Drops the first `bytes` bytes of `pieces` (what a sender already wrote of the first frame).
template <class Piece>
void dropFront(std::vector<Piece>& pieces, size_t bytes) {
  size_t whole = 0;
  while (whole < pieces.size() && bytes >= pieces[whole].size) bytes -= pieces[whole++].size;
  pieces.erase(pieces.begin(), pieces.begin() + static_cast<std::ptrdiff_t>(whole));
  if (bytes == 0) return;
  Piece& first = pieces.front();
  if (first.external != nullptr) {
    first.external += bytes;
  } else {
    first.offset += bytes;
  }
  first.size -= bytes;
}

}  // namespace

// Note [Sender writes]: a frame goes to the loop thread to be written (ARCHITECTURE §3: only the loop
// writes sockets). For a caller about to block on the answer (rpcSync) that hand-off is a wake-up and a
// context switch of several microseconds on its own, a sixth of a no-op round trip here. So a frame marked
// fromSender is written by the sending thread itself, with one non-blocking sendmsg, when nothing of this
// connection waits to be written: unwritten_ (frames send() took, not yet all in the socket: posted,
// queued on the loop, in a libuv write request or partial_) is zero. Then no earlier frame of the same
// thread can be overtaken, and every socket write, the loop's included, happens under writeMutex_, so the
// bytes of two writers never interleave (while libuv has a request queued, unwritten_ is not zero and no
// sender writes). If the socket takes part of the frame, the rest waits in partial_, which the loop writes
// before anything else; if it takes nothing (full, or an error), the frame goes the usual way and the
// loop's write meets the same condition and reports it. fd_ is cleared under writeMutex_ before the handle
// closes, so a sender never writes a closed descriptor. Frames that are not marked keep the batching of the
// loop (one write for every frame a burst of calls queued): a flood of rpcAsync calls is cheaper that way.
void TcpConnection::send(OutgoingFrame frame, SendCallback done) {
  if (frame.fromSender && !loop_->inLoop() && writeFromSender(frame, done)) return;
  unwritten_.fetch_add(1);
  LoopConnection::send(std::move(frame), std::move(done));
}

bool TcpConnection::writeFromSender(OutgoingFrame& frame, SendCallback& done) {
  std::unique_lock<std::mutex> lock(writeMutex_);
  if (fd_ < 0 || unwritten_.load() != 0 || !fitsWirePrefix(frame)) return false;  // refused by the loop
  senderBytes_.clear();
  senderPieces_.clear();
  layOutFrame(frame, senderBytes_, senderPieces_);
  if (senderPieces_.size() > 64) return false;  // many payloads: the loop's writev handles IOV_MAX
  senderIov_.clear();
  size_t total = 0;
  for (const auto& piece : senderPieces_) {
    const uint8_t* base = piece.external ? piece.external : senderBytes_.data() + piece.offset;
    senderIov_.push_back({const_cast<uint8_t*>(base), piece.size});
    total += piece.size;
  }
  msghdr message{};
  message.msg_iov = senderIov_.data();
  message.msg_iovlen = senderIov_.size();
  ssize_t n;
  do {
    n = ::sendmsg(fd_, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return false;  // nothing written: the loop writes it (and reports an error it meets)
  senderWrites_.fetch_add(1, std::memory_order_relaxed);
  if (static_cast<size_t>(n) == total) {
    lock.unlock();
    if (done) done(Result<void>());
    return true;
  }
  partial_.emplace(QueuedFrame{std::move(frame), std::move(done)});
  partialWritten_ = static_cast<size_t>(n);
  partialPending_.store(true);
  unwritten_.fetch_add(1);
  lock.unlock();
  auto self = shared_from_this();
  if (!loop_->post([self] { self->requestFlushFromLoop(); })) {
    // The context closed meanwhile and no loop will write the rest: fail it here.
    std::optional<QueuedFrame> failed;
    {
      std::lock_guard<std::mutex> relock(writeMutex_);
      failed.swap(partial_);
    }
    if (failed && failed->done) failed->done(Error::disconnected(describe() + ": the context is closed"));
  }
  return true;
}

void TcpConnection::requestFlushFromLoop() {
  if (!dirty_) {
    dirty_ = true;
    loop_->markDirtyFromLoop(shared_from_this());
  }
}

void TcpConnection::writeFromLoop(std::vector<QueuedFrame> frames) {
  // The frames' bytes as pieces in wire order: inline (offset into writeBytes_) or external (pointer into
  // caller memory). Built in vectors the connection keeps, so a write that leaves at once (the usual case
  // for small frames) allocates nothing.
  std::vector<uint8_t>& bytes = writeBytes_;
  std::vector<WritePiece>& pieces = writePieces_;
  bytes.clear();
  pieces.clear();
  std::unique_lock<std::mutex> lock(writeMutex_);  // Note [Sender writes]
  size_t alreadyWritten = 0;
  if (partial_) {
    // A sender's frame the socket took part of goes first.
    frames.insert(frames.begin(), std::move(*partial_));
    alreadyWritten = partialWritten_;
    partial_.reset();
    partialPending_.store(false);
  }
  if (frames.empty()) return;
  size_t inlineSize = 0;
  for (const auto& queued : frames) {
    const auto& f = queued.frame;
    size_t header = sizeof(FramePrefix) + 8 * f.payloads.size();
    inlineSize += header;
    if (f.envelope.size() <= kInlineEnvelopeBytes) inlineSize += f.envelope.size();
  }
  bytes.reserve(inlineSize);
  for (const auto& queued : frames) layOutFrame(queued.frame, bytes, pieces);
  dropFront(pieces, alreadyWritten);
  std::vector<uv_buf_t>& buffers = writeBuffers_;
  buffers.clear();
  buffers.reserve(pieces.size());
  size_t totalBytes = 0;
  for (const auto& piece : pieces) {
    const uint8_t* base = piece.external ? piece.external : bytes.data() + piece.offset;
    buffers.push_back(uv_buf_init(const_cast<char*>(reinterpret_cast<const char*>(base)), 0));
    buffers.back().len = piece.size;
    totalBytes += piece.size;
  }
  auto fail = [&](int rc) {
    lock.unlock();  // closeFromLoop takes it
    Error error = Error::disconnected("tcp write to " + peerAddress_ + " failed: " + uvError(rc));
    for (auto& queued : frames) {
      if (queued.done) loop_->post([done = std::move(queued.done), error] { done(error); });
    }
    closeFromLoop(error);
  };
  // Note [Direct writes]: when nothing is queued in libuv, the bytes go out with one writev right here
  // (uv_try_write) and the frames complete at once. uv_write would do the same writev, but then complete
  // the request through the loop's pending queue and re-arm the socket's epoll registration (an
  // epoll_ctl per write), and it needs a request object. What the socket does not take now (a full send
  // buffer) goes through uv_write, which keeps order behind it and reports through onWrite.
  size_t written = 0;
  if (uv_stream_get_write_queue_size(reinterpret_cast<uv_stream_t*>(&handle_)) == 0) {
    int n = uv_try_write(reinterpret_cast<uv_stream_t*>(&handle_), buffers.data(),
                         static_cast<unsigned int>(buffers.size()));
    if (n >= 0) {
      written = static_cast<size_t>(n);
    } else if (n != UV_EAGAIN) {
      fail(n);
      return;
    }
  }
  if (written == totalBytes) {
    unwritten_.fetch_sub(frames.size());
    lock.unlock();
    for (auto& queued : frames) {
      // Every frame left, so each completes with success even if an earlier callback closed the connection.
      if (queued.done) completeSendFromLoop(queued.done, Result<void>());
    }
    return;
  }
  // The rest: a request owning the frames and a copy of the inline bytes, its buffers past `written`.
  auto request = std::make_unique<WriteRequest>();
  request->connection = shared_from_this();
  request->frames = std::move(frames);
  request->inlineBytes = bytes;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const WritePiece& piece = pieces[i];
    if (written >= piece.size) {
      written -= piece.size;
      continue;
    }
    const uint8_t* base = piece.external ? piece.external : request->inlineBytes.data() + piece.offset;
    request->buffers.push_back(uv_buf_init(const_cast<char*>(reinterpret_cast<const char*>(base + written)), 0));
    request->buffers.back().len = piece.size - written;
    written = 0;
  }
  request->req.data = request.get();
  int rc = uv_write(&request->req, reinterpret_cast<uv_stream_t*>(&handle_), request->buffers.data(),
                    static_cast<unsigned int>(request->buffers.size()), &TcpConnection::onWrite);
  if (rc < 0) {
    frames = std::move(request->frames);
    fail(rc);
    return;
  }
  (void)request.release();  // owned by onWrite now, which counts its frames out of unwritten_
}

void TcpConnection::onWrite(uv_write_t* req, int status) {
  std::unique_ptr<WriteRequest> request(static_cast<WriteRequest*>(req->data));
  auto& self = *request->connection;
  self.unwritten_.fetch_sub(request->frames.size());  // libuv has written them (or given up)
  if (status == 0) {
    for (auto& queued : request->frames) {
      if (queued.done) self.completeSendFromLoop(queued.done, Result<void>());
    }
    return;
  }
  Error error = status == UV_ECANCELED
                    ? Error::disconnected("tcp connection to " + self.peerAddress_ + " closed before the frame was sent")
                    : Error::disconnected("tcp write to " + self.peerAddress_ + " failed: " + uvError(status));
  if (status != UV_ECANCELED && self.closeError_) error.message += " (" + self.closeError_->message + ")";
  for (auto& queued : request->frames) {
    if (queued.done) self.completeSendFromLoop(queued.done, error);
  }
  if (status != UV_ECANCELED) self.closeFromLoop(error);
}

// Note [Waiting reader]: a caller blocked in rpcSync used to be woken by the loop thread, which had been
// woken by its socket: on a busy (or the one) core that is a context switch more than a raw socket
// ping-pong's, and across idle cores a wake-up of a sleeping CPU more (bench_rpc's no-op rpcSync; ARCHITECTURE
// §3's thread rules, docs/thread_model.md "Latency"). So a thread about to block for a reply may read its
// connection itself for a while (Connection::beginWaitingRead, used by Agent::rpcSync):
//  - The loop does not read sockets through uv_read_start but through its read set (TcpLoop::watchReads), an
//    epoll set of its own, level-triggered, on which the loop thread blocks (libuv is embedded in it:
//    TcpLoop::run). The waiting thread pauses its socket in that set (TcpLoop::pauseReads; epoll_ctl is
//    thread-safe; no libuv call is made off the loop thread), so the reply wakes only the waiting thread,
//    blocked in ppoll on the socket. It does so before it sends its call: on one core the callee's answer can
//    come back before the sender runs again.
//  - Whoever reads holds readerMutex_: the loop try-locks it per readable socket and skips one a waiting
//    thread holds; a waiting thread try-locks it and, when the loop or another waiter reads, just waits as
//    usual. So frames are read and handed to onFrame in order, one reader at a time, whichever thread.
//  - The waiter reads everything that arrives (replies of other calls, calls, heartbeats), until its own
//    reply is in (`done`), the window passed, or the connection closes; then it lets go and resumes the
//    socket in the read set (Note [Resume after letting go]), where anything still unread wakes the loop at
//    once (level-triggered).
//  - Closing stays the loop's: a failure the reader meets (end of stream, read error, malformed frame, a
//    throwing handler) is recorded (failReading, also what closeFromLoop does when called inside the read
//    path, tReading) and handed to closeFromLoop once the reader let go. closeFromLoop marks the connection
//    closing, wakes a waiting reader through kickFd_ and takes readerMutex_ before it closes the socket, so
//    no thread polls or reads an fd that was closed (and maybe reused). The loop blocks there only while a
//    waiter finishes the frame it is handing over: a reader never waits for the loop (frame handlers post,
//    and an inline handler run there must not block).
//  - What a frame handler sees: it may run on the waiting thread. The agent's handlers are thread-agnostic
//    (calls read there are posted to the executor; an inline handler's call runs right there, as on the
//    loop: Note [Inline handlers] in rpc/agent.cpp).
// A thread that already reads some connection (a handler's continuation calling rpcSync) does not read
// another (tReading). inproc does not do this (the default readWhileWaiting returns at once); ucx drives
// its worker instead (Note [Driving threads] in rpc/transport/ucx/context.cpp).
namespace {
thread_local const TcpConnection* tReading = nullptr;  // the connection this thread reads, if any

timespec timespecOf(std::chrono::nanoseconds ns) {
  return timespec{static_cast<time_t>(ns.count() / 1'000'000'000), static_cast<long>(ns.count() % 1'000'000'000)};
}

// Note [Lazy window timer]: readWhileWaiting's window is not ppoll's timeout. A ppoll with a timeout arms a
// kernel timer each time it sleeps and cancels it when woken, on both sides of every round trip; in a VM
// programming the timer is a VM exit: measured on the one-core ping-pong (a C program, both sides in ppoll),
// 16.0-16.6 us with a 2 ms timeout against 14.5 us without, and a p90 of 28 against 15.5 us. So each thread
// keeps a timerfd that it polls with the socket, armed to fire no later than the window's end; it is set
// again only once it fired or would fire too late. Back-to-back calls each move the window's end a little,
// but the timer is set about once per window (it fires at the oldest end; the thread re-arms it for the
// current one) instead of twice per call. Without a timerfd (none to be had) ppoll gets the timeout.
class WindowTimer {
 public:
  using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC, as the timerfd
  WindowTimer() : fd_(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)) {}
  WindowTimer(const WindowTimer&) = delete;
  WindowTimer& operator=(const WindowTimer&) = delete;
  ~WindowTimer() {
    if (fd_ >= 0) ::close(fd_);
  }

  // The fd to poll, readable no later than `end` (and maybe earlier: check the clock when it is), or -1.
  int armBy(Clock::time_point end, Clock::time_point now) {
    if (fd_ < 0) return -1;
    if (armedUntil_ > now && armedUntil_ <= end) return fd_;  // it will fire in time, and has not yet
    itimerspec spec{};
    spec.it_value = timespecOf(end.time_since_epoch());
    // Setting it also clears an expiry not read yet.
    if (::timerfd_settime(fd_, TFD_TIMER_ABSTIME, &spec, nullptr) != 0) return -1;
    armedUntil_ = end;
    return fd_;
  }

 private:
  int fd_;
  Clock::time_point armedUntil_{};
};
thread_local WindowTimer tWindowTimer;

struct ReadingScope {
  explicit ReadingScope(const TcpConnection* connection) : previous(tReading) { tReading = connection; }
  ~ReadingScope() { tReading = previous; }
  const TcpConnection* previous;
};
}  // namespace

void TcpConnection::beginReadingFromLoop() {
  uv_os_fd_t fd = -1;
  int rc = uv_fileno(reinterpret_cast<uv_handle_t*>(&handle_), &fd);
  if (rc < 0) {
    closeFromLoop(Error::disconnected("tcp read from " + peerAddress_ + " failed: " + uvError(rc)));
    return;
  }
  kickFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (kickFd_ < 0) {
    closeFromLoop(Error::failed("tcp connection to " + peerAddress_ + ": eventfd failed: " + std::strerror(errno)));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(readerMutex_);
    readFd_ = fd;
  }
  {
    std::lock_guard<std::mutex> lock(armMutex_);
    loop_->watchReads(this, fd);
    inReadSet_ = true;
  }
  readable_.store(true, std::memory_order_release);
}

void TcpConnection::beginStage(Stage stage, void* target, size_t bytes) {
  stage_ = stage;
  target_ = static_cast<uint8_t*>(target);
  remaining_ = bytes;
}

void TcpConnection::failReading(const Error& error) {
  if (readFailed_) return;
  readFailed_ = true;
  readError_ = error;
}

void TcpConnection::readReadyFromLoop() {
  std::unique_lock<std::mutex> lock(readerMutex_, std::try_to_lock);
  if (!lock.owns_lock() || readingStopped()) return;  // a waiting thread reads it (or it is closing)
  auto keepAlive = shared_from_this();
  {
    ReadingScope reading(this);
    readSocket(32);
  }
  std::optional<Error> failure = std::exchange(readError_, std::nullopt);
  lock.unlock();
  if (failure) closeFromLoop(*failure);
}

bool TcpConnection::beginWaitingRead() {
  if (tReading != nullptr || loop_->inLoop() || !readable_.load(std::memory_order_acquire)) return false;
  if (!readerMutex_.try_lock()) return false;
  if (readingStopped()) {
    readerMutex_.unlock();
    return false;
  }
  readerRole_ += 1;
  {
    std::lock_guard<std::mutex> lock(armMutex_);
    loop_->pauseReads(this, readFd_);  // the loop is no longer woken by this socket
    pausedBy_ = readerRole_;
  }
  tReading = this;
  return true;
}

void TcpConnection::readWhileWaiting(const std::function<bool()>& done, std::chrono::microseconds window) {
  DG_ASSERT(tReading == this, "TcpConnection::readWhileWaiting without beginWaitingRead");
  const auto deadline = WindowTimer::Clock::now() + window;
  while (!readingStopped() && !done()) {
    const auto now = WindowTimer::Clock::now();
    if (now >= deadline) break;
    const int timer = tWindowTimer.armBy(deadline, now);
    pollfd fds[3] = {{readFd_, POLLIN, 0}, {kickFd_, POLLIN, 0}, {timer, POLLIN, 0}};
    int ready;
    if (timer >= 0) {
      ready = ::ppoll(fds, 3, nullptr, nullptr);
    } else {
      const timespec timeout = timespecOf(deadline - now);
      ready = ::ppoll(fds, 2, &timeout, nullptr);
    }
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;  // the window passed (or ppoll failed: wait as usual)
    if (timer >= 0 && fds[2].revents != 0 && fds[0].revents == 0) continue;  // the clock says whether it ended
    if (fds[1].revents != 0) {
      // closeFromLoop (which set closing_ first, so the loop ends) or interruptWaitingRead: check again.
      uint64_t count = 0;
      while (::read(kickFd_, &count, sizeof(count)) < 0 && errno == EINTR) {
      }
      continue;
    }
    readSocket(32);
  }
}

void TcpConnection::interruptWaitingRead() {
  if (!readable_.load(std::memory_order_acquire)) return;  // nobody can be reading yet
  const uint64_t one = 1;
  while (::write(kickFd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

// Note [Resume after letting go]: a waiting reader resumes its socket in the loop's read set once it has
// let go of readerMutex_, not before. Resumed first, bytes already waiting woke the loop at once, which
// found the reader mutex still held, skipped the socket and was woken again by it (level-triggered): a
// busy loop until the reader let go, and on one core, where the loop had preempted the reader, for the rest
// of its time slice (measured: 9-14 epoll_wait calls per remote()+toHere() on one core, against none per
// rpcSync; +10 us of system time per operation). Resumed after, the socket may already have a new reader
// that paused it again: pausedBy_, under armMutex_, says whether the pause is still this reader's (else the
// new one resumes it when it lets go); and it may be closing: closeFromLoop takes it out of the read set
// under armMutex_ (inReadSet_), so nothing is resumed after that.
void TcpConnection::endWaitingRead() {
  DG_ASSERT(tReading == this, "TcpConnection::endWaitingRead without beginWaitingRead");
  tReading = nullptr;
  const bool resume = !readingStopped();
  const uint64_t role = readerRole_;
  const int fd = readFd_;
  std::optional<Error> failure = std::exchange(readError_, std::nullopt);
  readerMutex_.unlock();
  if (resume) {
    std::lock_guard<std::mutex> lock(armMutex_);
    if (pausedBy_ == role && inReadSet_) {
      // Level-triggered: bytes that came in since the last read wake the loop at once.
      loop_->resumeReads(this, fd);
      pausedBy_ = 0;
    }
  }
  if (failure) {
    auto self = shared_from_this();
    // Refused only once the context is closing, which closes this connection anyway.
    (void)loop_->post([self, error = std::move(*failure)] { self->closeFromLoop(error); });
  }
}

void TcpConnection::readSocket(int reads) {
  try {
    for (int i = 0; i < reads && !readingStopped(); ++i) {
      // A large region (payload or big envelope) is read straight into its destination.
      const bool direct = target_ != nullptr && remaining_ >= kDirectReadBytes;
      uint8_t* into = direct ? target_ : scratch_.data();
      const size_t capacity = direct ? std::min<size_t>(remaining_, size_t{1} << 30) : scratch_.size();
      const ssize_t n = ::recv(readFd_, into, capacity, MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        failReading(Error::disconnected("tcp read from " + peerAddress_ + " failed: " + std::strerror(errno)));
        return;
      }
      if (n == 0) {
        std::string message = "tcp peer " + peerAddress_ + " closed the connection";
        if (!(stage_ == Stage::kPrefix && remaining_ == sizeof(FramePrefix))) {
          message += " in the middle of a frame";
          std::fprintf(stderr, "distgrad tcp: %s\n", message.c_str());
        }
        failReading(Error::disconnected(message));
        return;
      }
      const auto got = static_cast<size_t>(n);
      if (direct) {
        target_ += got;
        remaining_ -= got;
        consumeFromLoop(nullptr, 0);
      } else {
        consumeFromLoop(scratch_.data(), got);
      }
      if (got < capacity) return;  // a short read: the socket has nothing more now
    }
  } catch (...) {
    // Callbacks are guarded where they run; this catches the rest (e.g. std::bad_alloc for an envelope).
    failReading(Error::failed(
        reportCallbackException("reading from the tcp connection to " + peerAddress_, "closing the connection")));
  }
}

void TcpConnection::consumeFromLoop(const uint8_t* data, size_t size) {
  for (;;) {
    while (remaining_ == 0) {
      if (!completeStageFromLoop()) return;
    }
    if (size == 0) return;
    size_t take = std::min(size, remaining_);
    if (target_ != nullptr) {
      std::memcpy(target_, data, take);
      target_ += take;
    }
    remaining_ -= take;
    data += take;
    size -= take;
  }
}

bool TcpConnection::completeStageFromLoop() {
  if (closing_) return false;
  switch (stage_) {
    case Stage::kPrefix: {
      auto valid = validatePrefix(prefix_, loop_->options().limits);
      if (!valid.ok()) {
        failFromLoop(valid.error().message);
        return false;
      }
      sizes_.assign(prefix_.payloadCount, 0);
      beginStage(Stage::kSizes, sizes_.data(), sizes_.size() * sizeof(uint64_t));
      return true;
    }
    case Stage::kSizes: {
      if (!checkSizeTableFromLoop()) return false;
      current_.flags = prefix_.flags;
      current_.envelope.resize(prefix_.envelopeBytes);
      beginStage(Stage::kEnvelope, current_.envelope.data(), current_.envelope.size());
      return true;
    }
    case Stage::kEnvelope: {
      if (!allocatePayloadsFromLoop()) return false;
      size_t head = sizeof(FramePrefix) + 8 * sizes_.size() + current_.envelope.size();
      beginStage(Stage::kEnvelopePadding, nullptr, paddingTo64(head));
      return true;
    }
    case Stage::kEnvelopePadding:
    case Stage::kPayloadPadding: {
      payloadIndex_ = stage_ == Stage::kEnvelopePadding ? 0 : payloadIndex_ + 1;
      if (payloadIndex_ < sizes_.size()) {
        beginStage(Stage::kPayload, current_.payloads[payloadIndex_].data, sizes_[payloadIndex_]);
        return true;
      }
      deliverFromLoop();
      return !closing_;
    }
    case Stage::kPayload:
      beginStage(Stage::kPayloadPadding, nullptr, paddingTo64(sizes_[payloadIndex_]));
      return true;
  }
  return false;
}

void TcpConnection::deliverFromLoop() {
  IncomingFrame frame = std::move(current_);
  current_ = IncomingFrame{};
  beginStage(Stage::kPrefix, &prefix_, sizeof(FramePrefix));
  handFrameFromLoop(std::move(frame));
}

void TcpConnection::closeFromLoop(const Error& error) {
  if (tReading == this) {
    // Inside the read path (a malformed frame, a handler closing its own connection): the reader stops
    // and hands the error back to closeFromLoop once it let go (Note [Waiting reader]).
    failReading(error);
    return;
  }
  DG_ASSERT(loop_->inLoop(), "TcpConnection::closeFromLoop off the loop thread");
  if (closing_ || !initialized_) return;
  closing_ = true;
  closeError_ = error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);  // Note [Sender writes]: no sender writes from here on
    fd_ = -1;
  }
  if (readable_.load(std::memory_order_acquire)) {
    // Note [Waiting reader]: wake a thread reading the socket and wait until it let go, so that nobody
    // polls or reads the fd once uv_close closed it.
    const uint64_t one = 1;
    while (::write(kickFd_, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
    std::lock_guard<std::mutex> lock(readerMutex_);
    std::lock_guard<std::mutex> arm(armMutex_);  // Note [Resume after letting go]
    loop_->unwatchReads(readFd_);
    inReadSet_ = false;
    readFd_ = -1;
  }
  // In-flight writes complete with UV_ECANCELED before the close callback runs.
  uv_close(reinterpret_cast<uv_handle_t*>(&handle_), &TcpConnection::onClose);
}

void TcpConnection::onClose(uv_handle_t* handle) {
  auto* self = static_cast<TcpConnection*>(handle->data);
  auto keep = self->self_;  // closedFromLoop drops the self reference; the catch below still uses *self
  try {
    self->closedFromLoop();
  } catch (...) {
    reportCallbackException("closing the tcp connection to " + self->peerAddress_, "ignored");
  }
}

void TcpConnection::closedFromLoop() {
  auto keep = markClosedFromLoop();  // the self reference, released when this function returns
  Error error = *closeError_;
  auto queued = std::move(queue_);
  queue_.clear();
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (partial_) queued.insert(queued.begin(), std::move(*partial_));
    partial_.reset();
  }
  for (auto& frame : queued) {
    if (frame.done) {
      completeSendFromLoop(frame.done,
                           Error::disconnected("tcp connection to " + peerAddress_ + " closed: " + error.message));
    }
  }
  reportClosedFromLoop(error);
}

}  // namespace distgrad::rpc::transport::tcp
