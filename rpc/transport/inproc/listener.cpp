#include "rpc/transport/inproc/listener.h"

#include <cstdio>

#include "rpc/transport/inproc/connection.h"

namespace distgrad::rpc::transport::inproc {

InprocListener::InprocListener(std::string name, std::shared_ptr<InprocHub> hub, std::shared_ptr<InprocLoop> loop,
                               FrameLimits limits, AcceptCallback onAccept)
    : name_(std::move(name)), hub_(std::move(hub)), loop_(std::move(loop)), limits_(limits),
      onAccept_(std::move(onAccept)) {}

InprocListener::~InprocListener() { hub_->remove(name_, this); }

void InprocListener::acceptFromAnyThread(std::shared_ptr<InprocConnection> connection) {
  if (!loop_->track(connection)) {
    connection->close();
    return;
  }
  auto self = shared_from_this();
  bool posted = loop_->post([self, connection] {
    if (self->closed()) {
      connection->closeFromLoop(Error::disconnected("inproc listener '" + self->name_ + "' closed"));
      return;
    }
    try {
      self->onAccept_(connection);
    } catch (...) {
      std::string message = reportCallbackException(
          "the accept callback of inproc listener '" + self->name_ + "'", "closing the connection");
      connection->closeFromLoop(Error::failed(message));
    }
  });
  if (!posted) connection->close();
}

void InprocListener::close() {
  if (closed_.exchange(true)) return;
  hub_->remove(name_, this);
}

}  // namespace distgrad::rpc::transport::inproc
