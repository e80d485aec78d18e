// The UCX transport on the ucp API: one ucp context and one ucp worker per process, shared by every ucx
// Context and driven by one loop thread (Note [One worker per process], context.cpp); client-server
// endpoints over sockaddrs (listen/connect take "host:port" like tcp); frames as active messages whose
// payloads land straight in the PayloadAllocator's buffers.
//
// Threads: UcxWorker owns the ucp context, the worker (UCS_THREAD_MODE_SERIALIZED) and the thread that
// drives them. Whoever holds the worker's drive lock is "the loop" (inLoop(), methods named ...FromLoop):
// the loop thread holds it whenever it is awake, and a thread about to wait for an answer (or to send one
// frame) may take it while the loop thread sleeps and do the loop's work itself (Note [Driving threads],
// context.cpp). Each Context holds a UcxLoop, its share of the worker: its options, connections, listeners
// and close. By default the loop sleeps in epoll_wait on the worker's event fd (ucp_worker_get_efd,
// re-armed with ucp_worker_arm) and on an eventfd that other threads write when they post a task (spinning
// a while before sleeping was tried and made the round trip slower here, 133 us against 50: see
// bench/README.md); while any Context asks for ContextOptions::ucxBusyPoll it never sleeps and spins in
// ucp_worker_progress (lowest latency, one core at 100%). ucp callbacks (active messages, request
// completions, endpoint errors, connection requests) only record what happened: user callbacks (onFrame,
// onClosed, send and connect completions, onAccept) run afterwards from the loop's deferred queue, so they
// may call back into the transport freely. Context methods may be called from any thread;
// Context::close() must not be called from the loop thread (it waits for it).
//
// Viability: createUcxContext returns an Error (never aborts) when ucp cannot be initialised or the worker
// offers no wake-up fd; ucxViable() answers once per process whether a Context can be created.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "rpc/transport/loop_context.h"
#include "rpc/transport/transport.h"

namespace distgrad::rpc::transport::ucx {

class UcxConnection;
class UcxListenerImpl;

// Active-message ids of the ucx wire (docs/wire_protocol.md, "ucx").
enum class AmId : uint16_t {
  kFrame = 1,     // header: prefix | sizes | envelope; data: the payloads back to back
  kHead = 2,      // header: prefix; data: sizes | envelope (a head too large for one AM header)
  kPayloads = 3,  // after a kHead with payload bytes: data: the payloads back to back
  kHello = 4,     // the client's first message: its completion proves the endpoint is wired up
  kBye = 5,       // a graceful close: everything sent before it has been delivered
};

// "ucs_status_string(status) (code)", for messages.
std::string ucsError(ucs_status_t status);

class UcxLoop;

// The process's ucp context and worker and the thread that drives them (Note [One worker per process]).
class UcxWorker {
 public:
  // The running worker, or a new one (its thread started) when there is none; counts a tenant. An Error
  // when UCX is unusable.
  static Result<std::shared_ptr<UcxWorker>> acquire(bool busyPoll);
  // Uncounts a tenant (after its close drained); the last one stops the thread, which destroys the worker
  // and the ucp context, and waits for it. Not on the loop thread.
  void release(bool busyPoll);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // Queues fn for the loop thread. With a `gate` (a Context's "closing" flag, guarded by this worker's task
  // lock): refused (false, fn dropped) once the gate is shut, unless called on the loop thread; `shut`
  // shuts it with this task, the last one it admits.
  bool post(std::function<void()> fn, bool* gate = nullptr, bool shut = false);
  // The loop thread, or a thread driving the worker now (Note [Driving threads]).
  bool inLoop() const;
  bool onLoopThread() const { return std::this_thread::get_id() == threadId_; }

