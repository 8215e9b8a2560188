#!/usr/bin/env python
"""Train a ResNet-style CNN fed by a background-thread CUDA prefetcher.

In the manner of the hand-written prefetchers found in many public training repos
(a ``threading.Thread`` producer, like ``BackgroundGenerator``/``CUDAPrefetcher`` in
image-restoration and detection code bases): the producer thread makes a batch on the
host in pinned memory, copies it to the GPU on its own ``torch.cuda.Stream`` with
``non_blocking=True``, records a ``torch.cuda.Event`` and puts the batch into a
``queue.Queue(maxsize=3)``. The training loop makes the current stream wait on that
event, calls ``record_stream`` on the batch's tensors so the caching allocator does
not hand their memory back to the side stream too early, and trains a small ResNet
with SGD + momentum and ``cudnn.benchmark``. The producer is stopped cleanly at the
end (a stop event, the queue drained, the thread joined). Random images and labels
stand in for a dataset, so it runs offline.

    python threaded_prefetch.py --steps 10
"""

import argparse
import queue
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description="ResNet training with a threaded CUDA prefetcher")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--queue-size", type=int, default=3)
    p.add_argument("--device", default="cuda")
    return p.parse_args()


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, num_blocks=(2, 2, 2, 2), width=64, num_classes=100):
        super().__init__()
        self.in_planes = width
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        self.layer1 = self._make_layer(width, num_blocks[0], 1)
        self.layer2 = self._make_layer(width * 2, num_blocks[1], 2)
        self.layer3 = self._make_layer(width * 4, num_blocks[2], 2)
        self.layer4 = self._make_layer(width * 8, num_blocks[3], 2)
        self.fc = nn.Linear(width * 8, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class CUDAPrefetcher:
    """A producer thread that stages batches on the GPU ahead of the training loop."""

    def __init__(self, make_batch, device, num_batches, queue_size=3):
        self.make_batch = make_batch
        self.device = device
        self.num_batches = num_batches
        self.queue = queue.Queue(maxsize=queue_size)
        self.stop_event = threading.Event()
        self.use_cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream() if self.use_cuda else None
        self.error = None
        self.thread = threading.Thread(target=self._run, name="cuda-prefetcher", daemon=True)
        self.thread.start()

    def _put(self, item):
        while not self.stop_event.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            for _ in range(self.num_batches):
                if self.stop_event.is_set():
                    break
                images, labels = self.make_batch()
                if self.use_cuda:
                    images, labels = images.pin_memory(), labels.pin_memory()
                    with torch.cuda.stream(self.stream):
                        images = images.to(self.device, non_blocking=True)
                        labels = labels.to(self.device, non_blocking=True)
                        # normalise on the GPU, on the side stream (as many prefetchers do)
                        images = images.float().div_(255.0).sub_(0.5).div_(0.25)
                        event = torch.cuda.Event()
                        event.record(self.stream)
                else:
                    images = images.float().div_(255.0).sub_(0.5).div_(0.25)
                    event = None
                if not self._put((images, labels, event)):
                    return
        except BaseException as e:  # hand the error to the training loop
            self.error = e
        finally:
            self._put(None)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if item is None:
            if self.error is not None:
                raise RuntimeError("prefetcher thread failed") from self.error
            raise StopIteration
        images, labels, event = item
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            images.record_stream(torch.cuda.current_stream())
            labels.record_stream(torch.cuda.current_stream())
        return images, labels

    def close(self):
        self.stop_event.set()
        try:  # drain so a blocked put() returns
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            raise RuntimeError("prefetcher thread did not stop")


def main():
    args = parse_args()
    device = args.device  # "cuda"
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    model = ResNet(width=args.width, num_classes=args.num_classes).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"ResNet-18-style: {n_params / 1e6:.2f}M parameters")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    criterion = nn.CrossEntropyLoss()

    def make_batch():
        images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), dtype=torch.uint8)
        labels = torch.randint(0, args.num_classes, (args.batch_size,))
        return images, labels

    prefetcher = CUDAPrefetcher(make_batch, device, args.steps, args.queue_size)
    model.train()
    try:
        for step, (images, labels) in enumerate(prefetcher):
            t0 = time.time()
            output = model(images)
            loss = criterion(output, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 2 == 0 or step == args.steps - 1:
                msg = f"step {step}: loss {loss.item():.4f}, {1000 * (time.time() - t0):.0f} ms"
                if device.startswith("cuda"):
                    msg += (f", allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB, "
                            f"max reserved {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")
                print(msg)
    finally:
        prefetcher.close()
    print("done; prefetcher stopped:", not prefetcher.thread.is_alive())


if __name__ == "__main__":
    main()
