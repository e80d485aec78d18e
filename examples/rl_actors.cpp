// rl_actors: one agent and N observers learning CartPole with REINFORCE, PyTorch's "distributed RL with
// RPC" tutorial (with its batched-inference variant) done natively.
//
// Rank 0 is the agent: it holds the policy (an MLP 4 -> --hidden -> 2) and its Adam optimizer. Ranks 1..N are
// observers, each with its own CartPole (models/rl/cartpole.h). For every episode the agent asks all
// observers at once to play one episode (rl.run_episode); each observer, to choose each move, calls BACK
// into the agent with its state (rl.select_action, a nested call that arrives while the agent is itself
// waiting on the observers) and finally returns its rewards. The agent then turns each observer's rewards
// into discounted returns (--gamma), normalises them over the whole episode batch, and steps Adam on the
// REINFORCE loss sum(-log pi(a_t | s_t) * G_t) over the log-probabilities it saved when it chose the moves.
//
// Why nothing can deadlock, even with one executor thread per process (the test runs it that way):
// select_action is an asynchronous handler. It parks the observer's request with a promise and returns the
// promise's future at once, holding no thread; the agent runs the policy once for a whole batch (one state
// per observer still playing, so N requests become one forward pass) from whichever thread completes the
// batch: the handler of the last request to arrive, or the continuation that sees an observer's episode end.
// The observers' episode loop is a coroutine that co_awaits each action, so they hold no thread either, and
// the agent's main thread (not an executor thread) is the only thing that blocks, on the episode results.
//
// Determinism: the policy is built from --seed, observer k's environment from (--seed, k), and the agent
// samples the actions of a batch in observer order from one seeded generator; a batch always holds exactly
// the observers still playing, so the run is the same for a seed however the messages interleave.
//
// Running reward: an exponential moving average (weight 0.05, started at the first episode's value) of the
// mean reward of an episode over the observers. CartPole counts as solved when it reaches
// --reward-threshold (by default 0.95 x --max-steps: Gym's CartPole-v1 threshold, 475 of 500 steps); the
// run stops there or after --episodes.
//
//   build/tools/distgrad-run --nproc 3 -- build/examples/rl_actors [--episodes N] [--gamma X] [--lr X]
//       [--seed N] [--max-steps N] [--reward-threshold X] [--hidden N] [--log-every N] [--threads N]
// The last line rank 0 prints is {"example":"rl_actors","mode":"rl_actors",...}.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "models/optim/adam.h"
#include "models/rl/cartpole.h"
#include "models/zoo/mlp.h"
#include "rpc/agent.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
using models::rl::CartPole;
using Clock = std::chrono::steady_clock;

namespace rl {
// Observer: plays one episode, asking the calling agent for every move; returns the rewards of its steps
// and the seconds its environment took.
inline const rpc::Function<std::tuple<std::vector<double>, double>()> kRunEpisode{"rl.run_episode"};
// Agent: the action for observer `observer` in `state` (answered once the batch it joins is complete).
inline const rpc::Function<int64_t(int64_t, std::vector<double>)> kSelectAction{"rl.select_action"};
inline const rpc::Function<double()> kPeakRss{"rl.peak_rss_mib"};
}  // namespace rl

