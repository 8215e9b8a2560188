"""Training scripts written the way public projects write them, simulated for an H200.

Each script of ``benchmarks/scripts`` runs unmodified, from its own directory,
under ``memprof track --target h200`` and ``memprof advise --budget 24GiB``, in
a fresh process with the GPUs hidden (``CUDA_VISIBLE_DEVICES=``): on a
CPU-only build of torch that is the CPU machine's case, on a CUDA build the
login node's (a CUDA torch and no GPU). The arguments shrink the models so
the suite stays quick; the code paths are the scripts' own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from corpus import CORPUS, SCRIPTS, installed  # noqa: E402

#: Small sizes for each entry (the script's own options; none: the short scripts with fixed sizes).
SMALL = {
    "ppo_agent.py": ["--num-envs", "8", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1",
                     "--num-updates", "3", "--width", "256"],
    "nanogpt": ["--n_layer=2", "--n_head=4", "--n_embd=128", "--block_size=128", "--batch_size=4"],
    "gqa_decoder.py": ["--hidden-size", "128", "--intermediate-size", "352", "--layers", "2", "--heads", "4",
                       "--kv-heads", "2", "--seq-len", "64", "--batch-size", "2"],
    "hf_trainer.py": ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "32", "--batch-size", "4"],
    "lightning_gpt.py": ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--seq-len", "32", "--batch-size", "4"],
    "vision_reference.py": ["--model", "resnet18", "--batch-size", "8", "--workers", "2", "--train-crop-size", "64"],
    "peft_lora.py": ["--hidden-size", "64", "--intermediate-size", "176", "--num-layers", "2", "--num-heads", "4",
                     "--vocab-size", "1000", "--seq-len", "32", "--batch-size", "2"],
    "cuda_api_probe.py": ["--batch-size", "4", "--seq-len", "64", "--d-model", "128", "--n-layers", "2",
                          "--n-heads", "4", "--dim-feedforward", "256"],
    "accelerate_clm.py": ["--hidden-size", "64", "--intermediate-size", "176", "--num-layers", "2", "--num-heads", "4",
                          "--num-kv-heads", "2", "--vocab-size", "1000", "--block-size", "32",
                          "--per-device-train-batch-size", "4"],
    "ddp_classifier.py": ["--batch-size", "8", "--image-size", "32", "--width", "8", "--num-classes", "10",
                          "--samples", "256"],
    "fsdp2_llama.py": ["--dim", "64", "--ffn-dim", "176", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
                       "--vocab-size", "1000", "--seq-len", "32", "--local-batch-size", "4"],
    "wgan_gp.py": ["--img-size", "8", "--channels", "1", "--hidden", "64", "--latent-dim", "16", "--batch-size", "8",
                   "--n-critic", "2"],
    # 16 samples, as many as the generator's third batch norm has channels
    "dcgan.py": ["--batchSize", "16", "--ngf", "8", "--ndf", "8", "--batches", "8"],
    "timm_train.py": ["--model", "vit_tiny_patch16_224", "--batch-size", "4", "--num-classes", "10"],
    "triton_fused.py": ["--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--block-size", "64", "--batch-size", "2",
                        "--vocab-size", "1024"],
    "dpo_pairs.py": ["--hidden-size", "64", "--intermediate-size", "176", "--num-layers", "2", "--num-heads", "4",
                     "--vocab-size", "1000", "--seq-len", "32", "--prompt-len", "8", "--batch-size", "2"],
    "generate_then_train.py": ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--vocab-size", "1000",
                               "--reward-n-layer", "1", "--reward-n-embd", "32", "--batch-size", "4",
                               "--prompt-len", "8", "--max-new-tokens", "8"],
    "offload_activations.py": ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--hidden-dim", "176",
                               "--seq-len", "32", "--batch-size", "2", "--vocab-size", "1000"],
    "hifigan_gan.py": ["--batch_size", "2", "--segment_size", "8192", "--tiny"],
    "fsdp1_llama.py": ["--hidden-size", "64", "--intermediate-size", "176", "--num-layers", "2", "--num-heads", "4",
                       "--vocab-size", "1000", "--seq-len", "32", "--batch-size", "2"],
    "ddp_nosync_zero.py": ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--vocab-size", "1000",
                           "--block-size", "32", "--micro-batch-size", "2"],
    "gnn_scatter.py": ["--hidden", "32", "--layers", "2", "--in_dim", "16", "--graphs_per_batch", "8",
                       "--min_nodes", "10", "--max_nodes", "20"],
    "hf_trainer_custom_loss.py": ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4",
                                  "--intermediate-size", "128", "--vocab-size", "1000", "--max-len", "32",
                                  "--batch-size", "4", "--num-samples", "64"],
    "latent_diffusion.py": ["--model_channels", "32", "--channel_mult", "1,2", "--num_res_blocks", "1",
                            "--attention_levels", "0", "--num_heads", "4", "--context_dim", "32", "--context_len", "8",
                            "--latent_size", "16", "--batch", "2"],
    "lightning_manual_gan.py": ["--image-size", "32", "--ngf", "8", "--ndf", "8", "--batch-size", "4",
                                "--num-workers", "0"],
    "packed_seq2seq.py": ["--vocab", "1000", "--hidden", "64", "--batch", "4", "--max_src", "12", "--max_tgt", "12"],
    "moe_sorted_dispatch.py": ["--vocab-size", "1000", "--d-model", "64", "--n-layers", "2", "--n-heads", "4",
                               "--n-experts", "4", "--expert-hidden", "128", "--seq-len", "32", "--batch-size", "2"],
    "accelerate_accumulate.py": ["--vocab-size", "1000", "--d-model", "64", "--layers", "2", "--heads", "4",
                                 "--ffn-dim", "128", "--max-source-length", "32", "--max-target-length", "16",
                                 "--per-device-train-batch-size", "2"],
    "prefetch_classifier.py": ["--batch-size", "8", "--image-size", "32", "--width", "8", "--num-classes", "10",
                               "--samples", "256"],
    "optim_in_backward.py": ["--vocab-size", "1000", "--num-layers", "2", "--dim", "64", "--num-heads", "4",
                             "--num-kv-heads", "4", "--hidden-dim", "176", "--seq-len", "32", "--batch-size", "2"],
    "pinn_burgers.py": ["--n-u", "200", "--n-f", "2000", "--width", "32", "--depth", "2"],
    "whisper_finetune.py": ["--d-model", "64", "--layers", "2", "--heads", "4", "--ffn-dim", "128",
                            "--per-device-train-batch-size", "2", "--max-label-length", "16"],
    "sam_resnet.py": ["--batch-size", "32", "--width-factor", "2", "--depth", "10"],
    "adversarial_pgd.py": ["--batch-size", "32", "--width", "16"],
    "lookahead_param.py": ["--batch-size", "32", "--hidden", "256"],
    "multitask_hooks.py": ["--batch-size", "32", "--dim", "128", "--depth", "4"],
    "titan_meta_init.py": ["--dim", "256", "--n-layers", "4", "--n-heads", "8", "--n-kv-heads", "4",
                           "--vocab-size", "8192", "--seq-len", "512", "--batch-size", "8"],
    "memdebug_oom_retry.py": ["--d-model", "128", "--ffn-dim", "256", "--n-layers", "2", "--seq-len", "128",
                              "--start-batch-size", "131072"],
    "prune_finetune.py": ["--batch-size", "16", "--image-size", "64", "--num-classes", "10"],
    "transformer_xl_mems.py": ["--n_layer", "4", "--d_model", "128", "--n_head", "4", "--d_head", "32",
                               "--d_inner", "512", "--tgt_len", "64", "--mem_len", "64", "--eval-tgt-len", "32",
                               "--batch_size", "8", "--n_token", "10000", "--n-tokens-data", "200000"],
    "gp_deep_kernel.py": ["--n-train", "2048"],
    "hybrid_cpu_embedding.py": ["--top-mlp", "1024-1024-512-256", "--batch-size", "2048", "--num-samples", "16384"],
    "efficientnet_swish.py": ["--batch-size", "16", "--image-size", "64"],
    "glow_flow.py": ["--img-size", "32", "--n-flow", "8", "--n-block", "3", "--filter-size", "128"],
    "ckpt_wrapper_fp16.py": ["--batch-size", "2", "--seq-len", "64", "--vocab-size", "1000", "--dim", "64",
                             "--n-layers", "2", "--n-heads", "4"],
    "gradcache_contrastive.py": ["--batch-size", "8", "--chunk-size", "4", "--q-len", "16", "--p-len", "16",
                                 "--num-workers", "0"],
    "sac_continuous.py": ["--buffer-size", "1000", "--batch-size", "32", "--learning-starts", "50", "--hidden", "64"],
    "conformer_asr.py": ["--batch-size", "2", "--num-workers", "0", "--max-seconds", "3.0", "--d-model", "64",
                         "--num-heads", "4", "--ffn-dim", "128", "--num-layers", "2"],
    "swin_ema_onecycle.py": ["--batch-size", "2", "--num-classes", "10", "--workers", "0"],  # 224: its windows tile it
    "hf_accelerate_manual_accum.py": ["--per-device-train-batch-size", "2", "--block-size", "64"],
    "hf_detr_matcher.py": ["--batch-size", "2", "--min-size", "64", "--max-size", "96", "--max-boxes", "4",
                           "--num-queries", "10", "--d-model", "32", "--layers", "2"],
    "wav2vec2_ctc.py": ["--per-device-batch-size", "2", "--min-seconds", "0.5", "--max-seconds", "1.0",
                        "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--intermediate-size", "128"],
    "dino_multicrop.py": ["--arch", "vit_tiny", "--out_dim", "1024", "--batch_size_per_gpu", "2",
                          "--global_crops_size", "64", "--local_crops_number", "2", "--local_crops_size", "32"],
    "pointnet2_seg.py": ["--batch_size", "2", "--npoint", "512"],
    "kge_sparse_adam.py": ["--num-entities", "2000", "--num-relations", "50", "--hidden-dim", "32", "--proj-hidden",
                           "64", "--batch-size", "64", "--neg-size", "16", "--eval-chunk", "500", "--num-test", "8"],
    "hf_segformer.py": ["--image-size", "64", "--batch-size", "2", "--eval-batch-size", "2", "--num-labels", "10"],
    "hf_mlm_fused.py": ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--intermediate-size", "128",
                        "--vocab-size", "1000", "--min-len", "16", "--max-len", "32", "--num-samples", "64",
                        "--batch-size", "4"],
    "rwkv_tbptt.py": ["--vocab-size", "1000", "--n-embd", "64", "--n-layer", "2", "--ctx-len", "32", "--chunk-len", "8",
                      "--batch-size", "2"],
    "lightning_vit_callbacks.py": ["--batch-size", "4", "--image-size", "32", "--embed-dim", "64", "--depth", "2",
                                   "--num-heads", "4", "--num-classes", "10"],
    "video_3d_cudnn.py": ["--batch-size", "2", "--clip-len", "4", "--crop", "32", "--num-classes", "10", "--workers", "0"],
    "raft_flow.py": ["--batch_size", "4", "--image_size", "64", "96", "--iters", "3"],
    "reformer_reversible.py": ["--batch_size", "4", "--seq_len", "256", "--dim", "64", "--depth", "2", "--validate_every",
                               "3"],
    "lazy_iterable_tqdm.py": ["--batch-size", "16", "--image-size", "64"],
    "mp_spawn_imagenet.py": ["-b", "8", "--image-size", "64", "-j", "2"],
    "style_transfer_lbfgs.py": ["--imsize", "64"],
    "graphed_callables.py": ["--n-layers", "2", "--d-model", "256", "--n-heads", "4", "--seq-len", "128",
                             "--batch-size", "4", "--vocab-size", "8192", "--warmup-iters", "1"],
    "jit_trace_train.py": ["--width", "16", "--image-size", "64", "-b", "8", "--num-classes", "100"],
    "compiled_optimizer_lr.py": ["--width", "512", "--layers", "4", "--batch-size", "16"],
    "forward_ad_pinn.py": ["--n-collocation", "2048", "--n-boundary", "256", "--width", "64", "--depth", "4"],
    "ddp_static_graph.py": ["--batch-size", "8", "--accum-steps", "2", "--image-size", "32", "--width", "16",
                            "--hidden", "256", "--num-classes", "100"],
    "orthogonal_rnn.py": ["--vocab", "1000", "--emsize", "64", "--nhid", "256", "--batch-size", "16", "--bptt", "32"],
    "deprecated_sdp_kernel.py": ["--n_layer", "2", "--n_embd", "256", "--n_head", "4", "--block_size", "512",
                                 "--batch_size", "4", "--vocab_size", "8192"],
    "loss_history_leak.py": ["--batch-size", "32", "--image-size", "64", "--print-every", "1", "--val-every", "1"],
    "sac_policy_ckpt.py": ["--dim", "256", "--n_layers", "2", "--n_heads", "4", "--hidden_dim", "704",
                           "--vocab_size", "4096", "--batch_size", "2", "--seq_len", "512"],
    "tacotron_decoder.py": ["--batch_size", "16", "--min_frames", "40", "--max_frames", "60"],  # a step per frame
    "adaptive_softmax_lm.py": ["--vocab", "50000", "--emsize", "64", "--nhid", "128", "--bptt", "32",
                               "--batch_size", "16", "--tokens", "20000"],
    "deberta_mlm.py": ["--vocab-size", "1000", "--hidden-size", "64", "--layers", "2", "--heads", "4", "--seq-len", "64",
                       "--batch-size", "4", "--max-steps", "6"],
    "deform_det.py": ["--batch-size", "2", "--channels", "32", "--num-classes", "10", "--image-size", "128",
                      "--steps", "6"],
    "performer_lm.py": ["--vocab", "1000", "--dim", "64", "--depth", "2", "--seq-len", "128", "--batch-size", "4",
                        "--iters", "6"],
    "pixelcnn.py": ["--batch-size", "4", "--image-size", "16", "--hidden", "32", "--layers", "4", "--iters-per-epoch", "6"],
    "triplet_embed.py": ["--batch-size", "16", "--image-size", "64", "--epochs", "1"],
    "capsnet.py": ["--batch-size", "16", "--epochs", "1", "--steps-per-epoch", "6"],
    "clip_contrastive.py": ["--batch-size", "8", "--image-size", "64", "--text-len", "16", "--vocab-size", "1000",
                            "--width", "64", "--layers", "2", "--steps", "6"],
    "mistral_pure_bf16.py": ["--vocab-size", "1000", "--hidden-size", "64", "--intermediate-size", "176",
                             "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2", "--sliding-window", "32",
                             "--seq-len", "64", "--batch-size", "2", "--max-steps", "6", "--warmup-steps", "2"],
    "patch_inpaint.py": ["--batch-size", "8", "--image-size", "64", "--dim", "64", "--depth", "2", "--steps", "6"],
    "stylegan2_lazy_r1.py": ["--size", "16", "--batch", "8", "--channels", "32", "--iters", "12"],
    "tabular_plateau.py": ["--n-features", "64", "--n-train", "4096", "--n-val", "1024", "--batch-size", "256",
                           "--steps", "8"],
}


def _args(name: str) -> tuple[Path, str, list[str]]:
    folder, script, args, _ = CORPUS[name]
    return SCRIPTS / folder, script, [*args, *SMALL.get("nanogpt" if folder == "nanogpt" else script, [])]


def _memprof(cwd: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "memprof.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def _run(command: str, name: str, tmp_path: Path, *options: str, extra: tuple[str, ...] = (),
         env: dict | None = None) -> tuple[dict, str]:
    """``memprof COMMAND`` on corpus entry ``name`` for the simulated H200: (its JSON, its stderr)."""
    cwd, script, args = _args(name)
    out = tmp_path / "out.json"
    done = _memprof(cwd, command, script, "--target", "h200", *options, "--json", str(out), "--", *args, *extra,
                    env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stderr


def _needs(name: str) -> None:
    if not installed(name):
        pytest.skip(f"{', '.join(CORPUS[name][3])} not installed with this torch (the CI runs it with a CUDA build "
                    "of torch)")


@pytest.mark.parametrize("name", list(CORPUS))
def test_track_simulates_the_script(name, tmp_path):
    _needs(name)
    report, stderr = _run("track", name, tmp_path, "--steps", "2")
    assert report["source"] == "simulate" and report["meta"]["target"] == "H200-141GB"
    assert len(report["steps"]) == 2  # both optimizer steps ran (a GradScaler that found "inf" would skip them)
    peak = report["peak"]["bytes"]
    assert peak["parameters"] > 0
    # Adam's moments or SGD's momentum; pytorch/examples' word language model updates the parameters
    # itself (lstm-lm's first loop too, which is the one tracked: its GRU classifier with Adam comes after)
    # (and a TorchScript LSTM's, trained with SGD without momentum)
    assert (peak["optimizer_state"] > 0) == (name not in {"word-lm-transformer", "word-lm-lstm", "lstm-lm",
                                                          "jit-scripted-rnn"})
    assert "Traceback" not in stderr
    coupling = report["meta"].get("sample_coupling", {})
    assert coupling == COUPLING.get(name, {}), coupling


def test_megatron_style_fused_functions_free_what_they_saved(tmp_path):
    """Megatron's @torch.jit.script functions under reentrant checkpointing, with memprof's
    saved-tensors hook on: a hook that returned the tensor itself kept it and its grad_fn in a
    cycle no collector breaks (133 GiB simulated). What lives at the step's peak is the bf16
    weights and gradients, their fp32 master copies and gradients, and Adam's two moments:
    2 + 2 + 4 + 4 + 8 = 20 bytes a parameter, 6 of them counted as parameters."""
    report, _ = _run("track", "megatron-fused", tmp_path, "--steps", "2")
    peak = report["steps"][-1]["peak_allocated"]
    assert peak < 1.1 * 20 / 6 * report["peak"]["bytes"]["parameters"]


def test_lora_trains_only_the_adapters(tmp_path):
    """PEFT freezes the base: Adam's state is the LoRA matrices' alone, in float32.

    2 layers x 4 projections (q, k, v, o) x (A: 16 x 64 + B: 64 x 16) x 4 bytes = 65,536 bytes per state.
    """
    state = _run("track", "peft-lora", tmp_path, "--steps", "2")[0]["optimizer_state"]
    assert state["exp_avg"] == state["exp_avg_sq"] == 2 * 4 * (16 * 64 + 64 * 16) * 4


def test_compile_runs_eagerly_and_says_so(tmp_path):
    report, stderr = _run("track", "nanogpt-bf16", tmp_path, "--steps", "2", extra=("--compile=True",))
    assert "torch.compile of the model is simulated eagerly" in stderr
    assert "torch.compile" in report["meta"]["simulation_notes"]


def test_a_torchrun_script_simulates_one_rank_of_world_size(tmp_path):
    """torchrun's WORLD_SIZE reaches the fake process group: FSDP2 shards each parameter's
    rows over it, and Adam's state with it: per tensor 1/N of its fp32 bytes (every first
    dimension here is even), in 512-byte blocks."""
    from math import prod

    # The small Llama: embedding and head 1000 x 64; per layer q, k, v, o, gate, up, down
    # (2 key/value heads of 16) and two norms; the final norm.
    layer = [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176), (64,), (64,)]
    shapes = [(1000, 64), (1000, 64), *layer, *layer, (64,)]
    for n in (1, 2):
        report = _run("track", "fsdp2-llama", tmp_path, "--steps", "2", env={"WORLD_SIZE": str(n)})[0]
        assert f"one rank of {n} " in report["meta"]["simulation_notes"]["torch.distributed"]
        assert report["optimizer_state"]["exp_avg"] == sum(-(-prod(s) * 4 // n // 512) * 512 for s in shapes)
        # Checkpointing's recomputation saves the gathered weights detached; FSDP frees them with
        # resize_(0): what they held is not left counted as activations once backward is done
        # (2.8 MiB here; at the script's own size temporaries went 1.3 GiB below zero).
        done = [s for s in report["timeline"] if s["phase"] in ("after backward", "optimizer step")]
        assert done and all(s["activations"] == 0 and s["temporaries"] >= 0 for s in done)


def test_a_gan_tracks_both_models(tmp_path):
    """The critic steps first, the generator every second iteration: once the generator's
    optimizer has stepped, both models are tracked as one, each parameter in 512-byte blocks."""
    report = _run("track", "wgan-gp", tmp_path, "--steps", "2")[0]
    rows = {r["module"]: r for r in report["modules"]}
    blocks = lambda *numels: sum(-(-n * 4 // 512) * 512 for n in numels)  # noqa: E731
    # Linear 16->8, then 8->16, 16->32, 32->64 each with a BatchNorm1d, then 64->64 (8 x 8 pixels).
    generator = blocks(128, 8, 128, 16, 16, 16, 512, 32, 32, 32, 2048, 64, 64, 64, 4096, 64)
    critic = blocks(64 * 32, 32, 32 * 16, 16, 16, 1)
    assert rows["ModuleDict.Generator"]["parameters"] == generator
    assert rows["ModuleDict.Discriminator"]["parameters"] == critic
    assert report["optimizer_state"]["exp_avg"] == generator + critic


def test_lightning_ddp_runs_one_rank_of_the_fake_process_group(tmp_path):
    report, stderr = _run("track", "lightning", tmp_path, "--steps", "2", extra=("--strategy", "ddp"))
    assert report["modules"][0]["module"] == "DistributedDataParallel" and len(report["steps"]) == 2
    assert "one rank of 1 on PyTorch's fake process group" in report["meta"]["simulation_notes"]["torch.distributed"]


def test_pytorch_examples_imagenet_spawned_runs_every_plan(tmp_path):
    """pytorch/examples' ImageNet with --multiprocessing-distributed: mp.spawn's one process runs in
    this one on the simulated GPU, and its meters' all_reduce of torch.tensor([meter.sum, meter.count])
    (a 0-dim CUDA tensor inside the data) no longer stops 13 of the 20 plans."""
    extra = ("--multiprocessing-distributed", "--world-size", "1", "--rank", "0", "--dist-url",
             "tcp://127.0.0.1:23456", "--steps", "5")
    advice, _ = _run("advise", "imagenet-example-one-gpu", tmp_path, "--budget", "24GiB", extra=extra)
    assert "torch.multiprocessing.spawn" in advice["baseline"]["meta"]["simulation_notes"]
    assert len(advice["plans"]) == 20 and advice["failed"] == {}


@pytest.mark.parametrize("name", ["nanogpt-fp16-scaler", "gqa-fp32", "hf-trainer", "lightning", "vision-reference",
                                  "peft-lora", "cuda-api-bf16", "accelerate-clm", "ddp-classifier", "fsdp2-llama",
                                  "prefetch-classifier", "dcgan", "conformer-asr", "hf-detr-matcher", "wav2vec2-ctc",
                                  "dino-multicrop", "kge-sparse-adam", "rwkv-tbptt", "raft-flow",
                                  "reformer-reversible", "tabnet-ghost-bn", "swa-cifar", "autoresearch-gpt",
                                  "varlen-finetune", "einops-vit-metrics", "threaded-prefetch", "patch-inpaint",
                                  "stylegan2-lazy-r1", "deform-det", "ppo-agent", "clip-contrastive"])
def test_advise_ranks_plans_for_the_script(name, tmp_path):
    _needs(name)
    advice, _ = _run("advise", name, tmp_path, "--budget", "24GiB")
    assert advice["target"] == "H200-141GB" and advice["best"] is not None
    assert len(advice["plans"]) > 1
    does = advice["script_does"]
    assert {k: does[k] for k in WHAT_IT_DOES.get(name, {})} == WHAT_IT_DOES.get(name, {})
    plans = {p["plan"] for p in advice["plans"]}
    if does["autocast"] or does["forward_dtype"]:  # what the script does already is not offered again
        assert not any(p.startswith(("bf16", "fp16")) for p in plans) and "bf16" in advice["skipped"]
    if does["checkpointed"]:
        said = advice["skipped"]["ckpt"]
        assert "ckpt" not in plans and (said == "the script already checkpoints the repeated blocks"
                                        or bool(does["recomputed_by"]) and does["recomputed_by"] in said)
    # Accumulation changes what training computes where the samples meet (batch norm, in-batch pairs): said, and
    # such a plan is recommended only where no plan that fits trains the same model
    coupling = advice["baseline"]["meta"].get("sample_coupling", {})
    assert coupling == COUPLING.get(name, {})
    assert all(bool(p["changes"]) == ("accum" in p["plan"] and bool(coupling)) for p in advice["plans"])
    best = next(p for p in advice["plans"] if p["plan"] == advice["best"])
    assert not best["changes"] or not any(p["fits"] and not p["changes"] for p in advice["plans"])
    if name in ("prefetch-classifier", "dcgan"):  # a prefetched batch is cut; a generator's batch norm is not
        assert {"accum2", "accum4", "accum8"} <= plans
    if name == "fsdp2-llama":  # sharded by the script: memprof's sharding plans are for an unsharded model
        assert advice["skipped"]["offload_states"].startswith("the script shards the model already (FSDP2)")
    if name == "conformer-asr":  # each micro-batch as long as its longest sample, as its padding mask is
        assert "accum2" in plans, advice["failed"]
    # DETR: its box checks pass, its per-image target dicts are cut with the images; wav2vec 2.0: its
    # collator's host tensors are left whole; DINO: its crops (a list) give the batch size
    if name in ("hf-detr-matcher", "wav2vec2-ctc", "dino-multicrop"):
        assert {"accum2", "ckpt"} <= plans, advice["failed"]
    if name == "rwkv-tbptt":  # its recurrent state, detached by the loop, is passed back: not cut
        assert "back to its next forward" in advice["skipped"]["accum2"] and not advice["failed"]
    if name == "raft-flow":  # its noise, made on the host at the cut images' shape, is not cut again
        assert {"accum2", "ckpt+accum2"} <= plans, advice["failed"]
    if name == "reformer-reversible":  # a validation after step 0 and every 3: no plan's step
        assert advice["evaluation_peak_allocated_bytes"] > 0 and {"accum2", "bf16+accum2"} <= plans
        # its reversible layers recompute in backward; their irreversible twins never run
        assert does["idle_blocks"] == ["net.net.reformer.layers.irrev_blocks.0", "net.net.reformer.layers.irrev_blocks.1"]
        assert does["recomputed_by"] == "_ReversibleFunctionBackward"
        assert advice["skipped"]["ckpt"].startswith("the script already runs the repeated blocks again in backward")
    if name == "tabnet-ghost-bn":  # an epoch's short last batch, a predict pass in eval mode with gradients on
        assert not advice["failed"] and advice["evaluation_peak_allocated_bytes"] > 0
    if name == "swa-cifar":  # update_bn's pass over the averaged model every second step is no plan's
        assert not advice["failed"] and advice["evaluation_peak_allocated_bytes"] == 0
        peaks = {p["plan"]: p["peak_allocated"] for p in advice["plans"]}
        assert peaks["accum8"] < peaks["accum4"] < peaks["accum2"] < peaks["baseline"]
    if does["expandable_segments"]:  # every plan ran with them; none is offered again with them
        assert not any("expandable" in p.split("+") for p in plans)
    if name == "kge-sparse-adam":  # FSDP2 reduces no sparse gradient
        assert "makes sparse gradients (sparse=True)" in advice["failed"]["offload_states"]
    if name == "einops-vit-metrics":  # vit-pytorch's layers: ModuleList([ModuleList([Attention, FeedForward])])
        assert {"ckpt", "ckpt+accum2"} <= plans, advice["failed"]
    if name == "threaded-prefetch":  # its prefetching thread runs on the simulated GPU in every plan's run
        assert not advice["failed"] and {"accum2", "bf16", "ckpt"} <= plans
    if name == "patch-inpaint":  # its per-sample mask loop runs to the script's batch size in a micro-batch too
        assert {"accum2", "accum4", "accum8"} <= plans and not advice["failed"], advice["failed"]
    if name == "stylegan2-lazy-r1":  # every 4th step also regularizes: plans are measured on steps like the baseline's
        assert {"accum2", "accum4"} <= plans and "accum2" not in advice["skipped"]
    if name == "ppo-agent":  # minibatches picked from rollout buffers on the device by one index array: the
        # model's input is cut, and its old log-probabilities and advantages where the loss meets the new ones
        assert {"accum2", "accum4"} <= plans and not any(p.startswith("accum") for p in advice["failed"])
    if name == "deform-det":  # torchvision's deformable convolution: its im2col columns counted, no note
        assert not any("deform_conv2d" in n for n in advice["baseline"]["meta"].get("simulation_notes", {}))
    if name == "ddp-classifier":  # one rank on PyTorch's fake process group; DDP's inputs cut into micro-batches
        assert "accum2" in plans and "torch.distributed" in advice["baseline"]["meta"]["simulation_notes"]


#: What makes a sample's gradient depend on the others of its batch in each script's step (memprof.coupling),
#: at the SMALL sizes: its batch norms in training mode, its products over pairs of samples (CLIP's
#: image-text similarities, a triplet loss's distances), its statistics over the batch. None elsewhere.
COUPLING = {
    "vision-reference": {"batch_norm": 20}, "ddp-classifier": {"batch_norm": 20}, "wgan-gp": {"batch_norm": 3},
    "dcgan": {"batch_norm": 7}, "prefetch-classifier": {"batch_norm": 8}, "cuda-conveniences": {"batch_norm": 2},
    "maskrcnn-detection": {"batch_norm": 53}, "deeplab-segmentation": {"batch_norm": 61},
    "r3d-video": {"batch_norm": 20}, "maml-second-order": {"batch_norm": 44},
    "moco-clip": {"batch_norm": 53, "pairs": 1}, "audio-cnn": {"batch_norm": 8},
    "simclr-lars": {"pairs": 1, "batch_norm": 53}, "dcgan-specnorm": {"batch_norm": 5},
    "yolo-detect": {"batch_norm": 57}, "conformer-asr": {"batch_norm": 2}, "raft-flow": {"batch_norm": 15},
    "tabnet-ghost-bn": {"batch_norm": 233}, "swa-cifar": {"batch_norm": 19}, "threaded-prefetch": {"batch_norm": 20},
    "clip-contrastive": {"pairs": 1}, "triplet-embed": {"pairs": 1, "batch_norm": 21}, "byol-ema": {"batch_norm": 22},
    "airbench-cifar": {"batch_norm": 6}, "imagenet-example-one-gpu": {"batch_norm": 20},
    "qat-resnet": {"batch_norm": 20}, "gnn-scatter": {"batch_norm": 3}, "lightning-manual-gan": {"batch_norm": 5},
    "sam-resnet": {"batch_norm": 13}, "adversarial-pgd": {"batch_norm": 17}, "prune-finetune": {"batch_norm": 20},
    "gp-deep-kernel": {"batch_statistics": 2, "pairs": 1}, "resume-checkpointing": {"batch_norm": 20},
    "schedulefree-adamw": {"batch_norm": 12}, "efficientnet-swish": {"batch_norm": 28},
    "pointnet2-seg": {"batch_norm": 22}, "hf-segformer": {"batch_norm": 1}, "video-3d-cudnn": {"batch_norm": 37},
    "act-compress-hooks": {"batch_norm": 20}, "functorch-maml": {"batch_norm": 44},
    "lazy-iterable-tqdm": {"batch_norm": 8}, "jit-trace-train": {"batch_norm": 20},
    "ddp-static-graph": {"batch_norm": 8}, "multiscale-detector": {"batch_norm": 45},
    "tacotron-decoder": {"batch_norm": 8}, "spatial-transformer": {"batch_norm": 11},
    "memviz-snapshot": {"batch_norm": 53}, "pwg-wavenet-stft": {"batch_statistics": 3},
    "pixelcnn": {"batch_norm": 14}, "pixelcnn-dmol": {"batch_norm": 14}, "tabular-plateau": {"batch_norm": 3},
}


#: What each script does already, as ``memprof advise`` reports it (``script_does``), at the SMALL sizes.
WHAT_IT_DOES = {
    # the Trainer's bf16 is Accelerate's autocast inside the model's forward; Hugging Face's
    # layers checkpoint their forward, not their call
    "hf-trainer": {"autocast": "bf16", "checkpointed": ["transformer.h.0", "transformer.h.1"], "micro_batches": 1,
                   "trainer": "hf"},  # the Trainer's loop steps the optimizer: changes as TrainingArguments
    "lightning": {"trainer": "lightning"},
    # Accelerate without the Trainer: the script's own loop
    "accelerate-clm": {"autocast": "bf16", "micro_batches": 2, "optimizer": "AdamW", "trainer": "script"},
    # DDP's forward(*inputs) named by the wrapped ResNet's forward(x)
    "ddp-classifier": {"autocast": "bf16", "micro_batches": 1, "batch": {"x": [[8, 3, 32, 32], "fp32"]}},
    # FSDP2's MixedPrecisionPolicy gathers bf16 parameters; checkpoint_wrapper's layers are recomputed
    "fsdp2-llama": {"autocast": None, "forward_dtype": "bf16", "checkpointed": ["model.layers.0", "model.layers.1"]},
    # DataParallel's forward(*inputs) named by the wrapped Sequential's forward(input); the SGD state of one model
    "prefetch-classifier": {"autocast": "fp16", "batch": {"input": [[8, 3, 32, 32], "fp32"]}, "also_trains": []},
    # the discriminator steps first: its model is advised; the generator's 146,032 parameters are named
    "dcgan": {"optimizer": "Adam", "also_trains": ["Adam over 0.15 M parameters"]},
    # each turns expandable segments on in its first lines (PYTORCH_ALLOC_CONF; PYTORCH_CUDA_ALLOC_CONF by setdefault)
    "autoresearch-gpt": {"autocast": "bf16", "micro_batches": 2, "expandable_segments": True},
    "varlen-finetune": {"autocast": "fp16", "micro_batches": 1, "expandable_segments": True},
    "einops-vit-metrics": {"autocast": "bf16", "micro_batches": 1, "checkpointed": []},
    "threaded-prefetch": {"autocast": None, "micro_batches": 1, "optimizer": "SGD"},
}


CPU_ONLY = """\
import torch
model = torch.nn.Linear(64, 64)  # trains on the CPU whatever is available
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.randn(8, 64)).sum().backward()
    opt.step(); opt.zero_grad()
