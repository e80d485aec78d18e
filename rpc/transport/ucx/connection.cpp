#include "rpc/transport/ucx/connection.h"

#include <bit>
#include <cstdio>
#include <cstring>
#include <future>

namespace distgrad::rpc::transport::ucx {

// The prefix and size table are copied to and from the wire as native structs.
static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

namespace {

// A ucp request handle that completes without a callback of ours (goodbye messages): freed when done.
void freeWhenDone(ucs_status_ptr_t request) {
  if (request != nullptr && !UCS_PTR_IS_ERR(request)) ucp_request_free(request);
}

}  // namespace

// One frame on its way out: owns the envelope, the payload owners and the header until every AM of the
// frame completed. Deleted by the last completion.
struct UcxConnection::SendRequest {
  std::shared_ptr<UcxConnection> connection;
  OutgoingFrame frame;
  SendCallback done;
  std::vector<uint8_t> head;  // prefix | sizes | envelope
  std::vector<ucp_dt_iov_t> iov;
  int parts = 1;  // AMs not yet completed, plus one while they are being issued
  ucs_status_t status = UCS_OK;
};

// A rendezvous receive in flight: keeps the destination alive (the frame's payload owners) until ucp
// reports it finished, even when the connection closes meanwhile.
struct UcxConnection::RecvRequest {
  std::shared_ptr<UcxConnection> connection;
  std::vector<ucp_dt_iov_t> iov;
  std::vector<std::shared_ptr<void>> owners;
  bool isHead = false;
};

UcxConnection::UcxConnection(std::shared_ptr<UcxLoop> loop, std::string peerAddress)
    : LoopConnection("ucx", std::move(loop), std::move(peerAddress)) {}

UcxConnection::~UcxConnection() = default;

void UcxConnection::attachFromLoop(ucp_ep_h ep) {
  ep_ = ep;
  attached_ = true;
  self_ = shared_from_this();
  loop_->addFromLoop(this);
  loop_->mapEndpointFromLoop(ep, this);
}

void UcxConnection::onEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* connection = static_cast<UcxConnection*>(arg);
  connection->endpointFailed_ = true;
  // Inside ucp's progress: close (and run onClosed) afterwards.
  auto self = connection->shared_from_this();
  connection->loop_->deferFromLoop([self, status] {
    if (self->closing_) {
      self->forceCloseFromLoop();
      return;
    }
    self->closeFromLoop(
        Error::disconnected("ucx connection to " + self->peerAddress_ + " failed: " + ucsError(status)));
  });
}

