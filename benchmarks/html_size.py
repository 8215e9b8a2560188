"""Size of the HTML report for a 100-step tracked run on the CPU, and what plotly.js takes of it.

    python3 benchmarks/html_size.py [--out benchmarks/results/html-size.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from plotly.offline import get_plotlyjs
from torch import nn

import memprof


def tracked(timeline_steps: int) -> memprof.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.Adam(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    with memprof.track(model, opt, warmup=3, every=1, timeline_steps=timeline_steps) as prof:
        for _ in range(100):
            loss_fn(model(torch.randn(64, 784)), torch.randint(10, (64,))).backward()
            opt.step()
            opt.zero_grad()
    return prof.report()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the sizes as JSON there")
    args = p.parse_args()
    plotly_js = len(get_plotlyjs().encode())
    sizes = {"plotly_js_bytes": plotly_js}
    with tempfile.TemporaryDirectory() as tmp:
        for steps in (3, 100):
            page = tracked(steps).save_html(Path(tmp) / f"run-{steps}.html").stat().st_size
            sizes[f"page_bytes_timeline_{steps}_steps"] = page
            print(f"100 steps, timeline of the last {steps:3d}: {page:,} B ({page / 2**20:.2f} MiB), "
                  f"of which plotly.js {plotly_js:,} B and memprof's data {page - plotly_js:,} B")
    if args.out:
        Path(args.out).write_text(json.dumps(sizes, indent=1) + "\n")


if __name__ == "__main__":
    main()
