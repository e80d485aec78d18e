// A UCX connection: one ucp endpoint (client-server, peer error handling), framed, ordered, asynchronous.
//
// Sending: each frame is one active message kFrame whose header is prefix | sizes | envelope and whose data
// is the payloads, handed to ucp as an iovec straight from the SendBuffers (no copy by us; ucp sends large
// data by rendezvous, reading the sender's memory in place). A head larger than the worker's maximum AM
// header goes as kHead (header: prefix; data: sizes | envelope) followed by kPayloads. ucp_am_send_nbx's
// three outcomes (NULL: done, an error pointer, a request completed later by its callback) are folded into
// one completion that runs `done` from the loop's deferred queue, never inside send().
// Receiving: the AM callback only queues the message (keeping ucp's eager data or rendezvous descriptor);
// processInboundFromLoop then takes messages in arrival order, validates every field (validatePrefix, the
// header length, the size table against the prefix and the limits, the data length against the payload
// total, the allocator's buffers against the table), asks the PayloadAllocator for the destination and
// either copies eager data into it or receives rendezvous data straight into it (ucp_am_recv_data_nbx on
// an iovec of the destination buffers). A message that needs a rendezvous receive holds back the ones
// behind it, so frames are delivered in order. A violation closes the connection with a logged Error.
// Closing: close() sends kBye and waits for the peer's kBye in answer (bounded by kCloseFlushTimeout, so a
// peer that reads nothing cannot hold it open), then force-closes the endpoint; sends still pending fail
// `disconnected`. The peer reports `disconnected` when it reads the kBye (after every frame sent before it),
// answers with its own kBye, flushes and force-closes; or when ucp reports the endpoint failed (peer
// process gone).
// Callbacks, state, posting to the loop and close reporting: LoopConnection (rpc/transport/loop_connection.h).
// Lifetime: the connection keeps itself alive while its endpoint is open; call close().
// Waiting and sending threads: a thread about to wait for an answer may drive the worker itself meanwhile,
// and one sending a frame marked fromSender may issue it itself (Note [Driving threads], context.cpp).
// Thread-safety: public methods may be called from any thread; everything else runs on the loop (the loop
// thread or a driving thread, holding the worker's drive lock).
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rpc/transport/loop_connection.h"
#include "rpc/transport/ucx/context.h"

namespace distgrad::rpc::transport::ucx {

class UcxConnection final : public LoopConnection<UcxConnection, UcxLoop> {
 public:
  static constexpr auto kCloseFlushTimeout = std::chrono::milliseconds(1000);
  // How long the payloads of a failed send stay allocated (Note [Cross-memory attach], context.cpp): a
  // peer reading them by cross-memory attach after we gave up on it reads the bytes we sent, not memory
  // reused meanwhile. A Context's close releases them sooner (its timers run once its connections are gone).
  static constexpr auto kFailedSendLinger = std::chrono::seconds(10);

  UcxConnection(std::shared_ptr<UcxLoop> loop, std::string peerAddress);
  ~UcxConnection() override;

  // Note [Driving threads] (context.cpp): fromSender frames are issued by the sending thread when the loop
  // thread sleeps; a waiting thread drives the whole worker (every connection of the process) until its
  // answer is in.
  void send(OutgoingFrame frame, SendCallback done) override;
  bool beginWaitingRead() override;
  void readWhileWaiting(const std::function<bool()>& done, std::chrono::microseconds window) override;
  void endWaitingRead() override;
  void interruptWaitingRead() override;
  uint64_t framesWrittenBySender() const override { return senderSends_.load(std::memory_order_relaxed); }
  // The transports ucp chose for this endpoint (UcxLoop::describeEndpoint); "" once closed. Waits for the
  // loop when called from another thread.
  std::string lanes() override;
  // ucp's error callback for this connection's endpoint (the argument is the connection).
  static void onEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);

  // Loop thread only.
  // Adopts an endpoint (created by connect or accept); registers the connection with the loop.
  void attachFromLoop(ucp_ep_h ep);
  // Client side: sends kHello and reports through `done` once the endpoint is wired up (or failed).
  void handshakeFromLoop(ConnectCallback done);
  void closeFromLoop(const Error& error) override;
  // peerSaidBye: the peer closed first; our goodbye answers it and the endpoint closes once that is out.
  void closeFromLoop(const Error& error, bool peerSaidBye);
  // Called from the AM callback: queues one message (returns whether ucp's data is kept).
  bool queueInboundFromLoop(AmId id, const void* header, size_t headerLength, void* data, size_t length,
                            bool rendezvous, bool persistentData);
  void processInboundFromLoop();
  std::string lanesFromLoop() const;
  ucp_ep_h endpointFromLoop() const { return ep_; }

 private:
  struct Inbound {
    AmId id;
    std::vector<uint8_t> header;
    void* data = nullptr;  // ucp's eager data (held) or rendezvous descriptor
    size_t length = 0;
    bool rendezvous = false;
    bool held = false;            // data must be released with ucp_am_data_release
    std::vector<uint8_t> copied;  // eager data ucp did not let us keep
  };
  struct SendRequest;
  struct RecvRequest;
  enum class Expect { kHead, kPayloads };

  void sendFromLoop(OutgoingFrame frame, SendCallback done) override;
  void beginReadingFromLoop() override;  // processes what arrived before start()
  // Issues one AM of a frame; its completion (now or later) goes to partDoneFromLoop.
  void issueFromLoop(SendRequest* request, AmId id, const void* header, size_t headerLength, const void* data,
                     size_t count, bool iov);
  void partDoneFromLoop(SendRequest* request, ucs_status_t status);
  void handshakeDoneFromLoop(ConnectCallback done, ucs_status_t status);
  // Handles the front message; false when processing must stop (waiting for a receive, or closed).
  bool handleFromLoop(Inbound& message);
  bool parseHeadFromLoop(const uint8_t* sizesAndEnvelope, size_t bytes);
  // Moves message data (eager or rendezvous) into `targets`; false when a rendezvous receive is pending.
  bool receiveFromLoop(Inbound& message, std::vector<std::pair<void*, size_t>> targets, bool isHead);
  void receivedFromLoop(bool isHead);
  void deliverFromLoop();
  void releaseFromLoop(Inbound& message);
  void byeSentFromLoop();
  void forceCloseFromLoop();
  void closedFromLoop();

  ucp_ep_h ep_ = nullptr;
  std::atomic<uint64_t> senderSends_{0};  // frames their sending thread issued (sendHere)
  // Loop-thread state.
  bool attached_ = false;
  bool closeStarted_ = false;    // forceCloseFromLoop ran
  bool countedClosing_ = false;  // counted in the loop's closing connections
  bool peerSaidBye_ = false;     // we are closing because the peer said goodbye
  bool inboundMarked_ = false;
  bool receiving_ = false;       // a rendezvous receive is in flight
  bool endpointFailed_ = false;  // ucp reported the endpoint failed: no goodbye, close at once
  void* recvRequest_ = nullptr;  // the rendezvous receive in flight (cancelled by close)
  size_t pendingSends_ = 0;
  std::deque<Inbound> inbound_;
  Expect expect_ = Expect::kHead;
  std::vector<uint8_t> headBytes_;  // a kHead's data (sizes | envelope)
};

}  // namespace distgrad::rpc::transport::ucx