void UcxConnection::handshakeFromLoop(ConnectCallback done) {
  // The hello's flush completes once the endpoint is wired up and the server has the message, or fails
  // (nobody listening, rejected): that is the connect result.
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  freeWhenDone(ucp_am_send_nbx(ep_, static_cast<unsigned>(AmId::kHello), nullptr, 0, nullptr, 0, &param));
  struct Pending {
    std::shared_ptr<UcxConnection> connection;
    ConnectCallback done;
  };
  auto* pending = new Pending{shared_from_this(), std::move(done)};
  param = ucp_request_param_t{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = pending;
  param.cb.send = [](void* request, ucs_status_t status, void* user) {
    ucp_request_free(request);
    std::unique_ptr<Pending> owned(static_cast<Pending*>(user));
    owned->connection->handshakeDoneFromLoop(std::move(owned->done), status);
  };
  ucs_status_ptr_t flushed = ucp_ep_flush_nbx(ep_, &param);
  if (flushed == nullptr || UCS_PTR_IS_ERR(flushed)) {
    std::unique_ptr<Pending> owned(pending);
    handshakeDoneFromLoop(std::move(owned->done), flushed == nullptr ? UCS_OK : UCS_PTR_STATUS(flushed));
  }
}

void UcxConnection::handshakeDoneFromLoop(ConnectCallback done, ucs_status_t status) {
  auto self = shared_from_this();
  loop_->deferFromLoop([self, done = std::move(done), status]() mutable {
    if (status == UCS_OK && !self->closing_) {
      try {
        done(std::shared_ptr<Connection>(self));
      } catch (...) {
        std::string message =
            reportCallbackException("the connect callback for " + self->peerAddress_, "closing the new connection");
        self->closeFromLoop(Error::failed(message));
      }
      return;
    }
    std::string why =
        status != UCS_OK ? ucsError(status) : (self->closeError_ ? self->closeError_->message : std::string("closed"));
    Error error = Error::disconnected("ucx connect to " + self->peerAddress_ + " failed: " + why);
    self->closeFromLoop(error);
    try {
      done(error);
    } catch (...) {
      reportCallbackException("the connect callback for " + self->peerAddress_, "ignored");
    }
  });
}

// ---------------------------------------------------------------------------------------------- sending

void UcxConnection::sendFromLoop(OutgoingFrame frame, SendCallback done) {
  if (refuseSendFromLoop(frame, done, closing_ || ep_ == nullptr)) return;
  auto* request = new SendRequest{shared_from_this(), std::move(frame), std::move(done), {}, {}, 1, UCS_OK};
  const OutgoingFrame& f = request->frame;
  FramePrefix prefix;
  prefix.flags = f.flags;
  prefix.envelopeBytes = static_cast<uint32_t>(f.envelope.size());
  prefix.payloadCount = static_cast<uint32_t>(f.payloads.size());
  uint64_t total = 0;
  for (const auto& p : f.payloads) {
    total += p.size;
    // Empty payloads exist only in the size table: ucp's iovec gets the bytes.
    if (p.size > 0) request->iov.push_back({const_cast<void*>(p.data), p.size});
  }
  prefix.payloadBytes = total;
  auto& head = request->head;
  head.resize(sizeof(FramePrefix) + 8 * f.payloads.size() + f.envelope.size());
  std::memcpy(head.data(), &prefix, sizeof(prefix));
  for (size_t i = 0; i < f.payloads.size(); ++i) {
    uint64_t size = f.payloads[i].size;
    std::memcpy(head.data() + sizeof(FramePrefix) + 8 * i, &size, 8);
  }
  if (!f.envelope.empty()) {
    std::memcpy(head.data() + sizeof(FramePrefix) + 8 * f.payloads.size(), f.envelope.data(), f.envelope.size());
  }
  ++pendingSends_;
  // One contiguous payload goes as plain bytes; several as an iovec read in place by ucp.
  const void* data = nullptr;
  size_t count = 0;
  bool iov = false;
  if (request->iov.size() == 1) {
    data = request->iov[0].buffer;
    count = request->iov[0].length;
  } else if (request->iov.size() > 1) {
    data = request->iov.data();
    count = request->iov.size();
    iov = true;
  }
  if (head.size() <= loop_->maxAmHeader()) {
    issueFromLoop(request, AmId::kFrame, head.data(), head.size(), data, count, iov);
  } else {
    issueFromLoop(request, AmId::kHead, head.data(), sizeof(FramePrefix), head.data() + sizeof(FramePrefix),
                  head.size() - sizeof(FramePrefix), false);
    if (total > 0 && request->status == UCS_OK) issueFromLoop(request, AmId::kPayloads, nullptr, 0, data, count, iov);
  }
  partDoneFromLoop(request, UCS_OK);  // the issuing part
}

void UcxConnection::send(OutgoingFrame frame, SendCallback done) {
  // Note [Driving threads]: issued here when the loop thread sleeps and nothing is queued for it.
  if (frame.fromSender && !loop_->inLoop()) {
    size_t before = 0;
    bool issued = loop_->worker().sendHere(
        [&] {
          before = pendingSends_;
          sendFromLoop(std::move(frame), std::move(done));
        },
        [&] { return pendingSends_ == before; });  // after the completions ucp gave at once ran
    if (issued) {
      senderSends_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  LoopConnection::send(std::move(frame), std::move(done));
}

bool UcxConnection::beginWaitingRead() {
  if (!loop_->worker().beginDriving()) return false;
  if (started_ && !closing_ && ep_ != nullptr) return true;
  loop_->worker().endDriving();
  return false;
}

void UcxConnection::readWhileWaiting(const std::function<bool()>& done, std::chrono::microseconds window) {
  // As tcp's reader, it stops once this connection closes (its answer will not come this way).
  loop_->worker().driveWhile([&] { return done() || closing_; }, window);
}

void UcxConnection::endWaitingRead() { loop_->worker().endDriving(); }

void UcxConnection::interruptWaitingRead() { loop_->worker().interrupt(); }

void UcxConnection::issueFromLoop(SendRequest* request, AmId id, const void* header, size_t headerLength,
                                  const void* data, size_t count, bool iov) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  param.user_data = request;
  param.cb.send = [](void* ucpRequest, ucs_status_t status, void* user) {
    ucp_request_free(ucpRequest);
    auto* r = static_cast<SendRequest*>(user);
    r->connection->partDoneFromLoop(r, status);
  };
  if (iov) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_iov();
  }
  ++request->parts;
  ucs_status_ptr_t sent = ucp_am_send_nbx(ep_, static_cast<unsigned>(id), header, headerLength, data, count, &param);
  // The three outcomes fold into partDoneFromLoop: done now, failed now, or the callback above later.
  if (sent == nullptr) {
    partDoneFromLoop(request, UCS_OK);
  } else if (UCS_PTR_IS_ERR(sent)) {
    partDoneFromLoop(request, UCS_PTR_STATUS(sent));
  }
}

void UcxConnection::partDoneFromLoop(SendRequest* request, ucs_status_t status) {
  if (status != UCS_OK && request->status == UCS_OK) request->status = status;
  if (--request->parts > 0) return;
  // Every part is done: complete from the deferred queue (never inside send() or a ucp callback).
  std::unique_ptr<SendRequest> owned(request);
  auto self = std::move(owned->connection);
  ucs_status_t result = owned->status;
  auto done = std::move(owned->done);
  if (result != UCS_OK && !owned->iov.empty()) {
    // Note [Cross-memory attach] (context.cpp): a peer may still read these bytes in place after the send
    // failed here, so they are not freed (and reused) at once.
    loop_->addTimerFromLoop(std::chrono::steady_clock::now() + kFailedSendLinger,
                            [payloads = std::move(owned->frame.payloads)] {});
  }
  owned.reset();  // the payload owners go now: the bytes have left (or linger above)
  loop_->deferFromLoop([self, result, done = std::move(done)]() mutable {
    --self->pendingSends_;
    if (result == UCS_OK) {
      if (done) self->completeSendFromLoop(done, Result<void>());
      return;
    }
    Error error =
        result == UCS_ERR_CANCELED
            ? Error::disconnected("ucx connection to " + self->peerAddress_ + " closed before the frame was sent")
            : Error::disconnected("ucx send to " + self->peerAddress_ + " failed: " + ucsError(result));
    if (result != UCS_ERR_CANCELED && self->closeError_) error.message += " (" + self->closeError_->message + ")";
    if (done) self->completeSendFromLoop(done, error);
    self->closeFromLoop(error);
  });
}

// -------------------------------------------------------------------------------------------- receiving

void UcxConnection::beginReadingFromLoop() {
  // Messages that arrived before start() wait in inbound_.
  if (!inbound_.empty() && !inboundMarked_) {
    inboundMarked_ = true;
    loop_->markInboundFromLoop(shared_from_this());
  }
}

bool UcxConnection::queueInboundFromLoop(AmId id, const void* header, size_t headerLength, void* data, size_t length,
                                         bool rendezvous, bool persistentData) {
  if (closing_) {
    // Dropped (a rendezvous sender completes); the peer's goodbye answers ours.
    if (id == AmId::kBye && !closeStarted_ && !peerSaidBye_) {
      auto self = shared_from_this();
      loop_->deferFromLoop([self] { self->forceCloseFromLoop(); });
    }
    return false;
  }
  Inbound message;
  message.id = id;
  if (headerLength > 0) {
    message.header.assign(static_cast<const uint8_t*>(header), static_cast<const uint8_t*>(header) + headerLength);
  }
  message.length = length;
  message.rendezvous = rendezvous;
  if (rendezvous || persistentData) {
    message.data = data;
    message.held = true;
  } else if (length > 0) {
    message.copied.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + length);
  }
  inbound_.push_back(std::move(message));
  if (started_ && !inboundMarked_) {
    inboundMarked_ = true;
    loop_->markInboundFromLoop(shared_from_this());
  }
  return inbound_.back().held;
}

