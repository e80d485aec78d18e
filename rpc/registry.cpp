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

void Registry::bindEntry(BoundFunction entry) {
  DG_CHECK(!entry.name.empty(), "Registry::bindEntry: the function name must not be empty");
  DG_CHECK(static_cast<bool>(entry.invoke), "Registry::bindEntry: function '", entry.name, "' has no invoke");
  DG_CHECK(functions_.find(entry.name) == functions_.end(), "Registry::bindEntry: function '", entry.name,
           "' is already bound");
  std::string name = entry.name;
  functions_.emplace(std::move(name), std::make_shared<const BoundFunction>(std::move(entry)));
}

std::shared_ptr<const BoundFunction> Registry::find(const std::string& name) const {
  auto it = functions_.find(name);
  return it == functions_.end() ? nullptr : it->second;
}

namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out.empty() ? "none" : out;
}

}  // namespace

std::shared_ptr<const ClassEntry> Registry::findClass(const std::string& name) const {
  auto it = classes_.find(name);
  return it == classes_.end() ? nullptr : it->second;
}

Result<std::shared_ptr<const ClassEntry>> Registry::resolveClass(const std::string& name,
                                                                  const std::string& worker) const {
  if (auto entry = findClass(name)) return entry;
  Error error = Error::unimplemented("no class '" + name + "' on " + worker + " (classes: " + join(classNames()) + ")");
  error.worker = worker;
  return error;
}

std::vector<std::string> Registry::classNames() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : classes_) out.push_back(name);
  return out;
}

void Registry::addConstructor(const std::string& className, BoundConstructor constructor) {
  auto it = classes_.find(className);
  DG_ASSERT(it != classes_.end(), "ClassBinder used for a class its registry does not have");
  for (const auto& existing : it->second->constructors) {
    DG_CHECK(existing.hash != constructor.hash, "ClassBinder: class '", className, "' already has constructor ",
             existing.signature);
  }
  auto updated = std::make_shared<ClassEntry>(*it->second);
  updated->constructors.push_back(std::move(constructor));
  it->second = std::move(updated);
}

Result<const BoundConstructor*> ClassEntry::findConstructor(uint64_t hash, const std::string& worker) const {
  std::vector<std::string> signatures;
  for (const auto& constructor : constructors) {
    if (constructor.hash == hash) return &constructor;
    signatures.push_back(constructor.signature);
  }
  Error error = Error::unimplemented("class '" + name + "' on " + worker +
                                     " has no constructor matching the caller's arguments (signature hash "
                                     "differs); its constructors: " + join(signatures));
  error.worker = worker;
  return error;
}

Result<const BoundMethod*> ClassEntry::findMethod(const std::string& method, uint64_t hash,
                                                 const std::string& worker) const {
  std::vector<std::string> sameName;
  std::vector<std::string> all;
  for (const auto& bound : methods) {
    if (bound.name == method) {
      if (bound.hash == hash) return &bound;
      sameName.push_back(bound.signature);
    }
    all.push_back(bound.name);
  }
  Error error = sameName.empty()
                    ? Error::unimplemented("class '" + name + "' on " + worker + " has no method '" + method +
                                           "' (methods: " + join(all) + ")")
                    : Error::unimplemented("method '" + name + "::" + method + "' on " + worker + " has signature " +
                                           join(sameName) +
                                           ", which does not match the caller's (signature hash differs)");
  error.worker = worker;
  return error;
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : functions_) out.push_back(name);
  return out;
}

}  // namespace distgrad::rpc
