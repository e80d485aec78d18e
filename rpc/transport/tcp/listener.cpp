#include "rpc/transport/tcp/listener.h"

#include <cstdio>

#include "rpc/transport/loop_context.h"
#include "rpc/transport/tcp/connection.h"

namespace distgrad::rpc::transport::tcp {

TcpListenerImpl::TcpListenerImpl(std::shared_ptr<TcpLoop> loop, AcceptCallback onAccept)
    : loop_(std::move(loop)), onAccept_(std::move(onAccept)) {
  handle_.data = this;
}

Result<void> TcpListenerImpl::openFromLoop(const std::string& address) {
  std::string host;
  int port = 0;
  if (!splitHostPort(address, host, port)) {
    return Error::failed("tcp listen: malformed address '" + address + "', expected host:port (e.g. 127.0.0.1:0)");
  }
  sockaddr_storage storage{};
  if (uv_ip4_addr(host.c_str(), port, reinterpret_cast<sockaddr_in*>(&storage)) != 0 &&
      uv_ip6_addr(host.c_str(), port, reinterpret_cast<sockaddr_in6*>(&storage)) != 0) {
    return Error::failed("tcp listen: '" + host + "' is not a numeric IP address (in '" + address + "')");
  }
  if (loop_->closingFromLoop()) return Error::failed("tcp listen on " + address + ": the context is closed");
  uv_tcp_init(loop_->uvLoop(), &handle_);
  open_ = true;
  self_ = shared_from_this();
  loop_->addFromLoop(this);
  int rc = uv_tcp_bind(&handle_, reinterpret_cast<sockaddr*>(&storage), 0);
  if (rc == 0) rc = uv_listen(reinterpret_cast<uv_stream_t*>(&handle_), 511, &TcpListenerImpl::onConnection);
  if (rc == 0) {
    sockaddr_storage bound{};
    int length = sizeof(bound);
    rc = uv_tcp_getsockname(&handle_, reinterpret_cast<sockaddr*>(&bound), &length);
    if (rc == 0) address_ = formatAddress(reinterpret_cast<sockaddr*>(&bound));
  }
  if (rc != 0) {
    closeFromLoop();
    return Error::failed("tcp listen on " + address + " failed: " + uvError(rc));
  }
  return {};
}

void TcpListenerImpl::onConnection(uv_stream_t* server, int status) {
  auto* self = static_cast<TcpListenerImpl*>(server->data);
  if (status < 0) {
    std::fprintf(stderr, "distgrad tcp: accept on %s failed: %s\n", self->address_.c_str(), uvError(status).c_str());
    return;
  }
  if (self->closing_) return;
  auto connection = std::make_shared<TcpConnection>(self->loop_, "");
  connection->initFromLoop();
  int rc = uv_accept(server, reinterpret_cast<uv_stream_t*>(connection->handleFromLoop()));
  if (rc != 0) {
    std::fprintf(stderr, "distgrad tcp: accept on %s failed: %s\n", self->address_.c_str(), uvError(rc).c_str());
    connection->closeFromLoop(Error::disconnected("accept failed: " + uvError(rc)));
    return;
  }
  sockaddr_storage peer{};
  int length = sizeof(peer);
  if (uv_tcp_getpeername(connection->handleFromLoop(), reinterpret_cast<sockaddr*>(&peer), &length) == 0) {
    connection->setPeerAddressFromLoop(formatAddress(reinterpret_cast<sockaddr*>(&peer)));
  } else {
    connection->setPeerAddressFromLoop("<unknown peer of " + self->address_ + ">");
  }
  connection->connectedFromLoop();
  try {
    self->onAccept_(connection);
  } catch (...) {
    std::string message = reportCallbackException("the accept callback of tcp listener " + self->address_,
                                                  "closing the accepted connection");
    connection->closeFromLoop(Error::failed(message));
  }
}

void TcpListenerImpl::closeFromLoop() {
  if (!open_ || closing_) return;
  closing_ = true;
  uv_close(reinterpret_cast<uv_handle_t*>(&handle_), [](uv_handle_t* handle) {
    auto* self = static_cast<TcpListenerImpl*>(handle->data);
    self->loop_->removeFromLoop(self);
    self->onAccept_ = nullptr;
    auto keep = std::move(self->self_);  // may destroy *self when this scope ends
  });
}

void TcpListenerImpl::close() {
  auto self = shared_from_this();
  runOnLoop(*loop_, [self] { self->closeFromLoop(); });  // refused only after the context closed everything
}

}  // namespace distgrad::rpc::transport::tcp