  // Note [Driving threads]. beginDriving: this thread takes the loop's part (true) when nobody else has
  // it, after running the tasks posted so far (frames this thread posted before go out first); it must
  // call endDriving, which leaves the worker armed for the loop thread's sleep or wakes that thread.
  // driveWhile does the loop's work until `done()` holds or `window` passed, sleeping on the loop's
  // epoll set meanwhile (or spinning, while a Context busy-polls). interrupt() makes a driving thread check
  // `done()` again now.
  bool beginDriving();
  void driveWhile(const std::function<bool()>& done, std::chrono::microseconds window);
  void endDriving();
  void interrupt() { signal(driveWakeFd_); }
  // endDriving calls that woke the loop thread (Note [Arming after driving] in context.cpp).
  uint64_t wakesAfterDriving() const { return wakesAfterDriving_.load(std::memory_order_relaxed); }
  // Times the loop thread woke while another thread had the loop's part (Note [Watching apart]).
  uint64_t loopWakesWhileDriven() const { return loopWakesWhileDriven_.load(std::memory_order_relaxed); }
  // Note [Driving threads]: the sending thread issues a frame itself. `issue` runs as the loop (true) when
  // the loop thread sleeps and no task waits for it, then the completions it deferred; unless `finished()`
  // then holds (ucp took the whole frame at once) the loop thread is woken to progress the rest. A
  // template: nothing is allocated per frame.
  template <class Issue, class Finished>
  bool sendHere(Issue&& issue, Finished&& finished) {
    if (!enterToSend()) return false;
    bool unfinished = true;
    try {
      issue();
      runDeferredFromLoop();  // the completions ucp gave at once, or the frame's refusal
      unfinished = !finished();
    } catch (...) {
      leaveAfterSend(true);
      throw;
    }
    leaveAfterSend(unfinished);
    return true;
  }

  // Loop thread only (nullptr once the worker is destroyed).
  ucp_worker_h workerFromLoop() const { return worker_; }
  ucp_context_h ucpContext() const { return context_; }
  size_t maxAmHeader() const { return maxAmHeader_; }
  uint64_t memoryTypes() const { return memoryTypes_; }
  void deferFromLoop(std::function<void()> fn) { deferred_.push_back(std::move(fn)); }
  void addTimerFromLoop(const UcxLoop* owner, std::chrono::steady_clock::time_point deadline, std::function<void()> fn);
  void mapEndpointFromLoop(ucp_ep_h ep, UcxConnection* connection) { endpoints_[ep] = connection; }
  void unmapEndpointFromLoop(ucp_ep_h ep) { endpoints_.erase(ep); }
  void closingStartedFromLoop() { ++closingConnections_; }
  void closingDoneFromLoop() {
    if (closingConnections_ > 0) --closingConnections_;
  }
  void markInboundFromLoop(std::shared_ptr<UcxConnection> connection) { inbound_.push_back(std::move(connection)); }
  // `tenant` began closing: the loop tells it once it has drained (UcxLoop::drainedFromLoop).
  void closingTenantFromLoop(UcxLoop* tenant) { closingTenants_.push_back(tenant); }

  UcxWorker() = default;  // use acquire()

 private:
  Result<void> init();
  void run();
  // Progresses the worker and runs posted tasks, inbound processing and deferred work until none is left.
  void driveFromLoop();
  // One pass of the loop's work: due timers, driveFromLoop, closing tenants that drained.
  void turnFromLoop();
  bool runDeferredFromLoop();
  bool runTasks();
  static void drain(int eventFd);
  static void signal(int eventFd);
  // Sets windowFd_ to fire no later than wakeBy (false when it cannot be set).
  bool armWindowBy(std::chrono::steady_clock::time_point wakeBy, std::chrono::steady_clock::time_point now);
  void runTimersFromLoop();
  void answerDrainedTenantsFromLoop();
  int timeoutMsFromLoop() const;
  void wake() { signal(wakeFd_); }
  // Note [Watching apart]: the loop thread's set watches the worker's fd only while nobody drives.
  bool watchFromLoop(bool on);
  // What a thread that acted as the loop leaves for the loop thread itself: its stop, a busy poller to
  // serve, tasks, a tenant's close, closing connections to poll, a timer its sleep was not timed for.
  bool loopThreadNeeded() const;
  // loopThreadNeeded(), or the worker would not arm after a few progress-and-arm tries (Note [Arming after
  // driving] in context.cpp).
  bool loopNeededAfterDriving();
  // sendHere's halves: take the loop's part for one send (false when the loop thread or a task has it);
  // let go, waking the loop thread when `unfinished` or loopThreadNeeded().
  bool enterToSend();
  void leaveAfterSend(bool unfinished);
  static ucs_status_t onActiveMessage(void* arg, const void* header, size_t headerLength, void* data, size_t length,
                                      const ucp_am_recv_param_t* param);

