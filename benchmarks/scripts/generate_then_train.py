#!/usr/bin/env python
"""RLHF-lite / ReST-style loop: sample completions with `model.generate`, score them, and take a
policy-gradient step on the sampled tokens (REINFORCE with a batch-mean baseline).

Each step:
  1. sample `--max-new-tokens` tokens for a batch of prompts with `generate(do_sample=True, top_k=...)`
     under `torch.no_grad()` (KV cache on), the policy in eval mode;
  2. score the completions: a small frozen reward model (a GPT-2 trunk with a scalar head, on the
     last token of each completion) plus a simple rule on the tokens (a length bonus);
  3. advantages = reward - mean(reward), normalised; loss = -(advantage * log pi(token)) over the
     completion's tokens up to its first EOS; backward, clip, AdamW step.

GPT-2 small from a config (random weights), fp32 weights with bf16 autocast, random prompt ids:
nothing is downloaded.

    python generate_then_train.py                       # GPT-2 124M, 32 prompts x 64 tokens + 128 sampled
    python generate_then_train.py --device cpu --n-layer 2 --n-embd 64 --n-head 4 --vocab-size 1000 \
        --batch-size 2 --prompt-len 8 --max-new-tokens 8 --reward-n-layer 1 --reward-n-embd 32 --steps 1
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model, set_seed


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--reward-n-layer", type=int, default=4)
    p.add_argument("--reward-n-embd", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--length-bonus", type=float, default=0.01)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class RewardModel(nn.Module):
    """A GPT-2 trunk with a scalar head read at the last non-pad token (like GPT2ForSequenceClassification)."""

    def __init__(self, config):
        super().__init__()
        self.transformer = GPT2Model(config)
        self.score = nn.Linear(config.n_embd, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(-1) - 1
        return self.score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).squeeze(-1)


def completion_mask(completions, eos_token_id):
    """1 for the completion's tokens up to and including its first EOS, 0 after."""
    is_eos = completions == eos_token_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after_eos).long()


def main():
    args = parse_args()
    set_seed(args.seed)
    device = torch.device(args.device)
    amp = device.type == "cuda"

    eos = min(50256, args.vocab_size - 1)  # GPT-2's <|endoftext|>
    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                        vocab_size=args.vocab_size, n_positions=1024, bos_token_id=eos, eos_token_id=eos)
    policy = GPT2LMHeadModel(config).to(device)
    policy.generation_config.pad_token_id = eos
    policy.generation_config.eos_token_id = eos

    reward_config = GPT2Config(n_layer=args.reward_n_layer, n_embd=args.reward_n_embd, n_head=8 if args.reward_n_embd % 8 == 0 else 4,
                               vocab_size=args.vocab_size, n_positions=1024, bos_token_id=eos, eos_token_id=eos)
    reward_model = RewardModel(reward_config).to(device).eval().requires_grad_(False)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    print(f"policy {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M params, "
          f"reward model {sum(p.numel() for p in reward_model.parameters()) / 1e6:.1f}M params")

    P = args.prompt_len
    for step in range(args.steps):
        t0 = time.perf_counter()
        prompts = torch.randint(0, eos, (args.batch_size, P), device=device)
        prompt_mask = torch.ones_like(prompts)

        # 1. rollout
        policy.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            sequences = policy.generate(
                input_ids=prompts,
                attention_mask=prompt_mask,
                do_sample=True,
                top_k=args.top_k,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                use_cache=True,
            )
        policy.train()
        completions = sequences[:, P:]
        comp_mask = completion_mask(completions, eos)
        attention_mask = torch.cat([prompt_mask, comp_mask], dim=1)

        # 2. reward
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            rm_score = reward_model(sequences, attention_mask).float()
        reward = rm_score + args.length_bonus * comp_mask.sum(-1).float()
        advantages = (reward - reward.mean()) / (reward.std() + 1e-6)

        # 3. policy gradient on the sampled tokens
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = policy(input_ids=sequences, attention_mask=attention_mask).logits
        logits = logits[:, P - 1:-1].float() / args.temperature
        logprobs = torch.gather(logits.log_softmax(-1), 2, completions.unsqueeze(-1)).squeeze(-1)
        mask = comp_mask.float()
        loss = -((advantages.unsqueeze(1) * logprobs) * mask).sum() / mask.sum()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        dt = time.perf_counter() - t0
        print(f"step {step + 1}/{args.steps} | reward {reward.mean().item():.4f} | loss {loss.item():.4f} "
              f"| grad_norm {grad_norm.item():.3f} | completion len {comp_mask.sum(-1).float().mean().item():.1f} "
              f"| seq {tuple(sequences.shape)} | {dt * 1000:.0f} ms")

    if device.type == "cuda":
        print(f"peak memory allocated: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
