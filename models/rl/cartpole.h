// CartPole: the classic cart-and-pole control problem (Barto, Sutton & Anderson 1983), with the dynamics,
// constants, termination rule and reward of Gym's CartPole-v0/v1, for reinforcement-learning examples and
// tests that need a small, fast, deterministic environment without Python.
//
// A pole is hinged on a cart that moves along a frictionless track; each step pushes the cart left (action
// 0) or right (action 1) with a fixed force, and the state [x, x_dot, theta, theta_dot] advances by one
// explicit-Euler step of tau = 0.02 s. Every step earns reward 1, the step that ends the episode included.
// The episode terminates when the pole leans more than 12 degrees or the cart leaves [-2.4, 2.4], and is
// truncated after maxEpisodeSteps (Gym: 200 for v0, 500 for v1). reset() draws each state component
// uniformly from [-0.05, 0.05] with the environment's own seeded generator, so a seed fixes every episode.
//
//   rl::CartPole env(seed);                 // CartPoleOptions{.maxEpisodeSteps = 200} for v0
//   auto state = env.reset();
//   for (;;) {
//     rl::CartPole::Step s = env.step(action(state));
//     state = s.state;
//     if (s.terminated || s.truncated) break;
//   }
//
// Thread-safety: an environment is a plain value; use one per thread.
#pragma once

#include <array>
#include <cstdint>

#include "tensor/random.h"

namespace distgrad::models::rl {

// Gym's constants (cartpole.py). The defaults are the classic problem; change them only to study variants.
struct CartPoleOptions {
  double gravity = 9.8;
  double cartMass = 1.0;
  double poleMass = 0.1;
  double poleHalfLength = 0.5;  // Gym's `length`: half the pole's length
  double forceMagnitude = 10.0;
  double tau = 0.02;                                                    // seconds per step
  double thetaThreshold = 12.0 * 2.0 * 3.14159265358979323846 / 360.0;  // radians
  double xThreshold = 2.4;
  int64_t maxEpisodeSteps = 500;  // CartPole-v1; 200 for v0
};

class CartPole {
 public:
  static constexpr int64_t kObservationSize = 4;  // x, x_dot, theta, theta_dot
  static constexpr int64_t kNumActions = 2;       // 0: push left, 1: push right
  using State = std::array<double, 4>;

  struct Step {
    State state;
    double reward = 0;
    bool terminated = false;  // the pole fell or the cart left the track
    bool truncated = false;   // maxEpisodeSteps reached without terminating
  };

  // Throws ValueError for non-positive masses, length, tau, thresholds or maxEpisodeSteps.
  explicit CartPole(uint64_t seed, const CartPoleOptions& options = {});

  // Starts an episode from a random state near upright; returns it.
  State reset();
  // Starts an episode from `state` (tests, replays).
  void resetTo(const State& state);
  // Advances one step. Throws ValueError for an action other than 0 or 1, before the first reset, and
  // after the episode ended (reset first).
  Step step(int64_t action);

  const State& state() const { return state_; }
  // Steps taken in this episode.
  int64_t episodeSteps() const { return steps_; }
  bool episodeOver() const { return over_; }
  const CartPoleOptions& options() const { return options_; }

 private:
  CartPoleOptions options_;
  tensor::Generator gen_;
  State state_{};
  int64_t steps_ = 0;
  bool started_ = false;
  bool over_ = false;
};

}  // namespace distgrad::models::rl
