#include "rpc/transport/ucx/listener.h"

#include <cstdio>

#include "rpc/transport/loop_context.h"
#include "rpc/transport/tcp/context.h"
#include "rpc/transport/ucx/connection.h"

namespace distgrad::rpc::transport::ucx {

UcxListenerImpl::UcxListenerImpl(std::shared_ptr<UcxLoop> loop, AcceptCallback onAccept)
    : loop_(std::move(loop)), onAccept_(std::move(onAccept)) {}

Result<void> UcxListenerImpl::openFromLoop(const std::string& address) {
  std::string host;
  int port = 0;
  if (!tcp::splitHostPort(address, host, port)) {
    return Error::failed("ucx listen: malformed address '" + address + "', expected host:port (e.g. 127.0.0.1:0)");
  }
  sockaddr_storage storage{};
  if (uv_ip4_addr(host.c_str(), port, reinterpret_cast<sockaddr_in*>(&storage)) != 0 &&
      uv_ip6_addr(host.c_str(), port, reinterpret_cast<sockaddr_in6*>(&storage)) != 0) {
    return Error::failed("ucx listen: '" + host + "' is not a numeric IP address (in '" + address + "')");
  }
  if (loop_->closingFromLoop()) return Error::failed("ucx listen on " + address + ": the context is closed");
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&storage);
  params.sockaddr.addrlen = storage.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  params.conn_handler.cb = &UcxListenerImpl::onConnectionRequest;
  params.conn_handler.arg = this;
  ucs_status_t status = ucp_listener_create(loop_->workerFromLoop(), &params, &listener_);
  if (status != UCS_OK) {
    listener_ = nullptr;
    return Error::failed("ucx listen on " + address + " failed: " + ucsError(status));
  }
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  status = ucp_listener_query(listener_, &attr);
  if (status != UCS_OK) {
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
    return Error::failed("ucx listen on " + address + ": ucp_listener_query failed: " + ucsError(status));
  }
  address_ = tcp::formatAddress(reinterpret_cast<const sockaddr*>(&attr.sockaddr));
  self_ = shared_from_this();
  loop_->addFromLoop(this);
  return {};
}

void UcxListenerImpl::onConnectionRequest(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<UcxListenerImpl*>(arg);
  if (self->listener_ == nullptr || self->loop_->closingFromLoop()) {
    if (self->listener_ != nullptr) ucp_listener_reject(self->listener_, request);
    return;
  }
  std::string peer = "<unknown peer of " + self->address_ + ">";
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  if (ucp_conn_request_query(request, &attr) == UCS_OK) {
    peer = tcp::formatAddress(reinterpret_cast<const sockaddr*>(&attr.client_address));
  }
  auto connection = std::make_shared<UcxConnection>(self->loop_, peer);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxConnection::onEndpointError;
  params.err_handler.arg = connection.get();
  ucp_ep_h ep = nullptr;
  ucs_status_t status = ucp_ep_create(self->loop_->workerFromLoop(), &params, &ep);
  if (status != UCS_OK) {
    std::fprintf(stderr, "distgrad ucx: accepting %s on %s failed: %s\n", peer.c_str(), self->address_.c_str(),
                 ucsError(status).c_str());
    return;
  }
  connection->attachFromLoop(ep);
  // onAccept is user code: it runs after ucp's progress call returns.
  auto keep = self->shared_from_this();
  self->loop_->deferFromLoop([keep, connection] {
    if (!keep->onAccept_) {
      connection->closeFromLoop(Error::disconnected("ucx listener " + keep->address_ + " closed"));
      return;
    }
    try {
      keep->onAccept_(connection);
    } catch (...) {
      std::string message = reportCallbackException("the accept callback of ucx listener " + keep->address_,
                                                    "closing the accepted connection");
      connection->closeFromLoop(Error::failed(message));
    }
  });
}

void UcxListenerImpl::closeFromLoop() {
  if (listener_ == nullptr) return;
  ucp_listener_destroy(listener_);
  listener_ = nullptr;
  loop_->removeFromLoop(this);
  onAccept_ = nullptr;
  auto keep = std::move(self_);  // may destroy *this when this scope ends
}

void UcxListenerImpl::close() {
  auto self = shared_from_this();
  runOnLoop(*loop_, [self] { self->closeFromLoop(); });
}

}  // namespace distgrad::rpc::transport::ucx
