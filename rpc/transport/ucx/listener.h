// A UCX listener: a ucp listener on a sockaddr that accepts every connection request with a new endpoint
// (peer error handling) and hands the connection to onAccept from the loop's deferred queue.
// Thread-safety: close() and address() may be called from any thread; the rest runs on the loop.
#pragma once

#include <memory>
#include <string>

#include "rpc/transport/ucx/context.h"

namespace distgrad::rpc::transport::ucx {

class UcxListenerImpl : public std::enable_shared_from_this<UcxListenerImpl> {
 public:
  UcxListenerImpl(std::shared_ptr<UcxLoop> loop, AcceptCallback onAccept);
  // Creates the ucp listener; the Error says why it could not (bad address, address in use).
  Result<void> openFromLoop(const std::string& address);
  void closeFromLoop();
  void close();
  const std::string& address() const { return address_; }

 private:
  static void onConnectionRequest(ucp_conn_request_h request, void* arg);

  std::shared_ptr<UcxLoop> loop_;
  AcceptCallback onAccept_;
  ucp_listener_h listener_ = nullptr;
  std::string address_;  // written once by openFromLoop before listen() returns
  std::shared_ptr<UcxListenerImpl> self_;  // keeps this alive while the ucp listener exists
};

}  // namespace distgrad::rpc::transport::ucx
