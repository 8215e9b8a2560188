"""Contrastive image-text pre-training of a small CLIP from scratch with HF
CLIPModel, fp16 autocast + GradScaler, AdamW with no decay on bias/LayerNorm."""
import argparse

import torch
from transformers import AutoModel, CLIPConfig, CLIPTextConfig, CLIPVisionConfig


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--patch-size", type=int, default=16)
    p.add_argument("--text-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=49408)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--weight-decay", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=100)
    return p.parse_args()


def param_groups(model, weight_decay):
    no_decay = ("bias", "layer_norm", "layernorm", "embedding", "logit_scale")
    decay, skip = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (skip if any(k in name.lower() for k in no_decay) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": skip, "weight_decay": 0.0}]


def main():
    args = parse_args()
    device = "cuda"
    torch.manual_seed(0)

    text_cfg = CLIPTextConfig(vocab_size=args.vocab_size, hidden_size=args.width,
                              intermediate_size=4 * args.width, num_hidden_layers=args.layers,
                              num_attention_heads=args.width // 64, max_position_embeddings=args.text_len)
    vision_cfg = CLIPVisionConfig(hidden_size=args.width, intermediate_size=4 * args.width,
                                  num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
                                  image_size=args.image_size, patch_size=args.patch_size)
    config = CLIPConfig(text_config=text_cfg.to_dict(), vision_config=vision_cfg.to_dict(), projection_dim=256)
    model = AutoModel.from_config(config).to(device)
    model.train()

    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    for step in range(args.steps):
        pixel_values = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
        input_ids = torch.randint(1, args.vocab_size - 1, (args.batch_size, args.text_len), device=device)
        input_ids[:, -1] = args.vocab_size - 1   # eos token at the end (argmax pooling)
        attention_mask = torch.ones_like(input_ids)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = model(input_ids=input_ids, attention_mask=attention_mask,
                        pixel_values=pixel_values, return_loss=True)
            loss = out.loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)

        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f} "
                  f"logit_scale {model.logit_scale.exp().item():.2f}")


if __name__ == "__main__":
    main()
