// A TCP connection: framed, ordered, asynchronous send and receive over one uv_tcp_t.
//
// Sending: frames are queued on the loop; before the loop next blocks, everything queued is written with
// one writev of a uv_buf_t array (prefix + size table + envelope + padding inline, payloads referenced in
// place: no copy of payload bytes): uv_try_write when libuv has nothing queued, uv_write for what the
// socket did not take (Note [Direct writes] in connection.cpp). The SendBuffers' owners are held until the
// write completes. A frame marked fromSender is written by the sending thread itself when nothing of this
// connection is waiting to be written (Note [Sender writes]).
// Receiving: a state machine (prefix -> size table -> envelope -> PayloadAllocator -> payloads -> padding).
// Small pieces are read through a scratch buffer; a region of kDirectReadBytes or more is read straight into
// its destination (the allocator's buffer). Every size is checked (validatePrefix, the size table against
// the prefix and the limits, the allocator's buffers against the table) before it is used; a violation
// closes this connection with a logged Error.
// Callbacks, state, posting to the loop and close reporting: LoopConnection (rpc/transport/loop_connection.h).
// Lifetime: the connection keeps itself alive while its handle is open, so dropping the last user
// reference does not close it; call close().
// Thread-safety: public methods may be called from any thread; everything else runs on the loop thread.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "rpc/transport/loop_connection.h"
#include "rpc/transport/tcp/context.h"

namespace distgrad::rpc::transport::tcp {

class TcpConnection final : public LoopConnection<TcpConnection, TcpLoop> {
 public:
  static constexpr size_t kScratchBytes = 64 << 10;
  static constexpr size_t kDirectReadBytes = 16 << 10;

  TcpConnection(std::shared_ptr<TcpLoop> loop, std::string peerAddress);
  ~TcpConnection() override;

  // Any thread: writes a fromSender frame here when nothing is queued ahead of it (Note [Sender writes]).
  void send(OutgoingFrame frame, SendCallback done) override;

  // Loop thread only.
  void initFromLoop();  // uv_tcp_init, registration with the loop, self reference
  uv_tcp_t* handleFromLoop() { return &handle_; }
  void setPeerAddressFromLoop(std::string address) { peerAddress_ = std::move(address); }
  void connectedFromLoop();  // TCP_NODELAY
  void closeFromLoop(const Error& error) override;
  void flushFromLoop();

 private:
  enum class Stage { kPrefix, kSizes, kEnvelope, kEnvelopePadding, kPayload, kPayloadPadding };
  struct QueuedFrame {
    OutgoingFrame frame;
    SendCallback done;
  };
  struct WriteRequest;
  // A piece of a write in wire order: inline (offset into writeBytes_) or external (caller memory).
  struct WritePiece {
    const uint8_t* external;
    size_t offset;
    size_t size;
  };

  void sendFromLoop(OutgoingFrame frame, SendCallback done) override;
  // Note [Sender writes]: true when the frame was taken (written whole, or its rest left in partial_).
  bool writeFromSender(OutgoingFrame& frame, SendCallback& done);
  void requestFlushFromLoop();
  void beginReadingFromLoop() override;  // uv_read_start
  void writeFromLoop(std::vector<QueuedFrame> frames);
  void beginStage(Stage stage, void* target, size_t bytes);
  // Consumes bytes read into the scratch buffer; completes stages whose region is full.
  void consumeFromLoop(const uint8_t* data, size_t size);
  // Moves on from a completed stage. False when the connection closed meanwhile.
  bool completeStageFromLoop();
  void deliverFromLoop();
  void closedFromLoop();  // the handle's close callback
  void readFromLoop(ssize_t nread, const uv_buf_t* buf);  // onRead's body (onRead catches around it)

  static void onAlloc(uv_handle_t* handle, size_t suggested, uv_buf_t* buf);
  static void onRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf);
  static void onWrite(uv_write_t* req, int status);
  static void onClose(uv_handle_t* handle);

  uv_tcp_t handle_{};
  // Loop-thread state.
  bool initialized_ = false;
  bool dirty_ = false;
  std::vector<QueuedFrame> queue_;
  // writeFromLoop's storage, kept between writes (Note [Direct writes] in connection.cpp).
  std::vector<uint8_t> writeBytes_;
  std::vector<WritePiece> writePieces_;
  std::vector<uv_buf_t> writeBuffers_;
  // Note [Sender writes]. Every write to the socket (the loop's and a sender's) happens under writeMutex_.
  std::mutex writeMutex_;
  int fd_ = -1;                         // GUARDED_BY(writeMutex_): the socket while senders may write it
  std::optional<QueuedFrame> partial_;  // GUARDED_BY(writeMutex_): a sender's frame the socket took part of
  size_t partialWritten_ = 0;           // GUARDED_BY(writeMutex_): how much of it
  std::atomic<bool> partialPending_{false};
  std::atomic<size_t> unwritten_{0};  // frames send() took that are not yet all in the socket
  std::vector<uint8_t> senderBytes_;    // GUARDED_BY(writeMutex_): writeFromSender's storage
  std::vector<WritePiece> senderPieces_;
  std::vector<iovec> senderIov_;
  // Read state machine.
  std::vector<uint8_t> scratch_;
  Stage stage_ = Stage::kPrefix;
  uint8_t* target_ = nullptr;  // nullptr: skip `remaining_` bytes (padding)
  size_t remaining_ = 0;
  size_t payloadIndex_ = 0;
};

}  // namespace distgrad::rpc::transport::tcp
