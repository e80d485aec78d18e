// Shared by the pipeline trace tests (local_pipeline_test.cpp, rpc_pipeline_test.cpp): the pipeline events
// of a trace file (docs/tracing.md, "Pipeline events") checked against what a run of `steps` steps of S
// stages and M micro-batches must have recorded.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "tests/rpc/trace_test_util.h"

namespace distgrad::models::pipeline::tracecheck {

using trace::testing::TraceFile;
using Key = std::tuple<int64_t, int64_t, int64_t>;  // (a0, a1, a2)

inline Key argsOf(const tools::FlatObject& e) {
  return {e.integer("a0").value_or(-1), e.integer("a1").value_or(-1), e.integer("a2").value_or(-1)};
}

// The events named `name`, by their args, each checked to be a well-formed span of category pipeline with
// `detail` (when not empty). A key seen twice fails the test.
inline std::map<Key, const tools::FlatObject*> pipelineEvents(const TraceFile& file, const std::string& name,
                                                              const std::string& detail) {
  std::map<Key, const tools::FlatObject*> out;
  for (const tools::FlatObject* e : trace::testing::named(file, name)) {
    EXPECT_EQ(e->string("type"), "span") << name;
    EXPECT_EQ(e->string("cat"), "pipeline") << name;
    if (!detail.empty()) {
      EXPECT_EQ(e->string("detail"), detail) << name;
    }
    EXPECT_LE(e->integer("b").value_or(1), e->integer("e").value_or(0)) << name;
    const Key key = argsOf(*e);
    EXPECT_TRUE(out.emplace(key, e).second) << name << " recorded twice for (" << std::get<0>(key) << ", "
                                            << std::get<1>(key) << ", " << std::get<2>(key) << ")";
  }
  return out;
}

// Exactly one forward and one backward per (stage, micro-batch, step) for the stages in
// [firstStage, endStage), and nothing else.
inline void expectStageEvents(const TraceFile& file, int64_t firstStage, int64_t endStage, int64_t microBatches,
                              int64_t steps, const std::string& detail) {
  for (const char* name : {"pipeline.forward", "pipeline.backward"}) {
    SCOPED_TRACE(name);
    const auto events = pipelineEvents(file, name, detail);
    EXPECT_EQ(static_cast<int64_t>(events.size()), (endStage - firstStage) * microBatches * steps);
    for (int64_t s = firstStage; s < endStage; ++s) {
      for (int64_t m = 0; m < microBatches; ++m) {
        for (int64_t k = 0; k < steps; ++k) {
          EXPECT_EQ(events.count(Key{s, m, k}), 1u) << "stage " << s << ", micro-batch " << m << ", step " << k;
        }
      }
    }
  }
}

// The pipeline.step spans of `steps` steps: a0 the step, a1 M, a2 S, detail the schedule.
inline std::map<Key, const tools::FlatObject*> expectStepEvents(const TraceFile& file, int64_t microBatches,
                                                                int64_t stages, int64_t steps,
                                                                const std::string& schedule) {
  const auto events = pipelineEvents(file, "pipeline.step", schedule);
  EXPECT_EQ(static_cast<int64_t>(events.size()), steps);
  for (int64_t k = 0; k < steps; ++k) {
    EXPECT_EQ(events.count(Key{k, microBatches, stages}), 1u) << "step " << k;
  }
  return events;
}

}  // namespace distgrad::models::pipeline::tracecheck
