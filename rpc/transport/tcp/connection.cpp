#include "rpc/transport/tcp/connection.h"

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace distgrad::rpc::transport::tcp {

// The prefix and size table are copied to and from the wire as native structs.
static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

namespace {

constexpr uint8_t kZeros[kPayloadAlignment] = {};
// Envelopes up to this size are copied next to the frame header so a small frame is one contiguous iovec.
constexpr size_t kInlineEnvelopeBytes = 4096;

// The allocator used when start() gets none: 64-byte aligned heap buffers.
Result<std::vector<PayloadBuffer>> defaultAllocate(std::span<const uint64_t> sizes) {
  std::vector<PayloadBuffer> buffers;
  buffers.reserve(sizes.size());
  for (uint64_t size : sizes) {
    size_t rounded = static_cast<size_t>(size) + paddingTo64(static_cast<size_t>(size));
    void* data = std::aligned_alloc(kPayloadAlignment, rounded == 0 ? kPayloadAlignment : rounded);
    if (data == nullptr) return Error::failed("tcp: cannot allocate " + std::to_string(size) + " payload bytes");
    buffers.push_back({data, static_cast<size_t>(size), std::shared_ptr<void>(data, std::free)});
  }
  return buffers;
}

}  // namespace

struct TcpConnection::WriteRequest {
  uv_write_t req{};
  std::shared_ptr<TcpConnection> connection;
  std::vector<QueuedFrame> frames;  // keeps envelopes and payload owners alive until the write completes
  std::vector<uint8_t> inlineBytes;
  std::vector<uv_buf_t> buffers;
};

TcpConnection::TcpConnection(std::shared_ptr<TcpLoop> loop, std::string peerAddress)
    : loop_(std::move(loop)), peerAddress_(std::move(peerAddress)) {
  handle_.data = this;
}

TcpConnection::~TcpConnection() = default;

void TcpConnection::initFromLoop() {
  uv_tcp_init(loop_->uvLoop(), &handle_);
  initialized_ = true;
  self_ = shared_from_this();
  loop_->addFromLoop(this);
  scratch_.resize(kScratchBytes);
  beginStage(Stage::kPrefix, &prefix_, sizeof(FramePrefix));
}

void TcpConnection::connectedFromLoop() { uv_tcp_nodelay(&handle_, 1); }

void TcpConnection::send(OutgoingFrame frame, SendCallback done) {
  if (loop_->inLoop()) {
    sendFromLoop(std::move(frame), std::move(done));
    return;
  }
  // One allocation per frame: the task's only capture is one shared_ptr, which std::function stores in
  // place.
  struct Posted {
    std::shared_ptr<TcpConnection> self;
    QueuedFrame queued;
  };
  auto posted = std::make_shared<Posted>(Posted{shared_from_this(), QueuedFrame{std::move(frame), std::move(done)}});
  if (!loop_->post([posted] {
        posted->self->sendFromLoop(std::move(posted->queued.frame), std::move(posted->queued.done));
      })) {
    // The context is closed and its loop thread is gone: complete here, once.
    if (posted->queued.done) {
      posted->queued.done(Error::disconnected("tcp connection to " + peerAddress_ + ": the context is closed"));
    }
  }
}

void TcpConnection::sendFromLoop(OutgoingFrame frame, SendCallback done) {
  auto failLater = [&](Error error) {
    if (!done) return;
    loop_->post([done = std::move(done), error = std::move(error)] { done(error); });
  };
  if (closing_) {
    failLater(closeError_ ? Error::disconnected("tcp connection to " + peerAddress_ + " is closed: " + closeError_->message)
                          : Error::disconnected("tcp connection to " + peerAddress_ + " is closed"));
    return;
  }
  if (frame.envelope.size() > std::numeric_limits<uint32_t>::max() ||
      frame.payloads.size() > std::numeric_limits<uint32_t>::max()) {
    failLater(Error::failed("tcp send: a frame's envelope and payload count must fit 32 bits"));
    return;
  }
  queue_.push_back({std::move(frame), std::move(done)});
  if (!dirty_) {
    dirty_ = true;
    loop_->markDirtyFromLoop(shared_from_this());
  }
}

void TcpConnection::flushFromLoop() {
  dirty_ = false;
  if (closing_ || queue_.empty()) return;
  std::vector<QueuedFrame> frames;
  frames.swap(queue_);
  if (loop_->options().coalesceWrites) {
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

void TcpConnection::writeFromLoop(std::vector<QueuedFrame> frames) {
  auto request = std::make_unique<WriteRequest>();
  request->connection = shared_from_this();
  request->frames = std::move(frames);
  // Pieces in wire order: inline (offset into inlineBytes) or external (pointer into caller memory).
  struct Piece {
    const uint8_t* external;
    size_t offset;
    size_t size;
  };
  std::vector<Piece> pieces;
  size_t inlineSize = 0;
  for (const auto& queued : request->frames) {
    const auto& f = queued.frame;
    size_t header = sizeof(FramePrefix) + 8 * f.payloads.size();
    inlineSize += header;
    if (f.envelope.size() <= kInlineEnvelopeBytes) inlineSize += f.envelope.size();
  }
  auto& bytes = request->inlineBytes;
  bytes.reserve(inlineSize);
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
  for (const auto& queued : request->frames) {
    const auto& f = queued.frame;
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
  request->buffers.reserve(pieces.size());
  for (const auto& piece : pieces) {
    const uint8_t* base = piece.external ? piece.external : bytes.data() + piece.offset;
    request->buffers.push_back(uv_buf_init(const_cast<char*>(reinterpret_cast<const char*>(base)),
                                           static_cast<unsigned int>(0)));
    request->buffers.back().len = piece.size;
  }
  request->req.data = request.get();
  int rc = uv_write(&request->req, reinterpret_cast<uv_stream_t*>(&handle_), request->buffers.data(),
                    static_cast<unsigned int>(request->buffers.size()), &TcpConnection::onWrite);
  if (rc < 0) {
    Error error = Error::disconnected("tcp write to " + peerAddress_ + " failed: " + uvError(rc));
    for (auto& queued : request->frames) {
      if (queued.done) loop_->post([done = std::move(queued.done), error] { done(error); });
    }
    closeFromLoop(error);
    return;
  }
  (void)request.release();  // owned by onWrite now
}

void TcpConnection::onWrite(uv_write_t* req, int status) {
  std::unique_ptr<WriteRequest> request(static_cast<WriteRequest*>(req->data));
  auto& self = *request->connection;
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

void TcpConnection::start(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) {
  DG_CHECK(onFrame && onClosed, "Connection::start: onFrame and onClosed must be set");
  if (loop_->inLoop()) {
    startFromLoop(std::move(allocate), std::move(onFrame), std::move(onClosed));
    return;
  }
  auto self = shared_from_this();
  bool posted = loop_->post([self, allocate = std::move(allocate), onFrame = std::move(onFrame),
                             onClosed = std::move(onClosed)]() mutable {
    self->startFromLoop(std::move(allocate), std::move(onFrame), std::move(onClosed));
  });
  if (!posted) std::fprintf(stderr, "distgrad tcp: Connection::start after the context closed; ignored\n");
}

void TcpConnection::startFromLoop(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) {
  DG_CHECK(!started_, "Connection::start called twice on the tcp connection to ", peerAddress_);
  started_ = true;
  allocate_ = std::move(allocate);
  onFrame_ = std::move(onFrame);
  onClosed_ = std::move(onClosed);
  if (closed_) {
    // Closed before start: report it, later, on the loop.
    auto self = shared_from_this();
    loop_->post([self] {
      if (auto cb = std::move(self->onClosed_)) cb(*self->closeError_);
      self->onFrame_ = nullptr;
    });
    return;
  }
  if (closing_) return;  // closedFromLoop reports it
  int rc = uv_read_start(reinterpret_cast<uv_stream_t*>(&handle_), &TcpConnection::onAlloc, &TcpConnection::onRead);
  if (rc < 0) closeFromLoop(Error::disconnected("tcp read from " + peerAddress_ + " failed: " + uvError(rc)));
}

void TcpConnection::beginStage(Stage stage, void* target, size_t bytes) {
  stage_ = stage;
  target_ = static_cast<uint8_t*>(target);
  remaining_ = bytes;
}

void TcpConnection::onAlloc(uv_handle_t* handle, size_t /*suggested*/, uv_buf_t* buf) {
  auto* self = static_cast<TcpConnection*>(handle->data);
  if (self->target_ != nullptr && self->remaining_ >= kDirectReadBytes) {
    // Large region (payload or big envelope): read straight into its destination.
    *buf = uv_buf_init(reinterpret_cast<char*>(self->target_), 0);
    buf->len = std::min<size_t>(self->remaining_, size_t{1} << 30);
    return;
  }
  *buf = uv_buf_init(reinterpret_cast<char*>(self->scratch_.data()), static_cast<unsigned int>(self->scratch_.size()));
}

void TcpConnection::onRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
  auto* self = static_cast<TcpConnection*>(stream->data);
  auto keepAlive = self->shared_from_this();
  try {
    self->readFromLoop(nread, buf);
  } catch (...) {
    // Callbacks are guarded where they run; this catches the rest (e.g. std::bad_alloc for an envelope).
    std::string message =
        reportCallbackException("reading from the tcp connection to " + self->peerAddress_, "closing the connection");
    self->closeFromLoop(Error::failed(message));
  }
}

void TcpConnection::readFromLoop(ssize_t nread, const uv_buf_t* buf) {
  if (nread < 0) {
    bool midFrame = !(stage_ == Stage::kPrefix && remaining_ == sizeof(FramePrefix));
    if (nread == UV_EOF) {
      std::string message = "tcp peer " + peerAddress_ + " closed the connection";
      if (midFrame) {
        message += " in the middle of a frame";
        std::fprintf(stderr, "distgrad tcp: %s\n", message.c_str());
      }
      closeFromLoop(Error::disconnected(message));
    } else {
      closeFromLoop(Error::disconnected("tcp read from " + peerAddress_ + " failed: " +
                                        uvError(static_cast<int>(nread))));
    }
    return;
  }
  if (nread == 0 || closing_) return;
  auto n = static_cast<size_t>(nread);
  if (buf->base == reinterpret_cast<char*>(scratch_.data())) {
    consumeFromLoop(scratch_.data(), n);
  } else {
    target_ += n;
    remaining_ -= n;
    consumeFromLoop(nullptr, 0);
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

void TcpConnection::failFromLoop(const std::string& problem) {
  Error error = Error::failed("malformed frame from " + peerAddress_ + ": " + problem);
  std::fprintf(stderr, "distgrad tcp: closing connection to %s: %s\n", peerAddress_.c_str(), error.message.c_str());
  closeFromLoop(error);
}

bool TcpConnection::completeStageFromLoop() {
  if (closing_) return false;
  const FrameLimits& limits = loop_->options().limits;
  switch (stage_) {
    case Stage::kPrefix: {
      auto valid = validatePrefix(prefix_, limits);
      if (!valid.ok()) {
        failFromLoop(valid.error().message);
        return false;
      }
      sizes_.assign(prefix_.payloadCount, 0);
      beginStage(Stage::kSizes, sizes_.data(), sizes_.size() * sizeof(uint64_t));
      return true;
    }
    case Stage::kSizes: {
      uint64_t sum = 0;
      for (size_t i = 0; i < sizes_.size(); ++i) {
        if (sizes_[i] > limits.maxPayloadBytes || sizes_[i] > prefix_.payloadBytes - sum) {
          failFromLoop("payload " + std::to_string(i) + " declares " + std::to_string(sizes_[i]) +
                       " bytes, more than the frame's total of " + std::to_string(prefix_.payloadBytes));
          return false;
        }
        sum += sizes_[i];
      }
      if (sum != prefix_.payloadBytes) {
        failFromLoop("payload sizes sum to " + std::to_string(sum) + " bytes but the prefix declares " +
                     std::to_string(prefix_.payloadBytes));
        return false;
      }
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

bool TcpConnection::allocatePayloadsFromLoop() {
  if (sizes_.empty()) return true;
  std::span<const uint8_t> envelope(current_.envelope.data(), current_.envelope.size());
  std::span<const uint64_t> sizes(sizes_.data(), sizes_.size());
  std::optional<Result<std::vector<PayloadBuffer>>> result;
  try {
    result.emplace(allocate_ ? allocate_(envelope, sizes) : defaultAllocate(sizes));
  } catch (const std::exception& e) {
    failFromLoop(std::string("the payload allocator threw: ") + e.what());
    return false;
  } catch (...) {
    failFromLoop("the payload allocator threw a non-standard exception");
    return false;
  }
  if (closing_) return false;  // the allocator closed the connection
  if (!result->ok()) {
    Error error = result->error();
    std::fprintf(stderr, "distgrad tcp: closing connection to %s: payload allocation refused: %s\n",
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

void TcpConnection::deliverFromLoop() {
  IncomingFrame frame = std::move(current_);
  current_ = IncomingFrame{};
  beginStage(Stage::kPrefix, &prefix_, sizeof(FramePrefix));
  if (!onFrame_) return;
  try {
    onFrame_(std::move(frame));
  } catch (...) {
    // The handler's state is unknown after it threw mid-frame: drop this connection, keep the loop.
    std::string message =
        reportCallbackException("the frame handler of the tcp connection to " + peerAddress_, "closing the connection");
    closeFromLoop(Error::failed(message));
  }
}

void TcpConnection::close() {
  if (loop_->inLoop()) {
    closeFromLoop(Error::disconnected("tcp connection to " + peerAddress_ + " closed locally"));
    return;
  }
  auto self = shared_from_this();
  // Refused only when the context already closed every connection.
  loop_->post([self] { self->closeFromLoop(Error::disconnected("tcp connection to " + self->peerAddress_ + " closed locally")); });
}

void TcpConnection::closeFromLoop(const Error& error) {
  if (closing_ || !initialized_) return;
  closing_ = true;
  closeError_ = error;
  if (started_) uv_read_stop(reinterpret_cast<uv_stream_t*>(&handle_));
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
  auto keep = std::move(self_);  // released when this function returns
  closed_ = true;
  loop_->removeFromLoop(this);
  Error error = *closeError_;
  auto queued = std::move(queue_);
  queue_.clear();
  for (auto& frame : queued) {
    if (frame.done) {
      completeSendFromLoop(frame.done,
                           Error::disconnected("tcp connection to " + peerAddress_ + " closed: " + error.message));
    }
  }
  current_ = IncomingFrame{};
  sizes_.clear();
  allocate_ = nullptr;
  onFrame_ = nullptr;
  if (auto onClosed = std::move(onClosed_)) {
    try {
      onClosed(error);
    } catch (...) {
      reportCallbackException("the close callback of the tcp connection to " + peerAddress_, "ignored");
    }
  }
}

void TcpConnection::completeSendFromLoop(SendCallback& done, const Result<void>& result) {
  try {
    done(result);
  } catch (...) {
    // The connection cannot tell what state its owner is in after that: close it (a no-op if closing).
    std::string message =
        reportCallbackException("a send callback of the tcp connection to " + peerAddress_, "closing the connection");
    closeFromLoop(Error::failed(message));
  }
}

}  // namespace distgrad::rpc::transport::tcp
