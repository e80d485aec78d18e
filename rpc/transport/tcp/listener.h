// A TCP listener: a bound, listening uv_tcp_t that hands accepted connections to onAccept on the loop.
// Thread-safety: close() and address() may be called from any thread; the rest runs on the loop.
#pragma once

#include <memory>
#include <string>

#include "rpc/transport/tcp/context.h"

namespace distgrad::rpc::transport::tcp {

class TcpListenerImpl : public std::enable_shared_from_this<TcpListenerImpl> {
 public:
  TcpListenerImpl(std::shared_ptr<TcpLoop> loop, AcceptCallback onAccept);
  // Binds and listens; on failure the handle is closed and the Error returned.
  Result<void> openFromLoop(const std::string& address);
  void closeFromLoop();
  void close();
  const std::string& address() const { return address_; }

 private:
  static void onConnection(uv_stream_t* server, int status);

  std::shared_ptr<TcpLoop> loop_;
  AcceptCallback onAccept_;
  uv_tcp_t handle_{};
  std::string address_;  // written once by openFromLoop before listen() returns
  bool open_ = false;
  bool closing_ = false;
  std::shared_ptr<TcpListenerImpl> self_;  // keeps this alive until the handle's close callback
};

}  // namespace distgrad::rpc::transport::tcp
