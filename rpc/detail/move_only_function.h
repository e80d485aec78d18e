// MoveOnlyFunction<R(Args...)>: a type-erased callable that may own move-only state (a Promise, a
// coroutine handle, a unique_ptr). std::function requires copyable targets and std::move_only_function is
// C++23, so this is the small subset the executor, futures and timers need.
//
// Small callables (up to kInlineBytes, nothrow-movable) are stored in place; larger ones on the heap.
// Thread-safety: a value type; one object must not be used from two threads at once.
#pragma once

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>

#include "tensor/error.h"

namespace distgrad::rpc::detail {

template <typename Signature>
class MoveOnlyFunction;

template <typename R, typename... Args>
class MoveOnlyFunction<R(Args...)> {
 public:
  // Three pointers plus a shared_ptr: enough for the executor's usual closures (state + callback).
  static constexpr size_t kInlineBytes = 48;

  MoveOnlyFunction() noexcept = default;
  MoveOnlyFunction(std::nullptr_t) noexcept {}  // NOLINT: implicit like std::function

  template <typename F, typename D = std::decay_t<F>,
            typename = std::enable_if_t<!std::is_same_v<D, MoveOnlyFunction> && std::is_invocable_r_v<R, D&, Args...>>>
  MoveOnlyFunction(F&& f) {  // NOLINT: implicit like std::function
    if constexpr (kFitsInline<D>) {
      ::new (static_cast<void*>(buffer_)) D(std::forward<F>(f));
      ops_ = &kInlineOps<D>;
    } else {
      heap_ = new D(std::forward<F>(f));
      ops_ = &kHeapOps<D>;
    }
  }

  MoveOnlyFunction(MoveOnlyFunction&& other) noexcept { moveFrom(other); }
  MoveOnlyFunction& operator=(MoveOnlyFunction&& other) noexcept {
    if (this != &other) {
      reset();
      moveFrom(other);
    }
    return *this;
  }
  MoveOnlyFunction(const MoveOnlyFunction&) = delete;
  MoveOnlyFunction& operator=(const MoveOnlyFunction&) = delete;
  ~MoveOnlyFunction() { reset(); }

  explicit operator bool() const noexcept { return ops_ != nullptr; }

  R operator()(Args... args) {
    DG_ASSERT(ops_ != nullptr, "calling an empty MoveOnlyFunction");
    return ops_->invoke(target(), std::forward<Args>(args)...);
  }

  void reset() noexcept {
    if (ops_ != nullptr) {
      ops_->destroy(target());
      ops_ = nullptr;
      heap_ = nullptr;
    }
  }

 private:
  struct Ops {
    R (*invoke)(void* target, Args&&... args);
    void (*destroy)(void* target) noexcept;
    // Moves an in-place target from `from` to the buffer at `to` and destroys the source; null for heap.
    void (*relocate)(void* from, void* to) noexcept;
  };

  template <typename D>
  static constexpr bool kFitsInline = sizeof(D) <= kInlineBytes && alignof(D) <= alignof(std::max_align_t) &&
                                      std::is_nothrow_move_constructible_v<D>;

  template <typename D>
  static R invokeTarget(void* target, Args&&... args) {
    return (*static_cast<D*>(target))(std::forward<Args>(args)...);
  }
  template <typename D>
  static void destroyInline(void* target) noexcept {
    static_cast<D*>(target)->~D();
  }
  template <typename D>
  static void destroyHeap(void* target) noexcept {
    delete static_cast<D*>(target);
  }
  template <typename D>
  static void relocateInline(void* from, void* to) noexcept {
    ::new (to) D(std::move(*static_cast<D*>(from)));
    static_cast<D*>(from)->~D();
  }

  template <typename D>
  static constexpr Ops kInlineOps{&invokeTarget<D>, &destroyInline<D>, &relocateInline<D>};
  template <typename D>
  static constexpr Ops kHeapOps{&invokeTarget<D>, &destroyHeap<D>, nullptr};

  void* target() noexcept { return heap_ != nullptr ? heap_ : static_cast<void*>(buffer_); }

  void moveFrom(MoveOnlyFunction& other) noexcept {
    ops_ = other.ops_;
    if (ops_ == nullptr) return;
    if (other.heap_ != nullptr) {
      heap_ = other.heap_;
    } else {
      ops_->relocate(other.buffer_, buffer_);
    }
    other.ops_ = nullptr;
    other.heap_ = nullptr;
  }

  alignas(std::max_align_t) std::byte buffer_[kInlineBytes];
  void* heap_ = nullptr;
  const Ops* ops_ = nullptr;
};

}  // namespace distgrad::rpc::detail
