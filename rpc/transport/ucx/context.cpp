#include "rpc/transport/ucx/context.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <sstream>

#include "rpc/trace.h"
#include "rpc/transport/tcp/context.h"
#include "rpc/transport/ucx/connection.h"
#include "rpc/transport/ucx/listener.h"

namespace distgrad::rpc::transport::ucx {

std::string ucsError(ucs_status_t status) {
  return std::string(ucs_status_string(status)) + " (" + std::to_string(static_cast<int>(status)) + ")";
}

namespace {

// UCX settings this transport needs, applied with ucp_config_modify unless the user set the variable
// (UCX_<variable>) in the environment, which always wins. `name` is what ucp_config_modify matches against
// the transports' own tables: a component's field name, under its table's prefix where it has one.
struct Setting {
  const char* name;
  const char* variable;
  const char* value;
  const char* why;
};
constexpr Setting kSettings[] = {
    // UCX 1.13 leaves the shared-memory transports (sysv, posix, cma) out of endpoints that ask for peer
    // error handling unless this is set (openucx/ucx#8477); without it one-host traffic goes over tcp.
    // What UCX cannot tell about a dead peer on shared memory, the Agent's heartbeats do.
    {"MM_ERROR_HANDLING", "MM_ERROR_HANDLING", "y",
     "shared memory for client-server endpoints with peer error handling"},
    // Note [Cross-memory attach]: UCX 1.13 gives endpoints with peer error handling rendezvous lanes only
    // on memory domains that declare memory invalidation (select.c, ucp_wireup_add_rma_bw_lanes); CMA's
    // does not unless told to, so large payloads crossed the loopback over tcp. With it, one-host
    // rendezvous is a single process_vm_readv by the receiver straight from the sender's tensor storage.
    // What invalidation would have guarded (a peer reading a send buffer after the send failed here) the
    // connection guards itself: the payloads of a failed send are kept for kFailedSendLinger
    // (UcxConnection::partDoneFromLoop).
    {"MEMORY_INVALIDATE", "CMA_MEMORY_INVALIDATE", "y", "cross-memory attach (one copy) for one-host rendezvous"},
    // Note [Shared-memory queue]: UCX's shared-memory receive queue holds 64 messages by default. With 64
    // calls in flight it fills, the sender's messages wait in UCX's pending queue, and while anything waits
    // there ucp_worker_arm answers BUSY (mm_iface.c: "if we have outstanding send operations, can't go to
    // sleep"), so the loop spun through arm calls, two system calls each, until the receiver caught up,
    // on one core taking that receiver's time (perf stat of a 64-in-flight rpcAsync flood on one core: 23
    // system calls a call, 98% of the arms BUSY; 89k calls/s). With 256: 236k calls/s, 4.2 us of CPU a
    // call against 10.5 (bench_rpc, 2026-12-07). 256 x 128-byte elements is 32 KB a queue.
    {"MM_FIFO_SIZE", "MM_FIFO_SIZE", "256", "a shared-memory queue that a flood of 64 calls in flight does not fill"},
};

bool userSet(const char* name) { return std::getenv((std::string("UCX_") + name).c_str()) != nullptr; }

}  // namespace

// Note [One worker per process]
// Every ucx Context of a process shares one ucp context, one ucp worker and the thread that drives them.
// UCX 1.13 keeps the async handlers of all workers in one process-wide table keyed by file descriptor, and
// a worker that misses an event (its async context was busy) queues the fd to handle on its next progress;
// when that fd was closed meanwhile and its number reused by another worker's handler, the first worker's
// progress finds a handler of another worker and aborts the process (`Assertion handler->async == async
// failed` in __ucs_async_poll_missed; fixed upstream by openucx/ucx#9942, after 1.13). Agents running as
// threads of one process (tests, local clusters) open and close enough endpoints to hit it: about one run
// in twenty of the handshake tests did. With one worker every handler belongs to the same async context,
// and a process runs one ucx progress thread instead of one per Context. Each Context keeps its own share
// (UcxLoop: options, connections, listeners, close); the worker starts with the first Context and stops
// when the last one has closed. The registry's mutex is held while a worker starts or stops, so a new
// worker's fds never coexist with an old worker's handlers (nothing runs user code on the loop once the
// last tenant drained, so the stopping thread never waits for that mutex). The registry is a deliberate
// exception to STYLE's "no global registries": UCX's own table is process-wide, and a worker passed in by
// main() would abort the process whenever a program forgot to share it.
namespace {

std::mutex& registryMutex() {
  static std::mutex mutex;
  return mutex;
}

std::weak_ptr<UcxWorker>& registeredWorker() {  // GUARDED_BY(registryMutex())
  static std::weak_ptr<UcxWorker> worker;
  return worker;
}

}  // namespace

Result<std::shared_ptr<UcxWorker>> UcxWorker::acquire(bool busyPoll) {
  std::lock_guard lock(registryMutex());
  auto worker = registeredWorker().lock();
  if (worker == nullptr || worker->tenants_ == 0) {  // none yet, or one its last tenant stopped
    worker = std::make_shared<UcxWorker>();
    auto initialised = worker->init();
    if (!initialised.ok()) return initialised.error();
    std::promise<void> started;
    auto ready = started.get_future();
    // The thread holds its worker until run() returns: a worker whose tenants never all left (a Context
    // dropped on the loop thread, which cannot close it there) keeps running instead of being freed under
    // its thread, and stays the one the registry hands out.
    worker->thread_ = std::thread([self = worker, &started] {
      pthread_setname_np(pthread_self(), "dg-ucx-loop");
      trace::setThreadName("dg-ucx-loop");
      self->threadId_ = std::this_thread::get_id();
      started.set_value();
      self->run();
    });
    ready.wait();
    registeredWorker() = worker;
  }
  ++worker->tenants_;
  // A loop asleep in epoll_wait must notice it is to spin now (busy pollers post without waking it).
  if (busyPoll && worker->busyPollers_.fetch_add(1) == 0) worker->wake();
  return worker;
}

void UcxWorker::release(bool busyPoll) {
  DG_CHECK(!inLoop(), "ucx Context::close() must not be called from the ucx loop thread (it waits for it)");
  // The last busy poller gone: the loop may sleep again, and must first see what was posted without a wake.
  if (busyPoll && busyPollers_.fetch_sub(1) == 1) wake();
  std::lock_guard lock(registryMutex());
  DG_CHECK(tenants_ > 0, "ucx worker released more often than acquired");
  if (--tenants_ > 0) return;
  {
    std::lock_guard tasksLock(mutex_);
    stopping_.store(true, std::memory_order_release);
  }
  wake();
  signal(driveWakeFd_);  // a driver still asleep (Note [Watching apart]) lets go: the loop thread waits for it
  thread_.join();
}

Result<void> UcxWorker::init() {
  auto fail = [](const std::string& what, ucs_status_t status) {
    return Error::unimplemented("ucx transport unavailable: " + what + " failed: " + ucsError(status));
  };
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return fail("ucp_config_read", status);
  for (const auto& setting : kSettings) {
    if (userSet(setting.variable)) continue;
    status = ucp_config_modify(config, setting.name, setting.value);
    if (status != UCS_OK) {
      std::fprintf(stderr, "distgrad ucx: cannot set %s=%s (%s): %s\n", setting.name, setting.value, setting.why,
                   ucsError(status).c_str());
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  params.name = "distgrad";
  status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (status != UCS_OK) {
    context_ = nullptr;
    return fail("ucp_init", status);
  }
  ucp_context_attr_t contextAttr{};
  contextAttr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &contextAttr) == UCS_OK) memoryTypes_ = contextAttr.memory_types;
  ucp_worker_params_t workerParams{};
  workerParams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  workerParams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // Note [Driving threads]: one at a time, any thread
  status = ucp_worker_create(context_, &workerParams, &worker_);
  if (status != UCS_OK) {
    worker_ = nullptr;
    return fail("ucp_worker_create", status);
  }
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  status = ucp_worker_query(worker_, &attr);
  if (status != UCS_OK) return fail("ucp_worker_query", status);
  maxAmHeader_ = attr.max_am_header;
  status = ucp_worker_get_efd(worker_, &workerFd_);
  if (status != UCS_OK) return fail("ucp_worker_get_efd (the worker's transports offer no wake-up)", status);
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  driveWakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  windowFd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  loopEpollFd_ = ::epoll_create1(EPOLL_CLOEXEC);
  driveEpollFd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (wakeFd_ < 0 || driveWakeFd_ < 0 || windowFd_ < 0 || loopEpollFd_ < 0 || driveEpollFd_ < 0) {
    return Error::failed(std::string("ucx transport: eventfd/timerfd/epoll_create1 failed: ") + std::strerror(errno));
  }
  // Edge-triggered: an event is reported once. Nothing is lost by it: whoever sleeps armed the worker first
  // (ucp_worker_arm answers BUSY while anything is unprocessed), and each wake-up writes its eventfd anew.
  auto add = [](int set, int fd) {
    epoll_event event{};
    event.events = EPOLLIN | EPOLLET;
    event.data.fd = fd;
    return ::epoll_ctl(set, EPOLL_CTL_ADD, fd, &event) == 0;
  };
  if (!add(loopEpollFd_, workerFd_) || !add(loopEpollFd_, wakeFd_) || !add(driveEpollFd_, workerFd_) ||
      !add(driveEpollFd_, driveWakeFd_) || !add(driveEpollFd_, windowFd_)) {
    return Error::failed(std::string("ucx transport: epoll_ctl failed: ") + std::strerror(errno));
  }
  // One handler per message id; the argument tells the id apart (the callback gets no id).
  amArgs_.reserve(5);
  for (AmId id : {AmId::kFrame, AmId::kHead, AmId::kPayloads, AmId::kHello, AmId::kBye}) {
    amArgs_.push_back({this, id});
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                         UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = static_cast<unsigned>(id);
    // Whole messages, and eager data we may keep past the callback (processed after progress returns).
    handler.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    handler.cb = &UcxWorker::onActiveMessage;
    handler.arg = &amArgs_.back();
    status = ucp_worker_set_am_recv_handler(worker_, &handler);
    if (status != UCS_OK) return fail("ucp_worker_set_am_recv_handler", status);
  }
  return {};
}

UcxWorker::~UcxWorker() {
  // Never while its thread runs (the thread holds it): the thread destroyed the worker and the context when
  // it stopped, and release() joined it; this releases what a failed init() made.
  if (thread_.joinable()) thread_.detach();  // the thread's own reference was the last, as run() returned
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  for (int fd : {loopEpollFd_, driveEpollFd_, wakeFd_, driveWakeFd_, windowFd_}) {
    if (fd >= 0) ::close(fd);
  }
}

bool UcxWorker::post(std::function<void()> fn, bool* gate, bool shut) {
  bool wakeLoop = false;
  {
    std::lock_guard lock(mutex_);
    if (gate != nullptr && *gate && (shut || !inLoop())) return false;
    if (shut) *gate = true;
    wakeLoop = tasks_.empty();
    tasks_.push_back(std::move(fn));
    hasTasks_.store(true);  // seq_cst: Note [Watching apart]
  }
  // A busy-polling loop sees hasTasks_ without a wake-up; the eventfds stay open until the destructor. A
  // driver runs the tasks (Note [Watching apart]).
  if (wakeLoop && busyPollers_.load(std::memory_order_relaxed) == 0 && !inLoop()) {
    if (driving_.load()) {
      signal(driveWakeFd_);
    } else {
      wake();
    }
  }
  return true;
}

namespace {
thread_local const UcxWorker* tDriving = nullptr;  // the worker this thread drives now (Note [Driving threads])
}  // namespace

bool UcxWorker::inLoop() const { return tDriving == this || onLoopThread(); }

// Note [Driving threads]
// In event mode every frame used to cost the loop thread a wake-up on each side of a round trip more than
// a socket ping-pong: the caller posted its call to the loop (the eventfd), and the reply woke the loop,
// which then woke the caller (bench_rpc, ucx event mode: the round trip was 1.2-1.7x tcp's, whose sender
// writes and waiting reader take those wake-ups out: Note [Sender writes], Note [Waiting reader] in
// rpc/transport/tcp/connection.cpp). ucp cannot be entered by two threads at once, but the worker is
// SERIALIZED (any thread, one at a time), and all of the loop's state is guarded by one lock, driveMutex_,
// which the loop thread holds whenever it is awake; whoever holds it is the loop (inLoop()).
//  - A thread about to wait for an answer takes it (beginDriving, by Connection::beginWaitingRead, when the
//    loop thread sleeps: try_lock), runs the tasks posted so far (so that no frame it posted earlier is
//    overtaken), sends its frame as the loop would, and then drives the worker while it waits
//    (driveWhile): progress, tasks, received frames, deferred work, for every connection and Context of the
//    process, exactly the loop's work, sleeping on an epoll set of its own that watches the worker's fd
//    while the loop thread's set does not (Note [Watching apart]): the answer wakes the waiting thread
//    alone, as in a socket ping-pong. The driver stops when its answer is in or the window passed, and lets
//    go (endDriving) with the worker armed again, or else wakes the loop thread. Meanwhile it also runs the
//    loop's timers and answers closing Contexts (a 30 s serving window must not hold a close up); only the
//    worker's stop and busy polling are left to the loop thread.
//  - A thread that sends a frame marked fromSender without waiting this way issues it itself when the loop
//    thread sleeps and no task is queued (sendHere); when ucp finishes it at once (eager data), nothing is
//    left for the loop, which is not woken; when ucp keeps part of it (rendezvous, a full queue), the loop
//    is woken to progress it.
//  - While a Context busy-polls the loop thread never sleeps: a waiting thread announces itself (drivers_)
//    and the loop thread lets go of the lock and yields until it is done; the driver spins on the worker
//    instead, so the process still spins on one thread, the one that waits.
// What a driver runs is the loop's (frame handlers, completions): the agent treats it as it treats tcp's
// waiting reader (Context::inLoop() names the loop thread only: calls read here are posted to the executor,
// inline handlers run here).
//
// Note [Watching apart]: drivers used to sleep on the loop thread's own set, edge-triggered, where an edge
// wakes only the thread that went to sleep last: the driver, as a rule. But an edge that comes while the
// driver is awake goes to the loop thread, the set's only sleeper. On one core that is the rule, not the
// exception: the peer woken by this side's send runs at once, and its answer arrives before this side's
// driver got back to epoll_wait; the loop thread woke, found the lock taken, passed the event on, blocked
// on the lock, and took over after the driver, two context switches and ~8 system calls more; having gone
// back to sleep after the driver, it was then the last sleeper and got the next edge too (the one-core ucx
// rpcSync: 24.5 us median, p10 17.5; 2 loop-thread context switches per call). Now a driver sleeps on its
// own set (the worker's fd, driveWakeFd_, windowFd_), and for as long as it drives the loop thread's set
// (the worker's fd, wakeFd_) does not watch the worker (watchFromLoop: EPOLL_CTL_MOD, two system calls per
// driving; tcp's waiting reader pauses its socket in the loop's set the same way): 18.6 us, p90 20.6, the
// loop thread woken by no call (bench/README.md, "rpc"). A post wakes whoever has the loop's part: the
// driver (driveWakeFd_) while driving_ is set, else the loop thread; driving_ and hasTasks_ are seq_cst on
// both sides (the poster stores hasTasks_ then reads driving_, a driver stores driving_ then reads
// hasTasks_, in runTasks when it begins and in loopThreadNeeded when it ends), so a task is either run by
// a driver or wakes the loop thread. The loop thread, woken while another thread has the lock (a post that
// raced with a driver's start, a sender's frame), waits for the lock and does its turn after it
// (loopWakesWhileDriven counts these). What the worker signalled meanwhile is the driver's: it arms before
// it sleeps, and ucp_worker_arm answers BUSY while anything is unprocessed.
bool UcxWorker::beginDriving() {
  if (inLoop() || stopping_.load(std::memory_order_acquire)) return false;
  const bool busy = busyPollers_.load(std::memory_order_relaxed) > 0;
  if (busy) {
    // The spinning loop thread lets go within one pass.
    drivers_.fetch_add(1);
    const auto giveUp = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (!driveMutex_.try_lock()) {
      if (std::chrono::steady_clock::now() > giveUp) {
        drivers_.fetch_sub(1);
        return false;
      }
      std::this_thread::yield();
    }
  } else if (!driveMutex_.try_lock()) {
    return false;
  }
  if (worker_ == nullptr) {  // stopped: the loop thread destroyed it
    driveMutex_.unlock();
    if (busy) drivers_.fetch_sub(1);
    return false;
  }
  tDriving = this;
  driverSpins_ = busy;
  // Note [Watching apart]: from here on a post wakes this thread; what was posted before, it runs now.
  // (Busy polling, the loop thread does not sleep.)
  driving_.store(true);
  if (!busy) watchFromLoop(false);
  runTasks();
  return true;
}

void UcxWorker::driveWhile(const std::function<bool()>& done, std::chrono::microseconds window) {
  DG_ASSERT(tDriving == this, "UcxWorker::driveWhile without beginDriving");
  const auto end = std::chrono::steady_clock::now() + window;
  epoll_event events[4];
  for (;;) {
    turnFromLoop();
    if (done() || stopping_.load(std::memory_order_acquire)) return;
    const auto now = std::chrono::steady_clock::now();
    if (now >= end) return;
    if (busyPollers_.load(std::memory_order_relaxed) > 0) continue;
    ucs_status_t status = ucp_worker_arm(worker_);
    if (status == UCS_ERR_BUSY || hasTasks_.load(std::memory_order_acquire)) continue;
    if (status != UCS_OK) return;  // the loop thread reports it and polls
    // Awake no later than the window's end, the next timer, or the closing connections' next poll.
    auto wakeBy = end;
    if (const int ms = timeoutMsFromLoop(); ms >= 0) wakeBy = std::min(wakeBy, now + std::chrono::milliseconds(ms));
    if (!armWindowBy(wakeBy, now)) return;
    int n = ::epoll_wait(driveEpollFd_, events, 4, -1);
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == driveWakeFd_) drain(driveWakeFd_);
    }
  }
}

