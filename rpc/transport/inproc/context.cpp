#include "rpc/transport/inproc/context.h"

#include <pthread.h>

#include <cstdio>

#include "rpc/transport/inproc/connection.h"
#include "rpc/transport/inproc/listener.h"
#include "rpc/trace.h"

namespace distgrad::rpc::transport::inproc {

InprocLoop::InprocLoop() {
  // threadId_ is written before any task can run, so inLoop() never races with the thread's start.
  std::mutex started;
  std::unique_lock lock(started);
  std::condition_variable ready;
  bool ok = false;
  thread_ = std::thread([this, &started, &ready, &ok] {
    pthread_setname_np(pthread_self(), "dg-inproc-loop");
    trace::setThreadName("dg-inproc-loop");
    {
      std::lock_guard inner(started);
      threadId_ = std::this_thread::get_id();
      ok = true;
      // Notified under the lock: once the constructor sees `ok` it returns and `ready` (on its stack) dies,
      // so notifying after unlocking could touch a destroyed condition variable (found by TSan).
      ready.notify_one();
    }
    run();
  });
  ready.wait(lock, [&] { return ok; });
}

InprocLoop::~InprocLoop() {
  if (thread_.joinable()) {
    // Only reachable when the Context was never closed and the loop is released elsewhere.
    if (std::this_thread::get_id() == threadId_) {
      thread_.detach();
    } else {
      shutdown();
    }
  }
}

bool InprocLoop::post(std::function<void()> fn) {
  {
    std::lock_guard lock(mutex_);
    // While stopping, the loop thread itself may still post: the final drain runs those tasks too.
    if (stopping_ && !inLoop()) return false;
    tasks_.push_back(std::move(fn));
  }
  wake_.notify_one();
  return true;
}

void InprocLoop::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return !tasks_.empty() || stopping_; });
      if (tasks_.empty()) return;  // stopping_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    // A task (frame, close or send callback) that throws must not end the loop thread (std::terminate):
    // log and carry on. Frame handlers are also guarded per connection (InprocConnection::deliverFromLoop).
    try {
      task();
    } catch (...) {
      reportCallbackException("a task on the inproc loop", "the loop carries on");
    }
  }
}

bool InprocLoop::track(const std::shared_ptr<InprocConnection>& connection) {
  std::lock_guard lock(mutex_);
  if (stopping_) return false;
  std::erase_if(connections_, [](const auto& w) { return w.expired(); });
  connections_.push_back(connection);
  return true;
}

bool InprocLoop::track(const std::shared_ptr<InprocListener>& listener) {
  std::lock_guard lock(mutex_);
  if (stopping_) return false;
  std::erase_if(listeners_, [](const auto& w) { return w.expired(); });
  listeners_.push_back(listener);
  return true;
}

void InprocLoop::shutdown() {
  DG_CHECK(!inLoop(), "inproc Context::close() must not be called from its own loop thread (it joins it)");
  {
    std::lock_guard lock(mutex_);
    if (stopping_ || !thread_.joinable()) return;
    // The final task runs after everything queued so far; tasks it posts from the loop thread still run.
    tasks_.push_back([this] {
      std::vector<std::weak_ptr<InprocConnection>> connections;
      std::vector<std::weak_ptr<InprocListener>> listeners;
      {
        std::lock_guard inner(mutex_);
        connections.swap(connections_);
        listeners.swap(listeners_);
      }
      for (auto& weak : listeners) {
        if (auto l = weak.lock()) l->close();
      }
      for (auto& weak : connections) {
        if (auto c = weak.lock()) c->closeFromLoop(Error::disconnected("inproc context closed"));
      }
    });
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

Result<void> InprocHub::add(const std::string& name, const std::shared_ptr<InprocListener>& listener) {
  std::lock_guard lock(mutex_);
  auto it = listeners_.find(name);
  if (it != listeners_.end() && !it->second.expired()) {
    return Error::failed("inproc address '" + name + "' is already in use");
  }
  listeners_[name] = listener;
  return {};
}

void InprocHub::remove(const std::string& name, const InprocListener* listener) {
  std::lock_guard lock(mutex_);
  auto it = listeners_.find(name);
  if (it == listeners_.end()) return;
  auto current = it->second.lock();
  if (!current || current.get() == listener) listeners_.erase(it);
}

std::shared_ptr<InprocListener> InprocHub::find(const std::string& name) {
  std::lock_guard lock(mutex_);
  auto it = listeners_.find(name);
  return it == listeners_.end() ? nullptr : it->second.lock();
}

InprocContext::InprocContext(std::shared_ptr<InprocHub> hub, const ContextOptions& options)
    : LoopContext("inproc", std::make_shared<InprocLoop>(), options.limits), hub_(std::move(hub)) {
  DG_CHECK(hub_ != nullptr, "createInprocContext: hub must not be null");
}

Result<std::unique_ptr<Listener>> InprocContext::listen(const std::string& address, AcceptCallback onAccept) {
  if (address.empty()) return Error::failed("inproc listen: the address (a name) must not be empty");
  if (!onAccept) return Error::failed("inproc listen: onAccept must be set");
  if (closeCalled()) return Error::failed("inproc listen on '" + address + "': the context is closed");
  auto listener = std::make_shared<InprocListener>(address, hub_, loop_, limits(), std::move(onAccept));
  auto added = hub_->add(address, listener);
  if (!added.ok()) return added.error();
  if (!loop_->track(listener)) {
    hub_->remove(address, listener.get());
    return Error::failed("inproc listen on '" + address + "': the context is closed");
  }
  return std::unique_ptr<Listener>(std::make_unique<ListenerHandle<InprocListener>>(std::move(listener)));
}

void InprocContext::connect(const std::string& address, ConnectCallback done) {
  auto fail = [&](Error error) {
    auto shared = std::make_shared<Error>(std::move(error));
    if (!loop_->post([done, shared] { done(*shared); })) done(*shared);
  };
  auto listener = hub_->find(address);
  if (!listener || listener->closed()) {
    fail(Error::disconnected("inproc connect: no listener named '" + address + "'"));
    return;
  }
  std::string clientName = "inproc-client-" + std::to_string(hub_->nextClientId());
  auto client = std::make_shared<InprocConnection>(loop_, limits(), clientName, address);
  auto server = std::make_shared<InprocConnection>(listener->loop(), listener->limits(), address, clientName);
  InprocConnection::pair(client, server);
  if (!loop_->track(client)) {
    fail(Error::disconnected("inproc connect to '" + address + "': the context is closed"));
    server->close();
    return;
  }
  listener->acceptFromAnyThread(server);
  if (!loop_->post([done, client] { done(std::shared_ptr<Connection>(client)); })) {
    client->close();
    done(Error::disconnected("inproc connect to '" + address + "': the context is closed"));
  }
}

std::unique_ptr<Context> createInprocContext(std::shared_ptr<InprocHub> hub, const ContextOptions& options) {
  return std::make_unique<InprocContext>(std::move(hub), options);
}

}  // namespace distgrad::rpc::transport::inproc
