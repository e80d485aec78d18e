// CartPole: the dynamics against steps computed by hand from the equations of motion, termination at each
// bound, truncation, reset distribution and determinism, and the refused calls.
#include "models/rl/cartpole.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "tensor/error.h"

namespace distgrad::models::rl {
namespace {

constexpr double kTol = 1e-12;

void expectState(const CartPole::State& actual, const CartPole::State& expected) {
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(actual[i], expected[i], kTol) << "component " << i;
}

// From rest, pushing right: temp = F / (m_c + m_p) = 10 / 1.1; theta_acc = -temp / (l (4/3 - m_p / 1.1))
// = -600/41; x_acc = temp - m_p l theta_acc / 1.1 = 400/41. Euler with tau = 0.02 moves the velocities
// first-order only: x_dot = 8/41, theta_dot = -12/41, positions unchanged.
TEST(CartPoleTest, FirstStepFromRestMatchesTheEquationsOfMotion) {
  CartPole env(1);
  env.resetTo({0, 0, 0, 0});
  CartPole::Step s = env.step(1);
  expectState(s.state, {0.0, 8.0 / 41.0, 0.0, -12.0 / 41.0});
  EXPECT_EQ(s.reward, 1.0);
  EXPECT_FALSE(s.terminated);
  EXPECT_FALSE(s.truncated);
  // Second step: the positions take the previous velocities (x += 0.02 * 8/41, theta += 0.02 * -12/41);
  // at theta = 0 the accelerations are the same again, so the velocities double.
  s = env.step(1);
  expectState(s.state, {0.02 * 8.0 / 41.0, 16.0 / 41.0, -0.02 * 12.0 / 41.0, -24.0 / 41.0});
  EXPECT_EQ(env.episodeSteps(), 2);
}

// Pushing left is the mirror image of pushing right.
TEST(CartPoleTest, PushingLeftMirrorsPushingRight) {
  CartPole left(1), right(1);
  left.resetTo({0.1, -0.2, 0.05, 0.3});
  right.resetTo({-0.1, 0.2, -0.05, -0.3});
  for (int i = 0; i < 5; ++i) {
    const CartPole::State a = left.step(0).state;
    const CartPole::State b = right.step(1).state;
    for (size_t k = 0; k < 4; ++k) EXPECT_NEAR(a[k], -b[k], kTol);
  }
}

// A tilted, moving state (sin and cos and the theta_dot^2 term all matter), computed with the same formulas
// in double precision outside the library: x += tau x_dot; x_dot += tau x_acc; theta += tau theta_dot;
// theta_dot += tau theta_acc.
TEST(CartPoleTest, StepFromATiltedMovingState) {
  CartPole env(1);
  env.resetTo({0.1, -0.2, 0.05, 0.3});
  const double theta = 0.05, thetaDot = 0.3;
  const double temp = (-10.0 + 0.05 * thetaDot * thetaDot * std::sin(theta)) / 1.1;
  const double thetaAcc = (9.8 * std::sin(theta) - std::cos(theta) * temp) /
                          (0.5 * (4.0 / 3.0 - 0.1 * std::cos(theta) * std::cos(theta) / 1.1));
  const double xAcc = temp - 0.05 * thetaAcc * std::cos(theta) / 1.1;
  const CartPole::Step s = env.step(0);
  expectState(s.state, {0.1 - 0.02 * 0.2, -0.2 + 0.02 * xAcc, 0.05 + 0.02 * 0.3, 0.3 + 0.02 * thetaAcc});
  // The same numbers written out (an independent evaluation of the formulas).
  expectState(s.state, {0.096, -0.3957976546439626, 0.056, 0.6080233136061515});
}

// Always pushing right from rest tips the pole past 12 degrees (leaning left) on step 9, with the cart
// still well inside the track.
TEST(CartPoleTest, TerminatesWhenThePoleFalls) {
  CartPole env(1);
  env.resetTo({0, 0, 0, 0});
  CartPole::Step s;
  for (int i = 1; i <= 8; ++i) {
    s = env.step(1);
    ASSERT_FALSE(s.terminated) << "step " << i;
  }
  s = env.step(1);
  EXPECT_TRUE(s.terminated);
  EXPECT_FALSE(s.truncated);
  EXPECT_EQ(s.reward, 1.0);  // the step that ends the episode is rewarded too (Gym's rule)
  EXPECT_LT(s.state[2], -12.0 * std::numbers::pi / 180.0);
  EXPECT_NEAR(s.state[2], -0.21518604988500967, 1e-12);
  EXPECT_LT(std::abs(s.state[0]), 2.4);
  EXPECT_TRUE(env.episodeOver());
  EXPECT_THROW(env.step(0), ValueError);  // reset first
  env.reset();
  EXPECT_NO_THROW(env.step(0));
}

TEST(CartPoleTest, TerminatesWhenTheCartLeavesTheTrack) {
  CartPole env(1);
  // Upright and still, at x = 2.39 moving right at 1 m/s: x passes 2.4 on the first step (2.39 + 0.02).
  env.resetTo({2.39, 1.0, 0.0, 0.0});
  CartPole::Step s = env.step(0);
  EXPECT_TRUE(s.terminated);
  EXPECT_NEAR(s.state[0], 2.41, kTol);
  env.resetTo({-2.39, -1.0, 0.0, 0.0});
  EXPECT_TRUE(env.step(1).terminated);
  // Inside the bounds nothing ends.
  env.resetTo({2.3, 1.0, 0.0, 0.0});
  EXPECT_FALSE(env.step(0).terminated);
}

TEST(CartPoleTest, TruncatesAfterMaxEpisodeSteps) {
  // Alternating pushes keep the pole up for a few steps: with a limit of 3, the third step truncates.
  CartPole env(1, {.maxEpisodeSteps = 3});
  env.resetTo({0, 0, 0, 0});
  EXPECT_FALSE(env.step(1).truncated);
  EXPECT_FALSE(env.step(0).truncated);
  const CartPole::Step s = env.step(0);
  EXPECT_FALSE(s.terminated);
  EXPECT_TRUE(s.truncated);
  EXPECT_THROW(env.step(1), ValueError);
}

TEST(CartPoleTest, ResetIsSeededAndNearUpright) {
  CartPole a(42), b(42), c(43);
  for (int episode = 0; episode < 50; ++episode) {
    const CartPole::State sa = a.reset();
    const CartPole::State sb = b.reset();
    const CartPole::State sc = c.reset();
    EXPECT_EQ(sa, sb);
    EXPECT_NE(sa, sc);
    for (double v : sa) {
      EXPECT_GE(v, -0.05);
      EXPECT_LT(v, 0.05);
    }
    EXPECT_EQ(a.episodeSteps(), 0);
  }
  // Successive episodes of one environment start differently.
  EXPECT_NE(a.reset(), a.reset());
}

TEST(CartPoleTest, RefusesBadCalls) {
  CartPole env(1);
  EXPECT_THROW(env.step(0), ValueError);  // no reset yet
  env.reset();
  EXPECT_THROW(env.step(2), ValueError);
  EXPECT_THROW(env.step(-1), ValueError);
  EXPECT_THROW(CartPole(1, {.poleMass = 0}), ValueError);
  EXPECT_THROW(CartPole(1, {.maxEpisodeSteps = 0}), ValueError);
  try {
    env.step(7);
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("got 7"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace distgrad::models::rl
