"""Beginner's CIFAR-style training loop from a forum post: running_loss += loss and history.append(loss) without .item()."""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim


class Net(nn.Module):
    def __init__(self, width=64, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width * 2, 3, padding=1)
        self.conv3 = nn.Conv2d(width * 2, width * 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.LazyLinear(512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = self.pool(F.relu(self.conv3(x)))
        x = torch.flatten(x, 1)  # flatten all dimensions except batch
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return x


class MLP(nn.Module):
    def __init__(self, in_features, hidden=4096, num_classes=10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


parser = argparse.ArgumentParser(description="my first pytorch classifier")
parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--image-size", type=int, default=128)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--steps", type=int, default=10, help="training iterations")
parser.add_argument("--print-every", type=int, default=2)
parser.add_argument("--val-every", type=int, default=5, help="evaluate on the validation batch every N iterations")
parser.add_argument("--fixed", action="store_true", help="use .item() (the fix from the forum answer)")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print("Using device:", device)

# fake "dataset": a few random batches, like CIFAR but bigger images
inputs_all = torch.randn(4, args.batch_size, 3, args.image_size, args.image_size)
labels_all = torch.randint(0, 10, (4, args.batch_size))
val_inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size).to(device)
val_labels = torch.randint(0, 10, (args.batch_size,)).to(device)

if args.model == "cnn":
    net = Net(args.width).to(device)
    net(torch.zeros(1, 3, args.image_size, args.image_size, device=device))  # initialise the LazyLinear
else:
    net = MLP(3 * args.image_size * args.image_size).to(device)

criterion = nn.CrossEntropyLoss()
optimizer = optim.Adam(net.parameters(), lr=args.lr)

running_loss = 0.0
history = []
val_history = []
start = time.time()
for i in range(args.steps):
    # get the inputs; data is a list of [inputs, labels]
    inputs = inputs_all[i % 4].to(device)
    labels = labels_all[i % 4].to(device)

    # zero the parameter gradients
    optimizer.zero_grad()

    # forward + backward + optimize
    outputs = net(inputs)
    loss = criterion(outputs, labels)
    loss.backward()
    optimizer.step()

    # print statistics
    if args.fixed:
        running_loss += loss.item()
        history.append(loss.item())
    else:
        running_loss += loss
        history.append(loss)
    if i % args.print_every == args.print_every - 1:
        print(f"[{i + 1:5d}] loss: {running_loss / (i + 1):.3f}")

    if (i + 1) % args.val_every == 0:
        net.eval()
        if args.fixed:
            with torch.no_grad():
                val_loss = criterion(net(val_inputs), val_labels).item()
        else:
            val_loss = criterion(net(val_inputs), val_labels)
        val_history.append(val_loss)
        net.train()
        print(f"[{i + 1:5d}] val loss: {val_loss:.3f}")

print(f"Finished Training in {time.time() - start:.1f}s")
print(f"mean loss {sum(history) / len(history):.4f}, last val loss {val_history[-1] if val_history else float('nan'):.4f}")
if torch.cuda.is_available():
    print(f"max memory allocated: {torch.cuda.max_memory_allocated() / 1024**3:.2f} GiB")
