# Quantization-aware training, PyTorch eager-mode QAT tutorial / torchvision references/classification/train_quantization.py style, on the GPU
"""
QAT of a ResNet-18 written with QuantStub/DeQuantStub and FloatFunctional for the
residual add, trained on the GPU with fake quantization and converted to an int8
model on the CPU for evaluation after every epoch.

Data is random: an ImageNet-shaped fake dataset so the script runs anywhere.
"""
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.ao.quantization
from torch.ao.quantization import QuantStub, DeQuantStub
import torch.nn.intrinsic.qat


# # Setup warnings
import warnings
warnings.filterwarnings(
    action='ignore',
    category=DeprecationWarning,
    module=r'.*'
)
warnings.filterwarnings(
    action='default',
    module=r'torch.ao.quantization'
)

# Specify random seed for repeatable results
torch.manual_seed(191009)


######################################################################
# 1. Model architecture
# ---------------------
#
# We define a ResNet-18 with several notable modifications to enable quantization:
#
# - Replacing addition with ``nn.quantized.FloatFunctional``
# - Insert ``QuantStub`` and ``DeQuantStub`` at the beginning and end of the network.
# - Every ReLU is its own module so that it can be fused with the preceding conv/bn.


def conv3x3(in_planes, out_planes, stride=1):
    """3x3 convolution with padding"""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride,
                     padding=1, bias=False)


def conv1x1(in_planes, out_planes, stride=1):
    """1x1 convolution"""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super(BasicBlock, self).__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=False)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride
        # Replace torch.add with floatfunctional
        self.add_relu = nn.quantized.FloatFunctional()

    def forward(self, x):
        identity = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)

        if self.downsample is not None:
            identity = self.downsample(x)

        out = self.add_relu.add_relu(out, identity)

        return out

    def fuse_model(self, is_qat=False):
        fuse = torch.ao.quantization.fuse_modules_qat if is_qat else torch.ao.quantization.fuse_modules
        fuse(self, [['conv1', 'bn1', 'relu'], ['conv2', 'bn2']], inplace=True)
        if self.downsample:
            fuse(self.downsample, ['0', '1'], inplace=True)


class QuantizableResNet(nn.Module):

    def __init__(self, block, layers, num_classes=1000):
        super(QuantizableResNet, self).__init__()
        self.inplanes = 64
        self.quant = QuantStub()
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3,
                               bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=False)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        self.dequant = DeQuantStub()

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )

        layers = []
        layers.append(block(self.inplanes, planes, stride, downsample))
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))

        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.quant(x)
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)

        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)

        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        x = self.dequant(x)
        return x

    # Fuse Conv+BN and Conv+BN+Relu modules prior to quantization
    # This operation does not change the numerics
    def fuse_model(self, is_qat=False):
        fuse = torch.ao.quantization.fuse_modules_qat if is_qat else torch.ao.quantization.fuse_modules
        fuse(self, ['conv1', 'bn1', 'relu'], inplace=True)
        for m in self.modules():
            if type(m) is BasicBlock:
                m.fuse_model(is_qat)


def resnet18(num_classes=1000):
    return QuantizableResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)


######################################################################
# 2. Helper functions
# -------------------


class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self, name, fmt=':f'):
        self.name = name
        self.fmt = fmt
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = '{name} {val' + self.fmt + '} ({avg' + self.fmt + '})'
        return fmtstr.format(**self.__dict__)


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


class FakeImageNet(torch.utils.data.Dataset):
    """Random 3x224x224 images and labels, standing in for ImageFolder(...)."""

    def __init__(self, size, num_classes=1000, image_size=224):
        self.size = size
        self.num_classes = num_classes
        self.image_size = image_size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        img = torch.randn(3, self.image_size, self.image_size, generator=g)
        target = int(torch.randint(0, self.num_classes, (1,), generator=g))
        return img, target


def evaluate(model, criterion, data_loader, neval_batches):
    model.eval()
    top1 = AverageMeter('Acc@1', ':6.2f')
    top5 = AverageMeter('Acc@5', ':6.2f')
    cnt = 0
    with torch.no_grad():
        for image, target in data_loader:
            output = model(image)
            loss = criterion(output, target)
            cnt += 1
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            print('.', end = '')
            top1.update(acc1[0], image.size(0))
            top5.update(acc5[0], image.size(0))
            if cnt >= neval_batches:
                return top1, top5

    return top1, top5


def train_one_epoch(model, criterion, optimizer, data_loader, device, ntrain_batches):
    model.train()
    top1 = AverageMeter('Acc@1', ':6.2f')
    top5 = AverageMeter('Acc@5', ':6.2f')
    avgloss = AverageMeter('Loss', '1.5f')

    cnt = 0
    for image, target in data_loader:
        start_time = time.time()
        print('.', end = '')
        cnt += 1
        image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        top1.update(acc1[0], image.size(0))
        top5.update(acc5[0], image.size(0))
        avgloss.update(loss, image.size(0))
        if cnt >= ntrain_batches:
            print('Loss', avgloss.avg)

            print('Training: * Acc@1 {top1.avg:.3f} Acc@5 {top5.avg:.3f}'
                  .format(top1=top1, top5=top5))
            return

    print('Full imagenet train set:  * Acc@1 {top1.global_avg:.3f} Acc@5 {top5.global_avg:.3f}'
          .format(top1=top1, top5=top5))
    return


