// A TCP listener: a bound, listening uv_tcp_t that hands accepted connections to onAccept on the loop.
// Thread-safety: TcpListener methods may be called from any thread; TcpListenerImpl lives on the loop.
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

class TcpListener final : public Listener {
 public:
  explicit TcpListener(std::shared_ptr<TcpListenerImpl> impl) : impl_(std::move(impl)) {}
  ~TcpListener() override { impl_->close(); }
  std::string address() const override { return impl_->address(); }
  void close() override { impl_->close(); }

 private:
  std::shared_ptr<TcpListenerImpl> impl_;
};

}  // namespace distgrad::rpc::transport::tcp
