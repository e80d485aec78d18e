// What every example program shares: command-line flags, Fashion-MNIST loading, a progress bar, test-set
// accuracy, peak RSS and the final JSON line. Header-only (each example is one .cpp linked on its own).
//
//   examples::Flags flags("train_local", "Trains LeNet-5 on Fashion-MNIST in one process.");
//   int64_t epochs = 3;
//   flags.add("--epochs", epochs, "passes over the training set");
//   std::string deviceName = "cpu";
//   flags.add("--device", deviceName, examples::kDeviceHelp);
//   flags.parse(argc, argv);                        // --help prints the usage; a bad value exits 2
//   Device device = examples::deviceFromFlag(flags, deviceName);   // malformed or unavailable: exits 2
//   examples::Data data = examples::loadFashionMnist(dataDir, limit);
//   examples::Progress progress("epoch 1/3", loader.numBatches());   progress.update(done, images, loss);
//   examples::JsonLine("train_local").add("test_accuracy", acc).add("images_per_s", rate).print();
//
// Thread-safety: none of this is meant for concurrent use (one main thread per example).
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/data/data_loader.h"
#include "models/data/fashion_mnist.h"
#include "models/data/tensor_dataset.h"
#include "tensor/cuda/runtime.h"
#include "tensor/tensor.h"

namespace distgrad::examples {

// A small flag parser: "--name value" for numbers and strings, "--name" alone for booleans.
class Flags {
 public:
  Flags(std::string program, std::string summary) : program_(std::move(program)), summary_(std::move(summary)) {}

  template <typename T>
  Flags& add(const std::string& name, T& slot, const std::string& help) {
    static_assert(std::is_same_v<T, int64_t> || std::is_same_v<T, int> || std::is_same_v<T, uint64_t> ||
                      std::is_same_v<T, double> || std::is_same_v<T, std::string> || std::is_same_v<T, bool>,
                  "Flags: unsupported flag type");
    flags_.push_back(Flag{name, help, &slot, describe(slot)});
    return *this;
  }

  // Parses argv; --help prints the usage and exits 0, a bad flag or value prints it and exits 2.
  void parse(int argc, char** argv) const {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "-h" || arg == "--help") {
        std::cout << usage();
        std::exit(0);
      }
      const Flag* flag = find(arg);
      if (flag == nullptr) fail("unknown argument " + arg);
      if (auto* b = std::get_if<bool*>(&flag->slot)) {
        **b = true;
        continue;
      }
      if (i + 1 >= argc) fail("missing value for " + arg);
      const std::string value = argv[++i];
      try {
        size_t used = 0;
        std::visit(
            [&](auto* slot) {
              using T = std::remove_pointer_t<decltype(slot)>;
              if constexpr (std::is_same_v<T, std::string>) {
                *slot = value;
                used = value.size();
              } else if constexpr (std::is_same_v<T, double>) {
                *slot = std::stod(value, &used);
              } else if constexpr (std::is_same_v<T, uint64_t>) {
                if (!value.empty() && value[0] == '-') throw std::invalid_argument("negative");
                *slot = std::stoull(value, &used);
              } else if constexpr (std::is_same_v<T, int>) {
                *slot = std::stoi(value, &used);
              } else if constexpr (std::is_same_v<T, int64_t>) {
                *slot = std::stoll(value, &used);
              }
            },
            flag->slot);
        if (used != value.size()) throw std::invalid_argument("trailing characters");
      } catch (const std::logic_error&) {
        fail("bad value '" + value + "' for " + arg);
      }
    }
  }

  // Exits 2 with `message` and the usage when `ok` is false (for checks across flags after parse()).
  void require(bool ok, const std::string& message) const {
    if (!ok) fail(message);
  }

  const std::string& program() const { return program_; }

  std::string usage() const {
    std::ostringstream out;
    out << program_ << ": " << summary_ << "\nusage: " << program_ << " [FLAGS]\n";
    for (const Flag& f : flags_) {
      out << "  " << f.name << (std::holds_alternative<bool*>(f.slot) ? "" : " V") << "\n      " << f.help;
      if (!f.defaultValue.empty()) out << " (default " << f.defaultValue << ")";
      out << "\n";
    }
    return out.str();
  }

 private:
  using Slot = std::variant<int64_t*, int*, uint64_t*, double*, std::string*, bool*>;
  struct Flag {
    std::string name, help;
    Slot slot;
    std::string defaultValue;
  };

  template <typename T>
  static std::string describe(const T& value) {
    if constexpr (std::is_same_v<T, std::string>) {
      return value.empty() ? "" : value;
    } else if constexpr (std::is_same_v<T, bool>) {
      return value ? "on" : "";
    } else {
      std::ostringstream out;
      out << value;
      return out.str();
    }
  }
  const Flag* find(const std::string& name) const {
    for (const Flag& f : flags_) {
      if (f.name == name) return &f;
    }
    return nullptr;
  }
  [[noreturn]] void fail(const std::string& message) const {
    std::cerr << program_ << ": " << message << "\n" << usage();
    std::exit(2);
  }

  std::string program_, summary_;
  std::vector<Flag> flags_;
};

