// Synthetic labelled data sets for tests, examples and benchmarks (no files, fully determined by a seed).
// Thread-safety: stateless apart from the caller's Generator.
#pragma once

#include <cstdint>

#include "models/data/tensor_dataset.h"
#include "tensor/random.h"

namespace distgrad::models::data {

// Gaussian blobs: numClasses centres drawn from N(0, centerScale^2) per feature, samples drawn around their
// class centre with N(0, clusterStd^2). Classes are balanced and interleaved (sample i has class
// i % numClasses). inputs float32 [numSamples, numFeatures], labels int64 [numSamples].
TensorDataset makeGaussianBlobs(int64_t numSamples, int64_t numClasses, int64_t numFeatures, tensor::Generator& gen,
                                double clusterStd = 1.0, double centerScale = 4.0);

// Random images with a learnable rule: pixels ~ N(0, 1), and the label is the index of the class template
// (numClasses random N(0, 1) images of the same shape) with the largest inner product with the image, so a
// linear classifier can reach 100%. inputs float32 [numSamples, ...sampleShape], labels int64 [numSamples].
TensorDataset makeRandomImages(int64_t numSamples, const Shape& sampleShape, int64_t numClasses, tensor::Generator& gen);

}  // namespace distgrad::models::data
