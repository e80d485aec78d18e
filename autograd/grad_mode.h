// Per-thread switch for recording autograd history.
// Thread-safety: the flag is thread-local; guards affect only the thread that creates them.
#pragma once

namespace distgrad::autograd {

bool isGradEnabled();
void setGradEnabled(bool enabled);

// Disables recording for its scope (restores the previous state on exit).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(isGradEnabled()) { setGradEnabled(false); }
  ~NoGradGuard() { setGradEnabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Re-enables recording inside a NoGradGuard scope.
class EnableGradGuard {
 public:
  EnableGradGuard() : previous_(isGradEnabled()) { setGradEnabled(true); }
  ~EnableGradGuard() { setGradEnabled(previous_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace distgrad::autograd