void UcxConnection::releaseFromLoop(Inbound& message) {
  if (message.held && message.data != nullptr && loop_->workerFromLoop() != nullptr) {
    ucp_am_data_release(loop_->workerFromLoop(), message.data);
  }
  message.held = false;
  message.data = nullptr;
}

void UcxConnection::processInboundFromLoop() {
  inboundMarked_ = false;
  while (started_ && !closing_ && !receiving_ && !inbound_.empty()) {
    Inbound message = std::move(inbound_.front());
    inbound_.pop_front();
    bool carryOn = handleFromLoop(message);
    releaseFromLoop(message);  // a no-op when a receive took the descriptor
    if (!carryOn) return;
  }
}

bool UcxConnection::handleFromLoop(Inbound& message) {
  if (message.id == AmId::kBye) {
    if (expect_ == Expect::kPayloads) {
      std::fprintf(stderr, "distgrad ucx: peer %s closed the connection in the middle of a frame\n",
                   peerAddress_.c_str());
    }
    closeFromLoop(Error::disconnected("ucx peer " + peerAddress_ + " closed the connection"), true);
    return false;
  }
  if (message.id == AmId::kHello) {
    if (expect_ == Expect::kPayloads) {
      failFromLoop("a hello message in the middle of a frame");
      return false;
    }
    return true;
  }
  if (expect_ == Expect::kPayloads) {
    if (message.id != AmId::kPayloads) {
      failFromLoop("expected the payloads of the previous frame, got message kind " +
                   std::to_string(static_cast<int>(message.id)));
      return false;
    }
    if (!message.header.empty() || message.length != prefix_.payloadBytes) {
      failFromLoop("a payload message of " + std::to_string(message.length) + " bytes (header " +
                   std::to_string(message.header.size()) + ") for a frame of " + std::to_string(prefix_.payloadBytes) +
                   " payload bytes");
      return false;
    }
    std::vector<std::pair<void*, size_t>> targets;
    for (const auto& buffer : current_.payloads) {
      if (buffer.size > 0) targets.emplace_back(buffer.data, buffer.size);
    }
    if (!receiveFromLoop(message, std::move(targets), false)) return false;
    deliverFromLoop();
    return !closing_;
  }
  if (message.id == AmId::kPayloads) {
    failFromLoop("payload data without a frame head");
    return false;
  }
  // A head: kFrame (the whole head in the AM header) or kHead (prefix in the header, the rest as data).
  if (message.header.size() < sizeof(FramePrefix)) {
    failFromLoop("a frame header of " + std::to_string(message.header.size()) + " bytes, shorter than the " +
                 std::to_string(sizeof(FramePrefix)) + "-byte prefix");
    return false;
  }
  std::memcpy(&prefix_, message.header.data(), sizeof(FramePrefix));
  auto valid = validatePrefix(prefix_, loop_->options().limits);
  if (!valid.ok()) {
    failFromLoop(valid.error().message);
    return false;
  }
  const uint64_t headRest = 8ull * prefix_.payloadCount + prefix_.envelopeBytes;
  if (message.id == AmId::kFrame) {
    if (message.header.size() != sizeof(FramePrefix) + headRest) {
      failFromLoop("a frame header of " + std::to_string(message.header.size()) + " bytes where the prefix declares " +
                   std::to_string(sizeof(FramePrefix) + headRest));
      return false;
    }
    if (!parseHeadFromLoop(message.header.data() + sizeof(FramePrefix), headRest)) return false;
    if (message.length != prefix_.payloadBytes) {
      failFromLoop("a frame carrying " + std::to_string(message.length) + " payload bytes where the prefix declares " +
                   std::to_string(prefix_.payloadBytes));
      return false;
    }
    if (!allocatePayloadsFromLoop()) return false;
    std::vector<std::pair<void*, size_t>> targets;
    for (const auto& buffer : current_.payloads) {
      if (buffer.size > 0) targets.emplace_back(buffer.data, buffer.size);
    }
    if (!targets.empty() && !receiveFromLoop(message, std::move(targets), false)) return false;
    deliverFromLoop();
    return !closing_;
  }
  // kHead
  if (message.header.size() != sizeof(FramePrefix) || message.length != headRest) {
    failFromLoop("a frame head of " + std::to_string(message.length) + " bytes (header " +
                 std::to_string(message.header.size()) + ") where the prefix declares " + std::to_string(headRest));
    return false;
  }
  headBytes_.resize(headRest);
  if (headRest > 0 && !receiveFromLoop(message, {{headBytes_.data(), headBytes_.size()}}, true)) return false;
  receivedFromLoop(true);
  return !closing_;
}

