#include "models/optim/lr_scheduler.h"

#include <cmath>
#include <numbers>

namespace distgrad::models::optim {

LRScheduler::LRScheduler(Optimizer& optimizer)
    : optimizer_(optimizer), baseLearningRate_(optimizer.learningRate()) {}

void LRScheduler::step() { setEpoch(epoch_ + 1); }

void LRScheduler::setEpoch(int64_t epoch) {
  DG_CHECK(epoch >= 0, "LRScheduler::setEpoch: epoch must be >= 0, got ", epoch);
  epoch_ = epoch;
  optimizer_.setLearningRate(learningRateAt(epoch));
}

StepLR::StepLR(Optimizer& optimizer, int64_t stepSize, double gamma)
    : LRScheduler(optimizer), stepSize_(stepSize), gamma_(gamma) {
  DG_CHECK(stepSize > 0, "StepLR: stepSize must be > 0, got ", stepSize);
  DG_CHECK(std::isfinite(gamma) && gamma >= 0, "StepLR: gamma must be >= 0, got ", gamma);
  applyInitial();
}

double StepLR::learningRateAt(int64_t epoch) const {
  return baseLearningRate() * std::pow(gamma_, static_cast<double>(epoch / stepSize_));
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t tMax, double etaMin)
    : LRScheduler(optimizer), tMax_(tMax), etaMin_(etaMin) {
  DG_CHECK(tMax > 0, "CosineAnnealingLR: tMax must be > 0, got ", tMax);
  DG_CHECK(std::isfinite(etaMin) && etaMin >= 0, "CosineAnnealingLR: etaMin must be >= 0, got ", etaMin);
  applyInitial();
}

double CosineAnnealingLR::learningRateAt(int64_t epoch) const {
  const double phase = std::numbers::pi * static_cast<double>(epoch) / static_cast<double>(tMax_);
  return etaMin_ + (baseLearningRate() - etaMin_) * (1.0 + std::cos(phase)) / 2.0;
}

}  // namespace distgrad::models::optim
