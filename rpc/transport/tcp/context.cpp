#include "rpc/transport/tcp/context.h"

#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <future>
#include <mutex>

#include "rpc/transport/tcp/connection.h"
#include "rpc/transport/tcp/listener.h"
#include "rpc/trace.h"

namespace distgrad::rpc::transport::tcp {

std::string uvError(int code) { return std::string(uv_strerror(code)) + " (" + uv_err_name(code) + ")"; }


TcpLoop::TcpLoop(const ContextOptions& options) : options_(options) {
  int rc = uv_loop_init(&loop_);
  DG_CHECK(rc == 0, "tcp transport: uv_loop_init failed: ", uvError(rc));
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  DG_CHECK(wakeFd_ >= 0, "tcp transport: eventfd failed: ", std::strerror(errno));
  wakePoll_.data = this;
  prepare_.data = this;
  check_.data = this;
  rc = uv_poll_init(&loop_, &wakePoll_, wakeFd_);
  DG_CHECK(rc == 0, "tcp transport: uv_poll_init failed: ", uvError(rc));
  uv_poll_start(&wakePoll_, UV_READABLE,
                [](uv_poll_t* h, int, int) { static_cast<TcpLoop*>(h->data)->onWakeFromLoop(); });
  uv_prepare_init(&loop_, &prepare_);
  uv_prepare_start(&prepare_, [](uv_prepare_t* h) {
    auto* self = static_cast<TcpLoop*>(h->data);
    // Tasks posted from the loop itself (or while it was busy) run now instead of after a wake-up.
    self->inPrepare_ = true;
    self->runTasks();
    self->flushDirtyFromLoop();
    self->inPrepare_ = false;
  });
  uv_check_init(&loop_, &check_);
  uv_check_start(&check_, [](uv_check_t* h) { static_cast<TcpLoop*>(h->data)->flushDirtyFromLoop(); });
  // Only the wake-up handle (and real I/O) keep the loop alive.
  uv_unref(reinterpret_cast<uv_handle_t*>(&prepare_));
  uv_unref(reinterpret_cast<uv_handle_t*>(&check_));
  std::promise<void> started;
  auto ready = started.get_future();
  thread_ = std::thread([this, &started] {
    pthread_setname_np(pthread_self(), "dg-tcp-loop");
    trace::setThreadName("dg-tcp-loop");
    threadId_ = std::this_thread::get_id();
    started.set_value();
    run();
  });
  ready.wait();
}

TcpLoop::~TcpLoop() {
  if (inLoop()) {
    // Cannot join ourselves; only reachable when the last owner is released on the loop thread.
    std::fprintf(stderr, "distgrad tcp: loop destroyed on its own thread; detaching it\n");
    thread_.detach();
    return;
  }
  shutdown();
  int rc = uv_loop_close(&loop_);
  if (rc != 0) std::fprintf(stderr, "distgrad tcp: uv_loop_close: %s\n", uvError(rc).c_str());
  ::close(wakeFd_);
}

bool TcpLoop::post(std::function<void()> fn) {
  bool wakeLoop = false;
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !inLoop()) return false;
    // A non-empty queue means a wake-up is already on its way (or the loop runs the queue before it next
    // blocks). So does a task the loop posts to itself outside its prepare phase: the prepare callback
    // runs it before the loop next blocks in poll (Note [Batched hand-offs] in rpc/agent.cpp defers a
    // task per read this way; a wake-up would cost an eventfd write, a poll and a read).
    wakeLoop = tasks_.empty() && wakeOpen_ && !(inLoop() && !inPrepare_);
    tasks_.push_back(std::move(fn));
  }
  // Written after unlocking: on a busy core the write wakes the loop thread, which may preempt us at once
  // and would then block on the mutex we held (two more context switches). The eventfd stays open until
  // the destructor, and our caller holds the loop alive; a write that lands after the wake-up handle
  // closed only leaves the counter set.
  if (wakeLoop) wake();
  return true;
}

