// Learning-rate schedules that drive an Optimizer's learning rate, epoch by epoch (or step by step, at the
// caller's choice of what step() means).
//
// A scheduler records the optimizer's learning rate at construction as the base rate and sets the rate for
// epoch 0; each step() advances the epoch and sets the rate from the closed-form schedule:
//   StepLR:            lr(e) = base * gamma^floor(e / stepSize)
//   CosineAnnealingLR: lr(e) = etaMin + (base - etaMin) * (1 + cos(pi * e / tMax)) / 2
// (PyTorch's closed forms; the cosine keeps oscillating past tMax as PyTorch's does).
// The scheduler holds a reference to the optimizer, which must outlive it.
// Thread-safety: not thread-safe; drive it from the training loop's thread.
#pragma once

#include <cstdint>

#include "models/optim/optimizer.h"

namespace distgrad::models::optim {

class LRScheduler {
 public:
  explicit LRScheduler(Optimizer& optimizer);
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances to the next epoch and applies its learning rate.
  void step();
  // Jumps to `epoch` (e.g. when resuming) and applies its learning rate.
  void setEpoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  double baseLearningRate() const { return baseLearningRate_; }
  // The schedule's value at `epoch` (pure; does not touch the optimizer).
  virtual double learningRateAt(int64_t epoch) const = 0;

 protected:
  // Subclass constructors call this once their parameters are set (the base constructor cannot: the
  // schedule is virtual).
  void applyInitial() { setEpoch(0); }

 private:
  Optimizer& optimizer_;
  double baseLearningRate_;
  int64_t epoch_ = 0;
};

class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t stepSize, double gamma = 0.1);
  double learningRateAt(int64_t epoch) const override;

 private:
  int64_t stepSize_;
  double gamma_;
};

class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t tMax, double etaMin = 0.0);
  double learningRateAt(int64_t epoch) const override;

 private:
  int64_t tMax_;
  double etaMin_;
};

}  // namespace distgrad::models::optim
