// Future<T> / Promise<T>: the single asynchronous result type of the RPC layer.
//
// A Promise<T> is the producer side, a Future<T> the consumer side of one shared state; both are
// move-only and T may be void. The state completes exactly once, with a value or an Error (kinds in
// rpc/error.h). Consuming a result:
//   - get() blocks and returns T or throws RpcError; result() blocks and returns Result<T>; both consume
//     the future (valid() is false afterwards), like std::future.
//   - wait() / wait(timeout) block without consuming; isReady() never blocks.
//   - then(f) consumes the future and returns Future<U>. f takes Result<T> (it then sees errors), or T
//     (or nothing, for void) in which case an Error skips f and propagates. f may return U, Result<U>,
//     Future<U> (flattened: the returned future completes when the inner one does) or void. An exception
//     escaping f becomes the Error of the returned future (errorFromException).
//   - co_await future inside a coroutine (any coroutine; Future<T>-returning ones are supported natively,
//     see below) yields T or throws RpcError; co_await std::move(future).asResult() yields Result<T>.
//
// Note [Continuations never run inline]: a continuation registered with then() never runs inside the
// call that registered it, nor inside the setValue()/setError() that completed the state: it is posted to
// the Executor the future is bound to (the Promise's executor; via() rebinds). So a producer may complete
// a promise while holding its own locks, and then() on a ready future returns before f runs. The one
// exception is then(kInlineSafe, f): f is trusted to be short and thread-agnostic (forwarding a result,
// bumping a counter) and runs on whichever thread completes the state, or inside then() if it already has.
// then() on a ready future, called on a worker of its executor, and a completion in the tail of a posted
// continuation (after its function returned) queue f to run after the current task on that worker, without
// waking another (Note [Following the task] in rpc/executor.cpp).
// Even inline-safe callbacks are posted once kMaxInlineDepth of them are nested on one thread, so long
// forwarding chains cannot overflow the stack.
//
// Note [Continuations here]: a producer that holds no lock, running on a worker of the executor its
// consumers are bound to, may complete promises inside a ContinuationsHere scope: while it lives,
// continuations bound to that executor run on this thread at once (nested up to kMaxInlineDepth), as do
// the ones they complete in turn, instead of being posted. A post hands the result to another worker: a
// wake-up, and on a core busy with compute a wait of up to a time slice before that worker runs (a
// pipeline stage's output reached the next stage 3 ms late that way). Continuations run here must not
// block on what the producer would do next.
//
// Note [Broken promises]: destroying a Promise that was never completed completes it with a kFailed
// "broken promise" error, so a dropped producer fails its waiters instead of hanging them.
//
// Note [Refused continuations]: if the bound executor refuses a continuation or a coroutine resumption
// (it was shut down), the continuation is not dropped: as a last resort it runs inline on the thread that
// completed the state (or in then(), if the state was already complete), and the first such fallbacks are
// reported on stderr. Side effects a continuation owes someone (a flag, a condition variable, another
// promise) thus still happen, and no waiter hangs. Binding a future to an executor that is shut down before
// the future completes is still a lifetime bug of the caller; this only keeps it from becoming a hang.
//
// Coroutines: a function returning Future<T> may be a coroutine (co_await / co_return). It starts running
// at once in the caller's thread (unless that thread's stack is already deep, Note [Eager coroutine
// start]) and, at its first suspension, returns its future. Its executor (where it
// resumes after every co_await that has to wait, and where its future's continuations run) is the first
// Executor& or Executor* parameter, else the executor whose worker is calling it (Executor::current());
// calling one from another thread without an executor parameter throws ValueError. co_await on a future
// that is already ready continues without suspending. An exception escaping the coroutine completes its
// future with errorFromException(...) (an RpcError keeps its Error). Nothing blocks a thread while a
// coroutine waits, so a 2-thread pool handles any depth of nested awaits.
//
// Blocking in get()/wait() on an executor thread for work that needs that executor can deadlock a small
// pool: handlers await instead.
//
// Thread-safety: a Promise and its Future may live on different threads. One Promise or one Future object
// must not be used by two threads at once. The bound Executor must outlive the state.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "rpc/detail/move_only_function.h"
#include "rpc/error.h"
#include "rpc/executor.h"
#include "tensor/error.h"