bool UcxConnection::parseHeadFromLoop(const uint8_t* sizesAndEnvelope, size_t bytes) {
  DG_ASSERT(bytes == 8ull * prefix_.payloadCount + prefix_.envelopeBytes);
  sizes_.resize(prefix_.payloadCount);
  if (!sizes_.empty()) std::memcpy(sizes_.data(), sizesAndEnvelope, 8 * sizes_.size());
  if (!checkSizeTableFromLoop()) return false;
  current_ = IncomingFrame{};
  current_.flags = prefix_.flags;
  const uint8_t* envelope = sizesAndEnvelope + 8 * sizes_.size();
  current_.envelope.assign(envelope, envelope + prefix_.envelopeBytes);
  return true;
}

bool UcxConnection::receiveFromLoop(Inbound& message, std::vector<std::pair<void*, size_t>> targets, bool isHead) {
  if (!message.rendezvous) {
    // Eager data (already in this process): scattered into the destination.
    const uint8_t* source = message.held ? static_cast<const uint8_t*>(message.data) : message.copied.data();
    size_t offset = 0;
    for (const auto& [target, size] : targets) {
      std::memcpy(target, source + offset, size);
      offset += size;
    }
    return true;
  }
  // Rendezvous: ucp moves the bytes straight into the destination buffers (an iovec when several).
  auto* request = new RecvRequest{shared_from_this(), {}, {}, isHead};
  for (const auto& [target, size] : targets) request->iov.push_back({target, size});
  for (const auto& buffer : current_.payloads) request->owners.push_back(buffer.owner);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = request;
  param.cb.recv_am = [](void* ucpRequest, ucs_status_t status, size_t /*length*/, void* user) {
    ucp_request_free(ucpRequest);
    std::unique_ptr<RecvRequest> owned(static_cast<RecvRequest*>(user));
    auto connection = owned->connection;
    bool isHead = owned->isHead;
    connection->recvRequest_ = nullptr;
    connection->loop_->deferFromLoop(
        [connection, status, isHead, owned = std::shared_ptr<RecvRequest>(std::move(owned))] {
          connection->receiving_ = false;
          if (connection->closing_) return;
          if (status != UCS_OK) {
            connection->closeFromLoop(
                Error::disconnected("ucx receive from " + connection->peerAddress_ + " failed: " + ucsError(status)));
            return;
          }
          connection->receivedFromLoop(isHead);
          connection->processInboundFromLoop();
        });
  };
  void* buffer = request->iov[0].buffer;
  size_t count = request->iov[0].length;
  if (request->iov.size() > 1) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = ucp_dt_make_iov();
    buffer = request->iov.data();
    count = request->iov.size();
  }
  void* descriptor = message.data;
  message.data = nullptr;  // ucp owns the descriptor from here, whatever happens
  message.held = false;
  ucs_status_ptr_t received = ucp_am_recv_data_nbx(loop_->workerFromLoop(), descriptor, buffer, count, &param);
  if (received == nullptr) {
    delete request;
    return true;
  }
  if (UCS_PTR_IS_ERR(received)) {
    delete request;
    closeFromLoop(
        Error::disconnected("ucx receive from " + peerAddress_ + " failed: " + ucsError(UCS_PTR_STATUS(received))));
    return false;
  }
  receiving_ = true;
  recvRequest_ = received;
  return false;
}