// Note [Driving threads]: a driver's sleep is not bounded by epoll_wait's timeout: a timeout arms a kernel
// timer each time the thread sleeps and cancels it when woken, in a VM a few exits per round trip (the
// one-core ucx rpcSync, with epoll_pwait2's timeout: 24.2-25.0 us, inline handler 16.3-17.8; with this:
// 18.5-19.2 and 13.8-15.8 us, bench_rpc, 2026-12-07; tcp's Note [Lazy window timer] found the same).
// windowFd_, a timerfd in the drivers' set (Note [Watching apart]), is armed to fire no later than the
// driver's window ends and set again only once it fired or would fire too late, so back-to-back calls set it
// about once per window (an expiry with no driver asleep makes the next driver's first sleep return at once).
bool UcxWorker::armWindowBy(std::chrono::steady_clock::time_point wakeBy, std::chrono::steady_clock::time_point now) {
  if (windowArmedUntil_ > now && windowArmedUntil_ <= wakeBy) return true;  // it will fire in time
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wakeBy.time_since_epoch()).count();
  itimerspec spec{};
  spec.it_value = timespec{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  if (::timerfd_settime(windowFd_, TFD_TIMER_ABSTIME, &spec, nullptr) != 0) return false;
  windowArmedUntil_ = wakeBy;
  return true;
}