namespace distgrad::rpc {

template <typename T>
class Future;
template <typename T>
class Promise;
template <typename T>
Future<std::vector<Result<T>>> whenAll(std::vector<Future<T>> futures, Executor* executor = nullptr);

// Tag for then(): the continuation may run inline on the completing thread (see the note above).
struct InlineSafe {
  explicit InlineSafe() = default;
};
inline constexpr InlineSafe kInlineSafe{};

// Note [Continuations here]: while one lives on this thread, continuations bound to the executor whose
// worker this thread is run here when a promise completes, instead of being posted.
class ContinuationsHere {
 public:
  ContinuationsHere();
  ~ContinuationsHere();
  ContinuationsHere(const ContinuationsHere&) = delete;
  ContinuationsHere& operator=(const ContinuationsHere&) = delete;

 private:
  bool previous_;
};

// The Error for an exception caught in a continuation or coroutine: an RpcError keeps its Error; any
// other exception becomes kFailed with its what() as message and its demangled type in remoteType.
Error errorFromException(std::exception_ptr exception);
// The Error a destroyed, never-completed Promise leaves behind (Note [Broken promises]).
Error brokenPromiseError();

namespace detail {

inline constexpr int kMaxInlineDepth = 16;
// Per-thread nesting of inline-safe callbacks. enterInline() returns false (and changes nothing) once
// kMaxInlineDepth callbacks are nested; otherwise the caller must call leaveInline() afterwards.
bool enterInline();
void leaveInline();
// Note [Continuations here]: true while a ContinuationsHere scope lives on this thread.
bool continuationsHere();
// Note [Inline handlers] (rpc/agent.cpp): while a ForbidBlockingScope lives on this thread (an inline
// handler on a transport's loop thread), a blocking wait for a future that is not ready throws RpcError
// (kFailed) instead of stalling the loop that may be the one to complete it.
class ForbidBlockingScope {
 public:
  ForbidBlockingScope();
  ~ForbidBlockingScope();
  ForbidBlockingScope(const ForbidBlockingScope&) = delete;
  ForbidBlockingScope& operator=(const ForbidBlockingScope&) = delete;

 private:
  bool previous_;
};
// Throws the RpcError above when blocking is forbidden on this thread.
void checkMayBlock();
// Note [Following the task] (rpc/executor.cpp): true while this thread runs a posted continuation past
// its user function's return (completing then()'s future, and the inline-safe callbacks that runs): the
// task ends right after, so continuations dispatched now may follow it on this worker.
bool inTaskTail();
// Sets inTaskTail() to `tail` for its lifetime (restored after).
class TaskTailScope {
 public:
  explicit TaskTailScope(bool tail);
  ~TaskTailScope();
  TaskTailScope(const TaskTailScope&) = delete;
  TaskTailScope& operator=(const TaskTailScope&) = delete;

 private:
  bool previous_;
};
// Note [Eager coroutine start].
inline constexpr size_t kEagerStackBudget = 256 * 1024;
bool eagerStartAllowed();
// Reports (the first few times) a continuation run inline because its executor refused it
// (Note [Refused continuations]).
void reportRefusedContinuation();

template <typename T>
class FutureState : public std::enable_shared_from_this<FutureState<T>> {
 public:
  using Callback = MoveOnlyFunction<void(Result<T>&&)>;

  explicit FutureState(Executor* executor) : executor_(executor) {}

  // Returns false if already completed (the result is then dropped).
  bool complete(Result<T>&& result) {
    // Once the lock is released a waiter may return from get() and destroy the Promise it shares with us
    // (e.g. a Promise owned by the waiting thread, completed by reference on a worker): keep the state
    // alive until the notify and dispatch below are done (TSan found the notify on a destroyed state).
    std::shared_ptr<FutureState> keepAlive = this->shared_from_this();
    Callback callback;
    bool inlineSafe = false;
    Executor* executor = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (ready_.load(std::memory_order_relaxed)) return false;
      result_.emplace(std::move(result));
      ready_.store(true, std::memory_order_release);
      callback = std::move(callback_);
      inlineSafe = callbackInlineSafe_;
      executor = executor_;
    }
    // Notified after unlocking so a blocked get() does not wake into our held mutex (keepAlive holds it).
    completed_.notify_all();
    if (callback) dispatch(std::move(callback), inlineSafe, executor, /*followTask=*/inTaskTail());
    return true;
  }

