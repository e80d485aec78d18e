// Runs the real distgrad-run binary on small shell commands.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "rpc/error.h"
#include "rpc/options.h"
#include "rpc/store.h"

#ifndef DG_DISTGRAD_RUN_PATH
#error "DG_DISTGRAD_RUN_PATH must name the distgrad-run binary"
#endif

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Worker mode for the end-to-end rendezvous test: when this test binary is started by distgrad-run with
// DG_RENDEZVOUS_WORKER=1, it runs the bootstrap a real Agent will run (Options::fromEnv, rank 0 hosts the
// store at MASTER_ADDR:MASTER_PORT, everyone connects, registers, counts and meets at barriers) and exits
// before GoogleTest starts.
int rendezvousWorker() {
  using namespace distgrad::rpc;
  try {
    const Options options = Options::fromEnv();
    std::unique_ptr<StoreServer> server;
    if (options.rank == 0) server = StoreServer::start(options.rendezvousAddress());
    auto store = StoreClient::connect(options.rendezvousAddress(), 10000ms);
    store->set("worker/" + std::to_string(options.rank), options.name());
    const int64_t sum = store->add("rank-sum", options.rank + 1);
    store->barrier("registered", options.worldSize, 10000ms);
    // After the barrier every worker's registration and addition are visible to everyone.
    const int n = options.worldSize;
    const std::string total = store->getString("rank-sum", 0ms);
    std::string names;
    for (int r = 0; r < n; ++r) names += store->getString("worker/" + std::to_string(r), 0ms) + ",";
    std::printf("rank %d of %d via %s: partial %lld total %s names %s\n", options.rank, n, options.source.c_str(),
                static_cast<long long>(sum), total.c_str(), names.c_str());
    // Rank 0 keeps the store up until everyone has done its last store operation. (Not a barrier: rank 0
    // could pass it and close the store while another rank still waits for the barrier's reply.)
    if (options.rank == 0) {
      std::vector<std::string> left;
      for (int r = 1; r < n; ++r) left.push_back("left/" + std::to_string(r));
      store->wait(left, 10000ms);
    } else {
      store->set("left/" + std::to_string(options.rank), "1");
    }
    return total == std::to_string(n * (n + 1) / 2) ? 0 : 4;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rendezvous worker failed: %s\n", e.what());
    return 5;
  }
}

[[maybe_unused]] const bool kWorkerModeChecked = [] {
  const char* mode = std::getenv("DG_RENDEZVOUS_WORKER");
  if (mode != nullptr && std::string_view(mode) == "1") {
    const int code = rendezvousWorker();
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code);
  }
  return true;
}();

// distgrad-run as a child process with its stdout and stderr captured.
class LauncherProcess {
 public:
  explicit LauncherProcess(const std::vector<std::string>& args) {
    int out[2];
    int err[2];
    EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(err, O_CLOEXEC), 0);
    std::vector<std::string> full{DG_DISTGRAD_RUN_PATH};
    full.insert(full.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : full) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(99);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execv(argv[0], argv.data());
      ::_exit(98);
    }
    ::close(out[1]);
    ::close(err[1]);
    outFd_ = out[0];
    errFd_ = err[0];
    start_ = Clock::now();
  }
  ~LauncherProcess() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (outFd_ >= 0) ::close(outFd_);
    if (errFd_ >= 0) ::close(errFd_);
  }

  pid_t pid() const { return pid_; }
  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

  // Reads output until `done` holds or the time limit passes; false on timeout.
  bool readUntil(const std::function<bool()>& done, std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    while (!done()) {
      if (outFd_ < 0 && errFd_ < 0) return done();
      const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (remaining <= 0) return false;
      pollfd fds[2] = {{outFd_, POLLIN, 0}, {errFd_, POLLIN, 0}};
      if (::poll(fds, 2, static_cast<int>(remaining)) <= 0) continue;
      drain(fds[0], outFd_, out_);
      drain(fds[1], errFd_, err_);
    }
    return true;
  }

  // Reads everything and waits for the exit; returns the wait status, or -1 if it took longer than `limit`.
  int finish(std::chrono::milliseconds limit = 20000ms) {
    if (!readUntil([&] { return outFd_ < 0 && errFd_ < 0; }, limit)) return -1;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    exited_ = true;
    elapsed_ = Clock::now() - start_;
    return status;
  }
  Clock::duration elapsed() const { return elapsed_; }

 private:
  static void drain(const pollfd& p, int& fd, std::string& into) {
    if (fd < 0 || p.revents == 0) return;
    char buffer[4096];
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      into.append(buffer, static_cast<size_t>(n));
    } else {
      ::close(fd);
      fd = -1;
    }
  }

  pid_t pid_ = -1;
  int outFd_ = -1;
  int errFd_ = -1;
  bool exited_ = false;
  std::string out_;
  std::string err_;
  Clock::time_point start_;
  Clock::duration elapsed_{};
};

