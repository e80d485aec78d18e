// The seam between the RPC core and distributed autograd (autograd/distributed/, docs/dist_autograd.md).
//
// rpc/ never depends on distributed autograd: it keeps, per thread, the id of the distributed autograd
// context that is active (0 = none), and an Agent may hold one AutogradHook (installed through
// Registry::setAutogradHook before Agent::start). With both, the agent:
//   - sending a call (on the calling thread) while a context is active, or a response to a call that came
//     inside one: marks every sent tensor that requires grad (grad mode on) in its TensorDesc and calls
//     onSend, which records the SendBackward node; the envelope carries the context and message ids;
//   - receiving such a message: calls onReceive, which joins this worker to the context and returns the
//     RecvBackward node whose outputs the received grad tensors become (in payload order);
//   - running a call's handler: makes the call's context active on the executor thread for the handler's
//     synchronous part (nested calls then carry it on to further workers).
// A message that carries grad tensors to an agent without a hook is answered with a clear error.
// Thread-safety: the hook's methods are called concurrently from any agent thread and must not block.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "rpc/message.h"

namespace distgrad::rpc {

// The distributed autograd context active on this thread (0: none), and setting it (prefer the scope).
uint64_t activeAutogradContext();
void setActiveAutogradContext(uint64_t contextId);

// Makes `contextId` (0: none) the active context of this thread for its scope; restores the previous one.
class AutogradContextScope {
 public:
  explicit AutogradContextScope(uint64_t contextId);
  ~AutogradContextScope();
  AutogradContextScope(const AutogradContextScope&) = delete;
  AutogradContextScope& operator=(const AutogradContextScope&) = delete;

 private:
  uint64_t previous_;
};

// What the hook records for one sent message: its autograd message id (0: send it without a context) and,
// for a message with grad tensors, the ids of every message whose received tensors the sent ones were
// computed from, transitively (closureKnown false when the sender could not bound it): receivers keep it,
// so a backward can tell every worker which of its sends will receive a gradient without asking.
struct AutogradSend {
  uint64_t messageId = 0;
  bool closureKnown = false;
  std::vector<uint64_t> closure;
};

class AutogradHook {
 public:
  virtual ~AutogradHook() = default;
  // A message of context `contextId` is being sent to `peer` carrying `gradTensors` (the sent tensors that
  // require grad, in payload order; may be empty). Returns what goes in its envelope (messageId 0: the
  // message goes without a context: it carries no grad tensors and the context is gone here). Throws (the
  // send then fails with that message) when grad tensors cannot be recorded.
  virtual AutogradSend onSend(uint64_t contextId, const std::string& peer, const std::vector<Tensor>& gradTensors) = 0;
  // A message of context `ids.contextId` arrived from `peer` with tensors that require grad, described by
  // `gradMetas` (payload order); `ids` carries the sender's closure. Returns the node they hang from (one output per
  // entry of gradMetas), or nullptr when gradMetas is empty. Throws to refuse the message (the call fails with that
  // message).
  virtual std::shared_ptr<autograd::Node> onReceive(const AutogradIds& ids, const std::string& peer,
                                                    std::vector<autograd::TensorMeta> gradMetas) = 0;
};

}  // namespace distgrad::rpc