void UcxWorker::endDriving() {
  DG_ASSERT(tDriving == this, "UcxWorker::endDriving without beginDriving");
  driveFromLoop();
  // Note [Watching apart]: posts wake the loop thread again, and its sleep watches the worker again
  // (should that fail, the loop thread polls).
  driving_.store(false);
  const bool wakeLoop = loopNeededAfterDriving() || !watchFromLoop(true);
  const bool busy = driverSpins_;
  tDriving = nullptr;
  driveMutex_.unlock();
  if (busy) drivers_.fetch_sub(1);
  if (wakeLoop) {
    wakesAfterDriving_.fetch_add(1, std::memory_order_relaxed);
    wake();
  }
}

bool UcxWorker::enterToSend() {
  if (inLoop() || busyPollers_.load(std::memory_order_relaxed) > 0 || hasTasks_.load(std::memory_order_acquire)) {
    return false;
  }
  if (!driveMutex_.try_lock()) return false;
  // Under the lock no task runs: none queued now means every frame posted before was issued.
  if (worker_ == nullptr || hasTasks_.load(std::memory_order_acquire)) {
    driveMutex_.unlock();
    return false;
  }
  tDriving = this;
  return true;
}

void UcxWorker::leaveAfterSend(bool unfinished) {
  // A failed send closes its connection (which the loop thread polls while it closes) and may add a
  // timer; a completion may post: those are the loop thread's to notice too.
  const bool wakeLoop = unfinished || loopThreadNeeded();
  tDriving = nullptr;
  driveMutex_.unlock();
  if (wakeLoop) wake();
}

