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
    } catch (const std::exception& e) {
      std::fprintf(stderr, "distgrad inproc: the accept callback of listener '%s' threw: %s; closing the connection\n",
                   self->name_.c_str(), e.what());
      connection->closeFromLoop(Error::failed(std::string("the accept callback threw: ") + e.what()));
    } catch (...) {
      std::fprintf(stderr, "distgrad inproc: the accept callback of listener '%s' threw; closing the connection\n",
                   self->name_.c_str());
      connection->closeFromLoop(Error::failed("the accept callback threw a non-standard exception"));
    }
  });
  if (!posted) connection->close();
}

void InprocListener::close() {
  if (closed_.exchange(true)) return;
  hub_->remove(name_, this);
}

}  // namespace distgrad::rpc::transport::inproc
