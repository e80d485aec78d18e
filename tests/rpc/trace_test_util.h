// Shared by the trace tests (trace_test.cpp, agent_trace_test.cpp): a temporary directory and a trace
// file read back line by line with the reader distgrad-trace uses (tools/flat_json.h), failing the test on
// any line that is not one flat JSON object of a documented type (docs/tracing.md).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "tools/flat_json.h"

namespace distgrad::trace::testing {

namespace fs = std::filesystem;
using tools::FlatObject;

// A fresh directory under the system's temp directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dg-trace-test-XXXXXX").string();
    char* made = ::mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A trace file read back: every line must be one flat JSON object of a known type.
struct TraceFile {
  FlatObject header;
  std::vector<FlatObject> threads, clocks, events;
  std::optional<FlatObject> end;
  size_t lines = 0;
};

inline TraceFile readTrace(const std::string& path) {
  TraceFile file;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::string line;
  while (std::getline(in, line)) {
    ++file.lines;
    std::string error;
    auto object = tools::parseFlatJson(line, &error);
    EXPECT_TRUE(object.has_value()) << "line " << file.lines << " of " << path << " is not a flat JSON object ("
                                    << error << "): " << line;
    if (!object) continue;
    if (file.lines == 1) {
      EXPECT_EQ(object->integer("distgrad_trace"), 1) << line;
      file.header = std::move(*object);
      continue;
    }
    const auto type = object->string("type");
    EXPECT_TRUE(type.has_value()) << line;
    if (type == "thread") {
      file.threads.push_back(std::move(*object));
    } else if (type == "clock") {
      file.clocks.push_back(std::move(*object));
    } else if (type == "span" || type == "instant" || type == "async") {
      file.events.push_back(std::move(*object));
    } else if (type == "end") {
      EXPECT_FALSE(file.end.has_value()) << "two end lines";
      file.end = std::move(*object);
    } else {
      ADD_FAILURE() << "unknown line type: " << line;
    }
  }
  EXPECT_GE(file.lines, 1u) << path << " is empty";
  return file;
}

// The events of `file` named `name`.
inline std::vector<const FlatObject*> named(const TraceFile& file, const std::string& name) {
  std::vector<const FlatObject*> out;
  for (const auto& e : file.events) {
    if (e.string("name") == name) out.push_back(&e);
  }
  return out;
}

}  // namespace distgrad::trace::testing
