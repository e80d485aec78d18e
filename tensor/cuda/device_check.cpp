#include "tensor/cuda/device_check.h"

#include "tensor/cuda/runtime.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda {

bool onCuda(const char* op, std::initializer_list<NamedOperand> operands) {
  const NamedOperand* first = nullptr;
  for (const NamedOperand& o : operands) {
    if (o.second == nullptr || !o.second->defined()) continue;
    if (first == nullptr) {
      first = &o;
      continue;
    }
    const Device a = first->second->device(), b = o.second->device();
    DG_CHECK(a == b, op, ": all operands must be on one device, but ", first->first, " is on ", a.str(), " and ",
             o.first, " is on ", b.str());
  }
  if (first == nullptr || !first->second->device().isCuda()) return false;
  // Named here so that "no GPU" / "built without CUDA" errors say which op wanted the device.
  requireDevice(first->second->device().index, op);
  return true;
}

}  // namespace distgrad::tensor::cuda