  struct AmHandlerArg {
    UcxWorker* worker;
    AmId id;
  };
  struct Timer {
    std::chrono::steady_clock::time_point deadline;
    const UcxLoop* owner;  // alive while the timer is: a closing tenant drains only once it owns none
    std::function<void()> fn;
  };

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int workerFd_ = -1;
  // Note [Watching apart]: the loop thread sleeps on loopEpollFd_ (the worker's fd, wakeFd_), a driver on
  // driveEpollFd_ (the worker's fd, driveWakeFd_, windowFd_).
  int wakeFd_ = -1;       // wakes the loop thread: posts, stop, busy polling
  int driveWakeFd_ = -1;  // wakes the driver: interrupt(), a post while driving_
  int windowFd_ = -1;     // Note [Driving threads]: bounds a driver's sleep
  int loopEpollFd_ = -1;
  int driveEpollFd_ = -1;
  size_t maxAmHeader_ = 0;
  uint64_t memoryTypes_ = 0;
  std::vector<AmHandlerArg> amArgs_;
  size_t tenants_ = 0;  // GUARDED_BY(the registry's mutex, context.cpp)
  std::atomic<int> busyPollers_{0};
  std::mutex mutex_;
  std::vector<std::function<void()>> tasks_;  // GUARDED_BY(mutex_)
  std::atomic<bool> hasTasks_{false};
  std::atomic<bool> driving_{false};   // Note [Watching apart]: a thread other than the loop thread drives
  std::atomic<bool> stopping_{false};  // written under mutex_
  // Note [Driving threads]: held by whoever is the loop; busy-poll drivers waiting for it, counted.
  std::mutex driveMutex_;
  std::atomic<int> drivers_{0};
  std::atomic<uint64_t> wakesAfterDriving_{0};
  std::atomic<uint64_t> loopWakesWhileDriven_{0};
  std::thread thread_;
  std::thread::id threadId_;
  // Loop-thread state (Note [Driving threads]: whoever holds driveMutex_).
  bool driverSpins_ = false;                                  // the driving thread counted itself in drivers_
  bool loopWatches_ = true;                                   // the worker's fd is on in loopEpollFd_
  std::chrono::steady_clock::time_point windowArmedUntil_{};  // windowFd_ fires then (if still ahead)
  bool timersAddedByDriver_ = false;                          // since the loop thread last timed its sleep
  size_t closingConnections_ = 0;
  std::vector<std::function<void()>> deferred_;
  std::vector<std::shared_ptr<UcxConnection>> inbound_;
  std::vector<Timer> timers_;
  std::vector<UcxLoop*> closingTenants_;  // each alive until answered: its shutdown() waits for that
  std::unordered_map<ucp_ep_h, UcxConnection*> endpoints_;
};

// One Context's share of the process's UcxWorker: what LoopContext, the connections and the listeners of
// that Context use. Its close closes only its own listeners and connections.
class UcxLoop : public std::enable_shared_from_this<UcxLoop> {
 public:
  // Joins (or starts) the process's worker; an Error when UCX is unusable.
  static Result<std::shared_ptr<UcxLoop>> create(const ContextOptions& options);
  ~UcxLoop();
  UcxLoop(const UcxLoop&) = delete;
  UcxLoop& operator=(const UcxLoop&) = delete;

  // Queues fn for the loop thread. False (fn dropped) once shutdown began, unless called on the loop
  // thread itself.
  bool post(std::function<void()> fn);
  bool inLoop() const { return worker_->inLoop(); }
  bool onLoopThread() const { return worker_->onLoopThread(); }
  UcxWorker& worker() const { return *worker_; }
  // Closes this Context's listeners and connections, waits for their endpoints to close and leaves the
  // worker (the last to leave stops it). Not on the loop thread.
  void shutdown();

