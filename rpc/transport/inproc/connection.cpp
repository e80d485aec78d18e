#include "rpc/transport/inproc/connection.h"

#include <cstdio>
#include <cstring>

namespace distgrad::rpc::transport::inproc {

InprocConnection::InprocConnection(std::shared_ptr<InprocLoop> loop, FrameLimits limits, std::string localName,
                                   std::string peerName)
    : loop_(std::move(loop)), limits_(limits), localName_(std::move(localName)), peerName_(std::move(peerName)) {}

void InprocConnection::pair(const std::shared_ptr<InprocConnection>& a, const std::shared_ptr<InprocConnection>& b) {
  a->peer_ = b;
  b->peer_ = a;
}

void InprocConnection::completeSend(SendCallback done, Result<void> result) {
  if (!done) return;
  auto shared = std::make_shared<Result<void>>(std::move(result));
  if (!loop_->post([done, shared] { done(*shared); })) done(*shared);
}

void InprocConnection::send(OutgoingFrame frame, SendCallback done) {
  if (closed_.load()) {
    completeSend(std::move(done), Error::disconnected("inproc connection to '" + peerName_ + "' is closed"));
    return;
  }
  auto peer = peer_.lock();
  if (!peer) {
    completeSend(std::move(done), Error::disconnected("inproc peer '" + peerName_ + "' is gone"));
    return;
  }
  IncomingFrame incoming;
  incoming.flags = frame.flags;
  incoming.envelope = std::move(frame.envelope);
  incoming.payloads.reserve(frame.payloads.size());
  for (auto& buffer : frame.payloads) {
    if (buffer.owner || buffer.size == 0) {
      // Zero copy: the receiver shares the sender's bytes and keeps their owner alive.
      incoming.payloads.push_back({const_cast<void*>(buffer.data), buffer.size,
                                   std::const_pointer_cast<void>(buffer.owner)});
    } else {
      // No owner means the bytes are only guaranteed until `done`; the receiver needs them longer.
      std::shared_ptr<uint8_t[]> copy(new uint8_t[buffer.size]);
      std::memcpy(copy.get(), buffer.data, buffer.size);
      void* data = copy.get();
      incoming.payloads.push_back({data, buffer.size, std::shared_ptr<void>(copy, data)});
    }
  }
  auto self = shared_from_this();
  auto shared = std::make_shared<IncomingFrame>(std::move(incoming));
  bool posted = peer->loop_->post([peer, self, shared, done] { peer->receiveFromLoop(std::move(*shared), self, done); });
  if (!posted) {
    completeSend(std::move(done), Error::disconnected("inproc peer '" + peerName_ + "': its context is closed"));
  }
}

void InprocConnection::receiveFromLoop(IncomingFrame frame, const std::shared_ptr<InprocConnection>& sender,
                                       SendCallback done) {
  if (closedInLoop_) {
    sender->completeSend(std::move(done), Error::disconnected("inproc peer '" + localName_ + "' closed the connection"));
    return;
  }
  // The same checks a byte-stream receiver makes before allocating (validatePrefix and the size table).
  std::string problem;
  uint64_t total = 0;
  for (const auto& p : frame.payloads) total += p.size;
  if (frame.envelope.size() > limits_.maxEnvelopeBytes) {
    problem = "envelope of " + std::to_string(frame.envelope.size()) + " bytes exceeds the limit of " +
              std::to_string(limits_.maxEnvelopeBytes);
  } else if (frame.payloads.size() > limits_.maxPayloadCount) {
    problem = std::to_string(frame.payloads.size()) + " payloads exceed the limit of " +
              std::to_string(limits_.maxPayloadCount);
  } else if (total > limits_.maxPayloadBytes) {
    problem = std::to_string(total) + " payload bytes exceed the limit of " + std::to_string(limits_.maxPayloadBytes);
  }
  if (!problem.empty()) {
    Error error = Error::failed("malformed frame from inproc peer '" + peerName_ + "': " + problem);
    std::fprintf(stderr, "distgrad inproc: closing connection to '%s': %s\n", peerName_.c_str(), error.message.c_str());
    closeFromLoop(error);
    sender->completeSend(std::move(done), Error::disconnected("inproc peer '" + localName_ + "' refused the frame: " + problem));
    return;
  }
  if (started_) {
    deliverFromLoop(std::move(frame));
  } else {
    inbox_.push_back(std::move(frame));
  }
  sender->completeSend(std::move(done), {});
}

void InprocConnection::start(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) {
  DG_CHECK(onFrame && onClosed, "Connection::start: onFrame and onClosed must be set");
  auto self = shared_from_this();
  auto run = [self, onFrame = std::move(onFrame), onClosed = std::move(onClosed)]() mutable {
    DG_CHECK(!self->started_, "Connection::start called twice on the inproc connection to '", self->peerName_, "'");
    self->started_ = true;
    self->onFrame_ = std::move(onFrame);
    self->onClosed_ = std::move(onClosed);
    while (!self->inbox_.empty() && self->onFrame_) {
      IncomingFrame frame = std::move(self->inbox_.front());
      self->inbox_.pop_front();
      self->deliverFromLoop(std::move(frame));
    }
    if (self->closedInLoop_) self->reportClosedFromLoop();
  };
  if (!loop_->post(std::move(run))) {
    // The context is closed: there is no loop left to run the callbacks on.
    std::fprintf(stderr, "distgrad inproc: Connection::start after the context closed; ignored\n");
  }
}

void InprocConnection::deliverFromLoop(IncomingFrame frame) {
  try {
    onFrame_(std::move(frame));
  } catch (...) {
    // As in tcp: the handler's state is unknown after it threw, so this connection closes; the loop lives on.
    std::string message = reportCallbackException(
        "the frame handler of the inproc connection to '" + peerName_ + "'", "closing the connection");
    closeFromLoop(Error::failed(message));
  }
}

void InprocConnection::reportClosedFromLoop() {
  if (closeReported_ || !started_) return;
  closeReported_ = true;
  auto onClosed = std::move(onClosed_);
  onFrame_ = nullptr;
  onClosed(*closeError_);
}

void InprocConnection::closeFromLoop(const Error& error, bool keepInbox) {
  closed_.store(true);
  if (closedInLoop_) return;
  closedInLoop_ = true;
  closeError_ = error;
  if (!keepInbox) inbox_.clear();
  reportClosedFromLoop();
  if (auto peer = peer_.lock()) {
    // Note [Inproc ordering]: posted after every frame this end sent, so the peer sees them first.
    peer->loop_->post([peer] {
      peer->closeFromLoop(Error::disconnected("inproc peer '" + peer->peerName_ + "' closed the connection"),
                          /*keepInbox=*/true);
    });
  }
}

void InprocConnection::close() {
  if (closed_.exchange(true)) return;
  auto self = shared_from_this();
  loop_->post([self] { self->closeFromLoop(Error::disconnected("connection to '" + self->peerName_ + "' closed locally")); });
}

}  // namespace distgrad::rpc::transport::inproc
