// Two agents in two processes for the RPC benchmarks: worker1 in a child forked before any thread of this
// process exists (pinned with it when asked), worker0 in this process, which hosts the store. The child's
// main thread blocks on a pipe (reporting its process CPU time on request) while its agent serves. Pin
// this process before constructing a pinned pair so that the agent's threads inherit the mask.
// Not thread-safe; one pair at a time per process.
#pragma once

#include <unistd.h>

#include <functional>
#include <memory>
#include <string>

#include "bench/bench_util.h"
#include "bench/socket_bench_util.h"
#include "rpc/agent.h"
#include "rpc/store.h"

namespace distgrad::bench {

class AgentPair {
 public:
  // `options(rank, storeAddress)` and `registry(rank)` give each side's settings; `childSetup` runs in the
  // child before its agent starts.
  AgentPair(bool pinned, std::function<rpc::Options(int, const std::string&)> options,
            std::function<rpc::Registry(int)> registry, std::function<void()> childSetup = {}) {
    int toChild[2], fromChild[2];
    check(pipe(toChild) == 0 && pipe(fromChild) == 0, "pipe");
    child_ = forkChild(pinned, [&] {
      ::close(toChild[1]);
      ::close(fromChild[0]);
      if (childSetup) childSetup();
      runChild(toChild[0], fromChild[1], options, registry);
    });
    ::close(toChild[0]);
    ::close(fromChild[1]);
    toChild_ = toChild[1];
    fromChild_ = fromChild[0];
    store_ = rpc::StoreServer::start("127.0.0.1:0");
    int storePort = store_->port();
    check(::write(toChild_, &storePort, sizeof(storePort)) == sizeof(storePort), "write store port");
    agent_ = rpc::Agent::start(options(0, store_->address()), registry(0));
  }
  AgentPair(const AgentPair&) = delete;
  AgentPair& operator=(const AgentPair&) = delete;
  ~AgentPair() {
    check(::write(toChild_, &kQuit, 1) == 1, "write quit");
    agent_->shutdown();  // meets the child's shutdown at the store barrier
    agent_.reset();
    // Neither agent hosts the store, so neither waits at the last barrier for the other's final write: the
    // store closes only once the child has exited (closing it first failed the child's shutdown).
    reap(child_);
    store_.reset();
    ::close(toChild_);
    ::close(fromChild_);
  }

  rpc::Agent& agent() { return *agent_; }

  // The child process's CPU seconds so far (all its threads).
  double childCpuSeconds() {
    check(::write(toChild_, &kReportCpu, 1) == 1, "write cpu request");
    double seconds = 0;
    check(::read(fromChild_, &seconds, sizeof(seconds)) == sizeof(seconds), "read child cpu");
    return seconds;
  }

  // Options both benchmarks share: tcp on 127.0.0.1, the store at `storeAddress`, a fixed secret.
  static rpc::Options tcpOptions(int rank, const std::string& storeAddress, int executorThreads) {
    rpc::Options options;
    options.rank = rank;
    options.worldSize = 2;
    options.transport = "tcp";
    options.storeAddr = storeAddress;
    options.executorThreads = executorThreads;
    options.secret = "bench";
    return options;
  }

 private:
  static constexpr char kReportCpu = 'c';
  static constexpr char kQuit = 'q';

  static void runChild(int commands, int replies, const std::function<rpc::Options(int, const std::string&)>& options,
                       const std::function<rpc::Registry(int)>& registry) {
    int storePort = 0;
    check(::read(commands, &storePort, sizeof(storePort)) == sizeof(storePort), "read store port");
    auto agent = rpc::Agent::start(options(1, "127.0.0.1:" + std::to_string(storePort)), registry(1));
    char command = 0;
    while (::read(commands, &command, 1) == 1 && command != kQuit) {
      if (command == kReportCpu) {
        double seconds = processCpuSeconds();
        check(::write(replies, &seconds, sizeof(seconds)) == sizeof(seconds), "write child cpu");
      }
    }
    agent->shutdown();
  }

  pid_t child_ = -1;
  int toChild_ = -1, fromChild_ = -1;
  std::unique_ptr<rpc::StoreServer> store_;
  std::unique_ptr<rpc::Agent> agent_;
};

}  // namespace distgrad::bench
