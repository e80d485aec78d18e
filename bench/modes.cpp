// bench_modes: runs every training mode distgrad ships on the same model, data and batch size, and writes
// the comparison table docs/modes.md (mode, processes, images/s, peak RSS per process, test accuracy after
// K epochs, RPC overhead share) — the table reference benchmark suites publish for DP / MP / PMP / RPC-PMP.
//
//   bench_modes [--epochs K] [--limit N] [--batch-size B] [--model M] [--width W] [--micro-batches M]
//               [--modes a,b,...] [--rounds R] [--out docs/modes.md] [--no-write] [--dry-run]
//
// Each mode is one example program, run as a user runs it (the distributed ones through distgrad-run, one
// thread per process); the example's final JSON line is the measurement (nothing here is timed itself).
// Every row prints as a JSON line {"bench":"modes","mode":...} on stdout; the examples' own output goes to
// stderr so a failure can be read. The modes run one after another in one invocation, so their figures
// share the machine's state: compare them with each other, not with another run. With --rounds R every
// round runs every mode once, in order (so a drift of the machine's load reaches all modes alike), and the
// table shows each mode's median round (images/s: the median and the range over the rounds).
#include <sched.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "examples/example_util.h"
#include "tools/flat_json.h"

namespace {

namespace fs = std::filesystem;

// The examples' final lines are flat JSON objects (tools/flat_json.h).
using distgrad::tools::FlatObject;

std::optional<double> number(const FlatObject& o, const std::string& key) { return o.number(key); }

struct Settings {
  int64_t epochs = 1;
  int64_t limit = 12000;
  int64_t batchSize = 64;
  int64_t microBatches = 4;
  std::string model = "resnet18";
  int64_t width = 16;
  uint64_t seed = 0;
  std::string modes;
  int64_t rounds = 1;
  std::string out = "docs/modes.md";
  bool noWrite = false;
  bool dryRun = false;
};

struct Mode {
  std::string name;         // the row's label
  std::string description;  // what runs
  int processes;
  std::string command;  // relative to the build directory
  // The row is every process's own run at once (single_x2_bound): images/s summed over their result lines.
  bool sumProcesses = false;
};

// distgrad-run flags giving ranks `firstRank` and `firstRank` + 1 equal, disjoint halves of the CPUs this
// process may use, as scripts/demo.sh does for the stage workers (ranks 1 and 2); none with fewer than two
// CPUs.
std::string cpuHalves(int firstRank) {
  cpu_set_t allowed;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
    }
  }
  const size_t share = cpus.size() / 2;
  if (share == 0) return "";
  std::string flags;
  for (size_t half = 0; half < 2; ++half) {
    flags += " --cpu-bind " + std::to_string(firstRank + static_cast<int>(half)) + ":";
    for (size_t i = 0; i < share; ++i) {
      if (i > 0) flags += ',';
      flags += std::to_string(cpus[half * share + i]);
    }
  }
  return flags;
}

