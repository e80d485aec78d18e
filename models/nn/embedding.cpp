#include "models/nn/embedding.h"

#include "autograd/ops.h"

namespace distgrad::models {

Embedding::Embedding(int64_t numEmbeddings, int64_t embeddingDim, tensor::Generator& gen)
    : Module("Embedding"), numEmbeddings_(numEmbeddings), embeddingDim_(embeddingDim) {
  DG_CHECK(numEmbeddings > 0 && embeddingDim > 0, "Embedding: numEmbeddings and embeddingDim must be > 0, got ",
           numEmbeddings, " and ", embeddingDim);
  weight_ = tensor::normal({numEmbeddings, embeddingDim}, 0.0, 1.0, gen);
  registerParameter("weight", weight_);
}

Tensor Embedding::forward(const Tensor& indices) {
  DG_CHECK(indices.dtype() == DType::kInt64, "Embedding: indices must be int64, got ",
           tensor::dtypeName(indices.dtype()));
  return embedding(weight_, indices);
}

}  // namespace distgrad::models
