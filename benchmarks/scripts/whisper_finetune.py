# Whisper fine-tuning without the Trainer (in the style of the HF "fine-tune Whisper" blog and
# examples/pytorch/speech-recognition, a plain loop like run_speech_recognition_seq2seq_no_trainer):
# a whisper-small-shaped model built from its config (no download), log-mel features with
# SpecAugment done by hand, labels padded with -100, frozen encoder, AdamW + linear warmup,
# bf16 autocast and gradient checkpointing.
import argparse
import math
import time

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration, get_linear_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser(description="Fine-tune a Whisper model on speech (synthetic features)")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn-dim", type=int, default=3072)
    p.add_argument("--per-device-train-batch-size", type=int, default=16)
    p.add_argument("--max-label-length", type=int, default=160)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--max-train-steps", type=int, default=6)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--freeze-encoder", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--mask-time-prob", type=float, default=0.05)
    p.add_argument("--mask-time-length", type=int, default=10)
    p.add_argument("--mask-feature-length", type=int, default=10)
    p.add_argument("--num-feature-masks", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def spec_augment(features, mask_time_prob, mask_time_length, mask_feature_length, num_feature_masks):
    """SpecAugment on a (batch, n_mels, frames) log-mel batch: random time and frequency bands set to the mean."""
    bsz, n_mels, frames = features.shape
    device = features.device
    fill = features.mean(dim=(1, 2), keepdim=True)
    # time masks: about mask_time_prob of the frames, in spans of mask_time_length
    num_time_masks = max(1, int(mask_time_prob * frames / mask_time_length))
    t0 = torch.randint(0, frames - mask_time_length, (bsz, num_time_masks, 1), device=device)
    t = torch.arange(frames, device=device).view(1, 1, frames)
    time_mask = ((t >= t0) & (t < t0 + mask_time_length)).any(dim=1)  # (bsz, frames)
    # frequency masks
    f0 = torch.randint(0, n_mels - mask_feature_length, (bsz, num_feature_masks, 1), device=device)
    f = torch.arange(n_mels, device=device).view(1, 1, n_mels)
    freq_mask = ((f >= f0) & (f < f0 + mask_feature_length)).any(dim=1)  # (bsz, n_mels)
    mask = time_mask[:, None, :] | freq_mask[:, :, None]
    return torch.where(mask, fill, features)


def make_batch(config, batch_size, max_label_length, device):
    # stands in for WhisperFeatureExtractor output (log-mel, 30 s padded) + tokenizer labels
    input_features = torch.randn(batch_size, config.num_mel_bins, 3000, device=device)
    lengths = torch.randint(max_label_length // 4, max_label_length + 1, (batch_size,), device=device)
    labels = torch.randint(0, config.vocab_size - 100, (batch_size, max_label_length), device=device)
    labels[:, 0] = config.decoder_start_token_id  # the collator strips it again below
    pad = torch.arange(max_label_length, device=device)[None, :] >= lengths[:, None]
    labels = labels.masked_fill(pad, -100)
    # DataCollatorSpeechSeq2SeqWithPadding: drop the leading decoder_start_token if every row has it
    if (labels[:, 0] == config.decoder_start_token_id).all().cpu().item():
        labels = labels[:, 1:]
    return input_features, labels


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = "cuda"

    config = WhisperConfig(
        vocab_size=51865,
        num_mel_bins=80,
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn_dim,
        decoder_ffn_dim=args.ffn_dim,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50258,
        pad_token_id=50257,
        bos_token_id=50257,
        eos_token_id=50257,
        dropout=0.1,
        apply_spec_augment=False,  # done by hand in the loop
    )
    model = WhisperForConditionalGeneration(config)
    model.config.forced_decoder_ids = None
    model.config.suppress_tokens = []
    model.config.use_cache = False

    if args.freeze_encoder:
        if hasattr(model, "freeze_encoder"):
            model.freeze_encoder()
        else:
            model.model.encoder._freeze_parameters()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.to(device)
    model.train()

    no_decay = ["bias", "layer_norm.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_train_steps)

    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"parameters: {n_total / 1e6:.1f}M, trainable {n_train / 1e6:.1f}M")

    for step in range(args.max_train_steps):
        t0 = time.time()
        input_features, labels = make_batch(config, args.per_device_train_batch_size, args.max_label_length, device)
        input_features = spec_augment(input_features, args.mask_time_prob, args.mask_time_length,
                                      args.mask_feature_length, args.num_feature_masks)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(input_features=input_features, labels=labels)
            loss = outputs.loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f} ppl {math.exp(min(loss.item(), 20)):.1f} "
              f"grad_norm {grad_norm.item():.3f} lr {lr_scheduler.get_last_lr()[0]:.2e} "
              f"{(time.time() - t0) * 1000:.0f} ms")

    print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
          f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