bool UcxWorker::loopThreadNeeded() const {
  return stopping_.load(std::memory_order_acquire) || busyPollers_.load(std::memory_order_relaxed) > 0 ||
         hasTasks_.load() || !closingTenants_.empty() || closingConnections_ > 0 || timersAddedByDriver_;
}

// Note [Arming after driving]: a driver lets go with the worker armed, or else wakes the loop thread. The first
// ucp_worker_arm after a wake-up answers BUSY as a rule: arming drains the shared-memory interface's signal
// socket and reports that it found signals, asking for one more progress. Taken as "the loop is needed", every
// call woke the loop thread, which found the lock taken by the next driver already, passed the wake-up on and
// blocked on the lock until that driver let go, and so on: two context switches more per call and process
// (the one-core ucx rpcSync, bench_rpc 2026-12-07: 35.3 us against 28.4 with the callee's serving reader off;
// every one of ~12,000 endDriving calls of a run woke the loop). So the driver progresses and arms again, as
// the loop thread does, a few times (in the same runs the second arm answered OK every time): one-core
// rpcSync 24 us, inline handler 16 (was 22).
constexpr int kArmTries = 4;

bool UcxWorker::loopNeededAfterDriving() {
  for (int tries = 0; tries < kArmTries; ++tries) {
    if (loopThreadNeeded()) return true;
    const ucs_status_t status = ucp_worker_arm(worker_);
    if (status == UCS_OK) return false;
    if (status != UCS_ERR_BUSY) return true;  // the loop thread reports it
    driveFromLoop();
  }
  return true;
}

