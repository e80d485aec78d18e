#include "rpc/future.h"

#include <cxxabi.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <typeinfo>

namespace distgrad::rpc {

namespace {

std::string demangle(const char* mangled) {
  int status = 0;
  char* name = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = (status == 0 && name != nullptr) ? name : mangled;
  std::free(name);  // NOLINT: __cxa_demangle allocates with malloc
  return out;
}

thread_local int tInlineDepth = 0;
// Set while blocking waits are forbidden on this thread (ForbidBlockingScope).
thread_local bool tForbidBlocking = false;
// Set while a ContinuationsHere scope lives on this thread.
thread_local bool tContinuationsHere = false;
// Note [Following the task] (rpc/executor.cpp).
thread_local bool tTaskTail = false;
// The shallowest stack address at which a coroutine started on this thread (stacks grow down).
thread_local const char* tStackAnchor = nullptr;

}  // namespace

Error errorFromException(std::exception_ptr exception) {
  try {
    std::rethrow_exception(exception);
  } catch (const RpcError& e) {
    return e.error();
  } catch (const std::exception& e) {
    Error error = Error::failed(e.what());
    error.remoteType = demangle(typeid(e).name());
    return error;
  } catch (...) {
    const std::type_info* type = abi::__cxa_current_exception_type();
    Error error = Error::failed("non-standard exception");
    if (type != nullptr) error.remoteType = demangle(type->name());
    return error;
  }
}

Error brokenPromiseError() {
  return Error::failed(
      "broken promise: the Promise was destroyed without a result (its producer was dropped, e.g. by an "
      "executor that had shut down)");
}

ContinuationsHere::ContinuationsHere() : previous_(tContinuationsHere) { tContinuationsHere = true; }
ContinuationsHere::~ContinuationsHere() { tContinuationsHere = previous_; }

namespace detail {

bool continuationsHere() { return tContinuationsHere; }

bool inTaskTail() { return tTaskTail; }
TaskTailScope::TaskTailScope(bool tail) : previous_(tTaskTail) { tTaskTail = tail; }
TaskTailScope::~TaskTailScope() { tTaskTail = previous_; }

bool enterInline() {
  if (tInlineDepth >= kMaxInlineDepth) return false;
  ++tInlineDepth;
  return true;
}

void leaveInline() { --tInlineDepth; }

ForbidBlockingScope::ForbidBlockingScope() : previous_(tForbidBlocking) { tForbidBlocking = true; }
ForbidBlockingScope::~ForbidBlockingScope() { tForbidBlocking = previous_; }

void checkMayBlock() {
  Executor::wakeOwed();  // Note [Following the task] (rpc/executor.cpp)
  if (!tForbidBlocking) return;
  throw RpcError(Error::failed("a blocking wait for a future inside an inline handler: the handler runs on the "
                               "transport's loop thread, which may be the one to complete the future; return the "
                               "Future (or co_await it), or bind the function for the executor"));
}

bool eagerStartAllowed() {
  const char* here = static_cast<const char*>(__builtin_frame_address(0));
  if (tStackAnchor == nullptr || here > tStackAnchor) {
    tStackAnchor = here;
    return true;
  }
  return static_cast<size_t>(tStackAnchor - here) < kEagerStackBudget;
}

void reportRefusedContinuation() {
  // Reported a few times only: a shutdown with many futures still bound to the executor would flood stderr.
  static std::atomic<int> reported{0};
  int n = reported.fetch_add(1, std::memory_order_relaxed);
  if (n < 3) {
    std::fprintf(stderr,
                 "distgrad: a future's continuation was refused by its executor (shut down); running it inline on "
                 "the completing thread instead%s\n",
                 n == 2 ? " (further occurrences are not reported)" : "");
  }
}

Executor* executorFromArgs() {
  Executor* current = Executor::current();
  DG_CHECK(current != nullptr,
           "a Future-returning coroutine was called outside an executor thread and has no Executor& or "
           "Executor* parameter to bind its future to");
  return current;
}

}  // namespace detail

}  // namespace distgrad::rpc
