"""How long the advisor takes on this machine, next to one simulation of the same step.

    python benchmarks/advise_speed.py [--out DIR] [--only gpt2,llama7b,readme]

* GPT-2 124M (Hugging Face GPT2LMHeadModel, 16 x 1024 tokens, fp32, AdamW),
  and a Llama-7B-shaped decoder (hidden 4096, 32 layers, 32 heads, MLP
  11008, 8 x 2048 tokens, fp32 weights, AdamW), both built on meta: one
  simulation of two steps (the first in the process, then again), then
  ``memprof.advise`` with the default plans for a 24 GiB budget on the
  H200, in the same process: in this process alone (``jobs=1``), then
  with the plans in one forked process per CPU (the default);
* the README's main job (``memprof advise examples/train_gpt.py --budget
  rtx3060 -- ...``), wall clock of the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from memprof.advisor import advise, simulate_plan  # noqa: E402
from memprof.devices import get_gpu  # noqa: E402
from memprof.parallel import default_jobs  # noqa: E402
from memprof.workload import Workload  # noqa: E402

README_JOB = ["advise", "examples/train_gpt.py", "--budget", "rtx3060", "--", "--n-layer", "12", "--n-embd", "768",
              "--n-head", "12", "--block-size", "1024", "--batch-size", "32"]


def gpt2() -> Workload:
    from suite import workload

    return workload("gpt2")


def llama7b() -> Workload:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).cuda()
    ids = torch.randint(0, 32000, (8, 2048), device="cuda")
    return Workload(model, torch.optim.AdamW(model.parameters()), dict(input_ids=ids, labels=ids), lambda m, b: m(**b).loss)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def one(name: str, make) -> dict:
    # One simulation of the step as it is, as the advisor simulates a plan: past
    # the target's capacity (memprof.simulate would stop at the allocation that
    # does not fit: the Llama's fp32 step needs more than an H200).
    gpu = get_gpu("H200-141GB")
    _, first = timed(lambda: simulate_plan(make, list, gpu, steps=2))
    _, again = timed(lambda: simulate_plan(make, list, gpu, steps=2))
    alone, in_turn = timed(lambda: advise(make, "24GiB", target="H200-141GB", progress=False, jobs=1))
    advice, seconds = timed(lambda: advise(make, "24GiB", target="H200-141GB", progress=False))
    assert advice.table.equals(alone.table), "plans in forked processes must equal plans in one"
    row = {
        "workload": name, "plans": len(advice.table), "jobs": default_jobs(), "advise_seconds": round(seconds, 2),
        "advise_seconds_one_process": round(in_turn, 2),
        "first_simulation_seconds": round(first, 2), "simulation_seconds": round(again, 2),
        "advise_over_simulation": round(seconds / again, 1), "advise_over_first_simulation": round(seconds / first, 1),
        "one_process_over_simulation": round(in_turn / again, 1), "best": advice.best,
    }
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--only", default="gpt2,llama7b,readme")
    a = ap.parse_args()
    only = a.only.split(",")
    rows = [one(n, make) for n, make in (("gpt2-124M fp32 16x1024", gpt2), ("llama-7B-shaped fp32 8x2048", llama7b))
            if n.split("-")[0] in only or n.startswith("llama") and "llama7b" in only]
    if "readme" in only:
        root = Path(__file__).resolve().parents[1]
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "memprof.cli", *README_JOB], cwd=root, capture_output=True, text=True)
        seconds = time.perf_counter() - t
        if r.returncode:
            raise SystemExit(f"the README job failed:\n{r.stderr}")
        rows.append({"workload": "README job: memprof " + " ".join(README_JOB), "advise_seconds": round(seconds, 2),
                     "best": next((ln.split(":")[2].strip() for ln in r.stdout.splitlines() if "recommended:" in ln), None)})
        print(rows[-1], flush=True)
    meta = {"cpu_cores": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
            "command": "python " + " ".join(sys.argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "advise_speed.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
