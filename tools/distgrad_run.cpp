// distgrad-run: starts N worker processes on this machine with the torchrun environment contract.
//
//   distgrad-run --nproc N [--master-addr A] [--master-port P] [--grace-ms MS] [--transport T]
//                [--cpu-bind RANK:CPUS]... [--] PROGRAM ARGS...
//
// Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
// DISTGRAD_SECRET (one secret per job, generated here unless the launcher's own environment already has
// one), so rpc::Options::fromEnv() works unchanged. Every line a worker writes to stdout/stderr comes out on
// the launcher's stdout/stderr prefixed with "[rank] ". SIGINT/SIGTERM are forwarded to every worker.
// When a worker exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL after the
// grace period, and distgrad-run exits 1 naming the failed worker's rank, pid and status (as torchrun does).
// Exit codes: 0 all workers succeeded; 1 a worker failed; 2 bad arguments; 128+signal when interrupted.
//
// Design notes. The launcher is single-threaded: one poll() loop over the workers' pipes and a signalfd
// (SIGCHLD, SIGINT, SIGTERM are blocked and read from it, so no work happens in signal handlers). Each
// worker runs in its own process group and signals go to the group: a worker that is a shell script must
// not leave its children behind (they would keep the output pipes open and outlive the job). Workers also
// get PR_SET_PDEATHSIG(SIGKILL), so they die if the launcher itself is killed.
//
// Note [CPU binding]: --cpu-bind RANK:CPUS restricts a worker (all its threads) to a set of CPUs, set in
// the child before exec. Unbound workers keep the launcher's affinity. Pipeline stages are the use: each
// stage computes on one thread at a time, but on a different executor thread from one micro-batch to the
// next, and each hand-off wakes a thread the kernel places anew; on the 2-vCPU development VM, two stages'
// compute threads were seen sharing one vCPU while the other idled for milliseconds (perf sched), which
// stretched the stages' compute by 15% on average. Bound to a CPU each, they never share
// (docs/pipeline.md). The CPUs must be in the launcher's own affinity set.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "rpc/detail/hmac.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kExitWorkerFailed = 1;
constexpr int kExitUsage = 2;
constexpr size_t kMaxPartialLine = 64 * 1024;  // a longer line without '\n' is emitted in pieces
constexpr int kMaxProcesses = 4096;

struct Arguments {
  int nproc = 0;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 0;  // 0: pick a free one
  int graceMs = 5000;
  std::string transport;  // "": the workers inherit DISTGRAD_TRANSPORT (or default to tcp)
  std::vector<std::pair<int, cpu_set_t>> cpuBind;  // Note [CPU binding]: (rank, CPUs)
  std::vector<std::string> command;
};

const char* kUsage =
    "usage: distgrad-run --nproc N [--master-addr ADDR] [--master-port PORT] [--grace-ms MS] [--transport T] "
    "[--cpu-bind R:CPUS]... [--] PROGRAM [ARGS...]\n"
    "  --nproc N          number of worker processes to start on this machine (1..4096)\n"
    "  --master-addr ADDR rendezvous address given to the workers as MASTER_ADDR (default 127.0.0.1)\n"
    "  --master-port PORT rendezvous port (default: a free port picked by the launcher)\n"
    "  --grace-ms MS      how long workers get to exit after SIGTERM before SIGKILL (default 5000)\n"
    "  --transport T      the workers' transport, tcp or ucx (sets DISTGRAD_TRANSPORT; default: inherited, else tcp)\n"
    "  --cpu-bind R:CPUS  run worker R on these CPUs only (e.g. 1:0 or 2:2-3,6; repeatable; default: unbound)\n";

[[noreturn]] void usageError(const std::string& message) {
  std::fprintf(stderr, "distgrad-run: %s\n%s", message.c_str(), kUsage);
  std::exit(kExitUsage);
}

int parseIntArg(std::string_view name, std::string_view text, int lo, int hi) {
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || value < lo || value > hi) {
    usageError(std::string(name) + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
               "], got '" + std::string(text) + "'");
  }
  return value;
}

