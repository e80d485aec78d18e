// Embedding: a lookup table weight [numEmbeddings, embeddingDim]; forward maps int64 indices of any shape to
// [..., embeddingDim]. Initialised N(0, 1) like PyTorch.
// Thread-safety: see models/nn/module.h.
#pragma once

#include "models/nn/module.h"
#include "tensor/random.h"

namespace distgrad::models {

class Embedding : public Module {
 public:
  Embedding(int64_t numEmbeddings, int64_t embeddingDim, tensor::Generator& gen);
  Tensor forward(const Tensor& indices) override;
  int64_t numEmbeddings() const { return numEmbeddings_; }
  int64_t embeddingDim() const { return embeddingDim_; }
  const Tensor& weight() const { return weight_; }

 private:
  int64_t numEmbeddings_;
  int64_t embeddingDim_;
  Tensor weight_;
};

}  // namespace distgrad::models