  // Registers the one continuation. It receives the result exactly once (Note [Continuations never run
  // inline]); if it is dropped unrun (executor shut down), its destructor runs instead.
  void setCallback(Callback callback, bool inlineSafe) {
    Executor* executor = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      DG_ASSERT(!hasCallback_, "a future state got a second continuation");
      hasCallback_ = true;
      if (!ready_.load(std::memory_order_relaxed)) {
        callback_ = std::move(callback);
        callbackInlineSafe_ = inlineSafe;
        return;
      }
      executor = executor_;
    }
    dispatch(std::move(callback), inlineSafe, executor, /*followTask=*/true);
  }

  bool isReady() const { return ready_.load(std::memory_order_acquire); }

  void wait() {
    if (!isReady()) checkMayBlock();
    std::unique_lock<std::mutex> lock(mutex_);
    completed_.wait(lock, [&] { return ready_.load(std::memory_order_relaxed); });
  }
  template <typename Rep, typename Period>
  bool waitFor(std::chrono::duration<Rep, Period> timeout) {
    if (!isReady()) checkMayBlock();
    std::unique_lock<std::mutex> lock(mutex_);
    return completed_.wait_for(lock, timeout, [&] { return ready_.load(std::memory_order_relaxed); });
  }

  // Blocks, then moves the result out. Only the single consumer calls this, once.
  Result<T> take() {
    wait();
    std::lock_guard<std::mutex> lock(mutex_);
    DG_ASSERT(!hasCallback_, "a future's result taken twice");
    hasCallback_ = true;
    return std::move(*result_);
  }

  Executor* executor() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return executor_;
  }
  void setExecutor(Executor* executor) {
    std::lock_guard<std::mutex> lock(mutex_);
    DG_ASSERT(!hasCallback_, "via() after the future was consumed");
    executor_ = executor;
  }

 private:
  // followTask: then() on a ready future, or a completion in a task's tail: the continuation follows the
  // current task on this worker (Note [Following the task] in rpc/executor.cpp).
  void dispatch(Callback callback, bool inlineSafe, Executor* executor, bool followTask = false) {
    const bool here = inlineSafe || (continuationsHere() && executor != nullptr && executor->isCurrentThread());
    if (here && enterInline()) {
      struct Leave {
        ~Leave() { leaveInline(); }
      } leave;
      callback(takeCompleted());
      return;
    }
    // The callback waits in the state so the posted closure is one shared_ptr (stored in place, no
    // allocation per continuation).
    {
      std::lock_guard<std::mutex> lock(mutex_);
      callback_ = std::move(callback);
    }
    Task task([self = this->shared_from_this()] {
      TaskTailScope top(true);  // the top of a task: runContinuation clears it while the user's function runs
      self->runPostedCallback();
    });
    if (!(followTask ? executor->postAfterTask(std::move(task)) : executor->post(std::move(task)))) {
      // Refused (the executor shut down): run it here rather than drop it (Note [Refused continuations]).
      // `this` is alive: the caller (a Promise completing it, or then()) holds a reference.
      reportRefusedContinuation();
      runPostedCallback();
    }
  }

  void runPostedCallback() {
    Callback callback;
    Result<T> result = [&] {
      std::lock_guard<std::mutex> lock(mutex_);
      callback = std::move(callback_);
      return std::move(*result_);
    }();
    callback(std::move(result));
  }

  // The result after completion, for the continuation (the only reader once a callback is registered).
  Result<T> takeCompleted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(*result_);
  }

  mutable std::mutex mutex_;
  std::condition_variable completed_;
  std::atomic<bool> ready_{false};
  std::optional<Result<T>> result_;  // GUARDED_BY(mutex_)
  Callback callback_;                // GUARDED_BY(mutex_)
  bool callbackInlineSafe_ = false;  // GUARDED_BY(mutex_)
  bool hasCallback_ = false;         // GUARDED_BY(mutex_): consumed by then(), co_await, get() or result()
  Executor* executor_;               // GUARDED_BY(mutex_)
};

template <typename X>
struct IsFuture : std::false_type {};
template <typename X>
struct IsFuture<Future<X>> : std::true_type {
  using Value = X;
};
template <typename X>
struct IsResult : std::false_type {};
template <typename X>
struct IsResult<Result<X>> : std::true_type {
  using Value = X;
};

