// An inproc listener: a name in an InprocHub that accepts connections on its context's loop.
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "rpc/transport/inproc/context.h"

namespace distgrad::rpc::transport::inproc {

class InprocListener : public std::enable_shared_from_this<InprocListener> {
 public:
  InprocListener(std::string name, std::shared_ptr<InprocHub> hub, std::shared_ptr<InprocLoop> loop,
                 FrameLimits limits, AcceptCallback onAccept);
  ~InprocListener();

  // The name it is registered under in the hub (what connect() takes).
  const std::string& address() const { return name_; }
  const std::shared_ptr<InprocLoop>& loop() const { return loop_; }
  const FrameLimits& limits() const { return limits_; }
  // Hands `connection` to onAccept on the loop thread; closes it if the listener closed meanwhile.
  void acceptFromAnyThread(std::shared_ptr<InprocConnection> connection);
  void close();
  bool closed() const { return closed_.load(); }

 private:
  std::string name_;
  std::shared_ptr<InprocHub> hub_;
  std::shared_ptr<InprocLoop> loop_;
  FrameLimits limits_;
  AcceptCallback onAccept_;  // only touched on the loop thread after construction
  std::atomic<bool> closed_{false};
};

}  // namespace distgrad::rpc::transport::inproc
