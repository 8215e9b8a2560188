"""PyTorch tutorial "(beta) Running the compiled optimizer with an LR Scheduler": Adam with a tensor lr, LinearLR, opt.step()+sched.step() under torch.compile."""
import argparse

import torch


parser = argparse.ArgumentParser(description="Compiled optimizer with an LR scheduler")
parser.add_argument("--width", type=int, default=4096, help="in/out features of each Linear (tutorial: 1024)")
parser.add_argument("--layers", type=int, default=24, help="number of stacked Linear layers (tutorial: 10)")
parser.add_argument("--batch-size", type=int, default=256, help="rows of the input (tutorial: one vector)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--no-compile", action="store_true", help="run opt.step()/sched.step() eagerly")
parser.add_argument("--float-lr", action="store_true", help="lr=0.01 instead of torch.tensor(0.01) (recompiles)")
args = parser.parse_args()

# exit cleanly if we are on a device that doesn't support ``torch.compile``
if torch.cuda.get_device_capability() < (7, 0):
    print("Exiting because torch.compile is not supported on this device.")
    import sys

    sys.exit(0)

# Setup random seed
torch.manual_seed(12345)

# Create simple model
model = torch.nn.Sequential(
    *[torch.nn.Linear(args.width, args.width, False, device="cuda") for _ in range(args.layers)]
)
input = torch.rand(args.batch_size, args.width, device="cuda")

# Setting up and running the compiled optimizer with LR Scheduler
opt = torch.optim.Adam(model.parameters(), lr=0.01 if args.float_lr else torch.tensor(0.01))
sched = torch.optim.lr_scheduler.LinearLR(opt, total_iters=5)

if args.float_lr:
    torch._logging.set_logs(recompiles=True)


def step_fn():
    opt.step()
    sched.step()


fn = step_fn if args.no_compile else torch.compile(step_fn, fullgraph=False)

for step in range(args.steps):
    # run forward pass
    output = model(input)

    # run backward to populate the grads for our optimizer
    output.sum().backward()

    fn()
    opt.zero_grad(set_to_none=True)
    print(f"step {step}: lr {float(opt.param_groups[0]['lr']):.6f}, "
          f"max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