// What a continuation f returns, given the upstream value type T.
template <typename T, typename F>
auto continuationReturn() {
  if constexpr (std::is_invocable_v<F&, Result<T>&&>) {
    return std::type_identity<std::invoke_result_t<F&, Result<T>&&>>{};
  } else if constexpr (std::is_void_v<T>) {
    static_assert(std::is_invocable_v<F&>, "then(f) on Future<void>: f must take () or Result<void>");
    return std::type_identity<std::invoke_result_t<F&>>{};
  } else {
    static_assert(std::is_invocable_v<F&, T&&>, "then(f) on Future<T>: f must take T or Result<T>");
    return std::type_identity<std::invoke_result_t<F&, T&&>>{};
  }
}
template <typename T, typename F>
using ContinuationReturn = std::remove_cvref_t<typename decltype(continuationReturn<T, F>())::type>;

// The value type of the future then() returns for a continuation returning R.
template <typename R>
auto unwrapValue() {
  if constexpr (IsFuture<R>::value) {
    return std::type_identity<typename IsFuture<R>::Value>{};
  } else if constexpr (IsResult<R>::value) {
    return std::type_identity<typename IsResult<R>::Value>{};
  } else {
    return std::type_identity<R>{};
  }
}
template <typename R>
using UnwrapValue = typename decltype(unwrapValue<R>())::type;

template <typename U>
void forwardInto(Future<U>&& inner, Promise<U>&& promise);

// Calls `call` and completes `promise` with what it returns (a value, a Result, a Future to forward).
// `call`, the user's function, is not a task's tail unless it is inline-safe (short by contract); what
// follows its return is, if the caller was (Note [Following the task] in rpc/executor.cpp).
template <typename U, typename Call>
void deliver(Promise<U>& promise, Call&& call, bool inlineSafe) {
  using R = std::invoke_result_t<Call&>;
  auto user = [&] {
    TaskTailScope body(inlineSafe && inTaskTail());
    return call();
  };
  if constexpr (std::is_void_v<R>) {
    user();
    promise.setValue();
  } else if constexpr (IsFuture<R>::value) {
    forwardInto(user(), std::move(promise));
  } else if constexpr (IsResult<R>::value) {
    promise.setResult(user());
  } else {
    promise.setValue(user());
  }
}

template <typename T, typename F, typename U>
void runContinuation(F& f, Result<T>&& result, Promise<U>& promise, bool inlineSafe) {
  try {
    if constexpr (std::is_invocable_v<F&, Result<T>&&>) {
      deliver(
          promise, [&] { return f(std::move(result)); }, inlineSafe);
    } else {
      if (!result.ok()) {
        promise.setError(result.error());
        return;
      }
      if constexpr (std::is_void_v<T>) {
        deliver(
            promise, [&] { return f(); }, inlineSafe);
      } else {
        deliver(
            promise, [&] { return f(std::move(result).value()); }, inlineSafe);
      }
    }
  } catch (...) {
    promise.trySetError(errorFromException(std::current_exception()));
  }
}

// Owns a suspended coroutine until it is resumed; destroying it unresumed destroys the frame (which
// breaks the coroutine's own promise, so its waiters are failed rather than leaked). With `refused`, an
// unresumed task instead hands the coroutine back: it sets *refused and leaves the frame alone (used for a
// post() that may refuse; *refused must outlive the post() call, and a task post() accepted always runs).
class ResumeTask {
 public:
  explicit ResumeTask(std::coroutine_handle<> handle, bool* refused = nullptr) : handle_(handle), refused_(refused) {}
  ResumeTask(ResumeTask&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), refused_(std::exchange(other.refused_, nullptr)) {}
  ResumeTask& operator=(ResumeTask&&) = delete;
  ~ResumeTask() {
    if (!handle_) return;
    if (refused_ != nullptr) {
      *refused_ = true;
    } else {
      handle_.destroy();
    }
  }
  void operator()() { std::exchange(handle_, nullptr).resume(); }

 private:
  std::coroutine_handle<> handle_;
  bool* refused_ = nullptr;
};

template <typename U, bool kAsResult>
class FutureAwaiter {
 public:
  FutureAwaiter(std::shared_ptr<FutureState<U>> state, Executor* resumeOn)
      : state_(std::move(state)), resumeOn_(resumeOn) {}

  bool await_ready() const noexcept { return state_->isReady(); }