namespace {

struct Options {
  std::string device = "cpu";  // --device
  int64_t episodes = 500;
  double gamma = 0.99;
  double lr = 1e-2;
  uint64_t seed = 0;
  int64_t maxSteps = 500;
  double rewardThreshold = 0;  // 0: 0.95 * maxSteps
  int64_t hidden = 128;
  int64_t logEvery = 10;
  int threads = 1;
};

Options parseArgs(int argc, char** argv) {
  Options o;
  examples::Flags flags("rl_actors",
                        "REINFORCE on CartPole: an agent (rank 0) and WORLD_SIZE-1 observers that call back into it; "
                        "run with distgrad-run --nproc 1+N");
  flags.add("--episodes", o.episodes, "most episodes (each: one episode per observer, one policy update)")
      .add("--gamma", o.gamma, "discount factor")
      .add("--lr", o.lr, "Adam learning rate")
      .add("--seed", o.seed, "policy, environment and sampling seed")
      .add("--max-steps", o.maxSteps, "steps after which an episode is truncated (CartPole-v1: 500)")
      .add("--reward-threshold", o.rewardThreshold, "running reward that counts as solved (0: 0.95 x --max-steps)")
      .add("--hidden", o.hidden, "policy hidden units")
      .add("--log-every", o.logEvery, "print a progress line every N episodes")
      .add("--threads", o.threads, "oneDNN threads per process")
      .add("--device", o.device, examples::kDeviceHelp);
  flags.parse(argc, argv);
  (void)examples::cpuOnlyDeviceFromFlag(flags, o.device,
                                        "the policy answers one observation at a time over RPC; a GPU would only "
                                        "add a transfer per action, and CUDA tensors over RPC are issue 9's RPC "
                                        "part");
  flags.require(o.episodes >= 1 && o.maxSteps >= 1 && o.hidden >= 1 && o.logEvery >= 1 && o.threads >= 1,
                "--episodes, --max-steps, --hidden, --log-every, --threads must be >= 1");
  flags.require(o.gamma > 0 && o.gamma <= 1 && o.lr > 0, "--gamma must be in (0, 1], --lr > 0");
  flags.require(o.rewardThreshold >= 0 && o.rewardThreshold <= static_cast<double>(o.maxSteps),
                "--reward-threshold must be in [0, --max-steps]");
  if (o.rewardThreshold == 0) o.rewardThreshold = 0.95 * static_cast<double>(o.maxSteps);
  return o;
}

// The observer's episode loop. A coroutine: each co_await gives its thread back while the agent decides;
// it resumes on `executor` (a coroutine's first Executor& parameter is its home).
rpc::Future<std::tuple<std::vector<double>, double>> playEpisode(rpc::Executor& executor, rpc::Agent* agent,
                                                                 std::string agentName, std::shared_ptr<CartPole> env) {
  const int64_t me = agent->rank();
  std::vector<double> rewards;
  double envSeconds = 0;
  CartPole::State state = env->reset();
  for (;;) {
    const int64_t action =
        co_await agent->rpcAsync(agentName, rl::kSelectAction, me, std::vector<double>(state.begin(), state.end()));
    const auto t0 = Clock::now();
    const CartPole::Step step = env->step(action);
    envSeconds += examples::secondsSince(t0);
    rewards.push_back(step.reward);
    state = step.state;
    if (step.terminated || step.truncated) break;
  }
  co_return std::make_tuple(std::move(rewards), envSeconds);
}

// The agent's side of the observers' calls: batches their requests, runs the policy, remembers the
// log-probabilities of the chosen actions for the update. Called from executor threads (requests, episode
// ends) and the main thread (begin/take), all under one mutex.
class PolicyServer {
 public:
  PolicyServer(std::shared_ptr<models::MLP> policy, uint64_t seed) : policy_(std::move(policy)), sampler_(seed) {}

  // Before asking the observers to play: `observers` of them will send requests until their episode ends.
  void beginEpisode(int64_t observers) {
    std::lock_guard<std::mutex> lock(mutex_);
    playing_ = observers;
    active_.assign(static_cast<size_t>(observers) + 1, true);
    active_[0] = false;  // the agent itself
    saved_.assign(static_cast<size_t>(observers) + 1, {});
  }

  rpc::Future<int64_t> selectAction(rpc::Executor& executor, int64_t observer, std::vector<double> state) {
    rpc::Promise<int64_t> promise(executor);
    rpc::Future<int64_t> action = promise.getFuture();
    std::lock_guard<std::mutex> lock(mutex_);
    // A request from an observer that is not playing, or that already waits for an action, would stall
    // the batches (they wait for one request per playing observer): refuse it.
    const bool playing = observer >= 0 && observer < static_cast<int64_t>(active_.size()) && active_[observer];
    const bool waiting =
        std::any_of(pending_.begin(), pending_.end(), [&](const Request& r) { return r.observer == observer; });
    if (!playing || waiting || state.size() != static_cast<size_t>(CartPole::kObservationSize)) {
      promise.setError(rpc::Error::failed("select_action: unexpected request from observer " +
                                          std::to_string(observer) + (playing ? "" : " (not playing)") +
                                          (waiting ? " (already waiting for an action)" : "")));
      return action;
    }
    pending_.push_back(Request{observer, std::move(state), std::move(promise)});
    if (static_cast<int64_t>(pending_.size()) == playing_) serveBatchLocked();
    return action;
  }

