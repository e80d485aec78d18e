#!/usr/bin/env python3
"""PyTorch side of bench/train_step: ResNet training steps on the CPU (one thread) or on one GPU.

The same workloads as the C++ bench_train_step, so the two can be compared line by line: ResNets in
torchvision's layout (written out here: torchvision may not be installed), cross-entropy loss, SGD (lr
0.01, momentum 0.9), synthetic inputs. A timed step is zero_grad + forward + loss + backward + optimizer
step, after untimed warm-up steps.
  --device cpu (default): ResNet-18, 10 classes, 3x32x32, batch 32.
  --device cuda[:N]: ResNet-50, 1000 classes, 3x224x224, batch 64; each timed step ends with
    torch.cuda.synchronize(device), as the C++ side syncs its stream. PyTorch's own defaults are kept
    (cuDNN TF32 convolutions on, cudnn.benchmark off, float32, no AMP); the lines record them.
--model, --image, --classes, --batch override the defaults.

Prints JSON lines (the contract of bench/bench_util.h, plus "impl":"pytorch"):
  {"bench":"train_step","metric":"images_per_s","unit":"images/s","median":..,"p10":..,"p90":..,"n":..,...}
  {"bench":"train_step","metric":"peak_rss","unit":"MiB",...}   peak resident memory of this whole process
                                                                 (Python and libtorch included)
When torch is missing, or --device cuda finds no usable GPU, it prints one line with "skipped" and exits 0.

Run with Debian's interpreter, which has python3-torch: /usr/bin/python3 bench/train_step_torch.py
"""

import argparse
import json
import resource
import sys
import time

BENCH = "train_step"


def emit(record):
    print(json.dumps(record, separators=(",", ":")), flush=True)


def stats_of(samples):
    # Same order statistics as distgrad::bench::statsOf: element round(q * (n - 1)) of the sorted samples.
    s = sorted(samples)
    pick = lambda q: s[int(q * (len(s) - 1) + 0.5)]
    return {"median": pick(0.5), "p10": pick(0.1), "p90": pick(0.9), "n": len(s)}


def build_resnet18(nn, num_classes):
    class BasicBlock(nn.Module):
        def __init__(self, in_planes, planes, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = None
            if stride != 1 or in_planes != planes:
                self.downsample = nn.Sequential(
                    nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            layers = []
            in_planes = 64
            for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                layers.append(nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)))
                in_planes = planes
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512, num_classes)
            # torchvision's initialisation.
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.constant_(m.weight, 1)
                    nn.init.constant_(m.bias, 0)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet18()


def build_resnet50(nn, num_classes):
    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, in_planes, planes, stride):
            super().__init__()
            width = planes
            self.conv1 = nn.Conv2d(in_planes, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            # torchvision (v1.5): the stride sits on the 3x3 convolution.
            self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or in_planes != planes * 4:
                self.downsample = nn.Sequential(
                    nn.Conv2d(in_planes, planes * 4, 1, stride=stride, bias=False), nn.BatchNorm2d(planes * 4))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + identity)

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            layers = []
            in_planes = 64
            for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
                stage = [Bottleneck(in_planes, planes, stride)]
                in_planes = planes * 4
                stage += [Bottleneck(in_planes, planes, 1) for _ in range(blocks - 1)]
                layers.append(nn.Sequential(*stage))
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(2048, num_classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.constant_(m.weight, 1)
                    nn.init.constant_(m.bias, 0)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet50()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--model", choices=("resnet18", "resnet50"), default=None,
                        help="default: resnet18 on the CPU, resnet50 on a GPU")
    parser.add_argument("--image", type=int, default=None, help="input side (default 32 CPU, 224 GPU)")
    parser.add_argument("--classes", type=int, default=None, help="default 10 CPU, 1000 GPU")
    parser.add_argument("--batch", type=int, default=None, help="default 32 CPU, 64 GPU")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    try:
        import torch
        from torch import nn
    except ImportError:
        emit({"bench": BENCH, "impl": "pytorch", "skipped": "torch not installed"})
        return 0

    gpu = args.device.startswith("cuda")
    model_name = args.model or ("resnet50" if gpu else "resnet18")
    image = args.image or (224 if gpu else 32)
    classes = args.classes or (1000 if gpu else 10)
    batch = args.batch or (64 if gpu else 32)
    if gpu:
        index = int(args.device.split(":")[1]) if ":" in args.device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            emit({"bench": BENCH, "impl": "pytorch", "device": args.device, "model": model_name,
                  "skipped": "%s requested but %d CUDA devices are available" % (
                      args.device, torch.cuda.device_count() if torch.cuda.is_available() else 0)})
            return 0
    device = torch.device(args.device)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    build = build_resnet50 if model_name == "resnet50" else build_resnet18
    model = build(nn, num_classes=classes).to(device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(batch, 3, image, image, device=device)
    labels = torch.randint(0, classes, (batch,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        if gpu:
            torch.cuda.synchronize(device)
        return loss

    for _ in range(args.warmup):
        step()
    seconds, cpu_seconds = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        cpu_seconds.append(time.thread_time() - c0)
        seconds.append(time.perf_counter() - t0)

    common = {"impl": "pytorch", "model": model_name, "batch": batch, "input": "3x%dx%d" % (image, image),
              "classes": classes, "device": str(device), "threads": args.threads, "torch": torch.__version__}
    if gpu:
        common.update({"gpu": torch.cuda.get_device_name(device),
                       "cudnn_tf32": torch.backends.cudnn.allow_tf32,
                       "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
                       "cudnn_benchmark": torch.backends.cudnn.benchmark})
    emit({"bench": BENCH, "metric": "images_per_s", "unit": "images/s",
          **stats_of([batch / s for s in seconds]), **common})
    if not gpu:
        # Per CPU-second of the calling thread (torch.set_num_threads(1) keeps compute on it).
        emit({"bench": BENCH, "metric": "images_per_cpu_s", "unit": "images/cpu-s",
              **stats_of([batch / s for s in cpu_seconds]), **common})
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss is KiB on Linux
    emit({"bench": BENCH, "metric": "peak_rss", "unit": "MiB",
          "median": peak_mib, "p10": peak_mib, "p90": peak_mib, "n": 1, **common})
    return 0


if __name__ == "__main__":
    sys.exit(main())