int exitCode(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1000 - status; }

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Concatenation by appends (GCC 12 reports a false -Wrestrict on some operator+ chains).
std::string cat(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (auto p : parts) out.append(p);
  return out;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(DistgradRun, SetsTheEnvironmentPerRank) {
  LauncherProcess p({"--nproc", "3", "--", "sh", "-c",
                     "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK lw=$LOCAL_WORLD_SIZE a=$MASTER_ADDR "
                     "p=$MASTER_PORT s=$DISTGRAD_SECRET\""});
  const int status = p.finish();
  ASSERT_EQ(exitCode(status), 0) << p.err();
  const std::regex pattern(R"(\[(\d)\] r=(\d) w=3 l=(\d) lw=3 a=127\.0\.0\.1 p=(\d+) s=([0-9a-f]{64}))");
  std::map<int, std::pair<std::string, std::string>> byRank;  // rank -> (port, secret)
  for (const auto& line : lines(p.out())) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, pattern)) << "unexpected line: " << line;
    EXPECT_EQ(m[1], m[2]) << "the prefix names the rank";
    EXPECT_EQ(m[2], m[3]) << "LOCAL_RANK equals RANK on one machine";
    byRank[std::stoi(m[1])] = {m[4], m[5]};
  }
  ASSERT_EQ(byRank.size(), 3u) << p.out();
  EXPECT_GT(std::stoi(byRank[0].first), 0);
  for (int r = 1; r < 3; ++r) {
    EXPECT_EQ(byRank[r].first, byRank[0].first) << "one port for the whole job";
    EXPECT_EQ(byRank[r].second, byRank[0].second) << "one secret for the whole job";
  }
}

TEST(DistgradRun, ExplicitMasterAddressAndPortArePassedThrough) {
  LauncherProcess p({"--nproc=2", "--master-addr", "10.1.2.3", "--master-port=4567", "sh", "-c",
                     "echo $MASTER_ADDR:$MASTER_PORT"});
  ASSERT_EQ(exitCode(p.finish()), 0) << p.err();
  EXPECT_TRUE(contains(p.out(), "[0] 10.1.2.3:4567\n")) << p.out();
  EXPECT_TRUE(contains(p.out(), "[1] 10.1.2.3:4567\n")) << p.out();
}

TEST(DistgradRun, TransportFlagSetsDistgradTransport) {
  LauncherProcess p({"--nproc=2", "--transport", "ucx", "sh", "-c", "echo transport=$DISTGRAD_TRANSPORT"});
  ASSERT_EQ(exitCode(p.finish()), 0) << p.err();
  EXPECT_TRUE(contains(p.out(), "[0] transport=ucx\n")) << p.out();
  EXPECT_TRUE(contains(p.out(), "[1] transport=ucx\n")) << p.out();
}

// Note [CPU binding]: a bound rank runs on its CPUs only; the others keep the launcher's affinity.
TEST(DistgradRun, CpuBindRestrictsTheNamedRanks) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &allowed)) ++cpu;
  LauncherProcess p({"--nproc", "3", "--cpu-bind", "1:" + std::to_string(cpu), "--", "sh", "-c",
                     "grep Cpus_allowed_list /proc/$$/status"});
  ASSERT_EQ(exitCode(p.finish()), 0) << p.err();
  std::string launcher;
  {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.starts_with("Cpus_allowed_list:")) launcher = line;
    }
  }
  ASSERT_FALSE(launcher.empty());
  EXPECT_TRUE(contains(p.out(), "[1] Cpus_allowed_list:\t" + std::to_string(cpu) + "\n")) << p.out();
  EXPECT_TRUE(contains(p.out(), "[0] " + launcher + "\n")) << p.out();
  EXPECT_TRUE(contains(p.out(), "[2] " + launcher + "\n")) << p.out();
}

