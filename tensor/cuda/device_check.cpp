#include "tensor/cuda/device_check.h"

#include "tensor/cuda/runtime.h"
#include "tensor/error.h"

namespace distgrad::tensor::cuda {

Device deviceOf(const char* op, std::initializer_list<Operand> operands) {
  const Operand* first = nullptr;
  for (const Operand& operand : operands) {
    if (operand.tensor == nullptr || !operand.tensor->defined()) continue;
    if (first == nullptr) {
      first = &operand;
      continue;
    }
    const Device a = first->tensor->device();
    const Device b = operand.tensor->device();
    DG_CHECK(a == b, op, ": operands are on different devices: ", first->what, " on ", a.str(), ", ", operand.what,
             " on ", b.str(), " (move one with .to(device))");
  }
  if (first == nullptr) return Device::cpu();
  const Device device = first->tensor->device();
  // Named here so that "no GPU" / "built without CUDA" errors say which op wanted the device.
  if (device.isCuda()) requireDevice(device.index, op);
  return device;
}

}  // namespace distgrad::tensor::cuda
