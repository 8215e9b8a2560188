"""The real-world script corpus: measured on a GPU, simulated anywhere, compared.

    python3 benchmarks/corpus.py measure --out DIR            # on a GPU: memprof track each script for real
    python3 benchmarks/corpus.py simulate --out DIR           # anywhere: memprof track --target h200
    python3 benchmarks/corpus.py compare MEASURED SIMULATED --out benchmarks/results
    python3 benchmarks/corpus.py advise --out DIR             # anywhere: memprof advise --target h200 each script

The scripts in ``benchmarks/scripts/`` are written the way public training code
is (nanoGPT, Hugging Face Trainer, Lightning, torchvision's reference trainer,
PEFT, a plain loop around a grouped-query decoder, a script that asks the CUDA
runtime everything, Accelerate without the Trainer, DDP and FSDP2 written for torchrun,
a WGAN-GP in PyTorch-GAN's style, pytorch/examples' DCGAN, nn.DataParallel with a side-stream data prefetcher;
seven short ones in other habits: torch.cuda's conveniences with streams, events and a channels-last
fp16 net, a model.half() decoder with einsum attention, torch.compile on the model and the optimizer step,
T5 with Adafactor, torch.cuda.amp with reentrant checkpointing, a GroupNorm UNet with RAdam,
nn.TransformerEncoder with padding masks; and more since, each named by its first line); none of them
knows memprof. Each runs unmodified from its
own directory, as its users run it. ``measure`` and ``simulate`` write one
report per entry (``NAME.json``) and a log (``NAME.log``); ``compare`` writes
``corpus.md`` and ``corpus.json``: the last tracked step's peak allocated and
reserved, measured against predicted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
VISION = ("torchvision",)
SCRIPTS = HERE / "scripts"
GiB = 2**30

#: name -> (directory under benchmarks/scripts, script, its arguments, the packages it needs besides torch's own)
CORPUS: dict[str, tuple[str, str, list[str], tuple[str, ...]]] = {
    "nanogpt-bf16": ("nanogpt", "train.py", ["config/corpus.py"], ()),
    "nanogpt-fp16-scaler": ("nanogpt", "train.py", ["config/corpus_fp16.py"], ()),
    "nanogpt-fp16-deprecated-scaler": ("nanogpt", "train.py", ["config/corpus_fp16.py", "--scaler_api=cuda"], ()),
    "gqa-fp32": (".", "gqa_decoder.py", ["--dtype", "float32"], ()),
    "gqa-bf16": (".", "gqa_decoder.py", ["--dtype", "bfloat16"], ()),
    "gqa-bf16-mask": (".", "gqa_decoder.py", ["--dtype", "bfloat16", "--attention-mask"], ()),
    "hf-trainer": (".", "hf_trainer.py", [], ()),
    "lightning": (".", "lightning_gpt.py", [], ()),
    "vision-reference": (".", "vision_reference.py", ["--amp", "--channels-last", "--model-ema"], VISION),
    "peft-lora": (".", "peft_lora.py", [], ()),
    "cuda-api-bf16": (".", "cuda_api_probe.py", [], ()),
    "cuda-api-fp16": (".", "cuda_api_probe.py", ["--dtype", "float16"], ()),
    "accelerate-clm": (".", "accelerate_clm.py", [], ()),
    "ddp-classifier": (".", "ddp_classifier.py", [], ()),
    "fsdp2-llama": (".", "fsdp2_llama.py", ["--activation-checkpointing"], ()),
    "wgan-gp": (".", "wgan_gp.py", [], ()),
    "dcgan": (".", "dcgan.py", ["--batchSize", "256"], ()),
    "prefetch-classifier": (".", "prefetch_classifier.py", [], ()),
    "cuda-conveniences": (".", "cuda_conveniences.py", [], ()),
    "half-einsum": (".", "half_einsum.py", [], ()),
    "compiled-step": (".", "compiled_step.py", [], ()),
    "t5-adafactor": (".", "t5_adafactor.py", [], ()),
    "legacy-amp-reentrant": (".", "legacy_amp_reentrant.py", [], ()),
    "unet-segmentation": (".", "unet_segmentation.py", [], ()),
    "nn-transformer": (".", "nn_transformer.py", [], ()),
    "maskrcnn-detection": (".", "maskrcnn_detection.py", [], VISION),
    "deeplab-segmentation": (".", "deeplab_segmentation.py", [], VISION),
    "convnext-mixup": (".", "convnext_mixup.py", [], VISION),
    "r3d-video": (".", "r3d_video.py", [], VISION),
    "flex-attention-docs": (".", "flex_attention_docs.py", [], ()),
    "cuda-graph-step": (".", "cuda_graph_step.py", [], ()),
    "dpsgd-func": (".", "dpsgd_func.py", [], ()),
    "hf-qwen2-packed": (".", "hf_qwen2_packed.py", [], ()),
    "bf16-rope-decoder": (".", "bf16_rope_decoder.py", [], ()),
    "maml-second-order": (".", "maml_second_order.py", [], ()),
    "lstm-lm": (".", "lstm_lm.py", [], ()),
    "moco-clip": (".", "moco_clip.py", [], ()),
    "audio-cnn": (".", "audio_cnn.py", [], ()),
    "gnn-recsys": (".", "gnn_recsys.py", [], ()),
    "diffusion-finetune": (".", "diffusion_finetune.py", [], ()),
    "ppo-agent": (".", "ppo_agent.py", [], ()),
    "simclr-lars": (".", "simclr_lars.py", [], ()),
    "seq2seq-noam": (".", "seq2seq_noam.py", ["--updates", "6"], ()),
    "dcgan-specnorm": (".", "dcgan_specnorm.py", [], ()),
    "moe-router": (".", "moe_router.py", [], ()),
    "leak-checkpoint-sequential": (".", "leak_checkpoint_sequential.py", [], ()),
    "dqn-tutorial": (".", "dqn_tutorial.py", [], ()),
    "vae-examples": (".", "vae_examples.py", [], ()),
    "sparse-recsys": (".", "sparse_recsys.py", [], ()),
    "mamba-scan": (".", "mamba_scan.py", [], ()),
    "ctc-speech": (".", "ctc_speech.py", [], ()),
    "distill-vit": (".", "distill_vit.py", [], ()),
    "mae-pretrain": (".", "mae_pretrain.py", [], ()),
    "nerf-pytorch": (".", "nerf_pytorch.py", [], ()),
    "fno-darcy": (".", "fno_darcy.py", [], ()),
    "yolo-detect": (".", "yolo_detect.py", [], ()),
    "vqvae-ema": (".", "vqvae_ema.py", [], ()),
    "ddpm-unet": (".", "ddpm_unet.py", [], ()),
    "fairseq-tokens": (".", "fairseq_tokens.py", [], ()),
    "qat-resnet": (".", "qat_resnet.py", [], ()),
    "megatron-fused": (".", "megatron_fused.py", [], ()),
    "word-lm-transformer": (".", "word_language_model.py", [], ()),
    "word-lm-lstm": (".", "word_language_model.py", ["--model", "LSTM", "--nhid", "1024", "--nlayers", "2"], ()),
    "timm-vit": (".", "timm_train.py", [], ("timm", "torchvision")),
    "triton-fused": (".", "triton_fused.py", [], ("triton",)),
    "dpo-pairs": (".", "dpo_pairs.py", [], ()),
    "generate-then-train": (".", "generate_then_train.py", [], ()),
    "offload-activations": (".", "offload_activations.py", [], ()),
    "hifigan-gan": (".", "hifigan_gan.py", [], ()),
    "fsdp1-llama": (".", "fsdp1_llama.py", [], ()),
    "ddp-nosync-zero": (".", "ddp_nosync_zero.py", ["--out-dir", "/tmp/memprof-ddp-nosync-zero"], ()),
    "gnn-scatter": (".", "gnn_scatter.py", [], ()),
    "hf-trainer-custom-loss": (".", "hf_trainer_custom_loss.py", [], ()),
    "latent-diffusion": (".", "latent_diffusion.py", [], ()),
    "lightning-manual-gan": (".", "lightning_manual_gan.py", ["--max-steps", "12"], ()),
    "packed-seq2seq": (".", "packed_seq2seq.py", [], ()),
    "moe-sorted-dispatch": (".", "moe_sorted_dispatch.py", [], ()),
    "accelerate-accumulate": (".", "accelerate_accumulate.py", [], ()),
    "optim-in-backward": (".", "optim_in_backward.py", [], ()),
    "pinn-burgers": (".", "pinn_burgers.py", [], ()),
    "whisper-finetune": (".", "whisper_finetune.py", [], ()),
    "sam-resnet": (".", "sam_resnet.py", ["--batch-size", "256", "--width-factor", "8", "--depth", "16",
                                          "--max-steps", "10"], ()),
    "adversarial-pgd": (".", "adversarial_pgd.py", ["--batch-size", "256", "--width", "64", "--max-steps", "10"], ()),
    "lookahead-param": (".", "lookahead_param.py", ["--batch-size", "2048", "--hidden", "512", "--steps", "10"], ()),
    "multitask-hooks": (".", "multitask_hooks.py", ["--batch-size", "1024", "--dim", "512", "--depth", "8",
                                                    "--steps", "10"], ()),
    "titan-meta-init": (".", "titan_meta_init.py", ["--dim", "2048", "--n-layers", "8", "--n-heads", "16",
                                                    "--n-kv-heads", "8", "--vocab-size", "32000", "--seq-len", "2048",
                                                    "--batch-size", "4", "--steps", "10"], ()),
    "memdebug-oom-retry": (".", "memdebug_oom_retry.py", ["--steps", "6", "--snapshot", "/tmp/memprof-memdebug.pickle"],
                           ()),
    "prune-finetune": (".", "prune_finetune.py", ["--batch-size", "128", "--image-size", "224", "--num-classes", "1000",
                                                  "--max-steps", "10"], ()),
    "transformer-xl-mems": (".", "transformer_xl_mems.py", [
        "--n_layer", "12", "--d_model", "512", "--n_head", "8", "--d_head", "64", "--d_inner", "2048", "--tgt_len", "512",
        "--mem_len", "512", "--eval-tgt-len", "128", "--batch_size", "16", "--n_token", "32000",
        "--n-tokens-data", "2000000", "--max-steps", "10"], ()),
    "gp-deep-kernel": (".", "gp_deep_kernel.py", ["--n-train", "16384", "--max-steps", "10"], ()),
    "fabric-lm": (".", "fabric_lm.py", [], ()),
    "muon-speedrun": (".", "muon_speedrun.py", [], ()),
    "jagged-packing": (".", "jagged_packing.py", [], ()),
    "chunked-ce-lm": (".", "chunked_ce_lm.py", [], ()),
    "resume-checkpointing": (".", "resume_checkpointing.py", ["--checkpoint", "/tmp/memprof-resume/checkpoint.pth.tar"],
                             ()),
    "schedulefree-adamw": (".", "schedulefree_adamw.py", [], ()),
    "hf-dynamic-padding": (".", "hf_dynamic_padding.py", [], ()),
    "hf-seq2seq-trainer": (".", "hf_seq2seq_trainer.py", [], ()),
    "fp8-linear": (".", "fp8_linear.py", [], ()),
    "custom-fwd-ops": (".", "custom_fwd_ops.py", [], ()),
    "fsdp-tp-2d": (".", "fsdp_tp_2d.py", [], ()),
    "tp-llama": (".", "tp_llama.py", [], ()),
    "hybrid-cpu-embedding": (".", "hybrid_cpu_embedding.py", ["--top-mlp", "4096-4096-4096-256", "--batch-size", "16384",
                                                              "--num-samples", "65536", "--max-steps", "10"], ()),
    "efficientnet-swish": (".", "efficientnet_swish.py", ["--batch-size", "256", "--image-size", "224", "--max-steps", "10"],
                           ()),
    "glow-flow": (".", "glow_flow.py", ["--img-size", "64", "--n-flow", "32", "--n-block", "4", "--filter-size", "512",
                                        "--max-steps", "10"], ()),
    "ckpt-wrapper-fp16": (".", "ckpt_wrapper_fp16.py", ["--steps", "10"], ()),
    "gradcache-contrastive": (".", "gradcache_contrastive.py", ["--steps", "10"], ()),
    "sac-continuous": (".", "sac_continuous.py", ["--steps", "20"], ()),
    "conformer-asr": (".", "conformer_asr.py", ["--steps", "10"], ()),
    "swin-ema-onecycle": (".", "swin_ema_onecycle.py", ["--steps", "10"], ()),
    "hf-accelerate-manual-accum": (".", "hf_accelerate_manual_accum.py", ["--steps", "10", "--eval-steps", "1000"],
                                   ("accelerate",)),
    "hf-detr-matcher": (".", "hf_detr_matcher.py", ["--steps", "10"], ("transformers", "scipy", "PIL")),
    "wav2vec2-ctc": (".", "wav2vec2_ctc.py", ["--steps", "10"], ("transformers",)),
    "dino-multicrop": (".", "dino_multicrop.py", ["--steps", "10"], ()),
    "pointnet2-seg": (".", "pointnet2_seg.py", ["--steps", "10"], ()),
    "kge-sparse-adam": (".", "kge_sparse_adam.py", ["--steps", "10"], ()),
    "hf-segformer": (".", "hf_segformer.py", ["--steps", "10"], ("transformers", "accelerate")),
    "hf-mlm-fused": (".", "hf_mlm_fused.py", ["--steps", "10"], ("transformers", "accelerate")),
    "rwkv-tbptt": (".", "rwkv_tbptt.py", ["--steps", "10"], ()),
    "lightning-vit-callbacks": (".", "lightning_vit_callbacks.py", ["--steps", "10"], ("lightning",)),
    "video-3d-cudnn": (".", "video_3d_cudnn.py", ["--steps", "10"], ()),
    "raft-flow": (".", "raft_flow.py", ["--steps", "10"], ()),
    "reformer-reversible": (".", "reformer_reversible.py", ["--steps", "10"], ()),
    "bilstm-crf-ner": (".", "bilstm_crf_ner.py", ["--steps", "10"], ()),
    "tabnet-ghost-bn": (".", "tabnet_ghost_bn.py", ["--steps", "10"], ()),
    "neural-ode-adjoint": (".", "neural_ode_adjoint.py", ["--steps", "10"], ()),
    "swa-cifar": (".", "swa_cifar.py", ["--steps", "10"], ()),
    "autoresearch-gpt": (".", "autoresearch_gpt.py", ["--steps", "10"], ()),
    "varlen-finetune": (".", "varlen_finetune.py", ["--steps", "10"], ()),
    "einops-vit-metrics": (".", "einops_vit_metrics.py", ["--steps", "10"], ("einops", "torchmetrics")),
    "jit-scripted-rnn": (".", "jit_scripted_rnn.py", ["--steps", "10"], ()),
    "grouped-mm-moe": (".", "grouped_mm_moe.py", ["--steps", "10"], ()),
    "custom-op-library": (".", "custom_op_library.py", ["--steps", "10"], ()),
    "threaded-prefetch": (".", "threaded_prefetch.py", ["--steps", "10"], ()),
    "profiler-schedule": (".", "profiler_schedule.py", ["--steps", "10"], ()),
    "act-compress-hooks": (".", "act_compress_hooks.py", ["--steps", "10"], ()),
    "airbench-cifar": (".", "airbench_cifar.py", ["--steps", "10"], ()),
    "pygcn-sparse": (".", "pygcn_sparse.py", ["--steps", "10"], ()),
    "pygat-dense": (".", "pygcn_sparse.py", ["--steps", "10", "--model", "gat"], ()),
    "adafactor-pure-bf16": (".", "adafactor_pure_bf16.py", ["--steps", "10"], ()),
    "functorch-maml": (".", "functorch_maml.py", ["--steps", "10"], ()),
    "memory-fraction-cap": (".", "memory_fraction_cap.py", ["--steps", "10"], ()),
    "lazy-iterable-tqdm": (".", "lazy_iterable_tqdm.py", ["--steps", "10"], ()),
    "imagenet-example-one-gpu": (".", "mp_spawn_imagenet.py", ["--steps", "10", "--gpu", "0"], ()),
    "style-transfer-lbfgs": (".", "style_transfer_lbfgs.py", ["--steps", "10"], VISION),
    "graphed-callables": (".", "graphed_callables.py", ["--steps", "10"], ()),
    "jit-trace-train": (".", "jit_trace_train.py", ["--steps", "10"], ()),
    "compiled-optimizer-lr": (".", "compiled_optimizer_lr.py", ["--steps", "10"], ()),
    "forward-ad-pinn": (".", "forward_ad_pinn.py", ["--steps", "10"], ()),
    "ddp-static-graph": (".", "ddp_static_graph.py", ["--steps", "10"], ()),
    "orthogonal-rnn": (".", "orthogonal_rnn.py", ["--steps", "10"], ()),
    "deprecated-sdp-kernel": (".", "deprecated_sdp_kernel.py", ["--steps", "10"], ()),
    "loss-history-leak": (".", "loss_history_leak.py", ["--steps", "10"], ()),
    "sac-policy-ckpt": (".", "sac_policy_ckpt.py", ["--steps", "10"], ()),
    "func-ensemble": (".", "func_ensemble.py", ["--steps", "10"], ()),
    "vmap-ensemble": (".", "vmap_ensemble.py", ["--steps", "10"], ()),
    "dit-diffusion": (".", "dit_diffusion.py", ["--steps", "10"], ()),
    "multiscale-detector": (".", "multiscale_detector_cnn.py", ["--steps", "10"], ()),
    "layerdrop-transformer": (".", "layerdrop_transformer.py", ["--steps", "10"], ()),
    "fp16-master-weights": (".", "fp16_master_weights.py", ["--steps", "10"], ()),
    "tacotron-decoder": (".", "tacotron_decoder.py", ["--steps", "10"], ()),
    "sliding-window-attention": (".", "sliding_window_attention.py", ["--steps", "10"], ()),
    "lion-foreach": (".", "lion_foreach.py", ["--steps", "10"], ()),
    "spatial-transformer": (".", "spatial_transformer.py", ["--steps", "10"], ()),
    "byol-ema": (".", "byol_ema.py", ["--steps", "10"], ()),
    "contractive-ae-func": (".", "contractive_ae_func.py", ["--steps", "10"], ()),
    "memviz-snapshot": (".", "memviz_resnet_snapshot.py", ["--steps", "10", "--snapshot-dir", "/tmp"], ()),
    "pwg-wavenet-stft": (".", "pwg_wavenet_stft.py", ["--steps", "10"], ()),
    "perceiver-io-bytes": (".", "perceiver_io_bytes.py", ["--steps", "10"], ()),
    "adaptive-softmax-lm": (".", "adaptive_softmax_lm.py", [], ()),
    "deberta-mlm": (".", "deberta_mlm.py", [], ()),
    "deform-det": (".", "deform_det.py", [], VISION),
    "performer-lm": (".", "performer_lm.py", [], ()),
    "pixelcnn": (".", "pixelcnn.py", [], ()),
    "pixelcnn-dmol": (".", "pixelcnn.py", ["--loss", "dmol"], ()),
    "triplet-embed": (".", "triplet_embed.py", [], VISION),
    "capsnet": (".", "capsnet.py", [], ()),
    "clip-contrastive": (".", "clip_contrastive.py", [], ()),
    "mistral-pure-bf16": (".", "mistral_pure_bf16.py", [], ()),
    "patch-inpaint": (".", "patch_inpaint.py", [], ()),
    "stylegan2-lazy-r1": (".", "stylegan2_lazy_r1.py", [], ()),
    "tabular-plateau": (".", "tabular_plateau.py", [], ()),
}


def installed(name: str) -> bool:
    """Whether the packages entry ``name`` needs are installed here."""
    return all(importlib.util.find_spec(p) is not None for p in CORPUS[name][3])


def command(name: str, out: Path, target: str | None, steps: int, budget: str | None = None) -> tuple[list[str], Path]:
    """``memprof track`` of entry ``name`` (``memprof advise`` for ``budget``), and the folder it runs in."""
    folder, script, args, _ = CORPUS[name]
    verb = ["advise", script, "--budget", budget] if budget else ["track", script, "--steps", str(steps)]
    cmd = [sys.executable, "-m", "memprof.cli", *verb, "--json", str(out / f"{name}.json")]
    if target:
        cmd += ["--target", target]
    return [*cmd, "--", *args], SCRIPTS / folder


def run_one(name: str, out: Path, target: str | None, steps: int, env: dict, budget: str | None = None) -> dict:
    cmd, cwd = command(name, out, target, steps, budget)
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return {"name": name, "rc": rc, "seconds": round(time.monotonic() - start, 1), "command": " ".join(cmd[1:])}


def run_all(args: argparse.Namespace, target: str | None) -> None:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.no_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    names = [n for n in CORPUS if not args.only or n in args.only]
    if args.skip_missing:
        names = [n for n in names if installed(n)]
    budget = getattr(args, "budget", None)
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda n: run_one(n, out, target, args.steps, env, budget), names))
    for r in runs:
        if budget:  # what advise said: plans ranked, left out, failed (why)
            advice = json.loads((out / f"{r['name']}.json").read_text()) if r["rc"] == 0 else {}
            r.update(best=advice.get("best"), plans=len(advice.get("plans", [])),
                     skipped=len(advice.get("skipped", {})), failed=advice.get("failed", {}))
            if r["rc"]:
                r["error"] = (out / f"{r['name']}.log").read_text().strip().splitlines()[-1:]
        print(f"{r['name']:32s} rc={r['rc']} {r['seconds']:6.1f} s" + (f" failed {len(r['failed'])}" if budget else ""))
    (out / "runs.json").write_text(json.dumps(runs, indent=1))


def last_step(path: Path) -> dict | None:
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    steps = report.get("steps") or []
    return steps[-1] if steps else None


def compare(args: argparse.Namespace) -> None:
    measured, simulated = Path(args.measured), Path(args.simulated)
    rows = []
    for name in CORPUS:
        m, s = last_step(measured / f"{name}.json"), last_step(simulated / f"{name}.json")
        row = {"name": name, "measured": m, "simulated": s}
        if m and s:
            for key in ("peak_allocated", "peak_reserved"):
                row[f"{key}_error"] = (s[key] - m[key]) / m[key]
        rows.append(row)
    errs = sorted(abs(r["peak_allocated_error"]) for r in rows if "peak_allocated_error" in r)
    summary = {
        "median_abs_allocated_error": errs[len(errs) // 2] if errs else None,
        "worst_abs_allocated_error": errs[-1] if errs else None,
        "worst_abs_reserved_error": max((abs(r["peak_reserved_error"]) for r in rows if "peak_reserved_error" in r), default=None),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    lines = [
        "| script | measured alloc GiB | predicted alloc GiB | error | measured reserved GiB | predicted reserved GiB | error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m, s = r["measured"], r["simulated"]
        if not (m and s):
            have = "-" if not m else f"{m['peak_allocated'] / GiB:.2f}"
            lines.append(f"| {r['name']} | {have} | {'failed' if not s else 'no measurement'} | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {m['peak_allocated'] / GiB:.2f} | {s['peak_allocated'] / GiB:.2f} | "
            f"{100 * r['peak_allocated_error']:+.1f} % | {m['peak_reserved'] / GiB:.2f} | "
            f"{s['peak_reserved'] / GiB:.2f} | {100 * r['peak_reserved_error']:+.1f} % |"
        )
    (out / "corpus.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(summary))


def recheck(args: argparse.Namespace) -> None:
    """A whole-corpus simulation against each entry's latest measurement on the GPU: the
    ``measured_peak_allocated`` of the rows of an earlier recheck (``--before``), else of
    ``compare``'s outputs (``--measured``), and whether each gives the earlier run's bytes."""
    simulated = Path(args.simulated)
    before = {r["name"]: r for r in json.loads(Path(args.before).read_text())["rows"]}
    measured = {}
    for path in args.measured:
        for r in json.loads(Path(path).read_text())["rows"]:
            if r.get("measured"):
                measured[r["name"]] = (r["measured"]["peak_allocated"], path)
    rows = []
    for name in CORPUS:
        s, b = last_step(simulated / f"{name}.json"), before.get(name, {})
        m, where = ((b["measured_peak_allocated"], b["measured_in"]) if b.get("measured_peak_allocated")
                    else measured.get(name, (None, None)))
        rows.append({"name": name, "rc": 0 if s else 1,
                     "simulated_peak_allocated": s and s["peak_allocated"], "simulated_peak_reserved": s and s["peak_reserved"],
                     "measured_peak_allocated": m, "measured_in": where,
                     "simulated_before": b.get("simulated_peak_allocated"),
                     "error": s["peak_allocated"] / m - 1 if s and m else None})
    errs = sorted(abs(r["error"]) for r in rows if r["error"] is not None)
    summary = {"entries": len(rows), "ran": sum(r["rc"] == 0 for r in rows), "measured": len(errs),
               "median_abs_error": statistics.median(errs) if errs else None,
               "within_1pct": sum(e <= 0.01 for e in errs), "within_2pct": sum(e <= 0.02 for e in errs),
               "same_bytes_as_before": sum(r["simulated_peak_allocated"] == r["simulated_before"]
                                           for r in rows if r["simulated_before"])}
    Path(args.out).write_text(json.dumps({"commands": [" ".join(sys.argv)], "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))
    for r in rows:
        if r["rc"] or (r["simulated_before"] and r["simulated_peak_allocated"] != r["simulated_before"]):
            print(f"{r['name']}: rc {r['rc']}, {r['simulated_before']} -> {r['simulated_peak_allocated']} B")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd in ("measure", "simulate", "advise"):
        q = sub.add_parser(cmd)
        q.add_argument("--out", required=True)
        q.add_argument("--steps", type=int, default=3)
        q.add_argument("--jobs", type=int, default=1, help="scripts run at once")
        q.add_argument("--only", nargs="*", default=None)
        q.add_argument("--skip-missing", "--skip-vision", dest="skip_missing", action="store_true",
                       help="leave out the scripts whose packages (torchvision, timm, triton) are not installed here")
        q.add_argument("--no-gpu", action="store_true", help="hide the GPUs (CUDA_VISIBLE_DEVICES=)")
        if cmd in ("simulate", "advise"):
            q.add_argument("--target", default="h200")
        if cmd == "advise":
            q.add_argument("--budget", default="24GiB")
    q = sub.add_parser("compare")
    q.add_argument("measured")
    q.add_argument("simulated")
    q.add_argument("--out", default="benchmarks/results")
    q = sub.add_parser("recheck", help="a whole-corpus simulation against the latest measurements")
    q.add_argument("simulated")
    q.add_argument("--before", required=True, help="an earlier recheck's JSON (its rows' measurements)")
    q.add_argument("--measured", nargs="*", default=[], help="compare's corpus.json of entries measured since")
    q.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "compare":
        compare(args)
    elif args.cmd == "recheck":
        recheck(args)
    else:
        run_all(args, args.target if args.cmd in ("simulate", "advise") else None)


if __name__ == "__main__":
    main()