"""

VALUE_SHAPED = """\
import torch
model = torch.nn.Linear(4096, 4096).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    y = model(torch.randn(256, 4096, device="cuda"))
    counts = torch.bincount((y > 0).flatten().long())  # of values not followed, without minlength
    (y.sum() + counts.sum()).backward()
    opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize("command", [["track"], ["advise", "--budget", "24GiB"]], ids=["track", "advise"])
@pytest.mark.parametrize("source, says", [
    (CPU_ONLY, "memprof: error: Linear trains on the cpu, not on the simulated GPU"),
    (VALUE_SHAPED, "memprof: error: the script raised UnknownValues: aten.bincount makes an output whose shape depends"),
], ids=["model-on-the-cpu", "boolean-mask"])
def test_what_cannot_be_simulated_is_one_line(tmp_path, command, source, says):
    script = tmp_path / "train.py"
    script.write_text(source)
    done = _memprof(tmp_path, command[0], str(script), "--target", "h200", *command[1:])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(says) and "Traceback" not in done.stderr
    if source is VALUE_SHAPED:
        assert lines[-1].endswith("(at train.py line 6); memprof could not observe a training step")


OPTIMIZER_FIRST = """\
import torch, torch.nn as nn

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.body = nn.Embedding(1000, 64), nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        return self.head(self.body(self.emb(x)))

model = LM()
opt = torch.optim.AdamW(model.parameters())  # made before the move, as Accelerate's prepare() moves the model
model.to("cuda")
assert opt.param_groups[0]["params"][0] is model.emb.weight is model.head.weight and model.emb.weight.is_cuda
for _ in range(4):
    x = torch.randint(0, 1000, (8, 16), device="cuda")
    nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step(); opt.zero_grad()
"""