// "RANK:CPUS", CPUS a list of CPU numbers and ranges ("0", "2-3,6"), each CPU in `allowed`.
std::pair<int, cpu_set_t> parseCpuBind(std::string_view text, const cpu_set_t& allowed) {
  const std::string what = "--cpu-bind expects RANK:CPUS (e.g. 1:0 or 2:2-3,6), got '" + std::string(text) + "'";
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) usageError(what);
  const int rank = parseIntArg("--cpu-bind's rank", text.substr(0, colon), 0, kMaxProcesses - 1);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  std::string_view list = text.substr(colon + 1);
  if (list.empty()) usageError(what);
  while (!list.empty()) {
    const size_t comma = list.find(',');
    const std::string_view item = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    if (comma != std::string_view::npos && list.empty()) usageError(what);
    const size_t dash = item.find('-');
    const int first = parseIntArg("--cpu-bind's CPU", item.substr(0, dash), 0, CPU_SETSIZE - 1);
    const int last = dash == std::string_view::npos
                         ? first
                         : parseIntArg("--cpu-bind's CPU", item.substr(dash + 1), first, CPU_SETSIZE - 1);
    for (int cpu = first; cpu <= last; ++cpu) {
      if (!CPU_ISSET(cpu, &allowed)) {
        usageError("--cpu-bind: CPU " + std::to_string(cpu) + " is not among the CPUs this launcher may use");
      }
      CPU_SET(cpu, &cpus);
    }
  }
  return {rank, cpus};
}

Arguments parseArguments(int argc, char** argv) {
  Arguments args;
  bool haveNproc = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (!arg.starts_with("-")) break;  // the program
    // Accept both "--flag value" and "--flag=value".
    std::string_view name = arg;
    std::optional<std::string_view> value;
    if (const size_t eq = arg.find('='); eq != std::string_view::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    auto takeValue = [&]() -> std::string_view {
      if (value) return *value;
      if (i + 1 >= argc) usageError(std::string(name) + " needs a value");
      return argv[++i];
    };
    if (name == "--nproc" || name == "--nproc-per-node" || name == "--nproc_per_node") {
      args.nproc = parseIntArg(name, takeValue(), 1, kMaxProcesses);
      haveNproc = true;
    } else if (name == "--master-addr" || name == "--master_addr") {
      args.masterAddr = std::string(takeValue());
      if (args.masterAddr.empty()) usageError("--master-addr must not be empty");
    } else if (name == "--master-port" || name == "--master_port") {
      args.masterPort = parseIntArg(name, takeValue(), 1, 65535);
    } else if (name == "--grace-ms") {
      args.graceMs = parseIntArg(name, takeValue(), 0, 3'600'000);
    } else if (name == "--transport") {
      args.transport = std::string(takeValue());
      // inproc joins agents of one process only: meaningless across the launcher's processes.
      if (args.transport != "tcp" && args.transport != "ucx") {
        usageError("--transport must be tcp or ucx, got '" + args.transport + "'");
      }
    } else if (name == "--cpu-bind") {
      cpu_set_t allowed;
      if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
        usageError(std::string("--cpu-bind: cannot read this launcher's CPU affinity: ") + std::strerror(errno));
      }
      args.cpuBind.push_back(parseCpuBind(takeValue(), allowed));
    } else {
      usageError("unknown option '" + std::string(arg) + "'");
    }
  }
  if (!haveNproc) usageError("--nproc is required");
  for (size_t b = 0; b < args.cpuBind.size(); ++b) {
    const int rank = args.cpuBind[b].first;
    if (rank >= args.nproc) {
      usageError("--cpu-bind names rank " + std::to_string(rank) + " of " + std::to_string(args.nproc) + " workers");
    }
    for (size_t a = 0; a < b; ++a) {
      if (args.cpuBind[a].first == rank) usageError("--cpu-bind names rank " + std::to_string(rank) + " twice");
    }
  }
  for (; i < argc; ++i) args.command.emplace_back(argv[i]);
  if (args.command.empty()) usageError("no program to run");
  return args;
}

// A port that was free a moment ago on `host` (the usual launcher race: the store binds it soon after).
int pickFreePort(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  // Bind where the master will listen when that address is local; otherwise any local address will do.
  if (getaddrinfo(host.c_str(), "0", &hints, &found) != 0) found = nullptr;
  int port = 0;
  for (addrinfo* ai = found; ai != nullptr && port == 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    }
    ::close(fd);
  }
  if (found != nullptr) freeaddrinfo(found);
  if (port == 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in any{};
    any.sin_family = AF_INET;
    socklen_t len = sizeof(any);
    if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&any), sizeof(any)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&any), &len) == 0) {
      port = ntohs(any.sin_port);
    }
    if (fd >= 0) ::close(fd);
  }
  return port;
}

void writeAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own output is gone (closed pipe): keep supervising the workers regardless
    data += n;
    size -= static_cast<size_t>(n);
  }
}

std::string describeStatus(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "ended with wait status " + std::to_string(status);
}

// One worker output stream (stdout or stderr) being relayed line by line.
struct Stream {
  int fd = -1;      // read end of the pipe; -1 once it reached EOF
  int outFd = 1;    // where its lines go (the launcher's stdout or stderr)
  std::string partial;
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream out;
  Stream err;
};

class Launcher {
 public:
  explicit Launcher(Arguments args) : args_(std::move(args)) {}

  int run();

 private:
  void startWorkers(const std::vector<std::string>& environment);
  void relay(Worker& w, Stream& s);
  void emitLine(const Worker& w, Stream& s, std::string_view line);
  void flushPartial(const Worker& w, Stream& s);
  void reapChildren();
  void signalAll(int sig);
  void beginShutdown(int sig);
  void logLine(const std::string& message) {
    const std::string line = "distgrad-run: " + message + "\n";
    writeAll(2, line.data(), line.size());
  }
  size_t runningCount() const {
    size_t n = 0;
    for (const auto& w : workers_) n += w.running ? 1 : 0;
    return n;
  }

  Arguments args_;
  std::vector<Worker> workers_;
  sigset_t blocked_{};
  sigset_t original_{};
  int signalFd_ = -1;
  // The first worker failure (index into workers_), if any.
  std::optional<size_t> failed_;
  int interruptSignal_ = 0;
  std::optional<Clock::time_point> killDeadline_;  // SIGKILL the survivors at this time
  bool killed_ = false;
};