bool UcxWorker::watchFromLoop(bool on) {
  if (loopWatches_ == on) return true;
  epoll_event event{};
  event.events = on ? EPOLLIN | EPOLLET : 0;
  event.data.fd = workerFd_;
  if (::epoll_ctl(loopEpollFd_, EPOLL_CTL_MOD, workerFd_, &event) != 0) {
    std::fprintf(stderr, "distgrad ucx: epoll_ctl(EPOLL_CTL_MOD) of the worker's fd failed: %s%s\n",
                 std::strerror(errno), on ? "; the loop thread polls instead" : "");
    return false;
  }
  loopWatches_ = on;
  return true;
}

void UcxWorker::drain(int eventFd) {
  uint64_t count = 0;
  while (::read(eventFd, &count, sizeof(count)) < 0 && errno == EINTR) {
  }
}

void UcxWorker::signal(int eventFd) {
  const uint64_t one = 1;
  while (::write(eventFd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

bool UcxWorker::runTasks() {
  if (!hasTasks_.load()) return false;
  std::vector<std::function<void()>> batch;
  {
    std::lock_guard lock(mutex_);
    batch.swap(tasks_);
    hasTasks_.store(false, std::memory_order_relaxed);
  }
  for (auto& task : batch) {
    try {
      task();
    } catch (...) {
      reportCallbackException("a task posted to the ucx loop", "the loop carries on");
    }
  }
  return !batch.empty();
}

void UcxWorker::addTimerFromLoop(const UcxLoop* owner, std::chrono::steady_clock::time_point deadline,
                                 std::function<void()> fn) {
  // The loop thread's sleep was timed without it (Note [Driving threads]).
  if (!onLoopThread()) timersAddedByDriver_ = true;
  timers_.push_back({deadline, owner, std::move(fn)});
}

void UcxWorker::runTimersFromLoop() {
  if (timers_.empty()) return;
  auto now = std::chrono::steady_clock::now();
  std::vector<std::function<void()>> due;
  for (size_t i = 0; i < timers_.size();) {
    // A closing Context whose connections are gone does not wait for its timers.
    if (timers_[i].deadline <= now || timers_[i].owner->connectionsGoneFromLoop()) {
      due.push_back(std::move(timers_[i].fn));
      timers_[i] = std::move(timers_.back());
      timers_.pop_back();
    } else {
      ++i;
    }
  }
  for (auto& fn : due) deferFromLoop(std::move(fn));
}

void UcxWorker::answerDrainedTenantsFromLoop() {
  for (size_t i = 0; i < closingTenants_.size();) {
    UcxLoop* tenant = closingTenants_[i];
    bool ownsTimers = std::any_of(timers_.begin(), timers_.end(), [&](const Timer& t) { return t.owner == tenant; });
    if (!tenant->drainedFromLoop(ownsTimers)) {
      ++i;
      continue;
    }
    closingTenants_[i] = closingTenants_.back();
    closingTenants_.pop_back();
    tenant->answerDrainedFromLoop();  // its shutdown() may return and destroy it now
  }
}

int UcxWorker::timeoutMsFromLoop() const {
  if (closingConnections_ > 0) return UcxLoop::kClosingPollMs;
  if (timers_.empty()) return -1;
  auto next = timers_.front().deadline;
  for (const auto& timer : timers_) {
    if (timer.owner->connectionsGoneFromLoop()) return 0;  // runTimersFromLoop runs it at once
    next = std::min(next, timer.deadline);
  }
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - std::chrono::steady_clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms + 1, 0, 60000));
}

void UcxWorker::driveFromLoop() {
  for (;;) {
    bool busy = false;
    while (ucp_worker_progress(worker_) != 0) busy = true;
    if (runTasks()) busy = true;
    if (!inbound_.empty()) {
      busy = true;
      auto batch = std::move(inbound_);
      inbound_.clear();
      for (auto& connection : batch) {
        try {
          connection->processInboundFromLoop();
        } catch (...) {
          std::string message = reportCallbackException(
              "receiving from the ucx connection to " + connection->peerAddress(), "closing it");
          connection->closeFromLoop(Error::failed(message));
        }
      }
    }
    if (runDeferredFromLoop()) busy = true;
    if (!busy) return;
  }
}

bool UcxWorker::runDeferredFromLoop() {
  if (deferred_.empty()) return false;
  auto batch = std::move(deferred_);
  deferred_.clear();
  for (auto& fn : batch) {
    try {
      fn();
    } catch (...) {
      reportCallbackException("deferred work on the ucx loop", "the loop carries on");
    }
  }
  return true;
}

void UcxWorker::turnFromLoop() {
  runTimersFromLoop();
  driveFromLoop();
  if (!closingTenants_.empty()) answerDrainedTenantsFromLoop();
}

void UcxWorker::run() {
  epoll_event events[4];
  // Note [Driving threads]: the loop's state is this thread's only while it holds the drive lock.
  std::unique_lock drive(driveMutex_);
  for (;;) {
    turnFromLoop();
    // Every tenant drained before the last one released the worker: only tasks the loop posted itself can
    // be left.
    if (stopping_.load(std::memory_order_acquire)) {
      std::lock_guard lock(mutex_);
      if (tasks_.empty()) break;
    }
    if (busyPollers_.load(std::memory_order_relaxed) > 0) {
      if (drivers_.load(std::memory_order_acquire) > 0) {
        // A waiting thread spins on the worker instead until it is done.
        drive.unlock();
        while (drivers_.load(std::memory_order_acquire) > 0) std::this_thread::yield();
        drive.lock();
      }
      continue;
    }
    // Sleep only when ucp agrees nothing is pending (arm returns BUSY when events arrived meanwhile), and
    // not over a task posted while a busy-polling Context (which posts without waking) was leaving.
    ucs_status_t status = ucp_worker_arm(worker_);
    if (status == UCS_ERR_BUSY || hasTasks_.load(std::memory_order_acquire)) continue;
    if (status != UCS_OK) {
      std::fprintf(stderr, "distgrad ucx: ucp_worker_arm failed: %s; polling instead\n", ucsError(status).c_str());
    }
    int timeoutMs = status == UCS_OK ? timeoutMsFromLoop() : 0;
    if (!watchFromLoop(true)) {
      timeoutMs = timeoutMs < 0 ? UcxLoop::kClosingPollMs : std::min(timeoutMs, UcxLoop::kClosingPollMs);
    }
    timersAddedByDriver_ = false;  // this sleep is timed with every timer there is
    drive.unlock();
    int n = ::epoll_wait(loopEpollFd_, events, 4, timeoutMs);
    // Note [Watching apart]: should a thread have taken the lock since this one let go, what woke this one is
    // that thread's to handle too; this one takes over after it.
    if (!drive.try_lock()) {
      loopWakesWhileDriven_.fetch_add(1, std::memory_order_relaxed);
      drive.lock();
    }
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == wakeFd_) drain(wakeFd_);
    }
  }
  // Every endpoint and listener is closed: the worker and context go with the thread that used them (a
  // driver that comes later finds no worker).
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  ucp_cleanup(context_);
  context_ = nullptr;
}

