// A TCP connection: framed, ordered, asynchronous send and receive over one uv_tcp_t.
//
// Sending: frames are queued on the loop; before the loop next blocks, everything queued is written with
// one uv_write of a uv_buf_t array (prefix + size table + envelope + padding inline, payloads referenced in
// place: no copy of payload bytes). The SendBuffers' owners are held until the write completes.
// Receiving: a state machine (prefix -> size table -> envelope -> PayloadAllocator -> payloads -> padding).
// Small pieces are read through a scratch buffer; a region of kDirectReadBytes or more is read straight into
// its destination (the allocator's buffer). Every size is checked (validatePrefix, the size table against
// the prefix and the limits, the allocator's buffers against the table) before it is used; a violation
// closes this connection with a logged Error.
// Lifetime: the connection keeps itself alive while its handle is open, so dropping the last user
// reference does not close it; call close().
// Thread-safety: public methods may be called from any thread; everything else runs on the loop thread.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rpc/transport/tcp/context.h"

namespace distgrad::rpc::transport::tcp {

class TcpConnection final : public Connection, public std::enable_shared_from_this<TcpConnection> {
 public:
  static constexpr size_t kScratchBytes = 64 << 10;
  static constexpr size_t kDirectReadBytes = 16 << 10;

  TcpConnection(std::shared_ptr<TcpLoop> loop, std::string peerAddress);
  ~TcpConnection() override;

  void send(OutgoingFrame frame, SendCallback done) override;
  void start(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed) override;
  void close() override;
  std::string peerAddress() const override { return peerAddress_; }

  // Loop thread only.
  void initFromLoop();  // uv_tcp_init, registration with the loop, self reference
  uv_tcp_t* handleFromLoop() { return &handle_; }
  void setPeerAddressFromLoop(std::string address) { peerAddress_ = std::move(address); }
  void connectedFromLoop();  // TCP_NODELAY
  void closeFromLoop(const Error& error);
  void flushFromLoop();

 private:
  enum class Stage { kPrefix, kSizes, kEnvelope, kEnvelopePadding, kPayload, kPayloadPadding };
  struct QueuedFrame {
    OutgoingFrame frame;
    SendCallback done;
  };
  struct WriteRequest;

  void sendFromLoop(OutgoingFrame frame, SendCallback done);
  void startFromLoop(PayloadAllocator allocate, FrameCallback onFrame, CloseCallback onClosed);
  void writeFromLoop(std::vector<QueuedFrame> frames);
  void failFromLoop(const std::string& problem);  // malformed input: log and close
  void beginStage(Stage stage, void* target, size_t bytes);
  // Consumes bytes read into the scratch buffer; completes stages whose region is full.
  void consumeFromLoop(const uint8_t* data, size_t size);
  // Moves on from a completed stage. False when the connection closed meanwhile.
  bool completeStageFromLoop();
  bool allocatePayloadsFromLoop();
  void deliverFromLoop();
  void closedFromLoop();  // the handle's close callback
  void readFromLoop(ssize_t nread, const uv_buf_t* buf);  // onRead's body (onRead catches around it)
  // Runs a send callback; one that throws is logged and closes this connection (reportCallbackException).
  void completeSendFromLoop(SendCallback& done, const Result<void>& result);

  static void onAlloc(uv_handle_t* handle, size_t suggested, uv_buf_t* buf);
  static void onRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf);
  static void onWrite(uv_write_t* req, int status);
  static void onClose(uv_handle_t* handle);

  std::shared_ptr<TcpLoop> loop_;
  std::string peerAddress_;
  uv_tcp_t handle_{};
  std::shared_ptr<TcpConnection> self_;
  // Loop-thread state.
  bool initialized_ = false;
  bool started_ = false;
  bool closing_ = false;
  bool closed_ = false;
  bool dirty_ = false;
  std::optional<Error> closeError_;
  std::vector<QueuedFrame> queue_;
  PayloadAllocator allocate_;
  FrameCallback onFrame_;
  CloseCallback onClosed_;
  // Read state machine.
  std::vector<uint8_t> scratch_;
  Stage stage_ = Stage::kPrefix;
  uint8_t* target_ = nullptr;  // nullptr: skip `remaining_` bytes (padding)
  size_t remaining_ = 0;
  FramePrefix prefix_;
  std::vector<uint64_t> sizes_;
  IncomingFrame current_;
  size_t payloadIndex_ = 0;
};

}  // namespace distgrad::rpc::transport::tcp