void Launcher::startWorkers(const std::vector<std::string>& environment) {
  // Everything the child needs is prepared before fork(): after it only async-signal-safe calls are made.
  std::vector<char*> argv;
  for (const auto& a : args_.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const int devNull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  workers_.resize(static_cast<size_t>(args_.nproc));
  for (int rank = 0; rank < args_.nproc; ++rank) {
    Worker& w = workers_[static_cast<size_t>(rank)];
    w.rank = rank;
    std::vector<std::string> env = environment;
    env.push_back("RANK=" + std::to_string(rank));
    env.push_back("LOCAL_RANK=" + std::to_string(rank));
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const std::string execError = "distgrad-run: cannot execute '" + args_.command.front() + "': ";
    const cpu_set_t* cpus = nullptr;  // Note [CPU binding]
    for (const auto& [bound, set] : args_.cpuBind) {
      if (bound == rank) cpus = &set;
    }
    const std::string bindError = "distgrad-run: cannot bind rank " + std::to_string(rank) + " to its CPUs: ";

    int outPipe[2];
    int errPipe[2];
    if (::pipe2(outPipe, O_CLOEXEC) != 0 || ::pipe2(errPipe, O_CLOEXEC) != 0) {
      logLine(std::string("pipe failed: ") + std::strerror(errno));
      std::exit(kExitWorkerFailed);
    }
    const pid_t pid = ::fork();
    if (pid < 0) {
      logLine(std::string("fork failed: ") + std::strerror(errno));
      signalAll(SIGKILL);
      std::exit(kExitWorkerFailed);
    }
    if (pid == 0) {
      // Child. Die with the launcher, even if it is SIGKILLed.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(kExitWorkerFailed);  // the launcher died before prctl took effect
      ::setpgid(0, 0);
      ::dup2(outPipe[1], 1);
      ::dup2(errPipe[1], 2);
      if (devNull >= 0) ::dup2(devNull, 0);
      // Ignored signals and the blocked mask survive exec: give the program the defaults.
      ::signal(SIGPIPE, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &original_, nullptr);
      auto fail = [](const std::string& message, int err) {
        (void)!::write(2, message.data(), message.size());
        const char* reason = std::strerror(err);
        (void)!::write(2, reason, std::strlen(reason));
        (void)!::write(2, "\n", 1);
        ::_exit(127);
      };
      if (cpus != nullptr && ::sched_setaffinity(0, sizeof(*cpus), cpus) != 0) fail(bindError, errno);
      ::execvpe(argv[0], argv.data(), envp.data());
      fail(execError, errno);
    }
    // Parent. setpgid on both sides so signals to the group work even before the child ran.
    ::setpgid(pid, pid);
    ::close(outPipe[1]);
    ::close(errPipe[1]);
    w.pid = pid;
    w.running = true;
    w.out = {outPipe[0], 1, {}};
    w.err = {errPipe[0], 2, {}};
    fcntl(w.out.fd, F_SETFL, O_NONBLOCK);
    fcntl(w.err.fd, F_SETFL, O_NONBLOCK);
  }
  if (devNull >= 0) ::close(devNull);
}

void Launcher::emitLine(const Worker& w, Stream& s, std::string_view line) {
  // Built by appends: GCC 12 reports a false -Wrestrict on the operator+ chain here.
  std::string text;
  text.reserve(line.size() + 16);
  text.push_back('[');
  text.append(std::to_string(w.rank));
  text.append("] ");
  text.append(line);
  if (text.back() != '\n') text.push_back('\n');
  writeAll(s.outFd, text.data(), text.size());
}

void Launcher::flushPartial(const Worker& w, Stream& s) {
  if (!s.partial.empty()) emitLine(w, s, s.partial);
  s.partial.clear();
}

void Launcher::relay(Worker& w, Stream& s) {
  char buffer[65536];
  while (true) {
    const ssize_t n = ::read(s.fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      flushPartial(w, s);  // the last line may lack its '\n'
      ::close(s.fd);
      s.fd = -1;
      return;
    }
    s.partial.append(buffer, static_cast<size_t>(n));
    size_t start = 0;
    while (true) {
      const size_t newline = s.partial.find('\n', start);
      if (newline == std::string::npos) break;
      emitLine(w, s, std::string_view(s.partial).substr(start, newline - start + 1));
      start = newline + 1;
    }
    s.partial.erase(0, start);
    if (s.partial.size() > kMaxPartialLine) flushPartial(w, s);
  }
}

void Launcher::signalAll(int sig) {
  for (const auto& w : workers_) {
    // The whole process group: a shell worker's children must go too.
    if (w.running) ::kill(-w.pid, sig);
  }
}

void Launcher::beginShutdown(int sig) {
  signalAll(sig);
  if (!killDeadline_) killDeadline_ = Clock::now() + std::chrono::milliseconds(args_.graceMs);
}

void Launcher::reapChildren() {
  while (true) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    for (size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      if (w.pid != pid || !w.running) continue;
      w.running = false;
      w.status = status;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (ok) {
        // Its group may still hold children that keep the pipes open; they belong to a finished worker.
        ::kill(-w.pid, SIGTERM);
      } else if (!failed_ && interruptSignal_ == 0) {
        failed_ = i;
        logLine("worker rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") " +
                describeStatus(status) + "; terminating the other " + std::to_string(runningCount()) + " worker(s)");
        ::kill(-w.pid, SIGKILL);  // leftovers of the failed worker's group
        beginShutdown(SIGTERM);
      }
    }
  }
}

