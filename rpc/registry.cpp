#include "rpc/registry.h"

namespace distgrad::rpc {

namespace detail {

Error handlerError(Error error, const std::string& callee) {
  // errorFromException marks a plain C++ exception as kFailed with its type: that is the handler's own
  // failure, which the caller sees as `remote`.
  if (error.kind == ErrorKind::kFailed && !error.remoteType.empty()) error.kind = ErrorKind::kRemote;
  if (error.worker.empty()) error.worker = callee;
  return error;
}

Error handlerError(std::exception_ptr exception, const std::string& callee) {
  return handlerError(errorFromException(std::move(exception)), callee);
}

}  // namespace detail

std::shared_ptr<const BoundFunction> Registry::find(const std::string& name) const {
  auto it = functions_.find(name);
  return it == functions_.end() ? nullptr : it->second;
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : functions_) out.push_back(name);
  return out;
}

}  // namespace distgrad::rpc