def print_size_of_model(model):
    torch.save(model.state_dict(), "temp.p")
    print('Size (MB):', os.path.getsize("temp.p")/1e6)
    os.remove('temp.p')


######################################################################
# 3. Quantization-aware training
# ------------------------------


def get_args_parser(add_help=True):
    parser = argparse.ArgumentParser(description="PyTorch Quantized Classification Training", add_help=add_help)
    parser.add_argument("--device", default="cuda", type=str, help="device (Use cuda or cpu Default: cuda)")
    parser.add_argument("-b", "--batch-size", default=96, type=int, help="images per gpu")
    parser.add_argument("--eval-batch-size", default=8, type=int, help="images per eval batch (on the CPU)")
    parser.add_argument("--epochs", default=4, type=int, metavar="N", help="number of total epochs to run")
    parser.add_argument("--num-train-batches", default=2, type=int, help="training batches per epoch")
    parser.add_argument("--num-eval-batches", default=1, type=int, help="evaluation batches per epoch")
    parser.add_argument("-j", "--workers", default=2, type=int, metavar="N", help="number of data loading workers")
    parser.add_argument("--lr", default=0.0001, type=float, help="initial learning rate")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, metavar="W",
                        help="weight decay (default: 1e-4)", dest="weight_decay")
    parser.add_argument("--backend", default="fbgemm", type=str, help="fbgemm or qnnpack")
    parser.add_argument("--num-observer-update-epochs", default=3, type=int, metavar="N",
                        help="number of total epochs to update observers")
    parser.add_argument("--num-batch-norm-update-epochs", default=2, type=int, metavar="N",
                        help="number of total epochs to update batch norm stats")
    parser.add_argument("--num-classes", default=1000, type=int)
    parser.add_argument("--print-size", action="store_true", help="print the size of the float and int8 models")
    return parser


def main(args):
    print(args)
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True

    if args.backend not in torch.backends.quantized.supported_engines:
        raise RuntimeError("Quantized backend not supported: " + str(args.backend))
    torch.backends.quantized.engine = args.backend

    # Data loading code
    print("Loading data")
    dataset = FakeImageNet(args.batch_size * args.num_train_batches, args.num_classes)
    dataset_test = FakeImageNet(args.eval_batch_size * args.num_eval_batches, args.num_classes)
    data_loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True,
        num_workers=args.workers, pin_memory=True)
    data_loader_test = torch.utils.data.DataLoader(
        dataset_test, batch_size=args.eval_batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True)

    print("Creating model")
    qat_model = resnet18(num_classes=args.num_classes)
    qat_model.to(device)
    qat_model.fuse_model(is_qat=True)

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(qat_model.parameters(), lr=args.lr,
                                momentum=args.momentum, weight_decay=args.weight_decay)

    qat_model.qconfig = torch.ao.quantization.get_default_qat_qconfig(args.backend)
    torch.ao.quantization.prepare_qat(qat_model, inplace=True)
    print('Basic block: After preparation for QAT, note fake-quantization modules \n', qat_model.layer1[0])

    # QAT takes time and one needs to train over a few epochs.
    # Train and check accuracy after each epoch
    start_time = time.time()
    for nepoch in range(args.epochs):
        train_one_epoch(qat_model, criterion, optimizer, data_loader, device, args.num_train_batches)
        if nepoch >= args.num_observer_update_epochs:
            print("Disabling observer for subseq epochs, epoch = ", nepoch)
            # Freeze quantizer parameters
            qat_model.apply(torch.ao.quantization.disable_observer)
        if nepoch >= args.num_batch_norm_update_epochs:
            print("Freezing BN for subseq epochs, epoch = ", nepoch)
            # Freeze batch norm mean and variance estimates
            qat_model.apply(torch.nn.intrinsic.qat.freeze_bn_stats)

        # Check the accuracy after each epoch
        print("Evaluate QAT model")
        quantized_eval_model = copy.deepcopy(qat_model)
        quantized_eval_model.eval()
        quantized_eval_model.to(torch.device("cpu"))
        torch.ao.quantization.convert(quantized_eval_model, inplace=True)

        top1, top5 = evaluate(quantized_eval_model, criterion, data_loader_test, neval_batches=args.num_eval_batches)
        print('Epoch %d :Evaluation accuracy on %d images, %2.2f' % (nepoch, args.num_eval_batches * args.eval_batch_size, top1.avg))
        if device.type == "cuda":
            print('Max memory allocated: %.2f GB' % (torch.cuda.max_memory_allocated() / 1e9))

    if args.print_size:
        print_size_of_model(quantized_eval_model)

    total_time = time.time() - start_time
    print("Training time {:.1f}s".format(total_time))


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    main(args)