  void await_suspend(std::coroutine_handle<> handle) {
    // Inline-safe: store the result and post the resumption. The frame (and this awaiter in it) may be
    // resumed on another thread as soon as post() returns, so nothing here touches `this` after it.
    state_->setCallback(
        [this, handle, executor = resumeOn_](Result<U>&& result) mutable {
          result_.emplace(std::move(result));
          bool refused = false;
          executor->post(ResumeTask(handle, &refused));
          if (refused) {
            // The executor shut down: resume here rather than destroy the frame unresumed
            // (Note [Refused continuations]).
            reportRefusedContinuation();
            handle.resume();
          }
        },
        /*inlineSafe=*/true);
  }

  auto await_resume() {
    if (!result_) result_.emplace(state_->take());  // it was ready: no suspension happened
    if constexpr (kAsResult) {
      return std::move(*result_);
    } else if constexpr (std::is_void_v<U>) {
      result_->value();
    } else {
      return std::move(*result_).value();
    }
  }

 private:
  std::shared_ptr<FutureState<U>> state_;
  Executor* resumeOn_;
  std::optional<Result<U>> result_;
};

// co_await std::move(f).asResult(): yields Result<U> instead of throwing.
template <typename U>
struct ResultAwaitable {
  std::shared_ptr<FutureState<U>> state;
  FutureAwaiter<U, true> operator co_await() && {
    Executor* executor = state->executor();
    return {std::move(state), executor};
  }
};

Executor* executorFromArgs();
template <typename First, typename... Rest>
Executor* executorFromArgs(First& first, Rest&... rest) {
  if constexpr (std::is_same_v<std::remove_cv_t<First>, Executor>) {
    return &first;
  } else if constexpr (std::is_convertible_v<First, Executor*> && !std::is_same_v<First, std::nullptr_t>) {
    if (first != nullptr) return first;
    return executorFromArgs(rest...);
  } else {
    return executorFromArgs(rest...);
  }
}

template <typename T>
class CoroutinePromiseBase;
template <typename T>
class CoroutinePromise;

}  // namespace detail

template <typename T>
class Promise {
 public:
  explicit Promise(Executor& executor) : state_(std::make_shared<detail::FutureState<T>>(&executor)) {}
  Promise(Promise&& other) noexcept = default;
  Promise& operator=(Promise&& other) noexcept {
    if (this != &other) {
      breakIfPending();
      state_ = std::move(other.state_);
      futureTaken_ = other.futureTaken_;
    }
    return *this;
  }
  Promise(const Promise&) = delete;
  Promise& operator=(const Promise&) = delete;
  ~Promise() { breakIfPending(); }

  // The consumer side; may be taken once.
  Future<T> getFuture() {
    DG_CHECK(state_ != nullptr, "Promise::getFuture on a moved-from promise");
    DG_CHECK(!futureTaken_, "Promise::getFuture called twice");
    futureTaken_ = true;
    return Future<T>(state_);
  }

  // Completing twice is a bug in the caller: set*() throw InternalError; the trySet*() variants are for
  // producers that race by design (a response against its deadline) and return false if already done.
  template <typename... V>
  void setValue(V&&... value) {
    DG_ASSERT(trySetValue(std::forward<V>(value)...), "Promise completed twice (setValue)");
  }
  void setError(Error error) { DG_ASSERT(trySetError(std::move(error)), "Promise completed twice (setError)"); }
  void setResult(Result<T> result) { DG_ASSERT(trySetResult(std::move(result)), "Promise completed twice"); }

  template <typename... V>
  bool trySetValue(V&&... value) {
    if constexpr (std::is_void_v<T>) {
      static_assert(sizeof...(V) == 0, "Promise<void>::setValue takes no arguments");
      return trySetResult(Result<void>());
    } else {
      static_assert(sizeof...(V) >= 1, "Promise<T>::setValue needs a value");
      return trySetResult(Result<T>(T(std::forward<V>(value)...)));
    }
  }
  bool trySetError(Error error) { return trySetResult(Result<T>(std::move(error))); }
  bool trySetResult(Result<T> result) {
    DG_CHECK(state_ != nullptr, "completing a moved-from Promise");
    return state_->complete(std::move(result));
  }

  bool isCompleted() const { return state_ != nullptr && state_->isReady(); }
  Executor* executor() const { return state_ != nullptr ? state_->executor() : nullptr; }

 private:
  void breakIfPending() {
    if (state_ != nullptr && !state_->isReady()) state_->complete(Result<T>(brokenPromiseError()));
  }

  std::shared_ptr<detail::FutureState<T>> state_;
  bool futureTaken_ = false;
};

template <typename T>
class Future {
 public:
  using ValueType = T;
  using promise_type = detail::CoroutinePromise<T>;