// --device: where an example computes.
inline constexpr const char* kDeviceHelp = "where to compute: cpu | cuda | cuda:N (cuda = cuda:0)";

// "cpu", "cuda" (cuda:0) or "cuda:N" (N a decimal ordinal); throws ValueError naming the text otherwise.
inline Device parseDevice(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  const std::string prefix = "cuda:";
  if (text.rfind(prefix, 0) == 0 && text.size() > prefix.size() && text.size() <= prefix.size() + 4 &&
      text.find_first_not_of("0123456789", prefix.size()) == std::string::npos) {
    return Device::cuda(std::stoi(text.substr(prefix.size())));
  }
  throw ValueError("bad device '" + text + "': expected cpu, cuda or cuda:N");
}

// Why `device` cannot be used in this process, or "" when it can: "cuda:0 requested but no CUDA device is
// available (0 devices)", "cuda:2 requested but only 2 CUDA devices are available (cuda:0..cuda:1)", or that
// distgrad was built without CUDA.
inline std::string deviceUnavailableReason(Device device) {
  if (device.isCpu()) return "";
#ifndef DG_WITH_CUDA
  return device.str() + " requested but distgrad was built without CUDA (DG_WITH_CUDA=OFF)";
#else
  const int count = tensor::cuda::deviceCount();
  if (device.index >= 0 && device.index < count) return "";
  if (count == 0) return device.str() + " requested but no CUDA device is available (0 devices)";
  return device.str() + " requested but only " + std::to_string(count) + " CUDA device" +
         (count == 1 ? " is" : "s are") + " available (cuda:0.." + "cuda:" + std::to_string(count - 1) + ")";
#endif
}

// The device named by a --device flag's value, checked at start-up: a malformed name prints the usage and
// exits 2 (like any bad flag); a device this process cannot use prints why and exits 2, before any work.
inline Device deviceFromFlag(const Flags& flags, const std::string& text, const std::string& flagName = "--device") {
  Device device;
  try {
    device = parseDevice(text);
  } catch (const ValueError& e) {
    flags.require(false, flagName + ": " + e.what());
  }
  const std::string reason = deviceUnavailableReason(device);
  if (!reason.empty()) {
    std::cerr << flags.program() << ": " << flagName << ": " << reason << "\n";
    std::exit(2);
  }
  return device;
}

// For the examples whose CUDA path does not exist yet (docs/cuda.md, "Models, optimizers and examples on
// CUDA" lists them and why): --device is parsed and checked like everywhere, so the flag and its start-up
// errors are the same in every example, and then a CUDA device is refused with `why` (exit 2), before any
// work, rather than failing later inside a host-only component.
inline Device cpuOnlyDeviceFromFlag(const Flags& flags, const std::string& text, const std::string& why) {
  const Device device = deviceFromFlag(flags, text);
  if (device.isCuda()) {
    std::cerr << flags.program() << ": --device " << device.str() << ": not supported by this example yet: " << why
              << "\n";
    std::exit(2);
  }
  return device;
}

// The value of a one-element tensor on any device (a CUDA tensor is copied to the host: the host waits for
// the work that produced it, as loss.item() does in PyTorch).
inline double itemOf(const Tensor& t) { return (t.device().isCpu() ? t : t.to(Device::cpu())).item(); }

struct Data {
  models::data::TensorDataset train;
  models::data::TensorDataset test;
};

// Fashion-MNIST (normalised 1x28x28 float images, int64 labels) from `dir` or the default search path;
// `limit` > 0 keeps only the first `limit` training and test images (quick runs and tests).
inline Data loadFashionMnist(const std::string& dir, int64_t limit = 0) {
  using models::data::FashionMnist;
  using models::data::Split;
  using models::data::TensorDataset;
  auto cut = [limit](TensorDataset set) {
    if (limit <= 0 || limit >= set.size()) return set;
    return TensorDataset(narrow(set.inputs(), 0, 0, limit), narrow(set.labels(), 0, 0, limit));
  };
  return Data{cut(FashionMnist::load(Split::kTrain, dir)), cut(FashionMnist::load(Split::kTest, dir))};
}