int Launcher::run() {
  // Take SIGCHLD/SIGINT/SIGTERM through a signalfd; a closed stdout must not kill the launcher.
  sigemptyset(&blocked_);
  sigaddset(&blocked_, SIGCHLD);
  sigaddset(&blocked_, SIGINT);
  sigaddset(&blocked_, SIGTERM);
  sigaddset(&blocked_, SIGHUP);
  ::sigprocmask(SIG_BLOCK, &blocked_, &original_);
  ::signal(SIGPIPE, SIG_IGN);
  signalFd_ = ::signalfd(-1, &blocked_, SFD_NONBLOCK | SFD_CLOEXEC);
  if (signalFd_ < 0) {
    logLine(std::string("signalfd failed: ") + std::strerror(errno));
    return kExitWorkerFailed;
  }

  if (args_.masterPort == 0) {
    args_.masterPort = pickFreePort(args_.masterAddr);
    if (args_.masterPort == 0) {
      logLine("could not find a free port; pass --master-port");
      return kExitWorkerFailed;
    }
  }
  std::string secret;
  if (const char* existing = std::getenv("DISTGRAD_SECRET"); existing != nullptr && *existing != '\0') {
    secret = existing;
  } else {
    secret = distgrad::rpc::detail::generateSecret();
  }

  // The workers' shared environment: ours minus the variables we set.
  const char* kOverridden[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                               "DISTGRAD_SECRET"};
  std::vector<std::string> environment;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const char* o : kOverridden) overridden = overridden || name == o;
    if (!overridden) environment.emplace_back(entry);
  }
  environment.push_back("WORLD_SIZE=" + std::to_string(args_.nproc));
  environment.push_back("LOCAL_WORLD_SIZE=" + std::to_string(args_.nproc));
  environment.push_back("MASTER_ADDR=" + args_.masterAddr);
  environment.push_back("MASTER_PORT=" + std::to_string(args_.masterPort));
  environment.push_back("DISTGRAD_SECRET=" + secret);
  if (!args_.transport.empty()) {
    std::erase_if(environment, [](const std::string& e) { return e.starts_with("DISTGRAD_TRANSPORT="); });
    environment.push_back("DISTGRAD_TRANSPORT=" + args_.transport);
  }

  startWorkers(environment);

  std::optional<Clock::time_point> drainDeadline;  // after every worker exited, stop waiting for pipes here
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> owners;
  while (true) {
    const bool anyRunning = runningCount() > 0;
    fds.clear();
    owners.clear();
    fds.push_back({signalFd_, POLLIN, 0});
    owners.emplace_back(nullptr, nullptr);
    for (auto& w : workers_) {
      for (Stream* s : {&w.out, &w.err}) {
        if (s->fd < 0) continue;
        fds.push_back({s->fd, POLLIN, 0});
        owners.emplace_back(&w, s);
      }
    }
    if (!anyRunning && fds.size() == 1) break;  // all exited, all output relayed
    if (!anyRunning && !drainDeadline) drainDeadline = Clock::now() + std::chrono::milliseconds(1000);
    if (drainDeadline && Clock::now() >= *drainDeadline) break;  // a worker's orphan holds a pipe open

    int timeoutMs = -1;
    auto consider = [&](std::optional<Clock::time_point> t) {
      if (!t) return;
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*t - Clock::now()).count();
      const int clamped = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, 60'000)));
      timeoutMs = timeoutMs < 0 ? clamped : std::min(timeoutMs, clamped);
    };
    if (!killed_) consider(killDeadline_);
    consider(drainDeadline);
    const int ready = ::poll(fds.data(), fds.size(), timeoutMs);
    if (ready < 0 && errno != EINTR) {
      logLine(std::string("poll failed: ") + std::strerror(errno));
      signalAll(SIGKILL);
      return kExitWorkerFailed;
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) relay(*owners[i].first, *owners[i].second);
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo info{};
      while (::read(signalFd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGCHLD) continue;  // reaped below
        if (interruptSignal_ != 0) {
          // A second interrupt: the user does not want to wait for the grace period.
          signalAll(SIGKILL);
          killed_ = true;
          continue;
        }
        interruptSignal_ = sig;
        logLine(std::string("received SIG") + sigabbrev_np(sig) + ", forwarding it to " +
                std::to_string(runningCount()) + " worker(s)");
        beginShutdown(sig);
      }
    }
    reapChildren();
    if (killDeadline_ && !killed_ && Clock::now() >= *killDeadline_ && runningCount() > 0) {
      logLine("grace period of " + std::to_string(args_.graceMs) + " ms is over; killing " +
              std::to_string(runningCount()) + " worker(s)");
      signalAll(SIGKILL);
      killed_ = true;
    }
  }
  for (auto& w : workers_) {
    for (Stream* s : {&w.out, &w.err}) {
      if (s->fd >= 0) {
        flushPartial(w, *s);
        ::close(s->fd);
        s->fd = -1;
      }
    }
  }

  if (failed_) {
    const Worker& w = workers_[*failed_];
    logLine("job failed: worker rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") " +
            describeStatus(w.status));
    return kExitWorkerFailed;
  }
  if (interruptSignal_ != 0) return 128 + interruptSignal_;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Arguments args = parseArguments(argc, argv);
  try {
    Launcher launcher(std::move(args));
    return launcher.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distgrad-run: %s\n", e.what());
    return kExitWorkerFailed;
  }
}