  // An invalid future (valid() == false); every other method requires a valid one.
  Future() = default;
  Future(Future&&) noexcept = default;
  Future& operator=(Future&&) noexcept = default;
  Future(const Future&) = delete;
  Future& operator=(const Future&) = delete;

  bool valid() const { return state_ != nullptr; }
  bool isReady() const { return checked("isReady").isReady(); }
  void wait() const { checked("wait").wait(); }
  // True when the result arrived within `timeout`.
  template <typename Rep, typename Period>
  bool wait(std::chrono::duration<Rep, Period> timeout) const {
    return checked("wait").waitFor(timeout);
  }

  // Blocks until complete and consumes the future.
  Result<T> result() { return releaseState("result")->take(); }
  T get() {
    if constexpr (std::is_void_v<T>) {
      result().value();
    } else {
      return result().value();
    }
  }

  // Consumes the future; see the header comment for what f may take and return.
  template <typename F>
  auto then(F&& f) {
    return thenImpl(std::forward<F>(f), false);
  }
  template <typename F>
  auto then(InlineSafe, F&& f) {
    return thenImpl(std::forward<F>(f), true);
  }

  // Rebinds continuations (then, co_await outside a Future coroutine) to `executor`.
  Future via(Executor& executor) && {
    checked("via").setExecutor(&executor);
    return std::move(*this);
  }
  Executor* executor() const { return checked("executor").executor(); }

  // Awaitable yielding Result<T> instead of throwing.
  detail::ResultAwaitable<T> asResult() && { return {releaseState("asResult")}; }

  // co_await from coroutines that are not Future coroutines: resumes on this future's executor.
  detail::FutureAwaiter<T, false> operator co_await() && {
    Executor* executor = checked("co_await").executor();
    return {releaseState("co_await"), executor};
  }
  detail::FutureAwaiter<T, false> operator co_await() & { return std::move(*this).operator co_await(); }

 private:
  template <typename>
  friend class Promise;
  template <typename>
  friend class detail::CoroutinePromiseBase;
  template <typename U>
  friend void detail::forwardInto(Future<U>&&, Promise<U>&&);
  template <typename U>
  friend Future<std::vector<Result<U>>> whenAll(std::vector<Future<U>> futures, Executor* executor);

  explicit Future(std::shared_ptr<detail::FutureState<T>> state) : state_(std::move(state)) {}

  detail::FutureState<T>& checked(const char* what) const {
    DG_CHECK(state_ != nullptr, "Future::", what, " on an invalid future (moved-from, consumed or default)");
    return *state_;
  }
  std::shared_ptr<detail::FutureState<T>> releaseState(const char* what) {
    checked(what);
    return std::move(state_);
  }

  template <typename F>
  auto thenImpl(F&& f, bool inlineSafe) {
    using Fn = std::decay_t<F>;
    using U = detail::UnwrapValue<detail::ContinuationReturn<T, Fn>>;
    auto state = releaseState("then");
    Promise<U> promise(*state->executor());
    Future<U> next = promise.getFuture();
    state->setCallback(
        [fn = Fn(std::forward<F>(f)), promise = std::move(promise), inlineSafe](Result<T>&& result) mutable {
          detail::runContinuation<T>(fn, std::move(result), promise, inlineSafe);
        },
        inlineSafe);
    return next;
  }

  std::shared_ptr<detail::FutureState<T>> state_;
};

namespace detail {

template <typename T>
class CoroutinePromiseBase {
 public:
  template <typename... Args>
  explicit CoroutinePromiseBase(Args&... args) : executor_(executorFromArgs(args...)), promise_(*executor_) {}

  Future<T> get_return_object() { return promise_.getFuture(); }

  // Note [Eager coroutine start]: the body starts inline in the caller (no executor hop for the common
  // shallow case) unless the calling thread's stack already grew kEagerStackBudget since the shallowest
  // coroutine start seen on it; the body is then posted to the executor and starts on a fresh stack.
  // Deep synchronous recursion (a coroutine awaiting itself 10,000 levels down) thus cannot overflow.
  struct InitialAwaiter {
    CoroutinePromiseBase* self;
    bool await_ready() const noexcept { return eagerStartAllowed(); }
    void await_suspend(std::coroutine_handle<> handle) { self->executor_->post(ResumeTask(handle)); }
    void await_resume() const noexcept {}
  };
  InitialAwaiter initial_suspend() noexcept { return {this}; }
  // The frame frees itself once the body finished; the result already went to the shared state.
  std::suspend_never final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { promise_.trySetError(errorFromException(std::current_exception())); }

