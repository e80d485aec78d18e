// CUDA tensors over RPC (docs/cuda.md, "CUDA over RPC"): device maps and their validation, the wire fields
// (the envelope's device map, a TensorDesc's device), the handshake's device count, pinned staging, and
// end-to-end CUDA transfers. Everything up to the end-to-end section runs without a GPU; the GPU tests skip
// with the reason when no device is present.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "agent_test_util.h"
#include "rpc/device_map.h"
#include "rpc/message.h"
#include "rpc/store.h"
#include "tensor/cuda/pinned.h"
#include "tensor/cuda/runtime.h"
#include "tests/transport_params.h"

extern char** environ;

namespace distgrad::rpc {
namespace {

using namespace testing;  // the shared agent test setup (agent_test_util.h)
using tensor::Device;

template <typename F>
void expectValueError(F&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected a ValueError containing '" << needle << "'";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

template <typename R>
void expectErrorContains(const R& result, const std::string& text) {
  ASSERT_FALSE(result.ok()) << "expected an error containing: " << text;
  EXPECT_NE(result.error().message.find(text), std::string::npos) << result.error().message;
}

// ---------------------------------------------------------------- DeviceMap

TEST(DeviceMap, MapsAndInverts) {
  DeviceMap map{{Device::cuda(0), Device::cuda(1)}, {Device::cuda(1), Device::cuda(0)}, {Device::cuda(3), Device::cuda(7)}};
  EXPECT_EQ(map.size(), 3u);
  EXPECT_EQ(map.target(0), 1);
  EXPECT_EQ(map.target(3), 7);
  EXPECT_EQ(map.target(2), std::nullopt);
  EXPECT_EQ(map.targetsNeeded(), 8);
  EXPECT_EQ(map.str(), "{cuda:0 -> cuda:1, cuda:1 -> cuda:0, cuda:3 -> cuda:7}");
  const DeviceMap back = map.inverse();
  EXPECT_EQ(back.target(7), 3);
  EXPECT_EQ(back.target(1), 0);
  EXPECT_EQ(back.target(3), std::nullopt);
  EXPECT_EQ(back.inverse(), map);
  // The same pair twice is harmless.
  map.set(Device::cuda(0), Device::cuda(1));
  EXPECT_EQ(map.size(), 3u);
  EXPECT_TRUE(DeviceMap().empty());
  EXPECT_EQ(DeviceMap().targetsNeeded(), 0);
  EXPECT_EQ(DeviceMap().str(), "{}");
}

TEST(DeviceMap, RejectsBadEntries) {
  expectValueError([] { DeviceMap().set(Device::cpu(), Device::cuda(0)); }, "got source cpu");
  expectValueError([] { DeviceMap().set(Device::cuda(0), Device::cpu()); }, "got target cpu for source cuda:0");
  expectValueError([] { DeviceMap().set(Device::cuda(64), Device::cuda(0)); }, "source device index 64");
  expectValueError([] { DeviceMap().set(Device::cuda(0), Device::cuda(-1)); }, "target device index -1");
  // Two sources onto one target: the inverse (replies, gradients) would be ambiguous.
  expectValueError([] { DeviceMap{{Device::cuda(0), Device::cuda(2)}, {Device::cuda(1), Device::cuda(2)}}; },
                   "cuda:0 and cuda:1 are both mapped to cuda:2");
  expectValueError([] { DeviceMap{{Device::cuda(0), Device::cuda(2)}, {Device::cuda(1), Device::cuda(2)}}; },
                   "one-to-one");
  expectValueError([] { DeviceMap{{Device::cuda(0), Device::cuda(1)}, {Device::cuda(0), Device::cuda(2)}}; },
                   "cuda:0 is mapped to both cuda:1 and cuda:2");
}

TEST(DeviceMap, ParseDevice) {
  EXPECT_EQ(parseDevice("cpu", "t"), Device::cpu());
  EXPECT_EQ(parseDevice("cuda", "t"), Device::cuda(0));
  EXPECT_EQ(parseDevice("cuda:0", "t"), Device::cuda(0));
  EXPECT_EQ(parseDevice("cuda:63", "t"), Device::cuda(63));
  expectValueError([] { parseDevice("gpu", "where"); }, "where: unknown device 'gpu'");
  expectValueError([] { parseDevice("cuda:", "t"); }, "no valid index");
  expectValueError([] { parseDevice("cuda:x", "t"); }, "no valid index");
  expectValueError([] { parseDevice("cuda:1x", "t"); }, "no valid index");
  expectValueError([] { parseDevice("cuda:+1", "t"); }, "no valid index");
  expectValueError([] { parseDevice("cuda:-1", "t"); }, "has index -1");
  expectValueError([] { parseDevice("cuda:64", "t"); }, "index 64");
  expectValueError([] { parseDevice("cuda:99999999999", "t"); }, "no valid index");
}

TEST(DeviceMap, Options) {
  Options options;
  expectValueError([&] { options.setDeviceMap("", DeviceMap{{Device::cuda(0), Device::cuda(0)}}); },
                   "worker name is empty");
  options.setDeviceMap("worker1", DeviceMap{{Device::cuda(0), Device::cuda(1)}});
  EXPECT_EQ(options.deviceMaps.at("worker1").target(0), 1);
  EXPECT_NO_THROW(options.validate());
  options.deviceMaps[""] = DeviceMap{};
  expectValueError([&] { options.validate(); }, "deviceMaps has an entry for an empty worker name");
}

// ---------------------------------------------------------------- wire fields

std::vector<uint8_t> serialize(capnp::MessageBuilder& builder) {
  auto words = capnp::messageToFlatArray(builder);
  auto bytes = words.asBytes();
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

transport::IncomingFrame frameOf(capnp::MessageBuilder& builder, std::vector<uint64_t> sizes) {
  transport::IncomingFrame frame;
  frame.envelope = serialize(builder);
  for (uint64_t s : sizes) {
    auto storage = std::make_shared<tensor::Storage>(tensor::Storage::allocate(s));
    if (s > 0) std::memset(storage->data(), 0, s);
    frame.payloads.push_back({storage->data(), s, storage});
  }
  return frame;
}

// Both receive paths (the transports' allocator and decodeMessage) must refuse the envelope with `text`.
void expectRejected(capnp::MessageBuilder& builder, std::vector<uint64_t> sizes, const std::string& text) {
  std::vector<uint8_t> envelope = serialize(builder);
  expectErrorContains(makePayloadAllocator()(envelope, sizes), text);
  expectErrorContains(decodeMessage(frameOf(builder, sizes)), text);
}

// A response whose value is one float32 tensor of `n` elements on (deviceType, deviceIndex).
wire::TensorDesc::Builder tensorResponse(capnp::MallocMessageBuilder& builder, uint8_t deviceType, int16_t deviceIndex,
                                         int64_t n = 2) {
  auto env = builder.initRoot<wire::Envelope>();
  env.setKind(wire::Envelope::Kind::RESPONSE);
  env.setPayloadCount(1);
  auto desc = env.initValue().initTensor();
  desc.setDtype(static_cast<uint8_t>(DType::kFloat32));
  desc.initShape(1).set(0, n);
  desc.initStrides(1).set(0, 1);
  desc.setDeviceType(deviceType);
  desc.setDeviceIndex(deviceIndex);
  desc.setPayloadIndex(0);
  desc.setByteLength(static_cast<uint64_t>(n) * 4);
  return desc;
}

TEST(CudaWire, TensorDeviceFieldsAreValidated) {
  {
    capnp::MallocMessageBuilder b;
    tensorResponse(b, 0, 5);
    expectRejected(b, {8}, "names cpu with device index 5 (expected -1)");
  }
  {
    capnp::MallocMessageBuilder b;
    tensorResponse(b, 1, 64);
    expectRejected(b, {8}, "CUDA device index 64 (expected [0, 64))");
  }
  {
    capnp::MallocMessageBuilder b;
    tensorResponse(b, 1, -1);
    expectRejected(b, {8}, "CUDA device index -1");
  }
  {
    capnp::MallocMessageBuilder b;
    tensorResponse(b, 2, 0);
    expectRejected(b, {8}, "unknown device type 2 (expected 0 = cpu or 1 = cuda)");
  }
  // CPU with -1 (what senders write) or 0 (the field left unset) is accepted.
  for (int16_t index : {int16_t{-1}, int16_t{0}}) {
    capnp::MallocMessageBuilder b;
    tensorResponse(b, 0, index);
    auto message = decodeMessage(frameOf(b, {8}));
    ASSERT_TRUE(message.ok()) << message.error().message;
    auto value = message.value().decodeValue<Tensor>();
    ASSERT_TRUE(value.ok()) << value.error().message;
    EXPECT_TRUE(value.value().device().isCpu());
  }
}

TEST(CudaWire, ACudaTensorForADeviceTheReceiverLacksFailsNamingIt) {
  // Structurally valid (index < 64), so the envelope passes; decoding it is where the receiver's real device
  // count is checked.
  const int devices = tensor::cuda::deviceCount();
  capnp::MallocMessageBuilder b;
  tensorResponse(b, 1, static_cast<int16_t>(devices));
  auto message = decodeMessage(frameOf(b, {8}));
  ASSERT_TRUE(message.ok()) << message.error().message;
  expectErrorContains(message.value().decodeValue<Tensor>(),
                      "targets cuda:" + std::to_string(devices) + " but this process has " + std::to_string(devices) +
                          " CUDA device(s)");
}

TEST(CudaWire, EnvelopeDeviceMapRoundTrips) {
  auto map = std::make_shared<const DeviceMap>(DeviceMap{{Device::cuda(0), Device::cuda(3)}, {Device::cuda(2), Device::cuda(1)}});
  CodecScope scope;
  scope.deviceMap = map;
  EnvelopeFields fields;
  fields.kind = MessageKind::kCall;
  fields.autograd = AutogradIds{7, 9, false, {}};
  auto frame = encodeMessage(fields, {}, &scope);
  ASSERT_TRUE(frame.ok()) << frame.error().message;
  auto decoded = decodeLoopback(std::move(frame).value());
  ASSERT_TRUE(decoded.ok()) << decoded.error().message;
  EXPECT_EQ(decoded.value().fields().deviceMap, *map);
  ASSERT_TRUE(decoded.value().fields().autograd);
  EXPECT_EQ(decoded.value().fields().autograd->senderDeviceMap, *map);
  // A call's arguments are stream-ordered on the handler's thread; anything else waits on the host.
  EXPECT_FALSE(decoded.value().scope().cudaWaitOnHost);

  // Without a map, none is written.
  EnvelopeFields plain;
  plain.kind = MessageKind::kResponse;
  auto none = decodeLoopback(std::move(encodeMessage(plain)).value());
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none.value().fields().deviceMap.empty());
  EXPECT_TRUE(none.value().scope().cudaWaitOnHost);
}

TEST(CudaWire, EnvelopeDeviceMapIsValidated) {
  auto withMap = [](capnp::MallocMessageBuilder& b, std::vector<std::pair<int16_t, int16_t>> pairs) {
    auto env = b.initRoot<wire::Envelope>();
    env.setKind(wire::Envelope::Kind::CALL);
    env.initValue().setNull();
    auto list = env.initDeviceMap(static_cast<unsigned>(pairs.size()));
    for (unsigned i = 0; i < pairs.size(); ++i) {
      list[i].setSource(pairs[i].first);
      list[i].setTarget(pairs[i].second);
    }
  };
  {
    capnp::MallocMessageBuilder b;
    withMap(b, {{0, 64}});
    expectRejected(b, {}, "target device index 64");
  }
  {
    capnp::MallocMessageBuilder b;
    withMap(b, {{-3, 0}});
    expectRejected(b, {}, "source device index -3");
  }
  {
    capnp::MallocMessageBuilder b;
    withMap(b, {{0, 1}, {2, 1}});
    expectRejected(b, {}, "both mapped to cuda:1");
  }
  {
    capnp::MallocMessageBuilder b;
    withMap(b, {{0, 1}, {0, 2}});
    expectRejected(b, {}, "cuda:0 is mapped to both");
  }
  {
    capnp::MallocMessageBuilder b;
    std::vector<std::pair<int16_t, int16_t>> many(65, {0, 0});
    withMap(b, many);
    expectRejected(b, {}, "device map has 65 entries (at most 64)");
  }
  {
    capnp::MallocMessageBuilder b;
    withMap(b, {{0, 1}, {1, 0}});
    auto ok = decodeMessage(frameOf(b, {}));
    ASSERT_TRUE(ok.ok()) << ok.error().message;
    EXPECT_EQ(ok.value().fields().deviceMap.target(1), 0);
  }
}

// ---------------------------------------------------------------- pinned memory

TEST(Pinned, WithoutADeviceIsAClearError) {
  if (tensor::cuda::isAvailable()) GTEST_SKIP() << "a CUDA device is present (this checks the no-GPU error)";
  expectValueError([] { (void)tensor::cuda::allocatePinned(1024); }, "allocatePinned");
  const auto stats = tensor::cuda::pinnedStats();  // a query: never throws
  EXPECT_EQ(stats.bytesInUse, 0u);
}

TEST(Pinned, PoolReusesBlocks) {
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
  tensor::cuda::emptyPinnedCache();
  const auto before = tensor::cuda::pinnedStats();
  void* first = nullptr;
  {
    auto block = tensor::cuda::allocatePinned(5000);
    EXPECT_EQ(block.size(), 5000u);
    EXPECT_EQ(block.capacity(), 8192u);
    first = block.data();
    std::memset(block.data(), 1, block.size());
    EXPECT_EQ(tensor::cuda::pinnedStats().bytesInUse, before.bytesInUse + 8192);
  }
  auto again = tensor::cuda::allocatePinned(8000);  // same size class: the cached block
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(tensor::cuda::pinnedStats().reuses, before.reuses + 1);
  // Released after queued work: back in circulation once the stream reached it.
  auto stream = tensor::cuda::Stream::fromPool(0);
  again.releaseAfter(stream);
  again = tensor::cuda::PinnedBlock();
  stream.synchronize();
  EXPECT_EQ(tensor::cuda::pinnedStats().bytesPending, 0u);
}

TEST(Pinned, StagedCopiesRoundTripAcrossChunks) {
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
  // Sizes around the chunk size and the ring of chunks in flight.
  for (size_t n : {size_t{1}, size_t{4093}, tensor::cuda::kStagingChunkBytes - 1, tensor::cuda::kStagingChunkBytes,
                   tensor::cuda::kStagingChunkBytes * 5 + 3}) {
    std::vector<uint8_t> host(n), back(n, 0);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<uint8_t>(i * 131 + 7);
    tensor::Storage device = tensor::Storage::allocate(n, Device::cuda(0));
    auto stream = tensor::cuda::Stream::fromPool(0);
    tensor::cuda::copyHostToDeviceStaged(device.data(), host.data(), n, stream);
    // The producer of the device->host copy is the stream that wrote the bytes.
    tensor::cuda::copyDeviceToHostStaged(back.data(), device.data(), n, stream);
    EXPECT_EQ(back, host) << n << " bytes";
  }
}

// ---------------------------------------------------------------- agents, without a GPU

class CudaAgentTest : public AgentFixture {};

TEST_P(CudaAgentTest, HandshakeCarriesTheDeviceCount) {
  start();
  EXPECT_EQ(agent(0).peerCudaDevices("worker1"), tensor::cuda::deviceCount());
  EXPECT_EQ(agent(1).peerCudaDevices("worker0"), tensor::cuda::deviceCount());
  EXPECT_EQ(agent(0).peerCudaDevices("worker0"), tensor::cuda::deviceCount());  // itself
  EXPECT_EQ(agent(0).peerCudaDevices("nobody"), std::nullopt);
  EXPECT_TRUE(agent(1).peerDeviceMap("worker0").empty());
  // A per-call map is carried with CPU tensors without effect on them.
  CallOptions options;
  options.deviceMap = DeviceMap{{Device::cuda(0), Device::cuda(0)}};
  Tensor x = Tensor::fromVector({1.0f, 2.0f, 3.0f}, {3});
  Tensor y = agent(0).rpcSyncWith(options, "worker1", kIdentity, x);
  EXPECT_TRUE(y.device().isCpu());
  EXPECT_EQ(y.toVector<float>(), x.toVector<float>());
}

std::vector<std::string> startErrors(Cluster& cluster) {
  std::vector<std::string> out;
  for (auto& error : cluster.errors) {
    if (!error) {
      out.emplace_back();
      continue;
    }
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      out.emplace_back(e.what());
    }
  }
  return out;
}

TEST_P(CudaAgentTest, AMapNamingAnUnknownWorkerFailsStart) {
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.rendezvousTimeout = 3000ms;
  spec.customize = [](int rank, Options& options) {
    if (rank == 0) options.setDeviceMap("worker7", DeviceMap{{Device::cuda(0), Device::cuda(0)}});
  };
  registry_ = makeRegistry(world_);
  startCluster(cluster_, spec, world_, registry_);
  const auto errors = startErrors(cluster_);
  ASSERT_FALSE(errors[0].empty()) << "rank 0 started with a map naming an unknown worker";
  EXPECT_NE(errors[0].find("names worker 'worker7', which is not in the job (worker0, worker1)"), std::string::npos)
      << errors[0];
}

TEST_P(CudaAgentTest, AMapTargetingADeviceThePeerLacksFailsStartOnBothSides) {
  // The target is one past the peer's device count, whatever this machine has.
  const int devices = tensor::cuda::deviceCount();
  if (devices >= kMaxCudaDevices) GTEST_SKIP() << "64 CUDA devices: no index is missing";
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.customize = [devices](int rank, Options& options) {
    if (rank == 0) options.setDeviceMap("worker1", DeviceMap().setIndex(0, devices));
  };
  registry_ = makeRegistry(world_);
  startCluster(cluster_, spec, world_, registry_);
  const auto errors = startErrors(cluster_);
  const std::string expected = "maps cuda:0 -> cuda:" + std::to_string(devices) + " but worker1 has " +
                               std::to_string(devices) + " CUDA device(s)";
  // Both ends know both facts after the handshake; each refuses to start. (One may instead see the
  // other's teardown first; at least one names the device.)
  const bool named = errors[0].find(expected) != std::string::npos || errors[1].find(expected) != std::string::npos;
  EXPECT_TRUE(named) << "rank 0: " << errors[0] << "\nrank 1: " << errors[1];
  EXPECT_FALSE(errors[0].empty());
  EXPECT_FALSE(errors[1].empty());
}

// ---------------------------------------------------------------- end to end on a GPU

const Function<int64_t(Tensor)> kDeviceOf{"device_of"};

TEST_P(CudaAgentTest, CudaTensorRoundTrip) {
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
  ClusterSpec spec;
  // worker0 maps its cuda:0 to worker1's cuda:0; worker1 has no map of its own and answers through the
  // inverse (replies) or the inverse of worker0's announced map (its own sends).
  spec.customize = [](int rank, Options& options) {
    if (rank == 0) options.setDeviceMap("worker1", DeviceMap{{Device::cuda(0), Device::cuda(0)}});
  };
  start(spec, [](Registry& reg) {
    reg.bind(kDeviceOf, [](Tensor t) -> int64_t { return t.device().isCuda() ? t.device().index : -1; });
  });
  std::vector<float> values(3 * 1024 * 1024 + 5);  // > 2 staging chunks
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 1000) * 0.5f - 7.0f;
  const Tensor cpu = Tensor::fromVector(values, {static_cast<int64_t>(values.size())});
  const Tensor x = cpu.to(Device::cuda(0));
  EXPECT_EQ(agent(0).rpcSync("worker1", kDeviceOf, x), 0);
  Tensor y = agent(0).rpcSync("worker1", kIdentity, x);
  ASSERT_TRUE(y.device().isCuda());
  EXPECT_EQ(y.device().index, 0);
  EXPECT_EQ(y.to(Device::cpu()).toVector<float>(), values);
  // The callee's own calls back use the inverse of the map worker0 announced.
  Tensor z = agent(1).rpcSync("worker0", kIdentity, y.detach());
  EXPECT_EQ(z.to(Device::cpu()).toVector<float>(), values);
  // Empty and small tensors, other dtypes.
  Tensor empty = agent(0).rpcSync("worker1", kIdentity, Tensor::zeros({0, 3}, DType::kFloat32, Device::cuda(0)));
  EXPECT_EQ(empty.shape(), (Shape{0, 3}));
  EXPECT_TRUE(empty.device().isCuda());
  const Tensor ints = Tensor::fromVector(std::vector<int64_t>{1, -2, 3}, {3}).to(Device::cuda(0));
  EXPECT_EQ(agent(0).rpcSync("worker1", kIdentity, ints).to(Device::cpu()).toVector<int64_t>(),
            (std::vector<int64_t>{1, -2, 3}));
}

const Function<Tensor(int64_t)> kMakeCuda{"make_cuda"};

TEST_P(CudaAgentTest, CudaTensorWithoutAMapEntryIsRefusedAtTheCaller) {
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
  start({}, [](Registry& reg) {
    reg.bind(kMakeCuda, [](int64_t n) { return Tensor::ones({n}).to(Device::cuda(0)); });
  });
  const Tensor x = Tensor::ones({4}).to(Device::cuda(0));
  auto error = errorOf([&] { (void)agent(0).rpcSync("worker1", kIdentity, x); });
  EXPECT_NE(error.message.find("cannot send a tensor on cuda:0 to worker 'worker1'"), std::string::npos)
      << error.describe();
  EXPECT_NE(error.message.find("no entry for cuda:0"), std::string::npos) << error.describe();
  // A per-call map onto a device the callee lacks: refused at the caller, naming the callee's count.
  CallOptions options;
  options.deviceMap = DeviceMap().setIndex(0, tensor::cuda::deviceCount());
  error = errorOf([&] { (void)agent(0).rpcSyncWith(options, "worker1", kIdentity, x); });
  EXPECT_NE(error.message.find("CUDA device(s)"), std::string::npos) << error.describe();
  // A CUDA result for a caller that sent no map: the callee cannot place it and says why.
  error = errorOf([&] { (void)agent(0).rpcSync("worker1", kMakeCuda, int64_t{4}); });
  EXPECT_EQ(error.worker, "worker1") << error.describe();
  EXPECT_NE(error.message.find("cannot send a tensor on cuda:0 to worker 'worker0'"), std::string::npos)
      << error.describe();
  EXPECT_NE(error.message.find("inverse of its call's map"), std::string::npos) << error.describe();
}

// Two processes: the worker is this test binary run again (a fresh exec, not a fork: a forked child cannot
// use the CUDA driver its parent initialised), selected by an environment variable.
constexpr const char* kWorkerStoreVariable = "DG_TEST_CUDA_WORKER_STORE_PORT";

TEST(CudaProcess, WorkerRank1) {
  const char* port = std::getenv(kWorkerStoreVariable);
  if (port == nullptr) GTEST_SKIP() << "runs only as the child of CudaProcess.RoundTripAcrossProcesses";
  Registry reg;
  reg.bind(kIdentity, [](Tensor t) { return t; });
  auto agent = Agent::start(processOptions(1, 2, std::atoi(port), "cuda-proc"), reg);
  agent->shutdown();  // graceful: meets the parent at the barrier once it is done calling
}

TEST(CudaProcess, RoundTripAcrossProcesses) {
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
  auto store = StoreServer::start("127.0.0.1:0");
  const std::string variable = std::string(kWorkerStoreVariable) + "=" + std::to_string(store->port());
  std::vector<char*> env;
  for (char** e = environ; *e != nullptr; ++e) env.push_back(*e);
  env.push_back(const_cast<char*>(variable.c_str()));
  env.push_back(nullptr);
  std::string self = "/proc/self/exe";
  std::string filter = "--gtest_filter=CudaProcess.WorkerRank1";
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t child = 0;
  ASSERT_EQ(posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, argv, env.data()), 0);
  Options options = processOptions(0, 2, store->port(), "cuda-proc");
  options.setDeviceMap("worker1", DeviceMap{{Device::cuda(0), Device::cuda(0)}});
  Registry reg;
  std::unique_ptr<Agent> agent;
  try {
    agent = Agent::start(options, reg);
  } catch (const std::exception& e) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    FAIL() << "rank 0 failed to start: " << e.what();
  }
  std::vector<double> values(1 << 20);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(i) / 3.0 - 100.0;
  const Tensor x = Tensor::fromVector(values, {1024, 1024}).to(Device::cuda(0));
  const Tensor y = agent->rpcSync("worker1", kIdentity, x);
  EXPECT_TRUE(y.device().isCuda());
  EXPECT_EQ(y.shape(), (Shape{1024, 1024}));
  EXPECT_EQ(y.to(Device::cpu()).toVector<double>(), values);
  agent->shutdown();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "worker status " << status;
}

INSTANTIATE_TEST_SUITE_P(Transports, CudaAgentTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::rpc