void TcpLoop::wake() {
  const uint64_t one = 1;
  // EAGAIN (counter saturated) still leaves the fd readable: the wake-up is not lost.
  while (::write(wakeFd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void TcpLoop::onWakeFromLoop() {
  uint64_t count = 0;
  while (::read(wakeFd_, &count, sizeof(count)) < 0 && errno == EINTR) {
  }
  runTasks();
}

void TcpLoop::runTasks() {
  // Swapped with a vector kept for the purpose, so neither side allocates per batch once warm (a task
  // that re-enters runTasks gets a fresh vector).
  std::vector<std::function<void()>> batch;
  batch.swap(spareTasks_);
  {
    std::lock_guard lock(mutex_);
    if (tasks_.empty()) {
      spareTasks_.swap(batch);
      return;
    }
    batch.swap(tasks_);
  }
  struct Recycle {
    std::vector<std::function<void()>>& batch;
    std::vector<std::function<void()>>& spare;
    ~Recycle() {
      batch.clear();
      if (spare.capacity() < batch.capacity()) spare.swap(batch);
    }
  } recycle{batch, spareTasks_};
  for (auto& task : batch) {
    // One task's exception must neither reach libuv nor skip the tasks after it.
    try {
      task();
    } catch (...) {
      reportCallbackException("a task posted to the tcp loop", "the loop carries on");
    }
  }
}

void TcpLoop::run() {
  uv_run(&loop_, UV_RUN_DEFAULT);
  // After the handles closed, run what the close callbacks posted (send completions, onClosed followers).
  for (;;) {
    bool empty;
    {
      std::lock_guard lock(mutex_);
      empty = tasks_.empty();
    }
    if (empty && !uv_loop_alive(&loop_)) break;
    runTasks();
    uv_run(&loop_, UV_RUN_NOWAIT);
  }
}

void TcpLoop::shutdown() {
  DG_CHECK(!inLoop(), "tcp Context::close() must not be called from its own loop thread (it joins it)");
  {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      // Another caller is shutting down (or has): wait for it by joining below only if still joinable.
    } else {
      stopping_ = true;
      tasks_.push_back([this] { closeAllFromLoop(); });
      wake();
    }
  }
  if (thread_.joinable() && !inLoop()) {
    std::lock_guard lock(joinMutex_);
    if (thread_.joinable()) thread_.join();
  }
}

void TcpLoop::closeAllFromLoop() {
  closing_ = true;
  std::vector<TcpListenerImpl*> listeners(listeners_.begin(), listeners_.end());
  for (auto* listener : listeners) listener->closeFromLoop();
  std::vector<TcpConnection*> connections(connections_.begin(), connections_.end());
  for (auto* connection : connections) connection->closeFromLoop(Error::disconnected("tcp context closed"));
  dirty_.clear();
  {
    std::lock_guard lock(mutex_);
    wakeOpen_ = false;
    uv_close(reinterpret_cast<uv_handle_t*>(&wakePoll_), nullptr);
  }
  uv_close(reinterpret_cast<uv_handle_t*>(&prepare_), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&check_), nullptr);
}

void TcpLoop::markDirtyFromLoop(std::shared_ptr<TcpConnection> connection) {
  dirty_.push_back(std::move(connection));
}

void TcpLoop::flushDirtyFromLoop() {
  while (!dirty_.empty()) {
    // Swapped with a kept vector so that marking connections dirty allocates nothing once warm.
    std::vector<std::shared_ptr<TcpConnection>> dirty;
    dirty.swap(spareDirty_);
    dirty.swap(dirty_);
    struct Recycle {
      std::vector<std::shared_ptr<TcpConnection>>& dirty;
      std::vector<std::shared_ptr<TcpConnection>>& spare;
      ~Recycle() {
        dirty.clear();
        if (spare.capacity() < dirty.capacity()) spare.swap(dirty);
      }
    } recycle{dirty, spareDirty_};
    for (auto& connection : dirty) {
      try {
        connection->flushFromLoop();
      } catch (...) {
        std::string message =
            reportCallbackException("flushing the tcp connection to " + connection->peerAddress(), "closing it");
        connection->closeFromLoop(Error::failed(message));
      }
    }
  }
}

bool splitHostPort(const std::string& address, std::string& host, int& port) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 >= address.size()) return false;
  host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host.erase(host.size() - 1);
    host.erase(0, 1);
  }
  if (host.empty()) return false;
  long value = 0;
  for (size_t i = colon + 1; i < address.size(); ++i) {
    char c = address[i];
    if (c < '0' || c > '9') return false;
    value = value * 10 + (c - '0');
    if (value > 65535) return false;
  }
  port = static_cast<int>(value);
  return true;
}

std::string formatAddress(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (address->sa_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(address);
    uv_ip4_name(v4, text, sizeof(text));
    return std::string(text) + ":" + std::to_string(ntohs(v4->sin_port));
  }
  if (address->sa_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(address);
    uv_ip6_name(v6, text, sizeof(text));
    std::string out = "[";  // appended piecewise: GCC 12 flags a bogus -Wrestrict on the + chain
    out.append(text);
    out.append("]:");
    out.append(std::to_string(ntohs(v6->sin6_port)));
    return out;
  }
  return "<unknown address family>";
}

namespace {

// libuv writes with write()/writev(), which raise SIGPIPE on a connection whose peer has gone; its default
// action kills the whole process, so a dead peer would kill us instead of closing one connection (seen: a
// test process died of SIGPIPE after its peer was killed). As libuv's documentation advises, ignore it,
// once, and only where the program left the default action (a handler of its own stays).
void ignoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  });
}

}  // namespace

TcpContext::TcpContext(const ContextOptions& options)
    : LoopContext("tcp", std::make_shared<TcpLoop>(options), options.limits) {
  ignoreSigpipeOnce();
}