TEST(DistgradRun, PrefixesEveryLineOfStdoutAndStderr) {
  // Two lines in one write, a line split across writes, a last line without '\n', and stderr.
  LauncherProcess p({"--nproc", "2", "--", "sh", "-c",
                     "printf 'one\\ntwo\\n'; printf 'par'; sleep 0.05; printf 'tial\\n'; echo oops >&2; "
                     "printf 'no-newline'"});
  ASSERT_EQ(exitCode(p.finish()), 0) << p.err();
  for (int r = 0; r < 2; ++r) {
    const std::string prefix = cat({"[", std::to_string(r), "] "});
    for (const char* line : {"one", "two", "partial", "no-newline"}) {
      EXPECT_TRUE(contains(p.out(), cat({prefix, line, "\n"}))) << "missing '" << prefix << line << "' in:\n" << p.out();
    }
    EXPECT_TRUE(contains(p.err(), cat({prefix, "oops\n"}))) << p.err();
    EXPECT_FALSE(contains(p.out(), "oops"));
  }
  for (const auto& line : lines(p.out())) {
    EXPECT_TRUE(line.starts_with("[0] ") || line.starts_with("[1] ")) << "unprefixed line: " << line;
  }
}

TEST(DistgradRun, AFailingWorkerStopsTheJobAndIsNamed) {
  // Rank 1 fails; ranks 0 and 2 would run for 30 s, rank 2 as a child of a shell (killed with its group).
  LauncherProcess p({"--nproc", "3", "--grace-ms", "2000", "--", "sh", "-c",
                     "case $RANK in 1) exit 3;; 0) exec sleep 30;; *) sleep 30; echo never;; esac"});
  const int status = p.finish();
  EXPECT_NE(exitCode(status), 0);
  EXPECT_EQ(exitCode(status), 1);
  EXPECT_LT(p.elapsed(), 10s) << "the siblings were not terminated promptly";
  EXPECT_TRUE(std::regex_search(p.err(), std::regex(R"(worker rank 1 \(pid \d+\) exited with status 3)"))) << p.err();
  EXPECT_TRUE(contains(p.err(), "job failed")) << p.err();
  EXPECT_FALSE(contains(p.out(), "never"));
}

TEST(DistgradRun, AWorkerKilledBySignalIsReported) {
  LauncherProcess p({"--nproc", "2", "--grace-ms", "1000", "--", "sh", "-c",
                     "if [ $RANK = 0 ]; then kill -9 $$; fi; exec sleep 30"});
  const int status = p.finish();
  EXPECT_EQ(exitCode(status), 1);
  EXPECT_LT(p.elapsed(), 10s);
  EXPECT_TRUE(std::regex_search(p.err(), std::regex(R"(worker rank 0 \(pid \d+\) was killed by signal 9 \(SIGKILL\))")))
      << p.err();
}

TEST(DistgradRun, ForwardsSigtermToEveryWorker) {
  LauncherProcess p({"--nproc", "2", "--", "sh", "-c",
                     "trap 'echo got-term; exit 0' TERM; echo ready; while :; do sleep 0.02; done"});
  ASSERT_TRUE(p.readUntil([&] { return contains(p.out(), "[0] ready") && contains(p.out(), "[1] ready"); }, 10000ms))
      << p.out() << p.err();
  ASSERT_EQ(::kill(p.pid(), SIGTERM), 0);
  const int status = p.finish();
  EXPECT_EQ(exitCode(status), 128 + SIGTERM) << p.err();
  EXPECT_TRUE(contains(p.out(), "[0] got-term\n")) << p.out();
  EXPECT_TRUE(contains(p.out(), "[1] got-term\n")) << p.out();
  EXPECT_TRUE(contains(p.err(), "received SIGTERM")) << p.err();
}

