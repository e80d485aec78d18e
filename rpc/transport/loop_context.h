// LoopContext: what every transport Context shares (inproc, tcp, ucx): a name, one loop that runs every
// callback, defer() onto it, close() that shuts the loop down and joins its thread (also run by the
// destructor, except on the loop thread itself, which cannot join itself), the frame limits, and for the
// transports whose listeners open on the loop (tcp, ucx) listen() itself. ListenerHandle is the Listener
// that listen() returns for all three: it owns the transport's listener object and closes it when
// destroyed. runOnLoop is the "act now when already on the loop, else post" step of every public method.
//
// What Loop provides: post(fn) (false once shutdown began, unless called on the loop thread), inLoop() (may
// this thread act as the loop now), onLoopThread() (is this the loop's own thread: Context::inLoop; they
// differ only for ucx, whose waiting threads may drive its worker, Note [Driving threads]) and
// shutdown() (closes everything on the loop, joins its thread; idempotent; not on the loop thread).
//
// Thread-safety: every method may be called from any thread, except close() (and so the destructor) from
// the loop thread.
#pragma once

#include <atomic>
#include <cstdio>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>

#include "rpc/transport/transport.h"

namespace distgrad::rpc::transport {

// Runs fn at once when called on `loop`'s thread, else posts it there. False when the loop refused it (the
// context is closed).
template <class Loop, class Fn>
bool runOnLoop(Loop& loop, Fn&& fn) {
  if (loop.inLoop()) {
    fn();
    return true;
  }
  return loop.post(std::forward<Fn>(fn));
}

// The Listener listen() returns: closing or destroying it closes `Impl` (which has address() and close(),
// both callable from any thread).
template <class Impl>
class ListenerHandle final : public Listener {
 public:
  explicit ListenerHandle(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  ~ListenerHandle() override { impl_->close(); }
  std::string address() const override { return impl_->address(); }
  void close() override { impl_->close(); }

 private:
  std::shared_ptr<Impl> impl_;
};

template <class Loop>
class LoopContext : public Context {
 public:
  ~LoopContext() override {
    if (loop_->inLoop()) {
      std::fprintf(stderr, "distgrad %s: Context destroyed on its own loop thread; not joining it\n", name_.c_str());
      return;
    }
    close();
  }

  const std::string& name() const final { return name_; }
  void defer(std::function<void()> fn) final {
    DG_CHECK(loop_->post(std::move(fn)), name_, " Context::defer after close()");
  }
  bool inLoop() const final { return loop_->onLoopThread(); }
  void close() final {
    closed_.store(true);
    loop_->shutdown();
  }
  const FrameLimits& limits() const final { return limits_; }

 protected:
  LoopContext(std::string name, std::shared_ptr<Loop> loop, const FrameLimits& limits)
      : name_(std::move(name)), loop_(std::move(loop)), limits_(limits) {}

  // Whether close() was called (from any thread).
  bool closeCalled() const { return closed_.load(); }

  // listen() for transports whose listener opens on the loop: Impl(loop_, onAccept), then
  // Impl::openFromLoop(address) on the loop (this thread waits for it), wrapped in a ListenerHandle.
  template <class Impl>
  Result<std::unique_ptr<Listener>> listenOnLoop(const std::string& address, AcceptCallback onAccept) {
    if (!onAccept) return Error::failed(name_ + " listen: onAccept must be set");
    auto impl = std::make_shared<Impl>(loop_, std::move(onAccept));
    if (loop_->inLoop()) {
      auto opened = impl->openFromLoop(address);
      if (!opened.ok()) return opened.error();
    } else {
      std::promise<Result<void>> promise;
      auto future = promise.get_future();
      if (!loop_->post([&] { promise.set_value(impl->openFromLoop(address)); })) {
        return Error::failed(name_ + " listen on '" + address + "': the context is closed");
      }
      auto opened = future.get();
      if (!opened.ok()) return opened.error();
    }
    return std::unique_ptr<Listener>(std::make_unique<ListenerHandle<Impl>>(std::move(impl)));
  }

  const std::string name_;
  std::shared_ptr<Loop> loop_;

 private:
  FrameLimits limits_;
  std::atomic<bool> closed_{false};
};

}  // namespace distgrad::rpc::transport
