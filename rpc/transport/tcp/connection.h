// A TCP connection: framed, ordered, asynchronous send and receive over one uv_tcp_t.
//
// Sending: frames are queued on the loop; before the loop next blocks, everything queued is written with
// one writev of a uv_buf_t array (prefix + size table + envelope + padding inline, payloads referenced in
// place: no copy of payload bytes): uv_try_write when libuv has nothing queued, uv_write for what the
// socket did not take (Note [Direct writes] in connection.cpp). The SendBuffers' owners are held until the
// write completes. A frame marked fromSender is written by the sending thread itself when nothing of this
// connection is waiting to be written (Note [Sender writes]).
// Receiving: the loop reads a socket when its read set says it is readable, or a thread waiting for a reply
// reads it itself (beginWaitingRead, Note [Waiting reader]); whichever reads holds readerMutex_.
// A state machine (prefix -> size table -> envelope -> PayloadAllocator -> payloads -> padding).
// Small pieces are read through a scratch buffer; a region of kDirectReadBytes or more is read straight into
// its destination (the allocator's buffer). Every size is checked (validatePrefix, the size table against
// the prefix and the limits, the allocator's buffers against the table) before it is used; a violation
// closes this connection with a logged Error.
// Callbacks, state, posting to the loop and close reporting: LoopConnection (rpc/transport/loop_connection.h).
// Lifetime: the connection keeps itself alive while its handle is open, so dropping the last user
// reference does not close it; call close().
// Thread-safety: public methods may be called from any thread; everything else runs on the loop thread,
// except the read state machine, which runs under readerMutex_ on the thread that reads.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
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
  // Any thread but the loop's: Note [Waiting reader].
  bool beginWaitingRead() override;
  void readWhileWaiting(const std::function<bool()>& done, std::chrono::microseconds window) override;
  void endWaitingRead() override;
  void interruptWaitingRead() override;
  uint64_t framesWrittenBySender() const override { return senderWrites_.load(std::memory_order_relaxed); }

  // Loop thread only.
  void initFromLoop();  // uv_tcp_init, registration with the loop, self reference
  uv_tcp_t* handleFromLoop() { return &handle_; }
  void setPeerAddressFromLoop(std::string address) { peerAddress_ = std::move(address); }
  void connectedFromLoop();  // TCP_NODELAY
  void closeFromLoop(const Error& error) override;
  void flushFromLoop();
  // The loop's read set says the socket is readable: read it, unless a waiting thread does.
  void readReadyFromLoop();

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
  void beginReadingFromLoop() override;  // joins the loop's read set
  bool readingStopped() const override { return closing_ || readFailed_; }
  void writeFromLoop(std::vector<QueuedFrame> frames);
  void beginStage(Stage stage, void* target, size_t bytes);
  // The reader's part (under readerMutex_, on the loop or a waiting thread; the ...FromLoop names of the
  // state machine are kept from when only the loop read). At most `reads` recv calls; stops at a short read.
  void readSocket(int reads);
  // Consumes bytes read into the scratch buffer; completes stages whose region is full.
  void consumeFromLoop(const uint8_t* data, size_t size);
  // Moves on from a completed stage. False when the connection closed meanwhile.
  bool completeStageFromLoop();
  void deliverFromLoop();
  // A failure met while reading (end of stream, a read error, a malformed frame, a handler that threw):
  // the reader stops and, once it let go of the socket, the connection is closed with the first such error.
  void failReading(const Error& error);
  void closedFromLoop();  // the handle's close callback

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
  std::atomic<uint64_t> senderWrites_{0};  // frames writeFromSender took
  std::vector<uint8_t> senderBytes_;    // GUARDED_BY(writeMutex_): writeFromSender's storage
  std::vector<WritePiece> senderPieces_;
  std::vector<iovec> senderIov_;
  // Note [Waiting reader]. readerMutex_ is held by whichever thread reads the socket; the read state
  // below and readFd_ are guarded by it.
  std::mutex readerMutex_;
  std::atomic<bool> readable_{false};  // reading began: readFd_ and kickFd_ are set
  int readFd_ = -1;   // the socket (the handle's fd), for reading
  int kickFd_ = -1;   // eventfd: closeFromLoop and interruptWaitingRead wake a waiting reader through it
  bool readFailed_ = false;
  uint64_t readerRole_ = 0;  // GUARDED_BY(readerMutex_): the current (or last) waiting reader, counted from 1
  // Note [Resume after letting go]: armMutex_ orders the socket's pauses and resumes in the loop's read
  // set and its removal from it.
  std::mutex armMutex_;
  uint64_t pausedBy_ = 0;           // GUARDED_BY(armMutex_): the waiting reader that paused the socket (0: none)
  bool inReadSet_ = false;          // GUARDED_BY(armMutex_)
  std::optional<Error> readError_;  // failReading's error, until the reader hands it to closeFromLoop
  // Read state machine.
  std::vector<uint8_t> scratch_;
  Stage stage_ = Stage::kPrefix;
  uint8_t* target_ = nullptr;  // nullptr: skip `remaining_` bytes (padding)
  size_t remaining_ = 0;
  size_t payloadIndex_ = 0;
};

}  // namespace distgrad::rpc::transport::tcp
