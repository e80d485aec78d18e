#include "models/data/fashion_mnist.h"

#include <sys/stat.h>

#include <cstdlib>

#include "models/data/idx.h"

namespace distgrad::models::data {
namespace {

bool isFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The path of `base` (plain) or `base`.gz in dir, or "" when neither exists.
std::string findFile(const std::string& dir, const std::string& base) {
  for (const std::string& name : {base, base + ".gz"}) {
    std::string path = dir + "/" + name;
    if (isFile(path)) return path;
  }
  return "";
}

}  // namespace

std::vector<std::string> FashionMnist::searchPaths() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("DISTGRAD_DATA_DIR"); env != nullptr && *env != '\0') {
    dirs.emplace_back(env);
    dirs.push_back(std::string(env) + "/fashion-mnist");
  }
  dirs.emplace_back(kSystemDir);
  return dirs;
}

const std::vector<std::string>& FashionMnist::classNames() {
  static const std::vector<std::string> kNames{"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                               "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return kNames;
}

TensorDataset FashionMnist::load(Split split, const std::string& dir) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  const std::string imagesBase = prefix + "-images-idx3-ubyte";
  const std::string labelsBase = prefix + "-labels-idx1-ubyte";
  const std::vector<std::string> dirs = dir.empty() ? searchPaths() : std::vector<std::string>{dir};

  std::string imagesPath, labelsPath;
  for (const auto& d : dirs) {
    imagesPath = findFile(d, imagesBase);
    labelsPath = findFile(d, labelsBase);
    if (!imagesPath.empty() && !labelsPath.empty()) break;
    imagesPath.clear();
    labelsPath.clear();
  }
  if (imagesPath.empty()) {
    std::string searched;
    for (const auto& d : dirs) searched += (searched.empty() ? "" : ", ") + d;
    throw ValueError("FashionMnist::load: the " + prefix + " split (" + imagesBase + "[.gz] and " + labelsBase +
                     "[.gz]) was not found; searched: " + searched + ". Install the Debian package " +
                     kDebianPackage + " (apt-get install " + kDebianPackage +
                     ", files in " + kSystemDir + ") or set DISTGRAD_DATA_DIR to a directory holding the files");
  }

  const IdxArray images = readIdx(imagesPath);
  const IdxArray labels = readIdx(labelsPath);
  DG_CHECK(images.type == IdxType::kUInt8 && images.shape.size() == 3 && images.shape[1] == 28 && images.shape[2] == 28,
           "FashionMnist::load: '", imagesPath, "' should hold uint8 [N, 28, 28], holds ", idxTypeName(images.type), " ",
           tensor::shapeStr(images.shape));
  DG_CHECK(labels.type == IdxType::kUInt8 && labels.shape.size() == 1, "FashionMnist::load: '", labelsPath,
           "' should hold uint8 [N], holds ", idxTypeName(labels.type), " ", tensor::shapeStr(labels.shape));
  const int64_t n = images.shape[0];
  DG_CHECK(labels.shape[0] == n, "FashionMnist::load: '", imagesPath, "' has ", n, " images but '", labelsPath,
           "' has ", labels.shape[0], " labels");

  Tensor x = Tensor::empty({n, 1, 28, 28}, DType::kFloat32);
  float* xp = x.data<float>();
  // (pixel / 255 - mean) / std as one multiply-add per pixel.
  const float scale = static_cast<float>(1.0 / (255.0 * kStd));
  const float shift = static_cast<float>(-kMean / kStd);
  const uint8_t* src = images.bytes.data();
  for (int64_t i = 0, total = n * 28 * 28; i < total; ++i) xp[i] = static_cast<float>(src[i]) * scale + shift;

  Tensor y = Tensor::empty({n}, DType::kInt64);
  int64_t* yp = y.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t label = labels.bytes[static_cast<size_t>(i)];
    DG_CHECK(label < kNumClasses, "FashionMnist::load: '", labelsPath, "' has label ", int{label}, " at index ", i,
             " (expected 0..9)");
    yp[i] = label;
  }
  return TensorDataset(std::move(x), std::move(y));
}

}  // namespace distgrad::models::data