inline double peakRssMiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

inline double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A progress bar on terminals; a plain line every ~2 s otherwise (logs stay readable).
class Progress {
 public:
  Progress(std::string label, int64_t total)
      : label_(std::move(label)),
        total_(total),
        tty_(isatty(STDOUT_FILENO) != 0),
        start_(std::chrono::steady_clock::now()),
        lastPrint_(start_) {}

  // `done` of `total` steps finished, `images` seen so far in this epoch, a running loss.
  void update(int64_t done, int64_t images, double loss) {
    const auto now = std::chrono::steady_clock::now();
    const bool last = done >= total_;
    if (!last && std::chrono::duration<double>(now - lastPrint_).count() < (tty_ ? 0.1 : 2.0)) return;
    lastPrint_ = now;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double rate = elapsed > 0 ? static_cast<double>(images) / elapsed : 0.0;
    const auto d = static_cast<long long>(done);
    const auto t = static_cast<long long>(total_);
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(kWidth * std::min(done, total_) / std::max<int64_t>(total_, 1));
      std::printf("\r%s [%s%s] %lld/%lld loss %.4f %.0f img/s", label_.c_str(), std::string(filled, '#').c_str(),
                  std::string(kWidth - filled, '.').c_str(), d, t, loss, rate);
      if (last) std::printf("\n");
    } else {
      std::printf("%s batch %lld/%lld loss %.4f %.0f img/s\n", label_.c_str(), d, t, loss, rate);
    }
    std::fflush(stdout);
  }

 private:
  std::string label_;
  int64_t total_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, lastPrint_;
};

// An exponential moving average of the loss for the progress bar; a non-finite loss is an error (training
// diverged), reported with where it happened.
class RunningLoss {
 public:
  double add(double loss, const std::string& where) {
    DG_CHECK(std::isfinite(loss), "loss became ", loss, " at ", where);
    value_ = first_ ? loss : 0.95 * value_ + 0.05 * loss;
    first_ = false;
    return value_;
  }
  double value() const { return value_; }

 private:
  bool first_ = true;
  double value_ = 0;
};

// Fraction of `set` that `forward` (inputs -> logits) classifies correctly, in batches, without autograd.
// The caller puts its model in eval mode around it.
// Batches go to `device` (where the model lives).
inline double testAccuracy(const std::function<Tensor(const Tensor&)>& forward, const models::data::TensorDataset& set,
                           int64_t batchSize = 1000, Device device = Device::cpu()) {
  autograd::NoGradGuard noGrad;
  models::data::DataLoader loader(set, {.batchSize = batchSize, .device = device});
  int64_t correct = 0;
  int64_t seen = 0;
  for (const auto& batch : loader) {
    Tensor predicted = argmax(forward(batch.inputs), 1);
    const Tensor hits = sum(eq(predicted, batch.labels));
    correct += static_cast<int64_t>((hits.device().isCpu() ? hits : hits.to(Device::cpu())).item());
    seen += batch.size();
  }
  return seen > 0 ? static_cast<double>(correct) / static_cast<double>(seen) : 0.0;
}

// The last line of every example: {"example":"NAME","key":value,...}. Numbers print with %.6g unless
// given as integers; strings are escaped.
class JsonLine {
 public:
  JsonLine() = default;  // no "example" key (benchmarks start theirs with "bench")
  explicit JsonLine(const std::string& example) { add("example", example); }

  JsonLine& add(const std::string& key, const std::string& value) {
    field(key);
    out_ << '"';
    for (char c : value) {
      if (c == '"' || c == '\\') {
        out_ << '\\' << c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", c);
        out_ << buf;
      } else {
        out_ << c;
      }
    }
    out_ << '"';
    return *this;
  }
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, double value) {
    field(key);
    if (!std::isfinite(value)) {
      out_ << "null";
    } else {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.6g", value);
      out_ << buf;
    }
    return *this;
  }
  JsonLine& add(const std::string& key, int64_t value) {
    field(key);
    out_ << value;
    return *this;
  }
  JsonLine& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  JsonLine& add(const std::string& key, bool value) {
    field(key);
    out_ << (value ? "true" : "false");
    return *this;
  }

  std::string str() const { return first_ ? "{}" : out_.str() + "}"; }
  void print() const {
    std::printf("%s\n", str().c_str());
    std::fflush(stdout);
  }

 private:
  void field(const std::string& key) {
    out_ << (first_ ? "{" : ",") << '"' << key << "\":";
    first_ = false;
  }
  std::ostringstream out_;
  bool first_ = true;
};

}  // namespace distgrad::examples
