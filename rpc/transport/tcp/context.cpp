#include "rpc/transport/tcp/context.h"

#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>
#include <sys/epoll.h>
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
  // Note [Waiting reader] in connection.cpp: the loop thread blocks on its own epoll set, which holds the
  // connections' sockets (data.ptr: the connection), the wake-up eventfd (&wakeFd_) and libuv's backend fd
  // (null).
  readSetFd_ = ::epoll_create1(EPOLL_CLOEXEC);
  DG_CHECK(readSetFd_ >= 0, "tcp transport: epoll_create1 failed: ", std::strerror(errno));
  for (auto [fd, tag] : {std::pair<int, void*>{uv_backend_fd(&loop_), nullptr}, {wakeFd_, &wakeFd_}}) {
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.ptr = tag;
    rc = ::epoll_ctl(readSetFd_, EPOLL_CTL_ADD, fd, &event);
    DG_CHECK(rc == 0, "tcp transport: epoll_ctl(ADD) failed: ", std::strerror(errno));
  }
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
  ::close(readSetFd_);
}

bool TcpLoop::post(std::function<void()> fn) {
  bool wakeLoop = false;
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !inLoop()) return false;
    // A non-empty queue means a wake-up is already on its way (or the loop runs the queue before it next
    // blocks). So does a task the loop posts to itself: run() runs the queue before it blocks (Note
    // [Batched hand-offs] in rpc/agent.cpp defers a task per read this way; a wake-up would cost an
    // eventfd write, a poll and a read).
    wakeLoop = tasks_.empty() && !inLoop();
    tasks_.push_back(std::move(fn));
  }
  // Written after unlocking: on a busy core the write wakes the loop thread, which may preempt us at once
  // and would then block on the mutex we held (two more context switches). The eventfd stays open until
  // the destructor, and our caller holds the loop alive.
  if (wakeLoop) wake();
  return true;
}

void TcpLoop::wake() {
  const uint64_t one = 1;
  // EAGAIN (counter saturated) still leaves the fd readable: the wake-up is not lost.
  while (::write(wakeFd_, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
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
  // Note [Waiting reader] (connection.cpp): libuv is embedded (uv_backend_fd, uv_backend_timeout,
  // UV_RUN_NOWAIT) rather than run, so that this thread blocks on the read set, where readable sockets are
  // reported directly and a waiting reader can take its socket out. libuv runs its phases when its backend
  // fd is readable (listeners, connects, writes waiting for room) or it has work due (timers, close
  // callbacks, write completions: a timeout of 0); a wake-up by sockets or posted tasks costs no libuv poll.
  epoll_event events[64];
  for (;;) {
    // What was posted or queued since the last pass goes out before the loop blocks.
    runTasks();
    flushDirtyFromLoop();
    bool empty;
    {
      std::lock_guard lock(mutex_);
      empty = tasks_.empty();
    }
    const bool alive = uv_loop_alive(&loop_);
    // After closeAllFromLoop: once every handle closed and what their callbacks posted ran.
    if (closing_ && empty && !alive) break;
    const int timeout = !empty ? 0 : alive ? uv_backend_timeout(&loop_) : -1;
    const int count = ::epoll_wait(readSetFd_, events, 64, timeout);
    if (count < 0) {
      DG_CHECK(errno == EINTR, "tcp transport: epoll_wait failed: ", std::strerror(errno));
      continue;
    }
    bool runLibuv = alive && (timeout == 0 || count == 0);  // work due, or a libuv timer expired
    for (int i = 0; i < count; ++i) {
      void* tag = events[i].data.ptr;
      if (tag == nullptr) {
        runLibuv = true;
        continue;
      }
      if (tag == &wakeFd_) {
        uint64_t posted = 0;
        while (::read(wakeFd_, &posted, sizeof(posted)) < 0 && errno == EINTR) {
        }
        continue;  // the tasks run at the top of the next pass
      }
      auto* connection = static_cast<TcpConnection*>(tag);
      // A connection closed by an earlier one's frame handler left the set (closeFromLoop); its object lives
      // until its handle's close callback, which runs inside uv_run. Checked anyway: cheap, and safe.
      if (connections_.count(connection) != 0) connection->readReadyFromLoop();
    }
    // What the frames just read queued (replies of inline handlers, a refusal's last words) is written now,
    // before any task posted meanwhile runs: a task that closes the connection (an agent giving up on its
    // start) must not drop those frames.
    flushDirtyFromLoop();
    if (runLibuv) {
      uv_run(&loop_, UV_RUN_NOWAIT);
      flushDirtyFromLoop();  // the same for what libuv's callbacks (accepts, connects, completions) queued
    }
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
}

void TcpLoop::watchReads(TcpConnection* connection, int fd) {
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.ptr = connection;
  // Fails only for an fd that is not open (a bug: a connection watches its socket only while it is open).
  int rc = ::epoll_ctl(readSetFd_, EPOLL_CTL_ADD, fd, &event);
  DG_CHECK(rc == 0 || errno == EEXIST, "tcp transport: epoll_ctl(ADD) of a socket failed: ", std::strerror(errno));
}

namespace {
void modifyReads(int readSetFd, TcpConnection* connection, int fd, uint32_t events) {
  epoll_event event{};
  event.events = events;
  event.data.ptr = connection;
  // Fails only for an fd that is not in the set (a bug: a connection pauses and resumes its socket only
  // between watchReads and unwatchReads, under its reader lock).
  int rc = ::epoll_ctl(readSetFd, EPOLL_CTL_MOD, fd, &event);
  DG_CHECK(rc == 0, "tcp transport: epoll_ctl(MOD) of a socket failed: ", std::strerror(errno));
}
}  // namespace

void TcpLoop::pauseReads(TcpConnection* connection, int fd) {
  // No EPOLLIN; the kernel always adds EPOLLHUP and EPOLLERR, which EPOLLONESHOT reports once (the loop
  // skips the socket while its reader holds it, and resumeReads re-arms what is still pending).
  modifyReads(readSetFd_, connection, fd, EPOLLONESHOT);
}

void TcpLoop::resumeReads(TcpConnection* connection, int fd) { modifyReads(readSetFd_, connection, fd, EPOLLIN); }

void TcpLoop::unwatchReads(int fd) {
  // Closing: nothing to do about a failure (the fd is closed next, which drops it from the set anyway).
  (void)::epoll_ctl(readSetFd_, EPOLL_CTL_DEL, fd, nullptr);
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