UcxLoop::UcxLoop(const ContextOptions& options, std::shared_ptr<UcxWorker> worker)
    : options_(options),
      worker_(std::move(worker)),
      drained_(std::make_shared<std::promise<void>>()),
      drainedFuture_(drained_->get_future().share()) {}

Result<std::shared_ptr<UcxLoop>> UcxLoop::create(const ContextOptions& options) {
  auto worker = UcxWorker::acquire(options.ucxBusyPoll);
  if (!worker.ok()) return worker.error();
  return std::make_shared<UcxLoop>(options, std::move(worker).value());
}

UcxLoop::~UcxLoop() {
  {
    std::lock_guard lock(leaveMutex_);
    if (left_) return;
  }
  if (inLoop()) {
    std::fprintf(stderr, "distgrad ucx: a Context's loop share destroyed on the loop thread; it stays registered\n");
    return;
  }
  shutdown();
}

bool UcxLoop::post(std::function<void()> fn) { return worker_->post(std::move(fn), &stopping_); }

void UcxLoop::shutdown() {
  DG_CHECK(!inLoop(),
           "ucx Context::close() must not be called from the ucx loop thread, which runs the callbacks of every "
           "ucx Context of the process (close waits for it)");
  // Once, the last task of this Context's; `this` outlives it: shutdown waits below.
  (void)worker_->post([this] { closeAllFromLoop(); }, &stopping_, /*shut=*/true);
  drainedFuture_.wait();
  std::lock_guard lock(leaveMutex_);
  if (left_) return;
  left_ = true;
  worker_->release(options_.ucxBusyPoll);
}

