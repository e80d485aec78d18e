// Fashion-MNIST (Zalando's 28x28 grey-scale clothing images, 10 classes) from its IDX files.
//
// Files: {train,t10k}-{images-idx3,labels-idx1}-ubyte, plain or .gz. Without an explicit directory the
// loader searches $DISTGRAD_DATA_DIR (the directory itself, then its fashion-mnist/ subdirectory) and then
// /usr/share/datasets/fashion-mnist, where the Debian package dataset-fashion-mnist installs them. When no
// directory holds the files, the error names the package and every path searched.
// Images come back as float32 [N, 1, 28, 28]: pixels scaled to [0, 1], then normalised with the training
// set's mean 0.2860 and std 0.3530. Labels are int64 [N] in 0..9.
// Thread-safety: stateless.
#pragma once

#include <string>
#include <vector>

#include "models/data/tensor_dataset.h"

namespace distgrad::models::data {

enum class Split { kTrain, kTest };

class FashionMnist {
 public:
  static constexpr double kMean = 0.2860;
  static constexpr double kStd = 0.3530;
  static constexpr int64_t kNumClasses = 10;
  static constexpr const char* kDebianPackage = "dataset-fashion-mnist";
  static constexpr const char* kSystemDir = "/usr/share/datasets/fashion-mnist";

  // Loads a split from `dir`, or from the default search path when `dir` is empty.
  static TensorDataset load(Split split, const std::string& dir = "");
  // The directories searched when no directory is given, in order.
  static std::vector<std::string> searchPaths();
  // The class names, index = label.
  static const std::vector<std::string>& classNames();
};

}  // namespace distgrad::models::data