void UcxConnection::receivedFromLoop(bool isHead) {
  if (!isHead) {
    deliverFromLoop();
    return;
  }
  if (!parseHeadFromLoop(headBytes_.data(), headBytes_.size())) return;
  headBytes_.clear();
  if (!allocatePayloadsFromLoop()) return;
  if (prefix_.payloadBytes > 0) {
    expect_ = Expect::kPayloads;
    return;
  }
  deliverFromLoop();
}

void UcxConnection::deliverFromLoop() {
  IncomingFrame frame = std::move(current_);
  current_ = IncomingFrame{};
  expect_ = Expect::kHead;
  handFrameFromLoop(std::move(frame));
}

// ---------------------------------------------------------------------------------------------- closing

void UcxConnection::closeFromLoop(const Error& error) { closeFromLoop(error, false); }

void UcxConnection::closeFromLoop(const Error& error, bool peerSaidBye) {
  if (closing_ || !attached_) return;
  closing_ = true;
  closeError_ = error;
  for (auto& message : inbound_) releaseFromLoop(message);
  inbound_.clear();
  if (recvRequest_ != nullptr) ucp_request_cancel(loop_->workerFromLoop(), recvRequest_);
  if (ep_ == nullptr) {
    auto self = shared_from_this();
    loop_->deferFromLoop([self] { self->closedFromLoop(); });
    return;
  }
  if (endpointFailed_) {
    forceCloseFromLoop();
    return;
  }
  // A goodbye: the peer reads every frame we sent before it, reports its close, and answers with its own
  // goodbye. The closing side force-closes its endpoint when that answer (or an endpoint error) comes; the
  // answering side force-closes once its answer has left. A peer that never answers (it reads nothing)
  // cannot keep us: the timer force-closes. onClosed does not wait for ucp's endpoint teardown (which can
  // take a while on client-server endpoints): it runs when the force close is issued.
  loop_->closingStartedFromLoop();
  countedClosing_ = true;
  auto* keep = new std::shared_ptr<UcxConnection>(shared_from_this());
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  param.user_data = keep;
  param.cb.send = [](void* request, ucs_status_t, void* user) {
    ucp_request_free(request);
    std::unique_ptr<std::shared_ptr<UcxConnection>> owned(static_cast<std::shared_ptr<UcxConnection>*>(user));
    auto connection = *owned;
    connection->loop_->deferFromLoop([connection] { connection->byeSentFromLoop(); });
  };
  ucs_status_ptr_t sent = ucp_am_send_nbx(ep_, static_cast<unsigned>(AmId::kBye), nullptr, 0, nullptr, 0, &param);
  peerSaidBye_ = peerSaidBye;
  if (sent == nullptr || UCS_PTR_IS_ERR(sent)) {
    delete keep;
    if (UCS_PTR_IS_ERR(sent)) {
      forceCloseFromLoop();
      return;
    }
    byeSentFromLoop();
    if (closeStarted_) return;
  }
  auto self = shared_from_this();
  loop_->addTimerFromLoop(std::chrono::steady_clock::now() + kCloseFlushTimeout,
                          [self] { self->forceCloseFromLoop(); });
}

