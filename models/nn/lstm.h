// LSTM: a multi-layer long short-term memory network built from differentiable ops (linear, sigmoid, tanh,
// chunk, stack), so its backward comes from autograd and it runs on any backend the ops do.
//
// Input [T, N, inputSize] ([N, T, inputSize] with batchFirst). Per layer l and step t, with gates in
// PyTorch's order (input, forget, cell, output):
//   gates = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh;  i, f, g, o = chunk(gates, 4)
//   c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g);   h_t = sigmoid(o) * tanh(c_t)
// Parameters use PyTorch's names (weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0, ...) and its
// initialisation U(-1/sqrt(hiddenSize), 1/sqrt(hiddenSize)). The input projection of a layer is computed
// for all steps in one matmul; only the recurrent part runs step by step.
// Thread-safety: see models/nn/module.h.
#pragma once

#include <optional>
#include <vector>

#include "models/nn/module.h"
#include "tensor/random.h"

namespace distgrad::models {

// Hidden and cell state, each [numLayers, N, hiddenSize].
struct LstmState {
  Tensor h;
  Tensor c;
};

struct LstmOutput {
  Tensor output;  // last layer's h_t for every step: [T, N, hiddenSize] ([N, T, hiddenSize] with batchFirst)
  LstmState state;  // h_n and c_n
};

class LSTM : public Module {
 public:
  LSTM(int64_t inputSize, int64_t hiddenSize, tensor::Generator& gen, int64_t numLayers = 1, bool bias = true,
       bool batchFirst = false);

  // The output sequence only (zero initial state).
  Tensor forward(const Tensor& input) override;
  // Output plus final state; `initial` defaults to zeros.
  LstmOutput forwardWithState(const Tensor& input, const std::optional<LstmState>& initial = std::nullopt);

  int64_t inputSize() const { return inputSize_; }
  int64_t hiddenSize() const { return hiddenSize_; }
  int64_t numLayers() const { return numLayers_; }
  bool batchFirst() const { return batchFirst_; }

 private:
  struct Layer {
    Tensor weightIh;  // [4H, in]
    Tensor weightHh;  // [4H, H]
    Tensor biasIh;    // [4H] or undefined
    Tensor biasHh;
  };
  int64_t inputSize_;
  int64_t hiddenSize_;
  int64_t numLayers_;
  bool batchFirst_;
  // Sized once in the constructor and never resized: the base class holds pointers into it.
  std::vector<Layer> layers_;
};

}  // namespace distgrad::models
