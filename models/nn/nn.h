// Umbrella header for the nn modules (models/nn/*.h).
// Thread-safety: see models/nn/module.h.
#pragma once

#include "models/nn/activation.h"
#include "models/nn/batch_norm.h"
#include "models/nn/conv.h"
#include "models/nn/dropout.h"
#include "models/nn/embedding.h"
#include "models/nn/flatten.h"
#include "models/nn/linear.h"
#include "models/nn/lstm.h"
#include "models/nn/module.h"
#include "models/nn/pooling.h"
#include "models/nn/sequential.h"