  // Awaited futures resume this coroutine on its own executor.
  template <typename U>
  FutureAwaiter<U, false> await_transform(Future<U>&& future) {
    return {future.releaseState("co_await"), executor_};
  }
  template <typename U>
  FutureAwaiter<U, false> await_transform(Future<U>& future) {
    return {future.releaseState("co_await"), executor_};
  }
  template <typename U>
  FutureAwaiter<U, true> await_transform(ResultAwaitable<U>&& awaitable) {
    return {std::move(awaitable.state), executor_};
  }
  template <typename A>
  A&& await_transform(A&& awaitable) {
    return std::forward<A>(awaitable);
  }

 protected:
  Executor* executor_;
  Promise<T> promise_;
};

template <typename T>
class CoroutinePromise : public CoroutinePromiseBase<T> {
 public:
  using CoroutinePromiseBase<T>::CoroutinePromiseBase;
  template <typename V>
  void return_value(V&& value) {
    this->promise_.setValue(std::forward<V>(value));
  }
};

template <>
class CoroutinePromise<void> : public CoroutinePromiseBase<void> {
 public:
  using CoroutinePromiseBase<void>::CoroutinePromiseBase;
  void return_void() { this->promise_.setValue(); }
};


template <typename U>
void forwardInto(Future<U>&& inner, Promise<U>&& promise) {
  if (!inner.valid()) {
    promise.setError(Error::failed("a continuation returned an invalid Future"));
    return;
  }
  inner.releaseState("then")->setCallback(
      [promise = std::move(promise)](Result<U>&& result) mutable { promise.setResult(std::move(result)); },
      /*inlineSafe=*/true);
}
}  // namespace detail

template <typename T>
Future<std::decay_t<T>> makeReadyFuture(T&& value, Executor& executor) {
  Promise<std::decay_t<T>> promise(executor);
  promise.setValue(std::forward<T>(value));
  return promise.getFuture();
}
inline Future<void> makeReadyFuture(Executor& executor) {
  Promise<void> promise(executor);
  promise.setValue();
  return promise.getFuture();
}
template <typename T>
Future<T> makeErrorFuture(Error error, Executor& executor) {
  Promise<T> promise(executor);
  promise.setError(std::move(error));
  return promise.getFuture();
}

// Completes when every input has, with each input's Result in input order (errors do not short-circuit).
// The result is bound to `executor`, or to the first input's executor when null; an empty input needs an
// executor and yields a ready empty vector.
template <typename T>
Future<std::vector<Result<T>>> whenAll(std::vector<Future<T>> futures, Executor* executor) {
  for (size_t i = 0; i < futures.size(); ++i) {
    DG_CHECK(futures[i].valid(), "whenAll: input future ", i, " is invalid (moved-from or consumed)");
  }
  if (executor == nullptr) {
    DG_CHECK(!futures.empty(), "whenAll: an empty input needs an executor to bind the result to");
    executor = futures.front().executor();
  }
  Promise<std::vector<Result<T>>> promise(*executor);
  Future<std::vector<Result<T>>> all = promise.getFuture();
  if (futures.empty()) {
    promise.setValue(std::vector<Result<T>>{});
    return all;
  }
  struct Gather {
    Gather(size_t n, Promise<std::vector<Result<T>>> p) : results(n), remaining(n), promise(std::move(p)) {}
    std::mutex mutex;
    std::vector<std::optional<Result<T>>> results;
    size_t remaining;
    Promise<std::vector<Result<T>>> promise;
  };
  auto gather = std::make_shared<Gather>(futures.size(), std::move(promise));
  for (size_t i = 0; i < futures.size(); ++i) {
    futures[i].releaseState("whenAll")->setCallback(
        [gather, i](Result<T>&& result) {
          std::unique_lock<std::mutex> lock(gather->mutex);
          gather->results[i].emplace(std::move(result));
          if (--gather->remaining != 0) return;
          std::vector<Result<T>> out;
          out.reserve(gather->results.size());
          for (auto& r : gather->results) out.push_back(std::move(*r));
          lock.unlock();
          gather->promise.setValue(std::move(out));
        },
        /*inlineSafe=*/true);
  }
  return all;
}

}  // namespace distgrad::rpc