std::vector<Mode> modes(const Settings& s) {
  std::ostringstream common;
  common << " --epochs " << s.epochs << " --limit " << s.limit << " --batch-size " << s.batchSize << " --model "
         << s.model << " --width " << s.width << " --seed " << s.seed << " --threads 1";
  const std::string c = common.str();
  const std::string m = " --micro-batches " + std::to_string(s.microBatches);
  const std::string run = "tools/distgrad-run --nproc ";
  const std::string bindStages = cpuHalves(1);
  // Trainers of a parameter server each take half the batch: the same samples per optimizer step.
  std::ostringstream psCommon;
  psCommon << " --epochs " << s.epochs << " --limit " << s.limit << " --batch-size " << s.batchSize / 2 << " --model "
           << s.model << " --width " << s.width << " --seed " << s.seed << " --threads 1";
  return {
      {"single", "the whole model in one process (the baseline)", 1, "examples/single_worker" + c},
      // What two processes can compute at once here (Note [Two-process ceiling]).
      {"single_x2_bound",
       "2 single-worker runs at once, each bound to its own half of the CPUs: images/s summed, the machine's "
       "2-process ceiling",
       2, run + "2" + cpuHalves(0) + " -- examples/single_worker" + c, /*sumProcesses=*/true},
      {"local_mp", "2 stages in one process, run one after the other (model parallel)", 1,
       "examples/local_model_parallel --stages 2" + c},
      {"local_pipeline_gpipe", "2 stages in one process, one thread each, GPipe", 1,
       "examples/local_pipeline --stages 2 --schedule gpipe" + m + c},
      {"local_pipeline_1f1b", "2 stages in one process, one thread each, 1F1B", 1,
       "examples/local_pipeline --stages 2 --schedule 1f1b" + m + c},
      {"rpc_pipeline_gpipe", "2 stage workers + a driver over RPC (TCP), GPipe", 3,
       run + "3 -- examples/rpc_pipeline --schedule gpipe" + m + c},
      {"rpc_pipeline_1f1b", "2 stage workers + a driver over RPC (TCP), 1F1B", 3,
       run + "3 -- examples/rpc_pipeline --schedule 1f1b" + m + c},
      // Note [CPU binding] in tools/distgrad_run.cpp: each stage worker on its own CPUs.
      {"rpc_pipeline_gpipe_bound", "the same, each stage worker bound to its own half of the CPUs (--cpu-bind), GPipe", 3,
       run + "3" + bindStages + " -- examples/rpc_pipeline --schedule gpipe" + m + c},
      {"rpc_pipeline_1f1b_bound", "the same, each stage worker bound to its own half of the CPUs (--cpu-bind), 1F1B", 3,
       run + "3" + bindStages + " -- examples/rpc_pipeline --schedule 1f1b" + m + c},
      {"ps_ssgd", "parameter server + 2 trainers, synchronous SGD (batch split between trainers)", 3,
       run + "3 -- examples/parameter_server --mode ssgd" + psCommon.str()},
      {"ps_asgd", "parameter server + 2 trainers, asynchronous SGD (batch split between trainers)", 3,
       run + "3 -- examples/parameter_server --mode asgd" + psCommon.str()},
      // Data parallel: each rank takes half the batch, as the parameter server's trainers do.
      {"ddp", "2 ranks, DistributedDataParallel (batch split between ranks, gradients all-reduced)", 2,
       run + "2 -- examples/ddp --checkpoint checkpoints/bench_modes_ddp.ckpt" + psCommon.str()},
      {"zero", "2 ranks, DDP + ZeRO-1 (batch split between ranks, Adam state sharded)", 2,
       run + "2 -- examples/zero --checkpoint checkpoints/bench_modes_zero.ckpt" + psCommon.str()},
  };
}

struct Row {
  Mode mode;
  FlatObject result;
  std::string error;
  // With several rounds: the lowest and highest images/s of the mode's successful runs, and how many failed.
  std::optional<double> minRate, maxRate;
  int failedRuns = 0;
};

// A mode's row over its rounds: the successful run with the median images/s (its other figures with it), the
// range beside it; a failed run is counted, and a mode whose every run failed shows the first failure.
Row medianRun(std::vector<Row> runs) {
  std::vector<Row> ok;
  int failed = 0;
  for (Row& r : runs) {
    if (r.error.empty() && number(r.result, "images_per_s")) {
      ok.push_back(std::move(r));
    } else {
      ++failed;
    }
  }
  if (ok.empty()) {
    Row first = std::move(runs.front());
    first.failedRuns = failed;
    return first;
  }
  std::sort(ok.begin(), ok.end(), [](const Row& a, const Row& b) {
    return *number(a.result, "images_per_s") < *number(b.result, "images_per_s");
  });
  Row median = ok[(ok.size() - 1) / 2];
  median.minRate = number(ok.front().result, "images_per_s");
  median.maxRate = number(ok.back().result, "images_per_s");
  median.failedRuns = failed;
  return median;
}

