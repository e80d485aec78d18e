#include "models/pipeline/compute_token.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "rpc/executor.h"

namespace distgrad::models::pipeline {
namespace {

using namespace std::chrono_literals;

// Waits (bounded) until a thread is blocked in acquireBlocking.
void waitUntilBlocked(const ComputeToken& token) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (token.blocked() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(token.blocked(), 1);
}
// Time for a thread that should stay blocked to have taken the token if it could.
void giveItTime() { std::this_thread::sleep_for(20ms); }

// A backward blocking for the token; `acquired` turns true once it holds it.
std::thread blockedBackward(ComputeToken& token, std::atomic<bool>& acquired) {
  std::thread backward([&token, &acquired] {
    token.acquireBlocking();
    acquired = true;
  });
  waitUntilBlocked(token);
  return backward;
}

// Note [Stage compute token]: a blocked backward goes before the forward runner when the token is released.
TEST(ComputeToken, BlockedAcquirersGoFirstWithoutAReservation) {
  ComputeToken token;
  ASSERT_TRUE(token.tryAcquireOrNotify([] {}));
  std::atomic<bool> acquired{false};
  std::thread backward = blockedBackward(token, acquired);
  EXPECT_FALSE(acquired.load());
  int wakes = 0;
  EXPECT_FALSE(token.tryAcquireOrNotify([&] { ++wakes; }));  // a backward is blocked: the runner waits
  token.release();
  backward.join();
  EXPECT_TRUE(acquired.load());
  EXPECT_EQ(wakes, 0);
  token.release();
  EXPECT_EQ(wakes, 1);  // released with nobody blocked: the runner is woken
  EXPECT_TRUE(token.tryAcquireOrNotify([] {}));
}

// Note [1F1B alternation]: a release reserving the token for the forward runner wakes the runner and keeps
// a blocked backward waiting until the runner took the token and released it.
TEST(ComputeToken, AReservationMakesBlockedAcquirersWaitForTheRunner) {
  ComputeToken token;
  token.acquireBlocking();  // the ending backward holds it
  int wakes = 0;
  EXPECT_FALSE(token.tryAcquireOrNotify([&] { ++wakes; }));  // the runner waits for it
  std::atomic<bool> acquired{false};
  std::thread backward = blockedBackward(token, acquired);
  token.release(/*forwardNext=*/true);
  EXPECT_EQ(wakes, 1);
  giveItTime();
  EXPECT_FALSE(acquired.load()) << "a blocked backward took a token reserved for the forward";
  EXPECT_TRUE(token.tryAcquireOrNotify([] {}));  // the runner takes it despite the blocked backward
  giveItTime();
  EXPECT_FALSE(acquired.load());
  token.release();
  backward.join();
  EXPECT_TRUE(acquired.load());
  token.release();
}

// A reservation the runner will not use (nothing to run, not admitted, its post refused) is dropped, and a
// blocked backward goes on; dropping without a reservation changes nothing.
TEST(ComputeToken, ADroppedReservationLetsBlockedAcquirersGoOn) {
  ComputeToken token;
  token.acquireBlocking();
  std::atomic<bool> acquired{false};
  std::thread backward = blockedBackward(token, acquired);
  token.release(/*forwardNext=*/true);
  giveItTime();
  EXPECT_FALSE(acquired.load());
  token.dropReservation();
  backward.join();
  EXPECT_TRUE(acquired.load());
  token.dropReservation();  // held, not reserved: a no-op
  EXPECT_FALSE(token.tryAcquireOrNotify([] {}));
  token.release();
  EXPECT_TRUE(token.tryAcquireOrNotify([] {}));
}

// Note [Starved reservation]: a stage's backward, the only worker of its executor, blocks for the token
// while the forward runner it would be reserved for is queued behind it on that executor. Both orders:
// the release that would reserve comes after the worker blocked (no reservation is made), or before it
// (the reservation is dropped as it blocks). Without the rule each deadlocks.
TEST(ComputeToken, NoReservationWaitsForARunnerThatHasNoWorkerLeft) {
  for (const bool reserveFirst : {false, true}) {
    SCOPED_TRACE(reserveFirst ? "reserved before the worker blocked" : "released after the worker blocked");
    ComputeToken token;
    std::promise<void> ran, go;
    std::atomic<bool> acquired{false};
    rpc::Executor executor(1, "token-test");  // destroyed first: its thread is joined before the rest goes
    token.acquireBlocking();                  // the ending backward (not a worker) holds it
    // The runner, waiting for the token: its wake-up posts it to the executor, where it takes the token.
    auto runner = [&] {
      ASSERT_TRUE(token.tryAcquireOrNotify([] {}));
      token.release();
      ran.set_value();
    };
    ASSERT_FALSE(token.tryAcquireOrNotify([&] { ASSERT_TRUE(executor.post(runner)); }));
    // The next backward occupies the only worker, then blocks for the token.
    ASSERT_TRUE(executor.post([&, started = go.get_future().share()] {
      started.wait();
      token.acquireBlocking();
      acquired = true;
      token.release();
    }));
    if (reserveFirst) {
      token.release(/*forwardNext=*/true);  // the runner is queued behind the backward
      go.set_value();
    } else {
      go.set_value();
      waitUntilBlocked(token);
      token.release(/*forwardNext=*/true);
    }
    const bool finished = ran.get_future().wait_for(10s) == std::future_status::ready;
    if (!finished) token.dropReservation();  // what the rule does, so that the executor can be joined
    EXPECT_TRUE(finished) << "deadlocked";
    EXPECT_TRUE(acquired.load());
  }
}

}  // namespace
}  // namespace distgrad::models::pipeline
