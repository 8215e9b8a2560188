"""The PyTorch "Spatial Transformer Networks" tutorial scaled up to 3x224x224: a localisation net predicting an affine theta (fc_loc initialised to identity), F.affine_grid + F.grid_sample, a VGG-style classifier, an auxiliary low-res branch fed by F.interpolate(bilinear, align_corners=False), an nn.Embedding(max_norm=1.0) class-embedding loss (rows renormalised in place in forward), SGD + StepLR, fp32 with cudnn.benchmark."""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset


class FakeImageNet(Dataset):
    """Like torchvision.datasets.FakeData: every index deterministically gives the same random image."""

    def __init__(self, size, image_size=(3, 224, 224), num_classes=1000, random_offset=0):
        self.size = size
        self.image_size = image_size
        self.num_classes = num_classes
        self.random_offset = random_offset
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index + self.random_offset)
        img = torch.rand(*self.image_size, generator=g)
        target = torch.randint(0, self.num_classes, size=(1,), generator=g).item()
        img = (img - self.mean) / self.std  # transforms.Normalize
        return img, target


def conv_bn_relu(in_ch, out_ch, stride=1):
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


class Net(nn.Module):
    def __init__(self, num_classes=1000, embed_dim=128):
        super().__init__()
        # classifier (VGG-ish)
        self.features = nn.Sequential(
            conv_bn_relu(3, 64, stride=2),      # 112
            conv_bn_relu(64, 64),
            nn.MaxPool2d(2, 2),                 # 56
            conv_bn_relu(64, 128),
            conv_bn_relu(128, 128),
            nn.MaxPool2d(2, 2),                 # 28
            conv_bn_relu(128, 256),
            conv_bn_relu(256, 256),
            nn.MaxPool2d(2, 2),                 # 14
            conv_bn_relu(256, 512),
            conv_bn_relu(512, 512),
            nn.MaxPool2d(2, 2),                 # 7
        )
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

        # auxiliary classifier on a half-resolution copy of the transformed image
        self.aux = nn.Sequential(
            conv_bn_relu(3, 32, stride=2),      # 56
            conv_bn_relu(32, 64, stride=2),     # 28
            conv_bn_relu(64, 128, stride=2),    # 14
            nn.AdaptiveAvgPool2d((1, 1)),
            nn.Flatten(),
            nn.Linear(128, num_classes),
        )

        # class embeddings for the auxiliary embedding loss; rows are renormalised to norm <= 1 on lookup
        self.embed_proj = nn.Linear(512, embed_dim)
        self.class_embed = nn.Embedding(num_classes, embed_dim, max_norm=1.0)

        # Spatial transformer localization-network
        self.localization = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=7, stride=2, padding=3),
            nn.MaxPool2d(2, stride=2),
            nn.ReLU(True),
            nn.Conv2d(32, 64, kernel_size=5, padding=2),
            nn.MaxPool2d(2, stride=2),
            nn.ReLU(True),
            nn.Conv2d(64, 64, kernel_size=3, padding=1),
            nn.MaxPool2d(2, stride=2),
            nn.ReLU(True),
        )

        # Regressor for the 3 * 2 affine matrix
        self.fc_loc = nn.Sequential(
            nn.Linear(64 * 14 * 14, 128),
            nn.ReLU(True),
            nn.Linear(128, 3 * 2),
        )

        # Initialize the weights/bias with identity transformation
        self.fc_loc[2].weight.data.zero_()
        self.fc_loc[2].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))

    # Spatial transformer network forward function
    def stn(self, x):
        xs = self.localization(x)
        xs = xs.view(-1, 64 * 14 * 14)
        theta = self.fc_loc(xs)
        theta = theta.view(-1, 2, 3)

        grid = F.affine_grid(theta, x.size(), align_corners=False)
        x = F.grid_sample(x, grid, align_corners=False)
        return x

    def forward(self, x, target=None):
        # transform the input
        x = self.stn(x)

        # Perform the usual forward pass
        feats = self.features(x)
        pooled = torch.flatten(self.avgpool(feats), 1)
        logits = self.fc(F.dropout(pooled, training=self.training))

        x_low = F.interpolate(x, scale_factor=0.5, mode="bilinear", align_corners=False)
        aux_logits = self.aux(x_low)

        emb_loss = None
        if target is not None:
            z = F.normalize(self.embed_proj(pooled), dim=1)
            centers = self.class_embed(target)
            emb_loss = F.mse_loss(z, centers)
        return F.log_softmax(logits, dim=1), F.log_softmax(aux_logits, dim=1), emb_loss


def main():
    parser = argparse.ArgumentParser(description="Spatial Transformer Network, ImageNet-sized inputs")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--steps-per-epoch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--aux-weight", type=float, default=0.4)
    parser.add_argument("--emb-weight", type=float, default=0.1)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    torch.manual_seed(1)
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True

    train_loader = DataLoader(
        FakeImageNet(args.batch_size * args.steps_per_epoch, num_classes=args.num_classes),
        batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)

    model = Net(num_classes=args.num_classes).to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)

    def train(epoch, global_step):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            t0 = time.time()
            data, target = data.to(device), target.to(device)

            optimizer.zero_grad()
            output, aux_output, emb_loss = model(data, target)
            loss = F.nll_loss(output, target)
            aux_loss = F.nll_loss(aux_output, target)
            total = loss + args.aux_weight * aux_loss + args.emb_weight * emb_loss
            total.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}\taux: {:.6f}\temb: {:.6f}\t{:.3f}s".format(
                    epoch, batch_idx * len(data), len(train_loader.dataset),
                    100. * batch_idx / len(train_loader), loss.item(), aux_loss.item(), emb_loss.item(),
                    time.time() - t0))
            global_step += 1
            if global_step >= args.steps:
                break
        return global_step

    global_step = 0
    epochs = math.ceil(args.steps / args.steps_per_epoch)
    for epoch in range(1, epochs + 1):
        global_step = train(epoch, global_step)
        scheduler.step()
        print(f"epoch {epoch} done, lr now {scheduler.get_last_lr()[0]:.4g}, "
              f"max mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        if global_step >= args.steps:
            break


if __name__ == "__main__":
    main()
