#include "rpc/autograd_hook.h"

namespace distgrad::rpc {
namespace {
thread_local uint64_t tActiveContext = 0;
}  // namespace

uint64_t activeAutogradContext() { return tActiveContext; }
void setActiveAutogradContext(uint64_t contextId) { tActiveContext = contextId; }

AutogradContextScope::AutogradContextScope(uint64_t contextId) : previous_(tActiveContext) {
  tActiveContext = contextId;
}

AutogradContextScope::~AutogradContextScope() { tActiveContext = previous_; }

}  // namespace distgrad::rpc
