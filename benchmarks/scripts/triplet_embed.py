"""Deep metric learning with batch-hard triplet loss (Hermans et al., 2017) on a ResNet-18 trunk."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
import torchvision


class SyntheticIdentities(Dataset):
    """P identities x K images each; images are noise around a per-identity template."""

    def __init__(self, num_ids=64, per_id=8, size=128):
        g = torch.Generator().manual_seed(0)
        self.templates = torch.randn(num_ids, 3, size, size, generator=g)
        self.per_id = per_id
        self.num_ids = num_ids

    def __len__(self):
        return self.num_ids * self.per_id

    def __getitem__(self, idx):
        pid = idx // self.per_id
        img = self.templates[pid] + 0.5 * torch.randn_like(self.templates[pid])
        return img, pid


class EmbeddingNet(nn.Module):
    def __init__(self, dim=128):
        super().__init__()
        trunk = torchvision.models.resnet18(weights=None)
        trunk.fc = nn.Identity()
        self.trunk = trunk
        self.head = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU(inplace=True), nn.Linear(512, dim))

    def forward(self, x):
        return F.normalize(self.head(self.trunk(x)), p=2, dim=1)


def batch_hard_triplet_loss(emb, labels, margin=0.2):
    dist = torch.cdist(emb, emb, p=2)
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    eye = torch.eye(len(labels), dtype=torch.bool, device=emb.device)
    hardest_pos = (dist * (same & ~eye).float()).max(dim=1).values
    hardest_neg = dist.masked_fill(same, float("inf")).min(dim=1).values
    loss = F.relu(hardest_pos - hardest_neg + margin)
    return loss.mean(), (loss > 0).float().mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--margin", type=float, default=0.2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    dataset = SyntheticIdentities(num_ids=32, per_id=8, size=args.image_size)
    # sequential batches keep K images of each identity together, as a PK sampler would
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = EmbeddingNet(args.embedding_dim).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(loader))

    for epoch in range(args.epochs):
        model.train()
        for i, (images, targets) in enumerate(loader):
            images = images.cuda(non_blocking=True)
            targets = targets.cuda(non_blocking=True)
            emb = model(images)
            loss, frac_active = batch_hard_triplet_loss(emb, targets, args.margin)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f} active {frac_active.item():.2%} "
                  f"lr {scheduler.get_last_lr()[0]:.4f}")


if __name__ == "__main__":
    main()
