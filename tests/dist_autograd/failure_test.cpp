// Lifetimes and failures of distributed backward passes, over inproc and tcp: contexts are released on every
// worker they touched once they end, and a plain reply to a call still in flight then still arrives; a
// backward function that throws (or returns a wrong-shaped gradient) on any worker (the callee, a worker two
// hops away, the root itself) fails the root's backward with that worker's name and the original message;
// cancellation and the deadline abort a pass that is stuck in a remote backward function; bad roots are
// ValueErrors and leave the context usable; BackwardOptions::localDone fires once when the root's own part
// has run, before the pass completes, and never for a pass whose root part failed; whenLocalPartDone
// completes on each worker once its part ran, and fails on release, failure and cancellation; after each failure the
// workers still serve new contexts and hold nothing. Then, across processes (tcp on 127.0.0.1): a worker
// killed (SIGKILL) or stopped (SIGSTOP, only the heartbeat notices) in the middle of a backward fails the
// root's pass as `disconnected` naming it, within the heartbeat bound, whether the root called it or only
// another worker did, and the surviving workers release their parts.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "dist_autograd_test_util.h"
#include "rpc/store.h"
#include "tests/transport_params.h"

namespace distgrad::autograd::distributed::e2e {
namespace {

using SteadyTime = std::chrono::steady_clock;

class FailureTest : public DistAutogradFixture {
 protected:
  // The backward of a kGate stage signals `entered` and blocks until `release` (bounded, so a broken test
  // does not leave a thread stuck forever). Shared pointers: the gate may run after the test body left.
  struct Gate {
    std::shared_ptr<rpc::testing::Event> entered = std::make_shared<rpc::testing::Event>();
    std::shared_ptr<rpc::testing::Event> release = std::make_shared<rpc::testing::Event>();
  };
  Gate installGate() {
    Gate gate;
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.onGatedBackward = [entered = gate.entered, release = gate.release] {
      entered->set();
      release->waitFor();
    };
    return gate;
  }
};

TEST_P(FailureTest, ContextsAreReleasedOnEveryWorkerTheyTouched) {
  ASSERT_NO_FATAL_FAILURE(start(3));
  const TwoWorkerMlp m = twoWorkerMlp(3001);
  {
    // A context that made no call exists on its creator only.
    DistContext lonely(agent(2));
    EXPECT_EQ(lonely.id() >> 48, 2u) << "the context id starts with the creating worker's id";
    EXPECT_EQ(liveContexts(agent(2)), 1u);
    EXPECT_EQ(liveContexts(agent(0)), 0u);
    EXPECT_EQ(liveContexts(agent(1)), 0u);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();

  uint64_t id = 0;
  uint64_t forwarded = 0;  // worker1's calls to worker2 before the release
  {
    DistContext ctx(agent(0));
    id = ctx.id();
    EXPECT_EQ(id >> 48, 0u);
    // worker0 -> worker1 -> worker2: all three join.
    Tensor h = agent(0).rpcSync(name(1), kChain, std::string("l1"), name(2), std::string("l2"),
                                static_cast<int64_t>(Behavior::kPlain), std::string(), m.x);
    Tensor loss = headLoss(h, layer("worker0", "head"), m.y);
    ctx.backward(loss);
    for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(liveContexts(agent(rank)), 1u) << name(rank);
    EXPECT_TRUE(gradientsOf(agent(2), id).contains(layer("worker2", "l2").weight));
    forwarded = agent(1).metrics(name(2)).callsSent;
    // Moving keeps one context; ending twice is fine.
    DistContext moved(std::move(ctx));
    EXPECT_EQ(moved.id(), id);
    moved.end();
    moved.end();
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
  // worker1 forwarded the release to worker2, which worker0 never talked to in the context.
  EXPECT_EQ(agent(1).metrics(name(2)).callsSent, forwarded + 1);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_THROW((void)gradientsOf(agent(rank), id), ValueError) << name(rank) << " still knows the ended context";
  }

  // A context that ends without any backward (forward only) is released as well.
  {
    DistContext ctx(agent(0));
    (void)twoWorkerLoss(m);
    EXPECT_EQ(liveContexts(agent(1)), 1u);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();

  // Note [Control forwarding]: three workers that all talked to each other in a context (worker0 -> worker1
  // -> worker2, and worker0 -> worker2): the release takes two messages, worker0's; nobody forwards it.
  {
    DistContext ctx(agent(0));
    Tensor h = agent(0).rpcSync(name(1), kChain, std::string("l1"), name(2), std::string("l2"),
                                static_cast<int64_t>(Behavior::kPlain), std::string(), m.x);
    (void)agent(0).rpcSync(name(2), kIdentity, h);
    for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(liveContexts(agent(rank)), 1u) << name(rank);
    std::vector<uint64_t> sent;
    for (int from = 0; from < 3; ++from) {
      for (int to = 0; to < 3; ++to) sent.push_back(from == to ? 0 : agent(from).metrics(name(to)).callsSent);
    }
    ctx.end();
    ASSERT_TRUE(allReleased()) << liveCounts();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a forward would have been sent by now
    for (int from = 0; from < 3; ++from) {
      for (int to = 0; to < 3; ++to) {
        if (from == to) continue;
        const uint64_t expected = from == 0 ? 1 : 0;
        EXPECT_EQ(agent(from).metrics(name(to)).callsSent - sent[static_cast<size_t>(3 * from + to)], expected)
            << name(from) << " -> " << name(to);
      }
    }
  }
}

TEST_P(FailureTest, ACallInFlightWhenItsContextEndsStillGetsItsPlainReply) {
  // A call made inside a context is still running at the callee when the context ends and is released
  // there; its reply carries no tensor that requires grad (nothing autograd needs), so it must still
  // arrive. (RRef control messages sent when an RRef is dropped inside a context are such calls; their
  // replies fail the same way when the release overtakes them.)
  ASSERT_NO_FATAL_FAILURE(start(2));
  const Tensor x = input({8, 5}, 3051);  // requires grad: worker1 joins the context when it arrives
  rpc::Future<int64_t> call = [&] {
    DistContext ctx(agent(0));
    rpc::Future<int64_t> f = agent(0).rpcAsync(name(1), kParked, x);
    EXPECT_TRUE(world_.parkedEntered.waitFor());
    EXPECT_EQ(liveContexts(agent(1)), 1u);
    return f;
  }();
  EXPECT_TRUE(allReleased()) << liveCounts();
  std::shared_ptr<rpc::Promise<int64_t>> parked;
  {
    std::lock_guard<std::mutex> lock(world_.mutex);
    parked.swap(world_.parked);
  }
  ASSERT_TRUE(parked);
  parked->setValue(2);
  rpc::Result<int64_t> r = call.result();
  ASSERT_TRUE(r.ok()) << r.error().describe();
  EXPECT_EQ(r.value(), 40 + 2);
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(FailureTest, BackwardErrorsNameTheFailingWorkerAndKeepTheMessage) {
  ASSERT_NO_FATAL_FAILURE(start(3));
  struct Case {
    const char* what;
    std::string failing;  // the worker whose backward function fails
    Behavior behavior;
    bool chained;         // worker0 -> worker1 -> worker2 (fails on worker2) instead of worker0 -> worker1
    std::string message;  // part of the original message
    bool onRoot = false;  // the failing op is recorded on worker0 itself, after what worker1 computed
  };
  const std::vector<Case> cases = {
      {"throwing backward on worker1", "worker1", Behavior::kExplode, false, kExplodeMessage},
      {"wrong-shaped gradient on worker1", "worker1", Behavior::kWrongShape, false, "WrongShapeBackward"},
      {"throwing backward on worker2, two hops away", "worker2", Behavior::kExplode, true, kExplodeMessage},
      {"throwing backward on the root itself", "worker0", Behavior::kExplode, false, kExplodeMessage, true},
  };
  const Tensor x = input({8, 5}, 3101);
  const Tensor y = labels(8, 3, 3102);
  for (const Case& c : cases) {
    for (BackwardMode mode : bothModes()) {
      SCOPED_TRACE(std::string(c.what) + ", " + backwardModeName(mode));
      {
        DistContext ctx(agent(0));
        Tensor loss;
        if (c.chained) {
          Tensor h = agent(0).rpcSync(name(1), kChain, std::string("l1"), name(2), std::string("l2"),
                                      static_cast<int64_t>(c.behavior), std::string(), x);
          loss = headLoss(h, layer("worker0", "head"), y);
        } else if (c.onRoot) {
          Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
          loss = headLoss(withBehavior(world_, h, c.behavior), layer("worker0", "head7"), y);
        } else {
          Tensor h = agent(0).rpcSync(name(1), kLayerWith, std::string("l1"), static_cast<int64_t>(c.behavior), x);
          loss = headLoss(h, layer("worker0", "head7"), y);
        }
        BackwardOptions options;
        options.mode = mode;
        options.timeout = 20s;
        rpc::Error error = rpc::testing::errorOf([&] { ctx.backward(loss, options); });
        const std::string described = error.describe();
        EXPECT_NE(error.kind, rpc::ErrorKind::kTimeout) << described;
        EXPECT_EQ(error.worker, c.failing) << described;
        EXPECT_NE(described.find(c.failing), std::string::npos) << described;
        EXPECT_NE(described.find(c.message), std::string::npos) << described;
      }
      EXPECT_TRUE(allReleased()) << liveCounts();
    }
  }
  expectStillWorking(twoWorkerMlp(3103));
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(FailureTest, CancellationAbortsAPassStuckInARemoteBackward) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const Tensor x = input({8, 5}, 3201);
  const Tensor y = labels(8, 3, 3202);
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    Gate gate = installGate();
    {
      DistContext ctx(agent(0));
      Tensor h = agent(0).rpcSync(name(1), kLayerWith, std::string("l1"), static_cast<int64_t>(Behavior::kGate), x);
      Tensor loss = headLoss(h, layer("worker0", "head7"), y);
      rpc::CancellationSource source;
      BackwardOptions options;
      options.mode = mode;
      options.timeout = 20s;
      options.cancel = source.token();
      rpc::Future<void> pass = ctx.backwardAsync({loss}, options);
      ASSERT_TRUE(gate.entered->waitFor()) << "worker1's backward never started";
      EXPECT_FALSE(pass.isReady());
      source.cancel();
      ASSERT_TRUE(pass.wait(10s)) << "cancelling did not end the pass";
      rpc::Result<void> r = pass.result();
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().kind, rpc::ErrorKind::kCancelled) << r.error().describe();
      gate.release->set();  // worker1's stuck backward function returns into an aborted pass
    }
    EXPECT_TRUE(allReleased()) << liveCounts();
  }
  {
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.onGatedBackward = nullptr;
  }
  // Cancelled before it starts: fails at once.
  {
    const TwoWorkerMlp m = twoWorkerMlp(3203);
    DistContext ctx(agent(0));
    Tensor loss = twoWorkerLoss(m);
    rpc::CancellationSource source;
    source.cancel();
    BackwardOptions options;
    options.cancel = source.token();
    rpc::Error error = rpc::testing::errorOf([&] { ctx.backward(loss, options); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kCancelled) << error.describe();
  }
  expectStillWorking(twoWorkerMlp(3204));
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(FailureTest, DeadlineAbortsAPassStuckInARemoteBackward) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const Tensor x = input({8, 5}, 3301);
  const Tensor y = labels(8, 3, 3302);
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    Gate gate = installGate();
    {
      DistContext ctx(agent(0));
      Tensor h = agent(0).rpcSync(name(1), kLayerWith, std::string("l1"), static_cast<int64_t>(Behavior::kGate), x);
      Tensor loss = headLoss(h, layer("worker0", "head7"), y);
      BackwardOptions options;
      options.mode = mode;
      options.timeout = 300ms;
      const auto begin = SteadyTime::now();
      rpc::Error error = rpc::testing::errorOf([&] { ctx.backward(loss, options); });
      const auto elapsed = SteadyTime::now() - begin;
      EXPECT_EQ(error.kind, rpc::ErrorKind::kTimeout) << error.describe();
      EXPECT_GE(elapsed, 250ms);
      EXPECT_LT(elapsed, 10s);
      gate.release->set();
    }
    EXPECT_TRUE(allReleased()) << liveCounts();
  }
  {
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.onGatedBackward = nullptr;
  }
  expectStillWorking(twoWorkerMlp(3303));
  EXPECT_TRUE(allReleased()) << liveCounts();
}

// Note [Local part done]: BackwardOptions::localDone fires once the root's own nodes have all run (its
// gradients are complete and the gradient for worker1 is on its way) while worker1's backward is still
// stuck in a gate, so before the pass completes; exactly once. (The input is data: an x requiring grad
// would make x's gradient, which comes back from worker1, part of worker0's share of the pass.) A pass whose root part fails never calls
// it; a pass cancelled after the root's part ran has called it, once, and fails.
TEST_P(FailureTest, LocalDoneFiresWhenTheRootsPartHasRunBeforeThePassCompletes) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const Tensor x = input({8, 5}, 3351, /*requiresGrad=*/false);
  const Tensor y = labels(8, 3, 3352);
  const Layer& head = layer("worker0", "head7");
  struct Calls {
    std::atomic<int> count{0};
    rpc::testing::Event event;
  };
  auto withLocalDone = [](BackwardMode mode, const std::shared_ptr<Calls>& calls) {
    BackwardOptions options;
    options.mode = mode;
    options.timeout = 20s;
    options.localDone = [calls] {
      calls->count.fetch_add(1);
      calls->event.set();
    };
    return options;
  };
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    {
      SCOPED_TRACE("worker1's backward held in a gate");
      Gate gate = installGate();
      auto calls = std::make_shared<Calls>();
      DistContext ctx(agent(0));
      Tensor h = agent(0).rpcSync(name(1), kLayerWith, std::string("l1"), static_cast<int64_t>(Behavior::kGate), x);
      Tensor loss = headLoss(h, head, y);
      rpc::Future<void> pass = ctx.backwardAsync({loss}, withLocalDone(mode, calls));
      ASSERT_TRUE(calls->event.waitFor()) << "localDone never fired";
      ASSERT_TRUE(gate.entered->waitFor()) << "worker1's backward never started";
      EXPECT_FALSE(pass.isReady()) << "the pass completed while worker1's backward was held";
      // Every node of worker0 ran: its gradients are there before the pass completes.
      EXPECT_TRUE(ctx.gradients().contains(head.weight));
      EXPECT_TRUE(ctx.gradients().contains(head.bias));
      gate.release->set();
      ASSERT_TRUE(pass.wait(10s)) << "the pass did not complete after the gate opened";
      rpc::Result<void> r = pass.result();
      EXPECT_TRUE(r.ok()) << r.error().describe();
      EXPECT_EQ(calls->count.load(), 1);
    }
    {
      std::lock_guard<std::mutex> lock(world_.mutex);
      world_.onGatedBackward = nullptr;
    }
    {
      SCOPED_TRACE("the root's own part fails");
      auto calls = std::make_shared<Calls>();
      DistContext ctx(agent(0));
      Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
      Tensor loss = withBehavior(world_, headLoss(h, head, y), Behavior::kExplode);
      rpc::Future<void> pass = ctx.backwardAsync({loss}, withLocalDone(mode, calls));
      ASSERT_TRUE(pass.wait(10s));
      rpc::Result<void> r = pass.result();
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().worker, "worker0") << r.error().describe();
      EXPECT_EQ(calls->count.load(), 0) << "localDone fired for a pass whose root part failed";
    }
    {
      SCOPED_TRACE("the pass fails after the root's part ran");
      Gate gate = installGate();
      auto calls = std::make_shared<Calls>();
      DistContext ctx(agent(0));
      Tensor h = agent(0).rpcSync(name(1), kLayerWith, std::string("l1"), static_cast<int64_t>(Behavior::kGate), x);
      Tensor loss = headLoss(h, head, y);
      rpc::CancellationSource source;
      BackwardOptions options = withLocalDone(mode, calls);
      options.cancel = source.token();
      rpc::Future<void> pass = ctx.backwardAsync({loss}, options);
      ASSERT_TRUE(calls->event.waitFor()) << "localDone never fired";
      ASSERT_TRUE(gate.entered->waitFor()) << "worker1's backward never started";
      source.cancel();
      ASSERT_TRUE(pass.wait(10s)) << "cancelling did not end the pass";
      rpc::Result<void> r = pass.result();
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().kind, rpc::ErrorKind::kCancelled) << r.error().describe();
      gate.release->set();
      EXPECT_EQ(calls->count.load(), 1);
    }
    {
      std::lock_guard<std::mutex> lock(world_.mutex);
      world_.onGatedBackward = nullptr;
    }
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
  expectStillWorking(twoWorkerMlp(3353));
  EXPECT_TRUE(allReleased()) << liveCounts();
}

