// The TCP transport on libuv: one loop thread per Context, TCP_NODELAY, vectored writes straight from the
// payload buffers, frames queued in the same loop iteration coalesced into one write, and reads that land
// large payloads directly in the buffers the PayloadAllocator returns.
//
// Threads: TcpLoop owns the uv_loop_t and its thread; only that thread touches libuv handles (methods named
// ...FromLoop). Other threads post closures; the loop is woken through an eventfd, written only when the
// task queue goes from empty to non-empty (a loop that is busy anyway costs the poster no syscall). Context
// methods may be called from any thread; Context::close() must not be called from the loop thread (it
// joins it).
#pragma once

#include <uv.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "rpc/transport/loop_context.h"
#include "rpc/transport/transport.h"

namespace distgrad::rpc::transport::tcp {

class TcpConnection;
class TcpListenerImpl;

// "uv_strerror(code) (NAME)", for messages.
std::string uvError(int code);

// Exceptions must never unwind into libuv (C code: undefined behaviour, usually std::terminate): every place
// the loop runs a callback it does not own (onFrame, onClosed, send and connect completions, onAccept,
// posted tasks) catches and reports it with transport::reportCallbackException.

// A libuv loop and the thread that runs it (RAII: the destructor shuts down and closes the loop).
class TcpLoop {
 public:
  explicit TcpLoop(const ContextOptions& options);
  ~TcpLoop();
  TcpLoop(const TcpLoop&) = delete;
  TcpLoop& operator=(const TcpLoop&) = delete;

  // Queues fn for the loop thread. False (fn dropped) once shutdown began, unless called on the loop
  // thread itself (those tasks still run during the final drain).
  bool post(std::function<void()> fn);
  bool inLoop() const { return std::this_thread::get_id() == threadId_; }
  bool onLoopThread() const { return inLoop(); }
  // Runs fn later on the loop (never inline); loop thread only. Tasks the loop posts to itself run before it
  // next blocks, which is what the ucx loop's deferred queue gives (the shared LoopConnection uses both).
  void deferFromLoop(std::function<void()> fn) { post(std::move(fn)); }
  // Closes every connection and listener, drains the loop, joins the thread. Not on the loop thread.
  void shutdown();

  uv_loop_t* uvLoop() { return &loop_; }
  const ContextOptions& options() const { return options_; }
  bool closingFromLoop() const { return closing_; }

  // Loop-thread bookkeeping.
  void addFromLoop(TcpConnection* connection) { connections_.insert(connection); }
  void removeFromLoop(TcpConnection* connection) { connections_.erase(connection); }
  void addFromLoop(TcpListenerImpl* listener) { listeners_.insert(listener); }
  void removeFromLoop(TcpListenerImpl* listener) { listeners_.erase(listener); }
  // Asks for flushFromLoop() on `connection` before the loop next blocks (write coalescing).
  void markDirtyFromLoop(std::shared_ptr<TcpConnection> connection);
  // Note [Waiting reader] (connection.cpp): the loop learns that a socket is readable from its read set, an
  // epoll set of its own on which it blocks (libuv's backend fd is in it too), not from uv_read_start: a
  // thread that waits for a reply can then pause its socket in the set while it reads the socket itself,
  // which no libuv call may do off the loop thread. Any thread (epoll_ctl is thread-safe); level-triggered.
  // Pausing is EPOLL_CTL_MOD, not DEL and ADD: a pause and resume cost about 0.8 us here against 1.7-2.0 us,
  // twice per round trip. A paused socket wakes the loop at most once, for a hang-up or an error.
  void watchReads(TcpConnection* connection, int fd);
  void pauseReads(TcpConnection* connection, int fd);
  void resumeReads(TcpConnection* connection, int fd);
  void unwatchReads(int fd);

 private:
  void run();
  void runTasks();
  void wake();
  void closeAllFromLoop();
  void flushDirtyFromLoop();

  ContextOptions options_;
  uv_loop_t loop_{};
  // Not uv_async_t: its uv_async_send/uv__async_spin handshake made the loop thread spin (about 6% of a
  // no-op RPC's CPU on a loaded 2-core box) whenever a poster was preempted inside the send.
  int wakeFd_ = -1;     // eventfd, in the read set
  int readSetFd_ = -1;  // what the loop blocks on (Note [Waiting reader]): sockets, wakeFd_, libuv's backend fd
  std::mutex mutex_;
  std::vector<std::function<void()>> tasks_;  // GUARDED_BY(mutex_)
  std::vector<std::function<void()>> spareTasks_;  // loop: runTasks' batch storage, kept between batches
  bool stopping_ = false;                    // GUARDED_BY(mutex_)
  std::mutex joinMutex_;  // concurrent close() calls join the thread once
  std::thread thread_;
  std::thread::id threadId_;
  // Loop-thread state.
  bool closing_ = false;  // closeAllFromLoop ran
  std::unordered_set<TcpConnection*> connections_;
  std::unordered_set<TcpListenerImpl*> listeners_;
  std::vector<std::shared_ptr<TcpConnection>> dirty_;
  std::vector<std::shared_ptr<TcpConnection>> spareDirty_;  // flushDirtyFromLoop's storage, kept
};

class TcpContext final : public LoopContext<TcpLoop> {
 public:
  explicit TcpContext(const ContextOptions& options);

  Result<std::unique_ptr<Listener>> listen(const std::string& address, AcceptCallback onAccept) override;
  void connect(const std::string& address, ConnectCallback done) override;
};

std::unique_ptr<Context> createTcpContext(const ContextOptions& options = {});

// Splits "host:port" / "[v6]:port"; false when malformed.
bool splitHostPort(const std::string& address, std::string& host, int& port);
// "a.b.c.d:port" or "[v6]:port".
std::string formatAddress(const sockaddr* address);

}  // namespace distgrad::rpc::transport::tcp