  // Observer `observer`'s episode is over (its result, or its failure, reached the agent): the batches
  // stop waiting for it.
  void observerDone(int64_t observer) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (observer < 0 || observer >= static_cast<int64_t>(active_.size()) || !active_[observer]) return;
    active_[observer] = false;
    --playing_;
    // Only a failed observer can still have a request parked here; its caller has given up on it.
    std::erase_if(pending_, [&](Request& r) {
      if (r.observer != observer) return false;
      r.promise.setError(rpc::Error::failed("select_action: observer " + std::to_string(observer) + " stopped"));
      return true;
    });
    if (!pending_.empty() && static_cast<int64_t>(pending_.size()) == playing_) serveBatchLocked();
  }

  // Observer k's saved -log pi(a_t | s_t), in step order (index 0 unused); clears them.
  std::vector<std::vector<Tensor>> takeEpisode() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(saved_);
  }
  double computeSeconds() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return computeSeconds_;
  }
  double meanBatch() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return batches_ > 0 ? static_cast<double>(requests_) / static_cast<double>(batches_) : 0.0;
  }

 private:
  struct Request {
    int64_t observer;
    std::vector<double> state;
    rpc::Promise<int64_t> promise;
  };

  void serveBatchLocked() {
    const auto t0 = Clock::now();
    autograd::EnableGradGuard grad;  // the update needs the graph from states to log-probabilities
    std::sort(pending_.begin(), pending_.end(),
              [](const Request& a, const Request& b) { return a.observer < b.observer; });
    const auto n = static_cast<int64_t>(pending_.size());
    std::vector<float> states;
    for (const Request& r : pending_) states.insert(states.end(), r.state.begin(), r.state.end());
    const Tensor logProbs =
        logSoftmax(policy_->forward(Tensor::fromVector(states, {n, CartPole::kObservationSize})), 1);
    const std::vector<float> p = exp(logProbs.detach()).toVector<float>();
    std::vector<int64_t> actions(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) actions[i] = sampler_.uniform01() < p[static_cast<size_t>(2 * i)] ? 0 : 1;
    const Tensor negLogProbs = nllLoss(logProbs, Tensor::fromVector(actions, {n}), Reduction::kNone);  // [n]
    for (int64_t i = 0; i < n; ++i) {
      Request& r = pending_[static_cast<size_t>(i)];
      saved_[static_cast<size_t>(r.observer)].push_back(select(negLogProbs, 0, i));
      r.promise.setValue(actions[static_cast<size_t>(i)]);  // its continuation runs later, on the executor
    }
    pending_.clear();
    ++batches_;
    requests_ += n;
    computeSeconds_ += examples::secondsSince(t0);
  }

  mutable std::mutex mutex_;
  std::shared_ptr<models::MLP> policy_;
  tensor::Generator sampler_;
  int64_t playing_ = 0;       // observers still in this episode
  std::vector<bool> active_;  // by observer rank: still in this episode
  std::vector<Request> pending_;
  std::vector<std::vector<Tensor>> saved_;
  int64_t batches_ = 0, requests_ = 0;
  double computeSeconds_ = 0;
};

// Discounted returns G_t = r_t + gamma G_{t+1} of one episode.
std::vector<double> discountedReturns(const std::vector<double>& rewards, double gamma) {
  std::vector<double> out(rewards.size());
  double g = 0;
  for (size_t t = rewards.size(); t-- > 0;) out[t] = g = rewards[t] + gamma * g;
  return out;
}

double meanOf(const std::vector<double>& v, size_t first, size_t count) {
  count = std::min(count, v.size() - first);
  return std::accumulate(v.begin() + static_cast<std::ptrdiff_t>(first),
                         v.begin() + static_cast<std::ptrdiff_t>(first + count), 0.0) /
         static_cast<double>(count);
}