void UcxLoop::closeAllFromLoop() {
  closing_ = true;
  std::vector<UcxListenerImpl*> listeners(listeners_.begin(), listeners_.end());
  for (auto* listener : listeners) listener->closeFromLoop();
  std::vector<UcxConnection*> connections(connections_.begin(), connections_.end());
  for (auto* connection : connections) connection->closeFromLoop(Error::disconnected("ucx context closed"));
  worker_->closingTenantFromLoop(this);
}

ucs_status_t UcxWorker::onActiveMessage(void* arg, const void* header, size_t headerLength, void* data, size_t length,
                                        const ucp_am_recv_param_t* param) {
  auto* handler = static_cast<AmHandlerArg*>(arg);
  UcxWorker* loop = handler->worker;
  ucp_ep_h ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  auto it = loop->endpoints_.find(ep);
  // A message for an endpoint we closed (or never knew): dropped; ucp completes a rendezvous sender.
  if (it == loop->endpoints_.end()) return UCS_OK;
  bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  bool persistent = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
  try {
    bool kept =
        it->second->queueInboundFromLoop(handler->id, header, headerLength, data, length, rendezvous, persistent);
    return kept ? UCS_INPROGRESS : UCS_OK;
  } catch (...) {
    std::string message = reportCallbackException("queueing a ucx active message", "closing the connection");
    UcxConnection* connection = it->second;
    loop->deferFromLoop([connection, message] { connection->closeFromLoop(Error::failed(message)); });
    return UCS_OK;
  }
}

std::string UcxLoop::describeEndpoint(ucp_ep_h ep) {
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = ::open_memstream(&text, &size);
  if (stream == nullptr) return "";
  ucp_ep_print_info(ep, stream);
  std::fclose(stream);
  std::string info(text, size);
  std::free(text);
  // Lines look like "#                 lane[0]:  8:sysv/memory.0 md[4]      -> md[4]/sysv/sysdev[255] am am_bw#0";
  // keep "transport/device -> uses" per lane.
  std::istringstream lines(info);
  std::string line, out;
  while (std::getline(lines, line)) {
    auto lane = line.find("lane[");
    if (lane == std::string::npos) continue;
    std::istringstream words(line.substr(lane));
    std::string laneName, tl, word, uses;
    words >> laneName >> tl;
    auto colon = tl.find(':');
    if (colon != std::string::npos) tl = tl.substr(colon + 1);
    auto dot = tl.rfind('.');
    if (dot != std::string::npos) tl = tl.substr(0, dot);
    bool arrow = false;
    while (words >> word) {
      if (word == "->") {
        arrow = true;
        words >> word;  // the remote md/transport
        continue;
      }
      if (arrow) uses += (uses.empty() ? "" : " ") + word;
    }
    if (!out.empty()) out += "; ";
    out += tl + (uses.empty() ? "" : " (" + uses + ")");
  }
  return out;
}