def test_an_optimizer_made_before_the_move_holds_the_moved_parameters(tmp_path):
    """On a GPU ``model.to("cuda")`` keeps each Parameter object (it swaps ``.data``): the
    optimizer made before holds the model's parameters, the tied weight once: per Adam
    state 1000 x 64 x 4 + 64 x 64 x 4 bytes and the bias's 256 in a 512-byte block."""
    script = tmp_path / "train.py"
    script.write_text(OPTIMIZER_FIRST)
    out = tmp_path / "out.json"
    done = _memprof(tmp_path, "track", str(script), "--target", "h200", "--steps", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads(out.read_text())["optimizer_state"]
    assert state["exp_avg"] == state["exp_avg_sq"] == 1000 * 64 * 4 + 64 * 64 * 4 + 512


LESS_COMMON = """\
import torch, torch.nn as nn
torch.set_default_device("cuda")
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
torch.set_default_device("cpu")
opt = torch.optim.Adam(model.parameters(), capturable=True)
assert next(model.parameters()).is_cuda
for i in range(4):
    torch.cuda.nvtx.range_push("step")
    x = torch.randn(64, 256, device="cuda")
    with torch.cuda.amp.autocast(dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (64,), device="cuda"), label_smoothing=0.1)
    loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.nvtx.range_pop()
    print(f"step {i} loss {loss:.3f}")
"""


def test_less_common_cuda_calls(tmp_path):
    """A default CUDA device, capturable Adam, NVTX ranges, the deprecated autocast, label smoothing under fp16."""
    script = tmp_path / "train.py"
    script.write_text(LESS_COMMON)
    done = _memprof(tmp_path, "track", str(script), "--target", "a100-80gb", "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    # the model is small enough for its values to be followed: the loss is the real one, near ln(10)
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and all(2.0 < loss < 2.6 for loss in losses)  # memprof stops the script in step 3


PROFILED = """\
import torch, torch.nn as nn
from torch.profiler import profile, ProfilerActivity, schedule
model = nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
             schedule=schedule(wait=1, warmup=1, active=2)) as prof:
    for i in range(6):
        loss = model(torch.randn(64, 1024, device="cuda")).sum()
        loss.backward(); opt.step(); opt.zero_grad(); prof.step()
"""


def test_a_profiler_recording_cuda(tmp_path):
    """torch.profiler asked for CUDA activity on a simulated GPU: its C++ warned with a backtrace
    at every operator (17,000 lines for one Linear; advice on a larger script timed out)."""
    script = tmp_path / "train.py"
    script.write_text(PROFILED)
    done = _memprof(tmp_path, "track", str(script), "--target", "h200", "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CUDA" not in done.stderr and len(done.stderr.splitlines()) < 10, done.stderr[:3000]
