// The in-process transport: two endpoints in the same process exchange frames by reference.
//
// Addresses are names registered in an InprocHub. There is no process-wide registry: two inproc Contexts
// reach each other only when they were created with the same hub (createInprocContext(hub)).
// createContext("inproc") makes a context with its own private hub, so it can only talk to itself.
//
// Zero copy (reference semantics): the receiver's PayloadBuffer points at the sender's SendBuffer bytes and
// its owner keeps the sender's owner alive. The sender must therefore not modify a payload after sending it.
// A SendBuffer without an owner cannot be kept alive past the send, so its bytes are copied instead.
// The PayloadAllocator is never called (there is nothing to allocate); the receiver still enforces its
// FrameLimits on every frame and closes the connection with an Error when one is exceeded, and the decoder
// checks payload sizes against the envelope itself.
//
// Threads: each Context owns one loop thread (a task queue); every callback runs on it. Methods may be
// called from any thread. Context::close() must not be called from the context's own loop thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rpc/transport/loop_context.h"
#include "rpc/transport/transport.h"

namespace distgrad::rpc::transport::inproc {

class InprocListener;
class InprocConnection;

// A task queue served by one thread, plus the list of connections and listeners living on it (so that
// shutdown() can close them). Outlives its Context while connections still reference it; once stopped,
// post() from other threads refuses new tasks (the caller then handles the failure itself).
class InprocLoop {
 public:
  InprocLoop();
  ~InprocLoop();
  InprocLoop(const InprocLoop&) = delete;
  InprocLoop& operator=(const InprocLoop&) = delete;

  // Queues fn to run on the loop thread. Returns false (fn dropped) once the loop has stopped.
  bool post(std::function<void()> fn);
  bool inLoop() const { return std::this_thread::get_id() == threadId_; }
  bool onLoopThread() const { return inLoop(); }
  // Remembers an endpoint so shutdown() can close it; false (not tracked) once shutdown began.
  bool track(const std::shared_ptr<InprocConnection>& connection);
  bool track(const std::shared_ptr<InprocListener>& listener);
  // Refuses tasks from other threads, closes every tracked endpoint on the loop after the tasks queued
  // before, drains what that posts, and joins the thread. Must not be called on the loop thread.
  void shutdown();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;  // GUARDED_BY(mutex_)
  bool stopping_ = false;                    // GUARDED_BY(mutex_)
  std::vector<std::weak_ptr<InprocConnection>> connections_;  // GUARDED_BY(mutex_)
  std::vector<std::weak_ptr<InprocListener>> listeners_;      // GUARDED_BY(mutex_)
  std::thread thread_;
  std::thread::id threadId_;
};

// The name registry shared by the inproc contexts that may connect to each other.
class InprocHub {
 public:
  Result<void> add(const std::string& name, const std::shared_ptr<InprocListener>& listener);
  void remove(const std::string& name, const InprocListener* listener);
  std::shared_ptr<InprocListener> find(const std::string& name);
  uint64_t nextClientId() { return ++clients_; }

 private:
  std::mutex mutex_;
  std::map<std::string, std::weak_ptr<InprocListener>> listeners_;  // GUARDED_BY(mutex_)
  std::atomic<uint64_t> clients_{0};
};

class InprocContext final : public LoopContext<InprocLoop> {
 public:
  InprocContext(std::shared_ptr<InprocHub> hub, const ContextOptions& options);

  Result<std::unique_ptr<Listener>> listen(const std::string& address, AcceptCallback onAccept) override;
  void connect(const std::string& address, ConnectCallback done) override;

 private:
  std::shared_ptr<InprocHub> hub_;
};

// A context on `hub`: it reaches the listeners of every context created on the same hub.
std::unique_ptr<Context> createInprocContext(std::shared_ptr<InprocHub> hub, const ContextOptions& options = {});

}  // namespace distgrad::rpc::transport::inproc
