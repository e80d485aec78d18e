// One end of an inproc connection. A frame sent on one end is handed, by reference, to the other end's
// onFrame on the other end's loop thread; the sender's callback then runs on the sender's loop.
//
// Note [Inproc ordering]: every frame and the close notification from one end travel through the peer's
// single task queue in the order they were posted, so frames arrive in order and the peer's onClosed runs
// after the last frame sent before close().
// Thread-safety: all public methods may be called from any thread; state is touched on the loop thread.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>

#include "rpc/transport/inproc/context.h"

namespace distgrad::rpc::transport::inproc {

class InprocConnection final : public Connection, public std::enable_shared_from_this<InprocConnection> {
 public:
  InprocConnection(std::shared_ptr<InprocLoop> loop, FrameLimits limits, std::string localName,
                   std::string peerName);

  // Links two fresh ends to each other.
  static void pair(const std::shared_ptr<InprocConnection>& a, const std::shared_ptr<InprocConnection>& b);

  void send(OutgoingFrame frame, SendCallback done) override;
  void start(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) override;
  void close() override;
  std::string peerAddress() const override { return peerName_; }

  // Closes with `error` (the peer is told it was disconnected). Loop thread only. `keepInbox` keeps frames
  // that arrived before start() so they are still delivered before onClosed (used when the peer closed).
  void closeFromLoop(const Error& error, bool keepInbox = false);

 private:
  // Runs on this end's loop: checks the frame against the limits and hands it to onFrame.
  void receiveFromLoop(IncomingFrame frame, const std::shared_ptr<InprocConnection>& sender, SendCallback done);
  void reportClosedFromLoop();
  // Runs onFrame_; a handler that throws is logged and closes this connection.
  void deliverFromLoop(IncomingFrame frame);
  // Runs `done` on this end's loop; inline only when the loop has stopped (there is no other thread left).
  void completeSend(SendCallback done, Result<void> result);

  std::shared_ptr<InprocLoop> loop_;
  FrameLimits limits_;
  std::string localName_;
  std::string peerName_;
  std::weak_ptr<InprocConnection> peer_;
  std::atomic<bool> closed_{false};
  // Loop-thread state.
  bool started_ = false;
  std::deque<IncomingFrame> inbox_;  // frames that arrived before start()
  FrameCallback onFrame_;
  CloseCallback onClosed_;
  bool closedInLoop_ = false;
  bool closeReported_ = false;
  std::optional<Error> closeError_;  // the reason, kept for an onClosed registered after the close
};

}  // namespace distgrad::rpc::transport::inproc
