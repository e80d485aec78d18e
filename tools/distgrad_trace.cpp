// distgrad-trace: merges, explains and draws the trace files the workers of a job wrote
// (docs/tracing.md, tools/README.md).
//
//   distgrad-trace merge DIR -o trace.json          one Chrome / Perfetto trace
//   distgrad-trace report DIR [--json]              where each worker's time went, the pipeline verdict
//   distgrad-trace plot DIR -o timeline.svg|.png [--step N|all] [--width PX]
//
// Exit status: 0 on success (warnings go to stderr), 1 when the trace cannot be used (no valid file, a
// step that is not there, an output that cannot be written, no cairo for plot), 2 for bad arguments.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tools/trace/merge.h"
#include "tools/trace/plot.h"
#include "tools/trace/report.h"
#include "tools/trace/trace_data.h"

namespace {

using namespace distgrad::tools::trace;

constexpr const char* kUsage =
    "usage: distgrad-trace merge DIR -o TRACE.json\n"
    "       distgrad-trace report DIR [--json]\n"
    "       distgrad-trace plot DIR -o PICTURE.svg|.png [--step N|all] [--width PIXELS]\n"
    "DIR holds the workers' *.trace.jsonl files (Options::traceDir / DISTGRAD_TRACE).\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void printWarnings(const std::vector<std::string>& warnings) {
  for (const auto& w : warnings) std::fprintf(stderr, "distgrad-trace: warning: %s\n", w.c_str());
}

int64_t parseInt(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used != value.size()) throw std::invalid_argument(value);
    return v;
  } catch (const std::exception&) {
    throw UsageError(flag + " needs an integer, got \"" + value + "\"");
  }
}

int run(int argc, char** argv) {
  if (argc < 2) throw UsageError("no command");
  const std::string command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (command != "merge" && command != "report" && command != "plot")
    throw UsageError("unknown command \"" + command + "\"");
  std::string dir, output;
  bool json = false;
  PlotOptions plot;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      return argv[++i];
    };
    if ((arg == "-o" || arg == "--output") && command != "report") {
      output = value();
    } else if (arg == "--json" && command == "report") {
      json = true;
    } else if (arg == "--step" && command == "plot") {
      const std::string v = value();
      if (v == "all") {
        plot.allSteps = true;
      } else {
        plot.step = parseInt(arg, v);
      }
    } else if (arg == "--width" && command == "plot") {
      plot.width = static_cast<int>(parseInt(arg, value()));
    } else if (!arg.empty() && arg[0] == '-') {
      throw UsageError("unknown option \"" + arg + "\" for " + command);
    } else if (dir.empty()) {
      dir = arg;
    } else {
      throw UsageError("unexpected argument \"" + arg + "\"");
    }
  }
  if (dir.empty()) throw UsageError(command + " needs a trace directory");
  if (command != "report" && output.empty()) throw UsageError(command + " needs -o OUTPUT");
  if (command == "plot" && !plotSupported()) {
    throw distgrad::ValueError(
        "this distgrad-trace was built without cairo, so plot is not available (install "
        "libcairo2-dev, e.g. with scripts/deps.sh, and re-run cmake)");
  }

  TraceSet set = loadTraceDir(dir);
  if (command == "merge") {
    printWarnings(set.warnings);
    std::ofstream out(output, std::ios::binary | std::ios::trunc);
    if (!out) throw distgrad::ValueError(output + ": cannot open for writing");
    const MergeStats stats = writeChromeTrace(set, out);
    out.close();
    if (!out) throw distgrad::ValueError(output + ": write failed");
    std::fprintf(stderr, "distgrad-trace: wrote %s: %zu worker(s), %zu events, %zu flows (%zu with one end dropped)\n",
                 output.c_str(), set.workers.size(), stats.events, stats.flows, stats.flowsDropped);
    return 0;
  }
  if (command == "report") {
    const Report report = analyze(set);
    if (json) {
      std::fputs(formatJsonLines(report, set).c_str(), stdout);
      printWarnings(report.warnings);
    } else {
      std::fputs(formatText(report, set).c_str(), stdout);  // warnings are part of the text
    }
    return 0;
  }
  printWarnings(set.warnings);
  const PlotLayout layout = layoutPlot(set, plot);
  renderPlot(layout, output, plot.width);
  std::fprintf(stderr, "distgrad-trace: wrote %s: %zu rows, %zu boxes\n", output.c_str(), layout.rows.size(),
               layout.boxes.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "distgrad-trace: %s\n%s", e.what(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distgrad-trace: error: %s\n", e.what());
    return 1;
  }
}
