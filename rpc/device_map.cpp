#include "rpc/device_map.h"

#include <charconv>

#include "tensor/error.h"

namespace distgrad::rpc {

DeviceMap::DeviceMap(std::initializer_list<std::pair<tensor::Device, tensor::Device>> entries) {
  for (const auto& [from, to] : entries) set(from, to);
}

DeviceMap& DeviceMap::set(tensor::Device from, tensor::Device to) {
  DG_CHECK(from.isCuda(), "device map: only CUDA devices can be mapped, got source ", from.str(),
           " (CPU tensors always land on the receiver's CPU)");
  DG_CHECK(to.isCuda(), "device map: only CUDA devices can be mapped, got target ", to.str(), " for source ",
           from.str(), " (CPU tensors always land on the receiver's CPU)");
  return setIndex(from.index, to.index);
}

DeviceMap& DeviceMap::setIndex(int from, int to, std::string_view what) {
  DG_CHECK(from >= 0 && from < kMaxCudaDevices, what, ": source device index ", from, " is outside [0, ",
           kMaxCudaDevices, ")");
  DG_CHECK(to >= 0 && to < kMaxCudaDevices, what, ": target device index ", to, " (source cuda:", from,
           ") is outside [0, ", kMaxCudaDevices, ")");
  auto f = forward_.find(from);
  if (f != forward_.end()) {
    DG_CHECK(f->second == to, what, ": cuda:", from, " is mapped to both cuda:", f->second, " and cuda:", to);
    return *this;
  }
  auto b = backward_.find(to);
  DG_CHECK(b == backward_.end(), what, ": cuda:", b == backward_.end() ? 0 : b->second, " and cuda:", from,
           " are both mapped to cuda:", to,
           ": a device map must be one-to-one (replies and gradients travel back with its inverse)");
  forward_.emplace(from, to);
  backward_.emplace(to, from);
  return *this;
}

std::optional<int> DeviceMap::target(int local) const {
  auto it = forward_.find(local);
  if (it == forward_.end()) return std::nullopt;
  return it->second;
}

DeviceMap DeviceMap::inverse() const {
  DeviceMap out;
  out.forward_ = backward_;
  out.backward_ = forward_;
  return out;
}

int DeviceMap::targetsNeeded() const { return backward_.empty() ? 0 : backward_.rbegin()->first + 1; }

std::string DeviceMap::str() const {
  std::string out = "{";
  for (const auto& [from, to] : forward_) {
    if (out.size() > 1) out += ", ";
    out += "cuda:" + std::to_string(from) + " -> cuda:" + std::to_string(to);
  }
  return out + "}";
}

tensor::Device parseDevice(std::string_view text, std::string_view what) {
  if (text == "cpu") return tensor::Device::cpu();
  if (text == "cuda") return tensor::Device::cuda(0);
  constexpr std::string_view kPrefix = "cuda:";
  DG_CHECK(text.substr(0, kPrefix.size()) == kPrefix, what, ": unknown device '", text,
           "' (expected cpu, cuda or cuda:N)");
  const std::string_view digits = text.substr(kPrefix.size());
  int index = -1;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  DG_CHECK(!digits.empty() && ec == std::errc() && ptr == digits.data() + digits.size() && digits[0] != '+',
           what, ": device '", text, "' has no valid index (expected cuda:N with N a decimal number)");
  DG_CHECK(index >= 0 && index < kMaxCudaDevices, what, ": device '", text, "' has index ", index,
           ", expected [0, ", kMaxCudaDevices, ")");
  return tensor::Device::cuda(index);
}

}  // namespace distgrad::rpc
