#include "models/pipeline/pipeline.h"

#include <algorithm>

#include "tensor/error.h"

namespace distgrad::models::pipeline {

void PipelineOptions::validate() const {
  DG_CHECK(microBatches >= 1, "PipelineOptions.microBatches must be >= 1, got ", microBatches);
  optimizer.validate();
}

std::vector<int64_t> microBatchSizes(int64_t batchSize, int64_t microBatches) {
  DG_CHECK(batchSize >= 1, "pipeline batch size must be >= 1, got ", batchSize);
  DG_CHECK(microBatches >= 1, "pipeline micro-batches must be >= 1, got ", microBatches);
  const int64_t count = std::min(batchSize, microBatches);
  std::vector<int64_t> sizes(static_cast<size_t>(count), batchSize / count);
  for (int64_t i = 0; i < batchSize % count; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

}  // namespace distgrad::models::pipeline
