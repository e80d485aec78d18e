#include "models/data/synthetic.h"

#include <limits>
#include <vector>

namespace distgrad::models::data {

TensorDataset makeGaussianBlobs(int64_t numSamples, int64_t numClasses, int64_t numFeatures, tensor::Generator& gen,
                                double clusterStd, double centerScale) {
  DG_CHECK(numSamples > 0 && numClasses > 0 && numFeatures > 0,
           "makeGaussianBlobs: numSamples, numClasses and numFeatures must be > 0, got ", numSamples, ", ", numClasses,
           ", ", numFeatures);
  DG_CHECK(clusterStd >= 0 && centerScale >= 0, "makeGaussianBlobs: clusterStd and centerScale must be >= 0");
  std::vector<double> centers(static_cast<size_t>(numClasses * numFeatures));
  for (auto& c : centers) c = centerScale * gen.normal();
  Tensor x = Tensor::empty({numSamples, numFeatures}, DType::kFloat32);
  Tensor y = Tensor::empty({numSamples}, DType::kInt64);
  float* xp = x.data<float>();
  int64_t* yp = y.data<int64_t>();
  for (int64_t i = 0; i < numSamples; ++i) {
    const int64_t label = i % numClasses;
    yp[i] = label;
    for (int64_t f = 0; f < numFeatures; ++f) {
      xp[i * numFeatures + f] =
          static_cast<float>(centers[static_cast<size_t>(label * numFeatures + f)] + clusterStd * gen.normal());
    }
  }
  return TensorDataset(std::move(x), std::move(y));
}

TensorDataset makeRandomImages(int64_t numSamples, const Shape& sampleShape, int64_t numClasses, tensor::Generator& gen) {
  DG_CHECK(numSamples > 0 && numClasses > 0, "makeRandomImages: numSamples and numClasses must be > 0, got ",
           numSamples, " and ", numClasses);
  const int64_t dim = tensor::numelOf(sampleShape);
  DG_CHECK(!sampleShape.empty() && dim > 0, "makeRandomImages: sample shape ", tensor::shapeStr(sampleShape),
           " must be non-empty");
  std::vector<float> templates(static_cast<size_t>(numClasses * dim));
  for (auto& t : templates) t = static_cast<float>(gen.normal());
  Shape shape{numSamples};
  shape.insert(shape.end(), sampleShape.begin(), sampleShape.end());
  Tensor x = Tensor::empty(shape, DType::kFloat32);
  Tensor y = Tensor::empty({numSamples}, DType::kInt64);
  float* xp = x.data<float>();
  int64_t* yp = y.data<int64_t>();
  for (int64_t i = 0; i < numSamples; ++i) {
    float* row = xp + i * dim;
    for (int64_t k = 0; k < dim; ++k) row[k] = static_cast<float>(gen.normal());
    int64_t best = 0;
    double bestScore = -std::numeric_limits<double>::infinity();
    for (int64_t c = 0; c < numClasses; ++c) {
      const float* t = templates.data() + c * dim;
      double score = 0;
      for (int64_t k = 0; k < dim; ++k) score += static_cast<double>(row[k]) * t[k];
      if (score > bestScore) {
        bestScore = score;
        best = c;
      }
    }
    yp[i] = best;
  }
  return TensorDataset(std::move(x), std::move(y));
}

}  // namespace distgrad::models::data