TEST(DistgradRun, WorkersIgnoringSigtermAreKilledAfterTheGracePeriod) {
  LauncherProcess p({"--nproc", "2", "--grace-ms", "200", "--", "sh", "-c",
                     "trap '' TERM INT; echo ready; while :; do sleep 0.02; done"});
  ASSERT_TRUE(p.readUntil([&] { return contains(p.out(), "[0] ready") && contains(p.out(), "[1] ready"); }, 10000ms))
      << p.out() << p.err();
  ASSERT_EQ(::kill(p.pid(), SIGINT), 0);
  const int status = p.finish(10000ms);
  EXPECT_EQ(exitCode(status), 128 + SIGINT) << p.err();
  EXPECT_TRUE(contains(p.err(), "grace period of 200 ms is over")) << p.err();
}

TEST(DistgradRun, EndToEndRendezvousThroughTheStore) {
  // This test binary is the worker program (see rendezvousWorker above).
  char self[4096];
  const ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(length, 0);
  self[length] = '\0';
  constexpr int kWorkers = 4;
  LauncherProcess p({"--nproc", std::to_string(kWorkers), "--", "env", "DG_RENDEZVOUS_WORKER=1", self});
  const int status = p.finish(30000ms);
  ASSERT_EQ(exitCode(status), 0) << p.out() << p.err();
  for (int r = 0; r < kWorkers; ++r) {
    const std::string expected = cat({"[", std::to_string(r), "] rank ", std::to_string(r),
                                      " of 4 via torchrun: partial "});
    EXPECT_TRUE(contains(p.out(), expected)) << "missing '" << expected << "' in:\n" << p.out();
  }
  // Everyone saw the complete sum and every worker's name.
  EXPECT_EQ(lines(p.out()).size(), size_t{kWorkers}) << p.out();
  for (const auto& line : lines(p.out())) {
    EXPECT_TRUE(contains(line, "total 10 names worker0,worker1,worker2,worker3,")) << line;
  }
}

TEST(DistgradRun, AllSucceedingExitsZero) {
  LauncherProcess p({"--nproc", "4", "true"});
  EXPECT_EQ(exitCode(p.finish()), 0) << p.err();
  EXPECT_EQ(p.err(), "");
}

TEST(DistgradRun, UnrunnableProgramFails) {
  LauncherProcess p({"--nproc", "2", "/nonexistent/program"});
  EXPECT_EQ(exitCode(p.finish()), 1);
  EXPECT_TRUE(contains(p.err(), "cannot execute '/nonexistent/program'")) << p.err();
}

TEST(DistgradRun, BadArgumentsAreUsageErrors) {
  const std::vector<std::vector<std::string>> bad = {
      {},
      {"true"},                                   // no --nproc
      {"--nproc", "0", "true"},
      {"--nproc", "two", "true"},
      {"--nproc", "2"},                           // no program
      {"--nproc", "2", "--"},                     // no program after --
      {"--nproc", "2", "--master-port", "70000", "true"},
      {"--nproc", "2", "--master-port", "0", "true"},
      {"--nproc", "2", "--master-addr=", "true"},
      {"--nproc", "2", "--frobnicate", "true"},
      {"--nproc", "2", "--transport", "carrier-pigeon", "true"},
      {"--nproc", "2", "--transport", "inproc", "true"},  // one process's agents only
      {"--nproc", "2", "--cpu-bind", "2:0", "true"},        // no rank 2
      {"--nproc", "2", "--cpu-bind", "1:0", "--cpu-bind", "1:0", "true"},
      {"--nproc", "2", "--cpu-bind", "1", "true"},
      {"--nproc", "2", "--cpu-bind", "1:", "true"},
      {"--nproc", "2", "--cpu-bind", "1:0,", "true"},
      {"--nproc", "2", "--cpu-bind", "1:x", "true"},
      {"--nproc", "2", "--cpu-bind", "1:1023", "true"},  // not a CPU this machine lets us use
      {"--nproc"},                                // missing value
  };
  for (const auto& args : bad) {
    LauncherProcess p(args);
    std::string joined;
    for (const auto& a : args) joined.append(a).append(" ");
    EXPECT_EQ(exitCode(p.finish()), 2) << joined;
    EXPECT_TRUE(contains(p.err(), "usage: distgrad-run")) << joined << "\n" << p.err();
    EXPECT_EQ(p.out(), "") << joined;
  }
}

}  // namespace
