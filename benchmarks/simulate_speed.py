"""How long memprof.simulate takes on this machine.

    python benchmarks/simulate_speed.py [--out DIR]

GPT-2 124M (16 x 1024, fp32, AdamW) and a Llama-7B-shaped decoder (hidden
4096, 32 layers, 32 heads, MLP 11008, vocabulary 32000; bf16 autocast, batch
1 x 2048, AdamW) built on meta, one and three simulated steps each, targeting
the H100 80 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import memprof  # noqa: E402
from suite import build  # noqa: E402


def llama7b():
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 32000, (1, 2048), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    rows = []
    for name, setup in (("gpt2-124M fp32 16x1024", lambda: build("gpt2", "fp32", "cuda")), ("llama-7B bf16 1x2048", llama7b)):
        for steps in (1, 3):
            t = time.perf_counter()
            r = memprof.simulate(setup, target="H100-80GB", steps=steps)
            sec = time.perf_counter() - t
            rows.append({"workload": name, "steps": steps, "seconds": round(sec, 2), "peak_GiB": round(r.peak.allocated / 2**30, 2)})
            print(rows[-1], flush=True)
    meta = {"cpu_cores": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "simulate_speed.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
