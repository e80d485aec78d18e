#include "rpc/error.h"

namespace distgrad::rpc {

const char* errorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kFailed: return "failed";
    case ErrorKind::kOverloaded: return "overloaded";
    case ErrorKind::kDisconnected: return "disconnected";
    case ErrorKind::kUnimplemented: return "unimplemented";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kCancelled: return "cancelled";
    case ErrorKind::kRemote: return "remote";
  }
  return "unknown";
}

std::string Error::describe() const {
  std::string out = errorKindName(kind);
  if (!worker.empty()) out += " on " + worker;
  out += ": ";
  if (kind == ErrorKind::kRemote && !remoteType.empty()) out += remoteType + ": ";
  out += message;
  return out;
}

}  // namespace distgrad::rpc