int runAgent(rpc::Agent& agent, const Options& opt, const std::shared_ptr<models::MLP>& policy,
             const std::shared_ptr<PolicyServer>& server) {
  const int64_t observers = agent.worldSize() - 1;
  models::optim::Adam optimizer(policy->parameters(), {.learningRate = opt.lr});
  std::printf(
      "rl_actors: agent %s, %lld observers, CartPole (max %lld steps, solved at running reward %g), "
      "policy MLP(4, %lld, 2), Adam lr %g, gamma %g\n",
      agent.name().c_str(), static_cast<long long>(observers), static_cast<long long>(opt.maxSteps),
      opt.rewardThreshold, static_cast<long long>(opt.hidden), opt.lr, opt.gamma);

  std::vector<double> episodeRewards;  // mean over the observers, per episode
  double running = 0;
  int64_t solvedAt = -1;
  int64_t steps = 0;
  double updateSeconds = 0, envSeconds = 0;
  const auto start = Clock::now();
  auto lastLog = start;
  int64_t stepsAtLastLog = 0;
  for (int64_t episode = 1; episode <= opt.episodes; ++episode) {
    server->beginEpisode(observers);
    std::vector<rpc::Future<std::tuple<std::vector<double>, double>>> runs;
    for (int64_t k = 1; k <= observers; ++k) {
      runs.push_back(agent.rpcAsync("worker" + std::to_string(k), rl::kRunEpisode)
                         .then([server, k](rpc::Result<std::tuple<std::vector<double>, double>>&& r) {
                           server->observerDone(k);  // success or not: stop waiting for its requests
                           return std::move(r);
                         }));
    }
    std::vector<rpc::Result<std::tuple<std::vector<double>, double>>> results =
        rpc::whenAll(std::move(runs), &agent.executor()).get();

    // REINFORCE over every observer's episode: returns normalised over the batch (the tutorial's variance
    // reduction), loss = sum over all moves of -log pi(a_t | s_t) * G_t.
    const auto t0 = Clock::now();
    std::vector<std::vector<Tensor>> saved = server->takeEpisode();
    std::vector<Tensor> negLogProbs;
    std::vector<double> returns;
    double rewardSum = 0, slowestEnv = 0;
    for (int64_t k = 1; k <= observers; ++k) {
      auto& [rewards, seconds] = results[static_cast<size_t>(k - 1)].value();  // throws the observer's error
      DG_CHECK(saved[k].size() == rewards.size(), "observer ", k, " reported ", rewards.size(), " rewards for ",
               saved[k].size(), " actions");
      const std::vector<double> g = discountedReturns(rewards, opt.gamma);
      returns.insert(returns.end(), g.begin(), g.end());
      negLogProbs.insert(negLogProbs.end(), saved[k].begin(), saved[k].end());
      rewardSum += std::accumulate(rewards.begin(), rewards.end(), 0.0);
      steps += static_cast<int64_t>(rewards.size());
      slowestEnv = std::max(slowestEnv, seconds);
    }
    envSeconds += slowestEnv;
    const double mean = std::accumulate(returns.begin(), returns.end(), 0.0) / static_cast<double>(returns.size());
    double var = 0;
    for (double g : returns) var += (g - mean) * (g - mean);
    const double stddev = std::sqrt(var / static_cast<double>(returns.size()));
    std::vector<float> normalised;
    for (double g : returns) normalised.push_back(static_cast<float>((g - mean) / (stddev + 1e-8)));
    const auto numMoves = static_cast<int64_t>(normalised.size());
    Tensor loss = sum(stack(negLogProbs, 0) * Tensor::fromVector(normalised, {numMoves}));
    optimizer.zeroGrad();
    distgrad::backward(loss);
    optimizer.step();
    updateSeconds += examples::secondsSince(t0);

    const double reward = rewardSum / static_cast<double>(observers);
    episodeRewards.push_back(reward);
    running = episode == 1 ? reward : 0.95 * running + 0.05 * reward;
    const bool solved = running >= opt.rewardThreshold;
    if (episode % opt.logEvery == 0 || solved || episode == opt.episodes) {
      const auto now = Clock::now();
      std::printf("episode %lld/%lld: reward %.1f, running reward %.1f, %.0f steps/s\n",
                  static_cast<long long>(episode), static_cast<long long>(opt.episodes), reward, running,
                  static_cast<double>(steps - stepsAtLastLog) / std::chrono::duration<double>(now - lastLog).count());
      std::fflush(stdout);
      lastLog = now;
      stepsAtLastLog = steps;
    }
    if (solved) {
      solvedAt = episode;
      std::printf("solved after %lld episodes: running reward %.1f >= %g\n", static_cast<long long>(episode), running,
                  opt.rewardThreshold);
      break;
    }
  }
  const double seconds = examples::secondsSince(start);
  const auto ran = static_cast<int64_t>(episodeRewards.size());

  double rssMax = examples::peakRssMiB();
  for (int64_t k = 1; k <= observers; ++k) {
    rssMax = std::max(rssMax, agent.rpcSync("worker" + std::to_string(k), rl::kPeakRss));
  }
  // The agent's compute (policy batches and updates) and the environments' (the slowest observer of each
  // episode) against the wall time; the rest went to messages and waiting for them.
  const double compute = server->computeSeconds() + updateSeconds + envSeconds;
  examples::JsonLine("rl_actors")
      .add("mode", "rl_actors")
      .add("workers", agent.worldSize())
      .add("observers", observers)
      .add("model", "mlp(4," + std::to_string(opt.hidden) + ",2)")
      .add("episodes", ran)
      .add("max_steps", opt.maxSteps)
      .add("gamma", opt.gamma)
      .add("lr", opt.lr)
      .add("seed", static_cast<int64_t>(opt.seed))
      .add("running_reward", running)
      .add("reward_threshold", opt.rewardThreshold)
      .add("solved", solvedAt > 0)
      .add("episodes_to_solve", solvedAt)
      .add("first10_reward", meanOf(episodeRewards, 0, 10))
      .add("last10_reward", meanOf(episodeRewards, static_cast<size_t>(std::max<int64_t>(0, ran - 10)), 10))
      .add("env_steps", steps)
      .add("steps_per_s", static_cast<double>(steps) / seconds)
      .add("mean_policy_batch", server->meanBatch())
      .add("seconds", seconds)
      .add("rpc_overhead_share", 1.0 - compute / seconds)
      .add("peak_rss_mib", examples::peakRssMiB())
      .add("peak_rss_mib_max", rssMax)
      .print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parseArgs(argc, argv);
  try {
    tensor::setNumThreads(opt.threads);
    const rpc::Options rpcOptions = rpc::Options::fromEnv();
    rpc::Registry reg;
    reg.bind(rl::kPeakRss, [] { return examples::peakRssMiB(); });
    std::shared_ptr<models::MLP> policy;
    std::shared_ptr<PolicyServer> server;
    if (rpcOptions.rank == 0) {
      tensor::Generator gen(opt.seed);
      policy = std::make_shared<models::MLP>(
          std::vector<int64_t>{CartPole::kObservationSize, opt.hidden, CartPole::kNumActions}, gen);
      server = std::make_shared<PolicyServer>(policy, opt.seed + 1);
      reg.bind(rl::kSelectAction, [server](const rpc::CallContext& ctx, int64_t observer, std::vector<double> state) {
        return server->selectAction(ctx.agent->executor(), observer, std::move(state));
      });
    } else {
      // One environment per observer, seeded by (seed, rank); it lives as long as the process.
      auto env = std::make_shared<CartPole>(opt.seed * 1'000'003 + static_cast<uint64_t>(rpcOptions.rank),
                                            models::rl::CartPoleOptions{.maxEpisodeSteps = opt.maxSteps});
      reg.bind(rl::kRunEpisode, [env](const rpc::CallContext& ctx) {
        return playEpisode(ctx.agent->executor(), ctx.agent, ctx.caller, env);
      });
    }
    auto agent = rpc::Agent::start(rpcOptions, reg);
    if (agent->worldSize() < 2) {
      std::cerr << "rl_actors: needs an agent and at least one observer: run it with distgrad-run --nproc 1+N\n";
      agent->shutdown(false);
      return 2;
    }
    int status = 0;
    if (agent->rank() == 0) {
      status = runAgent(*agent, opt, policy, server);
    }
    agent->shutdown();  // the observers serve until the agent is done: the graceful shutdown is a barrier
    return status;
  } catch (const std::exception& e) {
    std::cerr << "rl_actors: error: " << e.what() << "\n";
    return 1;
  }
}