Result<std::unique_ptr<Listener>> TcpContext::listen(const std::string& address, AcceptCallback onAccept) {
  return listenOnLoop<TcpListenerImpl>(address, std::move(onAccept));
}

namespace {

struct ConnectRequest {
  uv_connect_t req{};
  std::shared_ptr<TcpConnection> connection;
  std::string address;
  ConnectCallback done;
};

struct ResolveRequest {
  uv_getaddrinfo_t req{};
  std::shared_ptr<TcpLoop> loop;
  std::string address;
  int port = 0;
  ConnectCallback done;
};

void startConnect(const std::shared_ptr<TcpLoop>& loop, const sockaddr* target, const std::string& address,
                  ConnectCallback done) {
  if (loop->closingFromLoop()) {
    done(Error::disconnected("tcp connect to " + address + ": the context is closed"));
    return;
  }
  auto connection = std::make_shared<TcpConnection>(loop, address);
  connection->initFromLoop();
  auto request = std::make_unique<ConnectRequest>();
  request->connection = connection;
  request->address = address;
  request->done = std::move(done);
  request->req.data = request.get();
  int rc = uv_tcp_connect(&request->req, connection->handleFromLoop(), target, [](uv_connect_t* req, int status) {
    std::unique_ptr<ConnectRequest> request(static_cast<ConnectRequest*>(req->data));
    if (status < 0) {
      Error error = Error::disconnected("tcp connect to " + request->address + " failed: " + uvError(status));
      request->connection->closeFromLoop(error);
      try {
        request->done(error);
      } catch (...) {
        reportCallbackException("the connect callback for " + request->address, "ignored");
      }
      return;
    }
    request->connection->connectedFromLoop();
    try {
      request->done(std::shared_ptr<Connection>(request->connection));
    } catch (...) {
      std::string message =
          reportCallbackException("the connect callback for " + request->address, "closing the new connection");
      request->connection->closeFromLoop(Error::failed(message));
    }
  });
  if (rc < 0) {
    Error error = Error::disconnected("tcp connect to " + address + " failed: " + uvError(rc));
    connection->closeFromLoop(error);
    request->done(error);
    return;
  }
  (void)request.release();  // owned by the callback now
}

}  // namespace

void TcpContext::connect(const std::string& address, ConnectCallback done) {
  auto loop = loop_;
  auto task = [loop, address, done]() mutable {
    std::string host;
    int port = 0;
    if (!splitHostPort(address, host, port)) {
      done(Error::failed("tcp connect: malformed address '" + address + "', expected host:port"));
      return;
    }
    sockaddr_storage storage{};
    if (uv_ip4_addr(host.c_str(), port, reinterpret_cast<sockaddr_in*>(&storage)) == 0 ||
        uv_ip6_addr(host.c_str(), port, reinterpret_cast<sockaddr_in6*>(&storage)) == 0) {
      startConnect(loop, reinterpret_cast<sockaddr*>(&storage), address, std::move(done));
      return;
    }
    // A host name: resolve on libuv's thread pool, then connect to the first address.
    auto request = std::make_unique<ResolveRequest>();
    request->loop = loop;
    request->address = address;
    request->port = port;
    request->done = std::move(done);
    request->req.data = request.get();
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = uv_getaddrinfo(loop->uvLoop(), &request->req,
                            [](uv_getaddrinfo_t* req, int status, addrinfo* result) {
                              std::unique_ptr<ResolveRequest> request(static_cast<ResolveRequest*>(req->data));
                              try {
                                if (status < 0 || result == nullptr) {
                                  request->done(Error::disconnected("tcp connect: cannot resolve " + request->address +
                                                                    ": " + uvError(status)));
                                  if (result) uv_freeaddrinfo(result);
                                  return;
                                }
                                sockaddr_storage target{};
                                std::memcpy(&target, result->ai_addr, result->ai_addrlen);
                                uv_freeaddrinfo(result);
                                auto* port = target.ss_family == AF_INET
                                                 ? &reinterpret_cast<sockaddr_in*>(&target)->sin_port
                                                 : &reinterpret_cast<sockaddr_in6*>(&target)->sin6_port;
                                *port = htons(static_cast<uint16_t>(request->port));
                                startConnect(request->loop, reinterpret_cast<sockaddr*>(&target), request->address,
                                             std::move(request->done));
                              } catch (...) {
                                reportCallbackException("resolving " + request->address + " to connect", "ignored");
                              }
                            },
                            host.c_str(), nullptr, &hints);
    if (rc < 0) {
      request->done(Error::disconnected("tcp connect: cannot resolve " + address + ": " + uvError(rc)));
      return;
    }
    (void)request.release();
  };
  if (!loop_->post(std::move(task))) {
    done(Error::disconnected("tcp connect to " + address + ": the context is closed"));
  }
}

std::unique_ptr<Context> createTcpContext(const ContextOptions& options) {
  return std::make_unique<TcpContext>(options);
}

}  // namespace distgrad::rpc::transport::tcp