// Note [Local part done], on every worker: whenLocalPartDone completes on the root once its own nodes ran
// and on worker1 only once its (gated) part ran, each before the pass completes; asked again afterwards it is
// ready at once. It fails when the context is released first, when the pass fails before the part ran, and
// when its token is cancelled, which also releases a context that only the wait joined; a context created
// here and ended is a ValueError.
TEST_P(FailureTest, WhenLocalPartDoneCompletesOnEachWorkerOnceItsPartRan) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const Tensor x = input({8, 5}, 3361, /*requiresGrad=*/false);
  const Tensor y = labels(8, 3, 3362);
  const Layer& head = layer("worker0", "head7");
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    Gate gate = installGate();
    DistContext ctx(agent(0));
    // Asked before worker1 has seen the context: it joins it.
    rpc::Future<void> done1 = whenLocalPartDone(agent(1), ctx.id());
    rpc::Future<void> done0 = whenLocalPartDone(agent(0), ctx.id());
    Tensor h = agent(0).rpcSync(name(1), kLayerWith, std::string("l1"), static_cast<int64_t>(Behavior::kGate), x);
    BackwardOptions options;
    options.mode = mode;
    options.timeout = 20s;
    rpc::Future<void> pass = ctx.backwardAsync({headLoss(h, head, y)}, options);
    ASSERT_TRUE(done0.wait(10s)) << "worker0's part never reported";
    ASSERT_TRUE(gate.entered->waitFor()) << "worker1's backward never started";
    EXPECT_TRUE(done0.result().ok());
    EXPECT_FALSE(done1.isReady()) << "worker1's part reported while its backward was held";
    EXPECT_FALSE(pass.isReady());
    gate.release->set();
    ASSERT_TRUE(done1.wait(10s)) << "worker1's part never reported";
    rpc::Result<void> r1 = done1.result();
    EXPECT_TRUE(r1.ok()) << r1.error().describe();
    ASSERT_TRUE(pass.wait(10s));
    EXPECT_TRUE(pass.result().ok());
    EXPECT_TRUE(whenLocalPartDone(agent(1), ctx.id()).isReady());
    EXPECT_TRUE(whenLocalPartDone(agent(0), ctx.id()).isReady());
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.onGatedBackward = nullptr;
  }
  {
    SCOPED_TRACE("released before the part ran");
    DistContext ctx(agent(0));
    (void)agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
    rpc::Future<void> done1 = whenLocalPartDone(agent(1), ctx.id());
    ctx.end();
    ASSERT_TRUE(done1.wait(10s));
    rpc::Result<void> r = done1.result();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().kind, rpc::ErrorKind::kCancelled);
    EXPECT_NE(r.error().message.find("released before a backward pass"), std::string::npos) << r.error().describe();
  }
  {
    SCOPED_TRACE("the pass fails before the part ran");
    DistContext ctx(agent(0));
    Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
    rpc::Future<void> done0 = whenLocalPartDone(agent(0), ctx.id());
    Tensor loss = withBehavior(world_, headLoss(h, head, y), Behavior::kExplode);
    rpc::Future<void> pass = ctx.backwardAsync({loss});
    ASSERT_TRUE(pass.wait(10s));
    EXPECT_FALSE(pass.result().ok());
    ASSERT_TRUE(done0.wait(10s));
    rpc::Result<void> r = done0.result();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().worker, "worker0") << r.error().describe();
  }
  {
    SCOPED_TRACE("cancelled: a context only the wait joined goes with it");
    ASSERT_TRUE(allReleased()) << liveCounts();
    DistContext ctx(agent(0));
    rpc::CancellationSource source;
    rpc::Future<void> done1 = whenLocalPartDone(agent(1), ctx.id(), source.token());
    EXPECT_EQ(liveContexts(agent(1)), 1u);
    source.cancel(rpc::Error::timeout("the caller's deadline passed"));
    ASSERT_TRUE(done1.wait(10s));
    rpc::Result<void> r = done1.result();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().kind, rpc::ErrorKind::kTimeout) << r.error().describe();
    EXPECT_EQ(liveContexts(agent(1)), 0u);
  }
  {
    DistContext ended(agent(0));
    const uint64_t id = ended.id();
    ended.end();
    EXPECT_THROW((void)whenLocalPartDone(agent(0), id), ValueError);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
  expectStillWorking(twoWorkerMlp(3363));
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(FailureTest, BadRootsAreValueErrorsAndLeaveTheContextUsable) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const TwoWorkerMlp m = twoWorkerMlp(3401);
  {
    DistContext ctx(agent(0));
    Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), m.x);
    Tensor loss = headLoss(applyLayer(h, layer("worker0", "l2")), layer("worker0", "head"), m.y);
    // Not requiring grad.
    EXPECT_THROW(ctx.backward(loss.detach()), ValueError);
    EXPECT_THROW(ctx.backward(Tensor::scalar(1.0, DType::kFloat64)), ValueError);
    // Non-scalar without an explicit gradient.
    EXPECT_THROW(ctx.backward(h), ValueError);
    // Explicit gradients: wrong count, wrong shape.
    EXPECT_THROW(ctx.backward({loss, h}, {}, {Tensor::scalar(1.0, DType::kFloat64)}), ValueError);
    EXPECT_THROW(ctx.backward({h}, {}, {Tensor::ones({8, 6}, DType::kFloat64)}), ValueError);
    // No gradient arrived anywhere, and the context still runs a correct pass.
    EXPECT_EQ(ctx.gradients().size(), 0u);
    EXPECT_EQ(gradientsOf(agent(1), ctx.id()).size(), 0u);
    ctx.backward(loss);
    expectGradients(ctx, 0, m.expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

INSTANTIATE_TEST_SUITE_P(Transports, FailureTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------- a worker dies mid-backward (processes)

// worker1 runs in a forked child; worker0 (the root) and worker2 in this process. The forward goes
// worker0 -> worker2 (l1) -> worker1 (l2, gated): in the backward, worker1's gated function tells the parent
// through a pipe that it runs and then never returns, and the parent kills or stops the child.
class WorkerDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int portPipe[2];
    int notifyPipe[2];
    ASSERT_EQ(pipe(portPipe), 0);
    ASSERT_EQ(pipe(notifyPipe), 0);
    // Forked before this test starts any agent thread.
    child_ = fork();
    if (child_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      close(notifyPipe[0]);
      int storePort = 0;
      if (read(portPipe[0], &storePort, sizeof(storePort)) != sizeof(storePort)) _exit(2);
      try {
        World world;
        world.layers["worker1"] = makeLayers("worker1");
        const int notify = notifyPipe[1];
        world.onGatedBackward = [notify] {
          const char byte = 1;
          if (write(notify, &byte, 1) != 1) _exit(4);
          while (true) pause();  // stuck for good: the parent kills this process
        };
        rpc::Registry reg;
        bindStages(reg, world);
        auto agent = rpc::Agent::start(rpc::testing::processOptions(1, 3, storePort, kSecret), reg);
        while (true) pause();
      } catch (...) {
        _exit(3);
      }
    }
    ASSERT_GT(child_, 0);
    close(notifyPipe[1]);
    notify_ = notifyPipe[0];
    store_ = rpc::StoreServer::start("127.0.0.1:0");
    const int port = store_->port();
    ASSERT_EQ(write(portPipe[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
    close(portPipe[0]);
    close(portPipe[1]);

    for (const char* worker : {"worker0", "worker2"}) world_.layers[worker] = makeLayers(worker);
    bindStages(registry_, world_);
    rpc::testing::startProcessAgentPair(0, agent0_, 2, agent2_, 3, port, kSecret, registry_);
    if (HasFatalFailure()) return;
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.agents["worker0"] = agent0_.get();
    world_.agents["worker2"] = agent2_.get();
  }
  void TearDown() override {
    if (child_ > 0) {
      kill(child_, SIGKILL);
      int status = 0;
      waitpid(child_, &status, 0);
    }
    if (agent0_) agent0_->shutdown(false);
    if (agent2_) agent2_->shutdown(false);
    agent0_.reset();
    agent2_.reset();
    store_.reset();
    if (notify_ >= 0) close(notify_);
  }

  // Waits (bounded) for the child's byte saying its backward function runs.
  bool childBackwardRuns() {
    pollfd p{notify_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::chrono::milliseconds(rpc::testing::kTestTimeout).count())) != 1) return false;
    char byte = 0;
    return read(notify_, &byte, 1) == 1;
  }

  // worker1 dies by `signal` in the middle of a `mode` pass: the pass fails as disconnected naming worker1
  // within `bound`, the survivors release the context, and they still run a new one between themselves.
  // `nested`: worker0 -> worker2 (l1) -> worker1 (l2, gated), so worker0 never talked to worker1 itself;
  // otherwise worker0 calls worker2 (l1) and then worker1 (l2, gated) one after the other.
  void workerDiesMidBackward(int signal, BackwardMode mode, std::chrono::milliseconds bound, bool nested) {
    const Tensor x = input({8, 5}, 3501);
    const Tensor y = labels(8, 3, 3502);
    {
      DistContext ctx(*agent0_);
      Tensor h;
      if (nested) {
        h = agent0_->rpcSync("worker2", kChain, std::string("l1"), std::string("worker1"), std::string("l2"),
                             static_cast<int64_t>(Behavior::kGate), std::string(), x);
      } else {
        Tensor h1 = agent0_->rpcSync("worker2", kLayer, std::string("l1"), x);
        h = agent0_->rpcSync("worker1", kLayerWith, std::string("l2"), static_cast<int64_t>(Behavior::kGate), h1);
      }
      Tensor loss = headLoss(h, world_.layer("worker0", "head"), y);
      EXPECT_EQ(liveContexts(*agent2_), 1u);
      BackwardOptions options;
      options.mode = mode;
      options.timeout = 30s;  // far beyond the bound: only the death of worker1 may end the pass
      rpc::Future<void> pass = ctx.backwardAsync({loss}, options);
      ASSERT_TRUE(childBackwardRuns()) << "worker1's backward never started";
      ASSERT_EQ(kill(child_, signal), 0);
      const auto begin = SteadyTime::now();
      ASSERT_TRUE(pass.wait(rpc::testing::kTestTimeout)) << "the pass outlived worker1";
      const auto elapsed = SteadyTime::now() - begin;
      rpc::Result<void> r = pass.result();
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().kind, rpc::ErrorKind::kDisconnected) << r.error().describe();
      EXPECT_NE(r.error().describe().find("worker1"), std::string::npos) << r.error().describe();
      EXPECT_LT(elapsed, bound) << r.error().describe();
    }
    // Ending the context does not wait on the dead worker, and both survivors let go of their parts.
    EXPECT_TRUE(eventually([&] { return liveContexts(*agent0_) == 0 && liveContexts(*agent2_) == 0; }, bound))
        << "worker0: " << liveContexts(*agent0_) << " live, worker2: " << liveContexts(*agent2_) << " live";
    {
      DistContext ctx(*agent0_);
      Tensor h = agent0_->rpcSync("worker2", kLayer, std::string("l1"), x);
      Tensor loss = headLoss(h, world_.layer("worker0", "head7"), y);
      ctx.backward(loss);
      EXPECT_TRUE(gradientsOf(*agent2_, ctx.id()).contains(world_.layer("worker2", "l1").weight));
    }
    EXPECT_TRUE(eventually([&] { return liveContexts(*agent0_) == 0 && liveContexts(*agent2_) == 0; }));
  }

  static constexpr const char* kSecret = "dist-autograd-death";
  pid_t child_ = -1;
  int notify_ = -1;
  std::unique_ptr<rpc::StoreServer> store_;
  World world_;
  rpc::Registry registry_;
  std::unique_ptr<rpc::Agent> agent0_;
  std::unique_ptr<rpc::Agent> agent2_;
};

TEST_F(WorkerDeathTest, KilledWorkerBehindAnotherFailsThePassAndTheSurvivorsRelease) {
  // worker0 only ever talked to worker2; worker2 called worker1. The connection closes at once: well within one
  // heartbeat timeout (1 s) plus slack.
  workerDiesMidBackward(SIGKILL, BackwardMode::kExact, 2000ms, /*nested=*/true);
}

TEST_F(WorkerDeathTest, KilledWorkerTheRootCalledFailsThePassAndTheSurvivorsRelease) {
  workerDiesMidBackward(SIGKILL, BackwardMode::kFast, 2000ms, /*nested=*/false);
}

TEST_F(WorkerDeathTest, StoppedWorkerBehindAnotherFailsThePassWithinTheHeartbeatBound) {
  // Only the heartbeat timeout (1 s) notices a stopped process: one timeout plus slack.
  workerDiesMidBackward(SIGSTOP, BackwardMode::kFast, 1000ms + 1500ms, /*nested=*/true);
}

}  // namespace
}  // namespace distgrad::autograd::distributed::e2e
