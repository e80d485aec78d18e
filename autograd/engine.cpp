#include "autograd/engine.h"

#include "autograd/grad_mode.h"
#include "autograd/graph_task.h"
#include "autograd/ops.h"

namespace distgrad::autograd {

std::vector<Tensor> execute(const std::vector<Edge>& roots, const std::vector<Tensor>& rootGrads,
                            const ExecuteOptions& options) {
  DG_CHECK(roots.size() == rootGrads.size(), "backward: ", roots.size(), " roots but ", rootGrads.size(),
           " gradients");
  GraphTaskOptions taskOptions;
  taskOptions.retainGraph = options.retainGraph;
  taskOptions.captures = options.captures;
  taskOptions.accumulateLeaves = options.accumulateLeaves;
  GraphTask task(roots, std::move(taskOptions));
  for (size_t i = 0; i < roots.size(); ++i) task.deliver(roots[i], rootGrads[i]);
  while (Node* node = task.popReady()) {
    std::vector<Tensor> inputs = task.takeInputs(node);
    task.finish(node, task.run(*node, std::move(inputs)));
  }
  return task.takeCaptured();
}

namespace {
std::vector<Tensor> defaultRootGrads(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                                     const char* op) {
  if (!grads.empty()) {
    DG_CHECK(grads.size() == roots.size(), op, ": ", roots.size(), " tensors but ", grads.size(), " gradients");
    for (size_t i = 0; i < roots.size(); ++i) {
      DG_CHECK(grads[i].defined(), op, ": gradient ", i, " is undefined");
      DG_CHECK(grads[i].shape() == roots[i].shape(), op, ": gradient ", i, " has shape ",
               tensor::shapeStr(grads[i].shape()), " but the tensor has shape ", tensor::shapeStr(roots[i].shape()));
      DG_CHECK(grads[i].dtype() == roots[i].dtype() && grads[i].device() == roots[i].device(), op, ": gradient ", i,
               " is ", dtypeName(grads[i].dtype()), " on ", grads[i].device().str(), " but the tensor is ",
               dtypeName(roots[i].dtype()), " on ", roots[i].device().str());
    }
    return grads;
  }
  std::vector<Tensor> out;
  for (const auto& r : roots) {
    DG_CHECK(r.numel() == 1, op, ": an implicit gradient needs a one-element tensor, got shape ",
             tensor::shapeStr(r.shape()), " (pass explicit gradients)");
    out.push_back(Tensor::ones(r.shape(), r.dtype(), r.device()));
  }
  return out;
}

std::vector<Edge> rootEdges(const std::vector<Tensor>& roots, const char* op) {
  std::vector<Edge> edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    DG_CHECK(roots[i].defined() && roots[i].requiresGrad(), op, ": tensor ", i,
             " does not require grad and has no grad_fn");
    edges.push_back(gradientEdge(roots[i]));
  }
  return edges;
}
}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retainGraph) {
  ExecuteOptions options;
  options.retainGraph = retainGraph;
  execute(rootEdges(roots, "backward"), defaultRootGrads(roots, grads, "backward"), options);
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& gradOutputs, bool retainGraph) {
  ExecuteOptions options;
  options.retainGraph = retainGraph;
  options.accumulateLeaves = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    DG_CHECK(inputs[i].requiresGrad(), "grad: input ", i, " does not require grad");
    options.captures.push_back(gradientEdge(inputs[i]));
  }
  return execute(rootEdges(outputs, "grad"), defaultRootGrads(outputs, gradOutputs, "grad"), options);
}

}  // namespace distgrad::autograd