// Note [Two-process ceiling]: how fast a 2-process mode could be here at best. Two vCPUs of a VM may share
// a physical core, caches or memory bandwidth, so two processes computing at once may each run slower than
// one alone. single_x2_bound measures what two bound processes get, in the same run as the modes it bounds:
// its row's "x single" is the most a 2-worker mode can reach here. A 2-stage pipeline does less: with M
// micro-batches and balanced stages, GPipe and 1F1B keep each stage busy M of the step's M + 1 slots (one
// slot of fill, one of drain), so it stays below that ceiling x M / (M + 1) (1.6x single on two free cores
// with 4 micro-batches); the table's footnote gives both, which tells the machine's limit and the
// schedule's from the pipeline's own losses.
// `results`: the processes' result lines (one each, else an error); the row keeps the last, with images/s
// summed and peak RSS the largest.
void sumResults(const Mode& mode, const std::vector<FlatObject>& results, Row& row) {
  if (static_cast<int>(results.size()) != mode.processes) {
    row.error = std::to_string(results.size()) + " result lines from " + std::to_string(mode.processes) + " processes";
    return;
  }
  double rate = 0, rss = 0;
  for (const FlatObject& r : results) {
    const auto processRate = number(r, "images_per_s");
    if (!processRate) {
      row.error = "a result line without images_per_s";
      return;
    }
    rate += *processRate;
    rss = std::max(rss, number(r, "peak_rss_mib").value_or(0.0));
  }
  row.result = results.back();
  row.result.values["images_per_s"] = rate;
  row.result.values["peak_rss_mib"] = rss;
}

// Runs `command` in `dir` with stdout and stderr copied to our stderr; returns the last JSON object line
// that names an example (distgrad-run prefixes lines with "[rank] ").
Row runMode(const Mode& mode, const fs::path& dir) {
  Row row;
  row.mode = mode;
  const std::string command = "cd '" + dir.string() + "' && " + mode.command + " 2>&1";
  std::cerr << "bench_modes: " << mode.name << ": " << mode.command << "\n";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    row.error = "popen failed";
    return row;
  }
  std::string line;
  std::vector<FlatObject> results;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) {
    line += buf;
    if (line.empty() || line.back() != '\n') continue;
    std::cerr << "  " << line;
    const size_t brace = line.find("{\"example\"");
    if (brace != std::string::npos) {
      if (auto parsed = distgrad::tools::parseFlatJson(line.substr(brace))) results.push_back(std::move(*parsed));
    }
    line.clear();
  }
  const int status = pclose(pipe);
  if (status != 0) {
    row.error = "exit status " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  } else if (results.empty()) {
    row.error = "no JSON result line";
  } else if (!mode.sumProcesses) {
    row.result = std::move(results.back());
  } else {
    sumResults(mode, results, row);
  }
  return row;
}

std::string fixed(std::optional<double> v, int digits, double scale = 1.0) {
  if (!v) return "—";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, *v * scale);
  return buf;
}

double loadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : 0.0;
}

std::string machine(double load) {
  utsname u{};
  uname(&u);
  std::ostringstream out;
  out << u.machine << ", " << sysconf(_SC_NPROCESSORS_ONLN) << " cores, Linux " << u.release << ", load "
      << fixed(load, 2) << " before the run";
  return out.str();
}

