// Runs the fuzz entry point (fuzz_envelope_input.h) on mutations of valid frames, so every CI build
// exercises the decoder on hostile input even without libFuzzer.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <random>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include "rpc/fuzz_envelope_input.h"

namespace distgrad::rpc::fuzz {
namespace {

EnvelopeFields kindFields(MessageKind kind, uint64_t messageId = 0) {
  EnvelopeFields fields;
  fields.kind = kind;
  fields.messageId = messageId;
  return fields;
}
EnvelopeFields callFields(const std::string& name) {
  EnvelopeFields fields = kindFields(MessageKind::kCall);
  fields.functionName = name;
  return fields;
}

// Turns a valid frame into the fuzz input format.
std::vector<uint8_t> toFuzzInput(const transport::OutgoingFrame& frame) {
  std::vector<uint8_t> out;
  out.push_back(static_cast<uint8_t>(frame.payloads.size()));
  for (const auto& p : frame.payloads) {
    out.push_back(static_cast<uint8_t>(p.size));
    out.push_back(static_cast<uint8_t>(p.size >> 8));
  }
  out.insert(out.end(), frame.envelope.begin(), frame.envelope.end());
  return out;
}

std::vector<std::vector<uint8_t>> seeds() {
  std::vector<std::vector<uint8_t>> out;
  Tensor a = Tensor::arange(6).detach();
  Tensor b = Tensor::arange(3, DType::kInt64);
  out.push_back(toFuzzInput(encodeCall(callFields("f"), a, b).value()));
  out.push_back(toFuzzInput(encodeMessageWith(kindFields(MessageKind::kResponse),
                                              std::vector<Tensor>{a, Tensor(), b})
                                .value()));
  out.push_back(toFuzzInput(
      encodeMessageWith(kindFields(MessageKind::kResponse), FuzzConfig{3, {1.0, 2.0}}).value()));
  out.push_back(toFuzzInput(encodeMessageWith(kindFields(MessageKind::kResponse),
                                              std::map<std::string, int32_t>{{"a", 1}, {"b", 2}})
                                .value()));
  // CUDA over RPC: a call whose envelope carries a device map, and a response with a CUDA descriptor
  // (built by hand: encoding a CUDA tensor needs a GPU).
  CodecScope mapped;
  mapped.deviceMap = std::make_shared<const DeviceMap>(DeviceMap().setIndex(0, 1).setIndex(1, 0));
  out.push_back(toFuzzInput(encodeCallIn(&mapped, callFields("g"), a).value()));
  {
    capnp::MallocMessageBuilder builder;
    auto env = builder.initRoot<wire::Envelope>();
    env.setKind(wire::Envelope::Kind::RESPONSE);
    env.setPayloadCount(1);
    auto desc = env.initValue().initTensor();
    desc.setDtype(static_cast<uint8_t>(DType::kFloat32));
    desc.initShape(1).set(0, 2);
    desc.initStrides(1).set(0, 1);
    desc.setDeviceType(static_cast<uint8_t>(tensor::DeviceType::kCUDA));
    desc.setDeviceIndex(0);
    desc.setByteLength(8);
    auto pairs = env.initDeviceMap(1);
    pairs[0].setSource(0);
    pairs[0].setTarget(0);
    auto words = capnp::messageToFlatArray(builder);
    auto bytes = words.asBytes();
    transport::OutgoingFrame frame;
    frame.envelope.assign(bytes.begin(), bytes.end());
    static const uint8_t kPayload[8] = {};
    frame.payloads.push_back(transport::SendBuffer{kPayload, 8, nullptr});
    out.push_back(toFuzzInput(frame));
  }
  EnvelopeFields error = kindFields(MessageKind::kError);
  error.error = Error::timeout("late").onWorker("w");
  out.push_back(toFuzzInput(encodeMessage(error).value()));
  return out;
}

TEST(FuzzEnvelope, SeedsDecode) {
  // DG_FUZZ_SEED_DIR=dir writes the seeds there as a starting corpus for the libFuzzer target.
  const char* seedDir = std::getenv("DG_FUZZ_SEED_DIR");
  int index = 0;
  for (const auto& seed : seeds()) {
    EXPECT_EQ(runEnvelopeFuzzInput(seed.data(), seed.size()), "");
    if (seedDir != nullptr) {
      std::ofstream out(std::string(seedDir) + "/seed" + std::to_string(index++), std::ios::binary);
      out.write(reinterpret_cast<const char*>(seed.data()), static_cast<std::streamsize>(seed.size()));
    }
  }
}

TEST(FuzzEnvelope, MutatedInputsNeverCrash) {
  std::mt19937_64 rng(20240601);
  const auto base = seeds();
  for (int trial = 0; trial < 4000; ++trial) {
    std::vector<uint8_t> input = base[rng() % base.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !input.empty(); ++e) {
      const size_t at = rng() % input.size();
      switch (rng() % 5) {
        case 0: input[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: input[at] = static_cast<uint8_t>(rng()); break;
        case 2: input.resize(at); break;
        case 3: input.insert(input.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rng())); break;
        case 4: input[at] = (rng() % 2) ? 0xff : 0x00; break;
      }
    }
    std::string problem = runEnvelopeFuzzInput(input.data(), input.size());
    ASSERT_EQ(problem, "") << "trial " << trial;
  }
}

TEST(FuzzEnvelope, RandomInputsNeverCrash) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 1000; ++trial) {
    std::vector<uint8_t> input(rng() % 256);
    for (auto& b : input) b = static_cast<uint8_t>(rng());
    ASSERT_EQ(runEnvelopeFuzzInput(input.data(), input.size()), "") << "trial " << trial;
  }
}

}  // namespace
}  // namespace distgrad::rpc::fuzz