bool resolveAddress(const std::string& address, sockaddr_storage& out, socklen_t& length, std::string& error) {
  std::string host;
  int port = 0;
  if (!tcp::splitHostPort(address, host, port)) {
    error = "malformed address '" + address + "', expected host:port";
    return false;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &result);
  if (rc != 0 || result == nullptr) {
    error = "cannot resolve '" + host + "': " + ::gai_strerror(rc);
    return false;
  }
  std::memcpy(&out, result->ai_addr, result->ai_addrlen);
  length = result->ai_addrlen;
  ::freeaddrinfo(result);
  return true;
}

UcxContext::UcxContext(std::shared_ptr<UcxLoop> loop) : LoopContext("ucx", loop, loop->options().limits) {}

Result<std::unique_ptr<Listener>> UcxContext::listen(const std::string& address, AcceptCallback onAccept) {
  return listenOnLoop<UcxListenerImpl>(address, std::move(onAccept));
}

void UcxContext::connect(const std::string& address, ConnectCallback done) {
  // Resolved on the caller's thread: a host name may block in getaddrinfo, which the loop must not.
  auto target = std::make_shared<sockaddr_storage>();
  socklen_t length = 0;
  std::string problem;
  if (!resolveAddress(address, *target, length, problem)) {
    Error error = Error::failed("ucx connect: " + problem);
    if (!loop_->post([done, error] { done(error); })) done(error);
    return;
  }
  auto loop = loop_;
  auto task = [loop, address, target, length, done]() mutable {
    if (loop->closingFromLoop()) {
      done(Error::disconnected("ucx connect to " + address + ": the context is closed"));
      return;
    }
    auto connection = std::make_shared<UcxConnection>(loop, address);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(target.get());
    params.sockaddr.addrlen = length;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxConnection::onEndpointError;
    params.err_handler.arg = connection.get();  // alive while its endpoint is open (self reference)
    ucp_ep_h ep = nullptr;
    ucs_status_t status = ucp_ep_create(loop->workerFromLoop(), &params, &ep);
    if (status != UCS_OK) {
      done(Error::disconnected("ucx connect to " + address + " failed: " + ucsError(status)));
      return;
    }
    connection->attachFromLoop(ep);
    connection->handshakeFromLoop(std::move(done));
  };
  if (!loop_->post(std::move(task))) {
    done(Error::disconnected("ucx connect to " + address + ": the context is closed"));
  }
}

Result<std::unique_ptr<Context>> createUcxContext(const ContextOptions& requested) {
  ContextOptions options = requested;
  // Busy polling for agents started by the launcher, which build their ContextOptions themselves.
  if (const char* poll = std::getenv("DISTGRAD_UCX_BUSY_POLL"); poll != nullptr && std::string(poll) == "1") {
    options.ucxBusyPoll = true;
  }
  auto loop = UcxLoop::create(options);
  if (!loop.ok()) return loop.error();
  return std::unique_ptr<Context>(std::make_unique<UcxContext>(std::move(loop).value()));
}

bool ucxViable(std::string* reason) {
  static const std::optional<std::string> problem = []() -> std::optional<std::string> {
    auto context = createUcxContext();
    if (!context.ok()) return context.error().message;
    return std::nullopt;
  }();
  if (problem && reason != nullptr) *reason = *problem;
  return !problem.has_value();
}

std::string ucxMemoryTypes() {
  static const std::string types = []() -> std::string {
    auto loop = UcxLoop::create(ContextOptions{});
    if (!loop.ok()) return "";
    const uint64_t mask = loop.value()->memoryTypes();
    loop.value()->shutdown();
    std::string out;
    const std::pair<ucs_memory_type_t, const char*> known[] = {{UCS_MEMORY_TYPE_HOST, "host"},
                                                               {UCS_MEMORY_TYPE_CUDA, "cuda"},
                                                               {UCS_MEMORY_TYPE_CUDA_MANAGED, "cuda-managed"},
                                                               {UCS_MEMORY_TYPE_ROCM, "rocm"},
                                                               {UCS_MEMORY_TYPE_ROCM_MANAGED, "rocm-managed"}};
    for (const auto& [type, name] : known) {
      if ((mask & (uint64_t{1} << type)) == 0) continue;
      if (!out.empty()) out.push_back(',');  // appended piecewise: GCC 12 flags a bogus -Wrestrict on a + chain
      out.append(name);
    }
    return out;
  }();
  return types;
}

bool ucxSupportsCudaMemory() { return ucxMemoryTypes().find("cuda") != std::string::npos; }

}  // namespace distgrad::rpc::transport::ucx
