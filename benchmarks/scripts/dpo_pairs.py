#!/usr/bin/env python
"""Direct Preference Optimization (DPO) in a hand-written loop, the way the DPO paper's
reference code (eric-mitchell/direct-preference-optimization, trainers.py) and TRL's
DPOTrainer do it: a policy and a frozen reference copy, chosen and rejected responses
concatenated into one batch, per-token log-probs gathered from the log-softmax of the
logits under a loss mask, and the sigmoid DPO loss.

The policy is a Llama-style decoder built from a config (random weights) in bf16 and the
preference pairs are random tokens, so nothing is downloaded.

    python dpo_pairs.py                                 # ~220M params, bf16, 8 pairs x 1024 tokens
    python dpo_pairs.py --device cpu --hidden-size 64 --intermediate-size 176 --num-layers 2 \
        --num-heads 4 --vocab-size 1000 --seq-len 64 --prompt-len 16 --batch-size 2 --steps 1
"""

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from transformers import AutoModelForCausalLM, LlamaConfig, get_linear_schedule_with_warmup, set_seed


def parse_args():
    p = argparse.ArgumentParser(description="DPO on random preference pairs")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=2816)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=1024, help="prompt + response, padded")
    p.add_argument("--prompt-len", type=int, default=256, help="longest prompt")
    p.add_argument("--batch-size", type=int, default=8, help="preference pairs per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=10.0)
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def random_pairs(args, generator):
    """A batch as the DPO reference code's collate gives it: prompt+chosen and prompt+rejected,
    right-padded, labels -100 on the prompt and on the padding."""
    B, T, V = args.batch_size, args.seq_len, args.vocab_size
    pad_id = 0
    out = {}
    prompt_lens = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (B,), generator=generator)
    for side in ("chosen", "rejected"):
        ids = torch.randint(1, V, (B, T), generator=generator)
        resp_lens = torch.randint((T - args.prompt_len) // 2, T - args.prompt_len + 1, (B,), generator=generator)
        pos = torch.arange(T).unsqueeze(0)
        total = (prompt_lens + resp_lens).unsqueeze(1)
        attention_mask = (pos < total).long()
        ids = ids.masked_fill(attention_mask == 0, pad_id)
        labels = ids.masked_fill(pos < prompt_lens.unsqueeze(1), -100).masked_fill(attention_mask == 0, -100)
        out[f"{side}_input_ids"] = ids
        out[f"{side}_attention_mask"] = attention_mask
        out[f"{side}_labels"] = labels
    return out


def concatenated_inputs(batch):
    """Chosen first, rejected second, along the batch dimension (trainers.py: concatenated_inputs)."""
    return {
        k: torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]], dim=0)
        for k in ("input_ids", "attention_mask", "labels")
    }


def get_batch_logps(logits, labels, average_log_prob=False):
    """Sum (or mean) of the log-probs of the labels' tokens, prompt and padding masked out."""
    assert logits.shape[:-1] == labels.shape
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    # dummy token; we'll ignore the losses on these tokens later
    labels[labels == -100] = 0
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    if average_log_prob:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token_logps * loss_mask).sum(-1)


def concatenated_forward(model, batch):
    concatenated = concatenated_inputs(batch)
    all_logits = model(
        concatenated["input_ids"], attention_mask=concatenated["attention_mask"]
    ).logits.to(torch.float32)
    all_logps = get_batch_logps(all_logits, concatenated["labels"], average_log_prob=False)
    n = batch["chosen_input_ids"].shape[0]
    return all_logps[:n], all_logps[n:]


def preference_loss(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
                    reference_rejected_logps, beta):
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = reference_chosen_logps - reference_rejected_logps
    logits = pi_logratios - ref_logratios
    losses = -F.logsigmoid(beta * logits)
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def main():
    args = parse_args()
    set_seed(args.seed)
    device = torch.device(args.device)

    config = LlamaConfig(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=max(2048, args.seq_len),
        pad_token_id=0,
        use_cache=False,
    )
    policy = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).to(device)
    reference_model = copy.deepcopy(policy).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    n_params = sum(p.numel() for p in policy.parameters())
    print(f"policy: {n_params / 1e6:.1f}M params in {next(policy.parameters()).dtype}, reference: frozen copy")

    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0,
                                  fused=fused, foreach=None if fused else True)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.steps)

    generator = torch.Generator().manual_seed(args.seed)
    policy.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in random_pairs(args, generator).items()}

        policy_chosen_logps, policy_rejected_logps = concatenated_forward(policy, batch)
        with torch.no_grad():
            reference_chosen_logps, reference_rejected_logps = concatenated_forward(reference_model, batch)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps,
            beta=args.beta)
        loss = losses.mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        reward_acc = (chosen_rewards > rejected_rewards).float().mean()
        dt = time.perf_counter() - t0
        print(f"step {step + 1}/{args.steps} | loss {loss.item():.4f} | grad_norm {grad_norm.item():.3f} "
              f"| reward acc {reward_acc.item():.2f} | margin {(chosen_rewards - rejected_rewards).mean().item():.4f} "
              f"| lr {scheduler.get_last_lr()[0]:.2e} | {dt * 1000:.0f} ms")

    if device.type == "cuda":
        print(f"peak memory allocated: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