  const ContextOptions& options() const { return options_; }
  // Loop thread only.
  ucp_worker_h workerFromLoop() const { return worker_->workerFromLoop(); }
  ucp_context_h ucpContext() const { return worker_->ucpContext(); }
  bool closingFromLoop() const { return closing_; }
  size_t maxAmHeader() const { return worker_->maxAmHeader(); }
  // ucp_context_query's memory types (a bit per ucs_memory_type_t).
  uint64_t memoryTypes() const { return worker_->memoryTypes(); }
  // Runs fn from the loop after the current ucp progress call returns (FIFO with the other deferred work).
  void deferFromLoop(std::function<void()> fn) { worker_->deferFromLoop(std::move(fn)); }
  // Runs fn at `deadline` on the loop (or during this Context's close, once its connections are gone).
  void addTimerFromLoop(std::chrono::steady_clock::time_point deadline, std::function<void()> fn) {
    worker_->addTimerFromLoop(this, deadline, std::move(fn));
  }
  void addFromLoop(UcxConnection* connection) { connections_.insert(connection); }
  void removeFromLoop(UcxConnection* connection) { connections_.erase(connection); }
  void addFromLoop(UcxListenerImpl* listener) { listeners_.insert(listener); }
  void removeFromLoop(UcxListenerImpl* listener) { listeners_.erase(listener); }
  void mapEndpointFromLoop(ucp_ep_h ep, UcxConnection* connection) { worker_->mapEndpointFromLoop(ep, connection); }
  void unmapEndpointFromLoop(ucp_ep_h ep) { worker_->unmapEndpointFromLoop(ep); }
  // Connections between their goodbye and their forced close: while there are any, the loop wakes every
  // kClosingPollMs, because ucp does not signal the event fd for every event a close waits for.
  void closingStartedFromLoop() { worker_->closingStartedFromLoop(); }
  void closingDoneFromLoop() { worker_->closingDoneFromLoop(); }
  static constexpr int kClosingPollMs = 1;
  // Endpoints whose ucp_ep_close_nbx is still in progress: this Context's close waits for them.
  void teardownStartedFromLoop() { ++teardowns_; }
  void teardownDoneFromLoop() {
    if (teardowns_ > 0) --teardowns_;
  }
  // Asks for UcxConnection::processInboundFromLoop before the loop next sleeps.
  void markInboundFromLoop(std::shared_ptr<UcxConnection> connection) {
    worker_->markInboundFromLoop(std::move(connection));
  }
  // One-line description of the transports ucp chose for `ep` (from ucp_ep_print_info), e.g.
  // "am: sysv/memory; rma_bw: cma/memory".
  static std::string describeEndpoint(ucp_ep_h ep);

  // For UcxWorker: whether this closing Context has nothing left on the loop but its timers; and telling
  // shutdown() that it has drained.
  bool connectionsGoneFromLoop() const { return closing_ && connections_.empty(); }
  bool drainedFromLoop(bool ownsTimers) const {
    return connectionsGoneFromLoop() && listeners_.empty() && teardowns_ == 0 && !ownsTimers;
  }
  void answerDrainedFromLoop() {
    auto drained = drained_;  // set_value may still run when shutdown() returned and *this is gone
    drained->set_value();
  }

  UcxLoop(const ContextOptions& options, std::shared_ptr<UcxWorker> worker);  // use create()

 private:
  void closeAllFromLoop();

  ContextOptions options_;
  std::shared_ptr<UcxWorker> worker_;
  bool stopping_ = false;  // the gate of this Context's posts, GUARDED_BY(the worker's task lock)
  std::shared_ptr<std::promise<void>> drained_;
  std::shared_future<void> drainedFuture_;
  std::mutex leaveMutex_;
  bool left_ = false;  // GUARDED_BY(leaveMutex_)
  // Loop-thread state.
  bool closing_ = false;
  size_t teardowns_ = 0;
  std::unordered_set<UcxConnection*> connections_;
  std::unordered_set<UcxListenerImpl*> listeners_;
};

class UcxContext final : public LoopContext<UcxLoop> {
 public:
  explicit UcxContext(std::shared_ptr<UcxLoop> loop);

  Result<std::unique_ptr<Listener>> listen(const std::string& address, AcceptCallback onAccept) override;
  void connect(const std::string& address, ConnectCallback done) override;
};

Result<std::unique_ptr<Context>> createUcxContext(const ContextOptions& options = {});
// Whether a ucx Context can be created here (checked once per process, by creating one); when not,
// `reason` gets the Error's message.
bool ucxViable(std::string* reason = nullptr);
// The memory types this UCX build can move, e.g. "host" (Debian's UCX 1.13 has no CUDA support) or
// "host,cuda"; "" when ucx is not viable. Checked once per process. distgrad's tensors are host memory
// today: this is the detection a CUDA path would consult, falling back to host staging without "cuda".
std::string ucxMemoryTypes();
bool ucxSupportsCudaMemory();
// Resolves "host:port" (numeric or a name) to a sockaddr; false with `error` set when it cannot.
bool resolveAddress(const std::string& address, sockaddr_storage& out, socklen_t& length, std::string& error);

}  // namespace distgrad::rpc::transport::ucx
