// The fuzz entry point shared by the libFuzzer target (fuzz_envelope.cpp, clang + DG_FUZZ=ON) and the
// gtest that runs it on mutated inputs under any compiler (envelope_fuzz_test.cpp).
//
// Input format (chosen so a fuzzer reaches the envelope quickly):
//   u8 n (payload count, mod 5) | n x u16 little-endian payload sizes | envelope bytes (the rest)
// The entry point runs what a receiving transport runs: the PayloadAllocator on the envelope and sizes,
// then fills the payloads, decodeMessage, and typed decodes. It checks that the allocator and
// decodeMessage agree and that decoded tensors stay inside their payloads; any other outcome (an Error
// is fine) must not crash.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "rpc/codec.h"
#include "rpc/message.h"

namespace distgrad::rpc::fuzz {

struct FuzzConfig {
  int64_t a = 0;
  std::vector<double> b;
  template <class V>
  void visitFields(V& v) {
    v("a", a);
    v("b", b);
  }
};

inline uint64_t touchTensor(const Tensor& t) {
  if (!t.defined()) return 0;
  // A CUDA descriptor decodes to a device tensor where a GPU exists: read it through a host copy.
  if (!t.device().isCpu()) return touchTensor(t.to(Device::cpu()));
  const auto* bytes = static_cast<const uint8_t*>(t.rawData());
  uint64_t sum = 0;
  for (size_t i = 0; i < t.nbytes(); ++i) sum += bytes[i];
  return sum;
}

template <typename T>
void tryDecode(const DecodedMessage& message) {
  auto result = message.template decodeValue<T>();
  (void)result.ok();
}

// Returns an empty string when the input was handled correctly, else what went wrong.
inline std::string runEnvelopeFuzzInput(const uint8_t* data, size_t size) {
  if (size < 1) return {};
  const size_t count = data[0] % 5;
  size_t pos = 1;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < count; ++i) {
    if (pos + 2 > size) return {};
    sizes.push_back(static_cast<uint64_t>(data[pos]) | static_cast<uint64_t>(data[pos + 1]) << 8);
    pos += 2;
  }
  std::span<const uint8_t> envelope(data + pos, size - pos);

  auto allocate = makePayloadAllocator();
  auto buffers = allocate(envelope, sizes);

  transport::IncomingFrame frame;
  frame.envelope.assign(envelope.begin(), envelope.end());
  std::vector<std::shared_ptr<std::vector<uint8_t>>> keep;
  if (buffers) {
    if (buffers.value().size() != sizes.size()) return "allocator returned the wrong number of buffers";
    for (size_t i = 0; i < sizes.size(); ++i) {
      auto& b = buffers.value()[i];
      if (b.size != sizes[i]) return "allocator returned a buffer of the wrong size";
      if (b.size > 0) std::memset(b.data, static_cast<int>(i + 1), b.size);
    }
    frame.payloads = std::move(buffers).value();
  } else {
    // Still run decodeMessage (as inproc would) with plain buffers of the declared sizes.
    for (uint64_t s : sizes) {
      auto bytes = std::make_shared<std::vector<uint8_t>>(s, 7);
      frame.payloads.push_back(transport::PayloadBuffer{bytes->data(), bytes->size(), bytes});
    }
  }
  const bool allocated = buffers.ok();
  auto message = decodeMessage(std::move(frame));
  if (message.ok() != allocated) {
    return std::string("allocator and decodeMessage disagree: allocator ") + (allocated ? "accepted" : "rejected") +
           ", decodeMessage " + (message.ok() ? "accepted" : "rejected: " + message.error().message);
  }
  if (!message) return {};
  const DecodedMessage& m = message.value();
  if (auto tensors = m.decodeValue<std::vector<Tensor>>()) {
    for (const Tensor& t : tensors.value()) {
      if (!t.defined()) continue;
      if (t.nbytes() != t.storage().nbytes()) return "decoded tensor does not span its payload";
      touchTensor(t);
    }
  }
  if (auto t = m.decodeValue<std::tuple<Tensor, Tensor>>()) {
    touchTensor(std::get<0>(t.value()));
    touchTensor(std::get<1>(t.value()));
  }
  tryDecode<Tensor>(m);
  tryDecode<std::map<std::string, int32_t>>(m);
  tryDecode<std::optional<std::vector<float>>>(m);
  tryDecode<FuzzConfig>(m);
  tryDecode<std::tuple<std::string, uint8_t, bool>>(m);
  tryDecode<std::vector<std::vector<std::vector<int64_t>>>>(m);
  return {};
}

}  // namespace distgrad::rpc::fuzz
