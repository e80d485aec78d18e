// GraphTask: one backward pass over a graph, as a state machine that gradients are fed into and nodes are
// taken out of one at a time. The local engine (autograd/engine.h) drives it to completion on one thread;
// the distributed engine (autograd/distributed/) keeps one per worker and context and feeds it gradients as
// they arrive from peers, so both share one implementation of dependency counting, buffering, hooks,
// validation and captures.
//
// The pass covers every node reachable from the `starts` given at construction. Each start edge is one
// expected delivery from outside (a root gradient, a gradient received from a peer): a node becomes ready
// once every edge into it, internal or external, has delivered. Among ready nodes the most recently created
// runs first.
// Thread-safety: none. deliver/popReady/takeInputs/finish must be serialised by the caller; run() touches no
// task state (only the node and the leaf sink), so the caller may run a node outside its lock while it
// serialises the other calls.
#pragma once

#include <functional>
#include <queue>
#include <unordered_map>
#include <vector>

#include "autograd/node.h"

namespace distgrad::autograd {

struct GraphTaskOptions {
  bool retainGraph = false;
  // Edges whose (fully summed) gradient the task keeps for takeCaptured(), in this order.
  std::vector<Edge> captures;
  // When false, AccumulateGrad nodes do not run (unless leafSink is set): leaves' .grad stays untouched.
  bool accumulateLeaves = true;
  // When set, a leaf's summed gradient goes here instead of into its .grad (distributed autograd
  // accumulates per context). Called from run(), so possibly outside the caller's lock.
  std::function<void(AccumulateGrad& leaf, Tensor grad)> leafSink;
};

class GraphTask {
 public:
  GraphTask(const std::vector<Edge>& starts, GraphTaskOptions options);
  GraphTask(const GraphTask&) = delete;
  GraphTask& operator=(const GraphTask&) = delete;

  // A gradient flowing into `edge` from outside the graph (one of the expected start deliveries). An
  // undefined gradient counts as a delivery that carries nothing.
  void deliver(const Edge& edge, const Tensor& grad);
  // One delivery into `node` carrying a gradient for each of its outputs (a start edge {node, 0}; how the
  // distributed engine hands a SendBackward the gradients that came back for its message).
  void deliverAll(Node* node, std::vector<Tensor> grads);
  // The next node to run (nullptr when none is ready).
  Node* popReady();
  // Moves out the summed gradients of `node` (one per output) and hands them to matching captures.
  std::vector<Tensor> takeInputs(Node* node);
  // Runs hooks, the node's backward and validation; returns one gradient per next edge (empty when the
  // node was skipped: no gradient defined). Releases saved tensors unless retainGraph. Touches only the
  // node (and the leaf sink).
  std::vector<Tensor> run(Node& node, std::vector<Tensor>&& inputs) const;
  // The hooks run() runs around a backward, without the backward itself: for a node whose gradients leave
  // the task instead (the distributed engine's RecvBackward sends them to a peer). runPreHooks runs the
  // tensor hooks, retainGrad of the node's outputs and the pre-hooks, and returns the gradients as they
  // left them; runPostHooks runs the post-hooks once the node has run (for a RecvBackward: its gradients
  // were handed to the agent).
  std::vector<Tensor> runPreHooks(Node& node, std::vector<Tensor>&& grads) const;
  void runPostHooks(Node& node, const std::vector<Tensor>& grads) const;
  // Routes the gradients `run` returned along the node's edges; successors may become ready.
  void finish(Node* node, std::vector<Tensor>&& gradInputs);

  // Every reachable node has run.
  bool done() const { return remaining_ == 0; }
  // Nodes reachable from the starts (the task's graph).
  size_t nodeCount() const { return dependencies_.size(); }
  // Nodes that have not run yet.
  size_t remaining() const { return remaining_; }
  // Whether `node` is part of this task.
  bool contains(const Node* node) const { return dependencies_.count(const_cast<Node*>(node)) != 0; }
  std::vector<Tensor> takeCaptured() { return std::move(captured_); }

 private:
  struct ReadyOrder {
    bool operator()(const Node* a, const Node* b) const { return a->sequenceNr() < b->sequenceNr(); }
  };
  std::vector<Tensor>& bufferOf(Node* node);
  void countDown(Node* node);

  GraphTaskOptions options_;
  std::vector<std::shared_ptr<Node>> startNodes_;  // keeps the graph alive for the task's lifetime
  std::unordered_map<Node*, int> dependencies_;    // every reachable node -> deliveries still expected
  std::unordered_map<Node*, std::vector<Tensor>> buffers_;
  std::priority_queue<Node*, std::vector<Node*>, ReadyOrder> ready_;
  std::vector<Tensor> captured_;
  size_t remaining_ = 0;
};

}  // namespace distgrad::autograd
