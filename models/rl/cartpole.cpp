#include "models/rl/cartpole.h"

#include <cmath>

#include "tensor/error.h"

namespace distgrad::models::rl {

CartPole::CartPole(uint64_t seed, const CartPoleOptions& options) : options_(options), gen_(seed) {
  const CartPoleOptions& o = options_;
  DG_CHECK(
      o.gravity > 0 && o.cartMass > 0 && o.poleMass > 0 && o.poleHalfLength > 0 && o.forceMagnitude > 0 && o.tau > 0,
      "CartPole: gravity, masses, pole length, force and tau must be > 0, got gravity ", o.gravity, ", cart mass ",
      o.cartMass, ", pole mass ", o.poleMass, ", half length ", o.poleHalfLength, ", force ", o.forceMagnitude,
      ", tau ", o.tau);
  DG_CHECK(o.thetaThreshold > 0 && o.xThreshold > 0, "CartPole: thresholds must be > 0, got theta ", o.thetaThreshold,
           ", x ", o.xThreshold);
  DG_CHECK(o.maxEpisodeSteps >= 1, "CartPole: maxEpisodeSteps must be >= 1, got ", o.maxEpisodeSteps);
}

CartPole::State CartPole::reset() {
  State s;
  for (double& v : s) v = -0.05 + 0.1 * gen_.uniform01();
  resetTo(s);
  return state_;
}

void CartPole::resetTo(const State& state) {
  state_ = state;
  steps_ = 0;
  started_ = true;
  over_ = false;
}

CartPole::Step CartPole::step(int64_t action) {
  DG_CHECK(action == 0 || action == 1, "CartPole::step: action must be 0 (left) or 1 (right), got ", action);
  DG_CHECK(started_, "CartPole::step: call reset() before the first step");
  DG_CHECK(!over_, "CartPole::step: the episode ended after ", steps_, " steps; call reset() first");
  const CartPoleOptions& o = options_;
  auto [x, xDot, theta, thetaDot] = state_;
  // Gym's cartpole.py, "euler" integrator: the equations of motion of Florian (2007), "Correct equations for
  // the dynamics of the cart-pole system", without friction.
  const double force = action == 1 ? o.forceMagnitude : -o.forceMagnitude;
  const double totalMass = o.cartMass + o.poleMass;
  const double poleMassLength = o.poleMass * o.poleHalfLength;
  const double cosTheta = std::cos(theta);
  const double sinTheta = std::sin(theta);
  const double temp = (force + poleMassLength * thetaDot * thetaDot * sinTheta) / totalMass;
  const double thetaAcc = (o.gravity * sinTheta - cosTheta * temp) /
                          (o.poleHalfLength * (4.0 / 3.0 - o.poleMass * cosTheta * cosTheta / totalMass));
  const double xAcc = temp - poleMassLength * thetaAcc * cosTheta / totalMass;
  x += o.tau * xDot;
  xDot += o.tau * xAcc;
  theta += o.tau * thetaDot;
  thetaDot += o.tau * thetaAcc;
  state_ = {x, xDot, theta, thetaDot};
  ++steps_;

  Step out;
  out.state = state_;
  out.reward = 1.0;
  out.terminated = x < -o.xThreshold || x > o.xThreshold || theta < -o.thetaThreshold || theta > o.thetaThreshold;
  out.truncated = !out.terminated && steps_ >= o.maxEpisodeSteps;
  over_ = out.terminated || out.truncated;
  return out;
}

}  // namespace distgrad::models::rl
