#include "models/nn/lstm.h"

#include <cmath>
#include <string>

#include "autograd/ops.h"

namespace distgrad::models {

LSTM::LSTM(int64_t inputSize, int64_t hiddenSize, tensor::Generator& gen, int64_t numLayers, bool bias,
           bool batchFirst)
    : Module("LSTM"), inputSize_(inputSize), hiddenSize_(hiddenSize), numLayers_(numLayers), batchFirst_(batchFirst) {
  DG_CHECK(inputSize > 0 && hiddenSize > 0 && numLayers > 0, "LSTM: inputSize, hiddenSize and numLayers must be > 0, got ",
           inputSize, ", ", hiddenSize, ", ", numLayers);
  const double bound = 1.0 / std::sqrt(static_cast<double>(hiddenSize));
  layers_.resize(static_cast<size_t>(numLayers));
  for (int64_t l = 0; l < numLayers; ++l) {
    Layer& layer = layers_[static_cast<size_t>(l)];
    const int64_t in = l == 0 ? inputSize : hiddenSize;
    const std::string suffix = "_l" + std::to_string(l);
    layer.weightIh = tensor::uniform({4 * hiddenSize, in}, -bound, bound, gen);
    layer.weightHh = tensor::uniform({4 * hiddenSize, hiddenSize}, -bound, bound, gen);
    registerParameter("weight_ih" + suffix, layer.weightIh);
    registerParameter("weight_hh" + suffix, layer.weightHh);
    if (bias) {
      layer.biasIh = tensor::uniform({4 * hiddenSize}, -bound, bound, gen);
      layer.biasHh = tensor::uniform({4 * hiddenSize}, -bound, bound, gen);
      registerParameter("bias_ih" + suffix, layer.biasIh);
      registerParameter("bias_hh" + suffix, layer.biasHh);
    }
  }
}

Tensor LSTM::forward(const Tensor& input) { return forwardWithState(input).output; }

LstmOutput LSTM::forwardWithState(const Tensor& input, const std::optional<LstmState>& initial) {
  DG_CHECK(input.dim() == 3 && input.size(2) == inputSize_, "LSTM(", inputSize_, " -> ", hiddenSize_,
           "): expected input ", batchFirst_ ? "[N, T, " : "[T, N, ", inputSize_, "], got ",
           tensor::shapeStr(input.shape()));
  Tensor x = batchFirst_ ? contiguous(transpose(input, 0, 1)) : input;
  const int64_t steps = x.size(0);
  const int64_t batch = x.size(1);
  DG_CHECK(steps > 0 && batch > 0, "LSTM: empty input ", tensor::shapeStr(input.shape()));
  const Shape stateShape{numLayers_, batch, hiddenSize_};

  Tensor h0, c0;
  if (initial.has_value()) {
    h0 = initial->h;
    c0 = initial->c;
    DG_CHECK(h0.defined() && c0.defined(), "LSTM: an initial state needs both h and c");
    DG_CHECK(h0.shape() == stateShape && c0.shape() == stateShape, "LSTM: initial h and c must be ",
             tensor::shapeStr(stateShape), ", got ", tensor::shapeStr(h0.shape()), " and ", tensor::shapeStr(c0.shape()));
    DG_CHECK(h0.dtype() == x.dtype() && c0.dtype() == x.dtype(), "LSTM: initial state dtype (",
             tensor::dtypeName(h0.dtype()), ") must match the input's (", tensor::dtypeName(x.dtype()), ")");
  } else {
    h0 = Tensor::zeros(stateShape, x.dtype(), x.device());  // on the input's device (a module moved by to())
    c0 = h0;
  }

  std::vector<Tensor> finalH, finalC;
  Tensor layerInput = x;
  for (int64_t l = 0; l < numLayers_; ++l) {
    const Layer& layer = layers_[static_cast<size_t>(l)];
    // All steps' input projections at once: [T, N, 4H].
    Tensor inputGates = linear(layerInput, layer.weightIh, layer.biasIh);
    Tensor h = select(h0, 0, l);
    Tensor c = select(c0, 0, l);
    std::vector<Tensor> outputs;
    outputs.reserve(static_cast<size_t>(steps));
    for (int64_t t = 0; t < steps; ++t) {
      Tensor gates = add(select(inputGates, 0, t), linear(h, layer.weightHh, layer.biasHh));
      std::vector<Tensor> g = chunk(gates, 4, 1);
      Tensor inGate = sigmoid(g[0]);
      Tensor forgetGate = sigmoid(g[1]);
      Tensor cellGate = tanh(g[2]);
      Tensor outGate = sigmoid(g[3]);
      c = add(mul(forgetGate, c), mul(inGate, cellGate));
      h = mul(outGate, tanh(c));
      outputs.push_back(h);
    }
    layerInput = stack(outputs, 0);
    finalH.push_back(h);
    finalC.push_back(c);
  }
  LstmOutput result;
  result.output = batchFirst_ ? transpose(layerInput, 0, 1) : layerInput;
  result.state.h = stack(finalH, 0);
  result.state.c = stack(finalC, 0);
  return result;
}

}  // namespace distgrad::models
