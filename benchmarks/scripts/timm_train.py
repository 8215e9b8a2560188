# ViT-S/16 classification in the style of timm's own train.py, built from scratch (pretrained=False):
# timm.create_model with drop_path, optional model.set_grad_checkpointing(), create_optimizer_v2 with
# layer-wise lr decay, timm.data.Mixup + SoftTargetCrossEntropy, ModelEmaV3, NativeScaler with fp16
# autocast, channels_last, cudnn.benchmark, create_scheduler_v2 stepped per update (step_update),
# synthetic images in pinned host memory copied with .cuda(non_blocking=True).
import argparse
import time

import torch
import timm
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV2, ModelEmaV3, NativeScaler, AverageMeter

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="vit_small_patch16_224")
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--img-size", type=int, default=224)
parser.add_argument("--num-classes", type=int, default=1000)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--grad-checkpointing", action="store_true")
parser.add_argument("--channels-last", action="store_true", default=True)
parser.add_argument("--lr", type=float, default=5e-4)
parser.add_argument("--clip-grad", type=float, default=None)
parser.add_argument("--model-ema-version", type=int, default=3, choices=(2, 3))
args = parser.parse_args()

torch.backends.cudnn.benchmark = True
device = torch.device("cuda")

model = timm.create_model(
    args.model,
    pretrained=False,
    num_classes=args.num_classes,
    drop_rate=0.0,
    drop_path_rate=0.1,
)
if args.grad_checkpointing:
    model.set_grad_checkpointing(enable=True)
model.to(device=device)
if args.channels_last:
    model.to(memory_format=torch.channels_last)

optimizer = create_optimizer_v2(
    model,
    opt="adamw",
    lr=args.lr * args.batch_size / 512,
    weight_decay=0.05,
    layer_decay=0.75,
)
amp_autocast = lambda: torch.autocast("cuda", dtype=torch.float16)
loss_scaler = NativeScaler()

if args.model_ema_version == 3:
    model_ema = ModelEmaV3(model, decay=0.9998, use_warmup=True)
else:
    model_ema = ModelEmaV2(model, decay=0.9998)

mixup_fn = Mixup(
    mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode="batch",
    label_smoothing=0.1, num_classes=args.num_classes,
)
train_loss_fn = SoftTargetCrossEntropy().to(device=device)

updates_per_epoch = args.steps
lr_scheduler, num_epochs = create_scheduler_v2(
    optimizer,
    sched="cosine",
    num_epochs=2,
    warmup_epochs=1,
    warmup_lr=1e-6,
    min_lr=1e-6,
    step_on_epochs=False,
    updates_per_epoch=updates_per_epoch,
)

# synthetic "loader": uint8-decoded images already normalized to float on the host, pinned
host_batches = [
    (torch.randn(args.batch_size, 3, args.img_size, args.img_size).pin_memory(),
     torch.randint(0, args.num_classes, (args.batch_size,)).pin_memory())
    for _ in range(2)
]

losses_m = AverageMeter()
model.train()
num_updates = 0
for batch_idx in range(args.steps):
    t0 = time.time()
    input, target = host_batches[batch_idx % len(host_batches)]
    input, target = input.cuda(non_blocking=True), target.cuda(non_blocking=True)
    input, target = mixup_fn(input, target)
    if args.channels_last:
        input = input.contiguous(memory_format=torch.channels_last)

    with amp_autocast():
        output = model(input)
        loss = train_loss_fn(output, target)

    optimizer.zero_grad()
    loss_scaler(
        loss, optimizer,
        clip_grad=args.clip_grad, clip_mode="norm",
        parameters=model.parameters(),
        create_graph=False,
    )
    num_updates += 1
    if args.model_ema_version == 3:
        model_ema.update(model, step=num_updates)
    else:
        model_ema.update(model)

    torch.cuda.synchronize()
    losses_m.update(loss.item(), input.size(0))
    lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
    lrl = [pg["lr"] for pg in optimizer.param_groups]
    print(f"step {batch_idx} loss {losses_m.val:.4f} ({losses_m.avg:.4f}) "
          f"lr {sum(lrl) / len(lrl):.3e} time {time.time() - t0:.3f}s")

print("max allocated GiB", torch.cuda.max_memory_allocated() / 2**30)
