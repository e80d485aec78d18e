// Umbrella header for the models module: nn modules, checkpoints, optimizers, schedules, data and the zoo.
// Thread-safety: as documented in each header.
#pragma once

#include "models/checkpoint.h"
#include "models/data/data_loader.h"
#include "models/data/fashion_mnist.h"
#include "models/data/idx.h"
#include "models/data/sampler.h"
#include "models/data/synthetic.h"
#include "models/data/tensor_dataset.h"
#include "models/metrics.h"
#include "models/nn/nn.h"
#include "models/optim/adam.h"
#include "models/optim/clip_grad.h"
#include "models/optim/lr_scheduler.h"
#include "models/optim/sgd.h"
#include "models/state_dict.h"
#include "models/zoo/lenet.h"
#include "models/zoo/mlp.h"
#include "models/zoo/resnet.h"