void writeTable(const Settings& s, const std::vector<Row>& rows, const std::string& when, const std::string& where,
                double loadBefore) {
  std::ofstream out(s.out);
  DG_CHECK(out.good(), "bench_modes: cannot write ", s.out);
  std::optional<double> single;
  for (const Row& r : rows) {
    if (r.mode.name == "single" && r.error.empty()) single = number(r.result, "images_per_s");
  }
  out << "# Training modes compared\n\n"
      << "Written by `build/bench/bench_modes` (bench/modes.cpp); do not edit by hand. Every mode trains the same\n"
      << "model on the same Fashion-MNIST images with the same batch size, one thread per process, one mode\n"
      << "after another in one run on " << where << ", " << when << ".\n\n";
  if (s.rounds > 1) {
    out << s.rounds << " rounds, each running every mode once in this order; each row is the mode's median round\n"
        << "(images/s: the median, and the range over the rounds).\n\n";
  }
  out << "Settings: " << s.model << " (width " << s.width << "), " << s.epochs << " epoch(s) over the first " << s.limit
      << " training images, batch " << s.batchSize << ", " << s.microBatches
      << " micro-batches in the pipelines; test accuracy on the first " << s.limit << " test images.\n\n"
      << "| mode | processes | images/s | × single | peak RSS per process (MiB, max) | test accuracy | overhead "
         "share | what runs |\n"
      << "|---|---|---|---|---|---|---|---|\n";
  for (const Row& r : rows) {
    out << "| " << r.mode.name << " | " << r.mode.processes << " | ";
    if (!r.error.empty()) {
      out << "failed: " << r.error << " | | | | | " << r.mode.description << " |\n";
      continue;
    }
    const auto rate = number(r.result, "images_per_s");
    auto rss = number(r.result, "peak_rss_mib_max");
    if (!rss) rss = number(r.result, "peak_rss_mib");
    auto overhead = number(r.result, "rpc_overhead_share");
    if (!overhead) overhead = number(r.result, "overhead_share");
    std::string rateText = fixed(rate, 0);
    if (r.minRate && r.maxRate && s.rounds > 1)
      rateText += " (" + fixed(r.minRate, 0) + "–" + fixed(r.maxRate, 0) + ")";
    if (r.failedRuns > 0) rateText += ", " + std::to_string(r.failedRuns) + " run(s) failed";
    out << rateText << " | " << (rate && single ? fixed(*rate / *single, 2) : "—") << " | " << fixed(rss, 0) << " | "
        << fixed(number(r.result, "test_accuracy"), 1, 100.0) << "% | "
        << (overhead ? fixed(overhead, 1, 100.0) + "%" : "—") << " | " << r.mode.description << " |\n";
  }
  out << "\nOverhead share: the fraction of the step's wall time that is neither compute nor the schedule's own\n"
      << "bubbles (pipelines: measured stage compute times replayed through the schedule with free communication\n"
      << "give the ideal step; overhead = (measured - ideal) / measured): RPC for the multi-process modes, thread\n"
      << "hand-overs and core sharing for the local ones. Parameter server: the trainers' step time not spent\n"
      << "computing. DDP and ZeRO: the step time not spent in forward + backward (the gradient all-reduce that\n"
      << "did not overlap with backward, the optimizer step, ZeRO's parameter broadcasts), over both ranks.\n";
  for (const Row& r : rows) {
    const auto rate = number(r.result, "images_per_s");
    if (!r.mode.sumProcesses || !r.error.empty() || !rate || !single) continue;
    // Note [Two-process ceiling].
    const double ceiling = *rate / *single;
    const double bubbleFree = static_cast<double>(s.microBatches) / static_cast<double>(s.microBatches + 1);
    out << "\n"
        << r.mode.name << " is what this machine gives two workers: " << fixed(ceiling, 2)
        << "× `single` (2.00 would be two free cores).\n"
        << "A 2-stage pipeline of " << s.microBatches << " micro-batches keeps each stage busy at most "
        << s.microBatches << "/" << s.microBatches + 1 << " of a step (the fill and drain bubbles of GPipe and\n"
        << "1F1B), so its × `single` is bounded by about " << fixed(ceiling, 2) << " × " << fixed(bubbleFree, 2)
        << " = " << fixed(ceiling * bubbleFree, 2) << " here, with perfectly balanced stages.\n";
  }
  // Measured before the first mode started, so it is other jobs' load, not ours.
  if (loadBefore > 0.5) {
    out << "\nOther jobs kept the machine busy (load average " << fixed(loadBefore, 2) << " before the run): the\n"
        << "multi-process and multi-thread modes could not count on a free core each, so their speed-ups over\n"
        << "`single` are lower bounds; the ratios between modes of the same kind (RPC pipeline vs local pipeline)\n"
        << "are the comparable figures.\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  using distgrad::examples::Flags;
  Settings s;
  Flags flags("bench_modes", "runs every training mode on the same model and data; writes docs/modes.md");
  flags.add("--epochs", s.epochs, "epochs per mode")
      .add("--limit", s.limit, "train/test images used (0 = all)")
      .add("--batch-size", s.batchSize, "images per optimizer step (split over trainers / micro-batches)")
      .add("--micro-batches", s.microBatches, "micro-batches per step in the pipelines")
      .add("--model", s.model, "model of every mode (resnet18, resnet50, mlp, lenet5)")
      .add("--width", s.width, "ResNet base width")
      .add("--seed", s.seed, "initialisation and shuffling seed")
      .add("--modes", s.modes, "comma-separated subset of the modes (default all)")
      .add("--rounds", s.rounds, "times every mode runs, round by round (the table shows each mode's median)")
      .add("--out", s.out, "table to write (relative to the source tree)")
      .add("--no-write", s.noWrite, "print the JSON lines only")
      .add("--dry-run", s.dryRun, "print the commands, run nothing");
  flags.parse(argc, argv);
  flags.require(
      s.epochs >= 1 && s.limit >= 0 && s.batchSize >= 2 && s.microBatches >= 1 && s.width >= 1 && s.rounds >= 1,
      "--epochs, --micro-batches, --width, --rounds must be >= 1, --batch-size >= 2, --limit >= 0");

  // The build directory is the one this binary lives in (build/bench/bench_modes -> build/).
  const fs::path buildDir = fs::canonical("/proc/self/exe").parent_path().parent_path();
  std::vector<Mode> selected;
  for (const Mode& m : modes(s)) {
    if (s.modes.empty() || ("," + s.modes + ",").find("," + m.name + ",") != std::string::npos) selected.push_back(m);
  }
  flags.require(!selected.empty(), "--modes selects no known mode");

  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  const double loadBefore = loadAverage();
  const std::string where = machine(loadBefore);
  std::vector<std::vector<Row>> runs(selected.size());
  bool failed = false;
  for (int64_t round = 0; round < (s.dryRun ? 1 : s.rounds); ++round) {
    for (size_t i = 0; i < selected.size(); ++i) {
      const Mode& m = selected[i];
      if (s.dryRun) {
        std::cout << m.name << ": (cd " << buildDir.string() << " && " << m.command << ")\n";
        continue;
      }
      Row row = runMode(m, buildDir);
      distgrad::examples::JsonLine line;
      line.add("bench", "modes").add("mode", m.name).add("processes", m.processes);
      if (s.rounds > 1) line.add("round", round);
      if (!row.error.empty()) {
        failed = true;
        line.add("error", row.error);
      }
      // The example's own fields, renamed where they would repeat the row's ("mode" is the row's name here).
      for (const auto& [key, value] : row.result.values) {
        const std::string name = key == "mode" || key == "example" ? "example_" + key : key;
        if (const double* d = std::get_if<double>(&value)) line.add(name, *d);
        if (const int64_t* n = std::get_if<int64_t>(&value)) line.add(name, *n);
        if (const std::string* str = std::get_if<std::string>(&value)) line.add(name, *str);
      }
      std::cout << line.str() << std::endl;
      runs[i].push_back(std::move(row));
    }
  }
  if (!s.dryRun && !s.noWrite) {
    std::vector<Row> rows;
    for (auto& modeRuns : runs) rows.push_back(medianRun(std::move(modeRuns)));
    // --out is relative to the source tree (bench_modes runs from anywhere).
    fs::path out = s.out;
    if (out.is_relative()) out = fs::path(DG_SOURCE_DIR) / out;
    s.out = out.string();
    writeTable(s, rows, when, where, loadBefore);
    std::cerr << "bench_modes: wrote " << s.out << "\n";
  }
  return failed ? 1 : 0;
}