void UcxConnection::byeSentFromLoop() {
  // Answering the peer's goodbye: nothing more to wait for.
  if (peerSaidBye_) forceCloseFromLoop();
}

void UcxConnection::forceCloseFromLoop() {
  if (closeStarted_ || ep_ == nullptr) return;
  closeStarted_ = true;
  if (countedClosing_) loop_->closingDoneFromLoop();
  countedClosing_ = false;
  loop_->unmapEndpointFromLoop(ep_);
  ucp_ep_h ep = ep_;
  ep_ = nullptr;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  // Forced: sends still pending complete with UCS_ERR_CANCELED (they fail `disconnected`).
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  param.user_data = loop_.get();
  param.cb.send = [](void* request, ucs_status_t, void* user) {
    ucp_request_free(request);
    static_cast<UcxLoop*>(user)->teardownDoneFromLoop();
  };
  ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &param);
  if (closing != nullptr && !UCS_PTR_IS_ERR(closing)) loop_->teardownStartedFromLoop();
  auto self = shared_from_this();
  loop_->deferFromLoop([self] { self->closedFromLoop(); });
}

void UcxConnection::closedFromLoop() {
  if (closed_) return;
  auto keep = markClosedFromLoop();  // the self reference, released when this function returns
  Error error = *closeError_;
  reportClosedFromLoop(error);
}

std::string UcxConnection::lanesFromLoop() const {
  if (ep_ == nullptr) return "";
  return UcxLoop::describeEndpoint(ep_);
}

std::string UcxConnection::lanes() {
  if (loop_->inLoop()) return lanesFromLoop();
  std::promise<std::string> promise;
  auto future = promise.get_future();
  auto self = shared_from_this();
  if (!loop_->post([&promise, self] { promise.set_value(self->lanesFromLoop()); })) return "";
  return future.get();
}

}  // namespace distgrad::rpc::transport::ucx
