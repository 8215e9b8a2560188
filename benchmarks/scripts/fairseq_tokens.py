# fairseq-style translation (transformer_wmt_en_de pre-norm, --max-tokens batches, label_smoothed_cross_entropy, --fp16 FP16Optimizer) without fairseq
import argparse
import contextlib
import logging
import math
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

logging.basicConfig(
    format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
    datefmt="%Y-%m-%d %H:%M:%S",
    level=logging.INFO,
)
logger = logging.getLogger("fairseq_cli.train")


# ----------------------------------------------------------------------------
# utils


def make_positions(tensor, padding_idx: int):
    """Replace non-padding symbols with their position numbers.

    Position numbers begin at padding_idx+1. Padding symbols are ignored.
    """
    # The series of casts and type-conversions here are carefully
    # balanced to both work with ONNX export and XLA.
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


@contextlib.contextmanager
def numpy_seed(seed, *addl_seeds):
    """Context manager which seeds the NumPy PRNG with the specified seed and
    restores the state afterward"""
    if seed is None:
        yield
        return
    if len(addl_seeds) > 0:
        seed = int(hash((seed, *addl_seeds)) % 1e6)
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf."""
    return t.float().fill_(float("-inf")).type_as(t)


def log_softmax(x, dim: int):
    return F.log_softmax(x.float(), dim=dim, dtype=torch.float32)


def move_to_cuda(sample, device=None):
    device = device or torch.cuda.current_device()

    def _move_to_cuda(tensor):
        return tensor.to(device=device, non_blocking=True)

    return apply_to_sample(_move_to_cuda, sample)


def apply_to_sample(f, sample):
    if hasattr(sample, "__len__") and len(sample) == 0:
        return {}

    def _apply(x):
        if torch.is_tensor(x):
            return f(x)
        elif isinstance(x, dict):
            return {key: _apply(value) for key, value in x.items()}
        elif isinstance(x, list):
            return [_apply(x) for x in x]
        elif isinstance(x, tuple):
            return tuple(_apply(x) for x in x)
        else:
            return x

    return _apply(sample)


def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None) -> torch.Tensor:
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if len(grads) == 0:
        if len(params) > 0:
            return params[0].new_tensor(0.0)
        else:
            return torch.tensor(0.0)

    if len(grads) == 1:
        total_norm = torch.norm(grads[0], p=2, dtype=torch.float32)
    else:
        device = grads[0].device
        total_norm = torch.norm(
            torch.stack([torch.norm(g, p=2, dtype=torch.float32).to(device) for g in grads])
        )

    if aggregate_norm_fn is not None:
        total_norm = aggregate_norm_fn(total_norm)

    if max_norm > 0:
        max_norm = float(max_norm)
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp_(max=1)
        for g in grads:
            g.mul_(clip_coef.to(g.device))
    return total_norm


# ----------------------------------------------------------------------------
# data: a LanguagePairDataset of random sentences, batched by --max-tokens


class Dictionary:
    def __init__(self, size, bos="<s>", pad="<pad>", eos="</s>", unk="<unk>"):
        self.bos_index, self.pad_index, self.eos_index, self.unk_index = 0, 1, 2, 3
        self.nspecial = 4
        self.size = size

    def pad_to_multiple_(self, padding_factor):
        if padding_factor > 1:
            self.size = ((self.size + padding_factor - 1) // padding_factor) * padding_factor

    def __len__(self):
        return self.size

    def pad(self):
        return self.pad_index

    def eos(self):
        return self.eos_index

    def bos(self):
        return self.bos_index


def collate_tokens(values, pad_idx, eos_idx=None, left_pad=False, move_eos_to_beginning=False, pad_to_multiple=1):
    """Convert a list of 1d tensors into a padded 2d tensor."""
    size = max(v.size(0) for v in values)
    size = size if pad_to_multiple == 1 else int(((size - 0.1) // pad_to_multiple + 1) * pad_to_multiple)
    res = values[0].new(len(values), size).fill_(pad_idx)

    def copy_tensor(src, dst):
        assert dst.numel() == src.numel()
        if move_eos_to_beginning:
            if eos_idx is None:
                # if no eos_idx is specified, then use the last token in src
                dst[0] = src[-1]
            else:
                dst[0] = eos_idx
            dst[1:] = src[:-1]
        else:
            dst.copy_(src)

    for i, v in enumerate(values):
        copy_tensor(v, res[i][size - len(v):] if left_pad else res[i][: len(v)])
    return res


class RandomLanguagePairDataset:
    """Stands in for an indexed binarized language pair: token ids are drawn per index."""

    def __init__(self, num_sentences, dictionary, max_source_positions=1024, max_target_positions=1024, seed=1,
                 left_pad_source=True, left_pad_target=False):
        rng = np.random.RandomState(seed)
        self.src_dict = self.tgt_dict = dictionary
        src_sizes = np.exp(rng.normal(3.2, 0.6, size=num_sentences)).astype(np.int64)
        self.src_sizes = np.clip(src_sizes, 2, max_source_positions - 1)
        ratio = np.exp(rng.normal(0.05, 0.15, size=num_sentences))
        self.tgt_sizes = np.clip((self.src_sizes * ratio).astype(np.int64), 2, max_target_positions - 1)
        self.seed = seed
        self.left_pad_source = left_pad_source
        self.left_pad_target = left_pad_target

    def __len__(self):
        return len(self.src_sizes)

    def __getitem__(self, index):
        rng = np.random.RandomState((self.seed * 1000003 + index) % 2**32)
        nspecial, vocab = self.src_dict.nspecial, len(self.src_dict)
        src = rng.randint(nspecial, vocab, size=self.src_sizes[index])
        tgt = rng.randint(nspecial, vocab, size=self.tgt_sizes[index])
        src[-1] = tgt[-1] = self.src_dict.eos()
        return {"id": index, "source": torch.from_numpy(src), "target": torch.from_numpy(tgt)}

    def num_tokens(self, index):
        return max(self.src_sizes[index], self.tgt_sizes[index])

    def ordered_indices(self, shuffle=True):
        if shuffle:
            indices = np.random.permutation(len(self)).astype(np.int64)
        else:
            indices = np.arange(len(self), dtype=np.int64)
        # sort by target length, then source length
        indices = indices[np.argsort(self.tgt_sizes[indices], kind="mergesort")]
        return indices[np.argsort(self.src_sizes[indices], kind="mergesort")]

    def collater(self, samples):
        if len(samples) == 0:
            return {}
        pad_idx, eos_idx = self.src_dict.pad(), self.src_dict.eos()

        def merge(key, left_pad, move_eos_to_beginning=False):
            return collate_tokens([s[key] for s in samples], pad_idx, eos_idx, left_pad, move_eos_to_beginning)

        id = torch.LongTensor([s["id"] for s in samples])
        src_tokens = merge("source", left_pad=self.left_pad_source)
        # sort by descending source length
        src_lengths = torch.LongTensor([s["source"].ne(pad_idx).long().sum() for s in samples])
        src_lengths, sort_order = src_lengths.sort(descending=True)
        id = id.index_select(0, sort_order)
        src_tokens = src_tokens.index_select(0, sort_order)

        target = merge("target", left_pad=self.left_pad_target)
        target = target.index_select(0, sort_order)
        tgt_lengths = torch.LongTensor([s["target"].ne(pad_idx).long().sum() for s in samples]).index_select(0, sort_order)
        ntokens = tgt_lengths.sum().item()

        # we create a shifted version of targets for feeding the
        # previous output token(s) into the next decoder step
        prev_output_tokens = merge("target", left_pad=self.left_pad_target, move_eos_to_beginning=True)
        prev_output_tokens = prev_output_tokens.index_select(0, sort_order)

        return {
            "id": id,
            "nsentences": len(samples),
            "ntokens": ntokens,
            "net_input": {
                "src_tokens": src_tokens,
                "src_lengths": src_lengths,
                "prev_output_tokens": prev_output_tokens,
            },
            "target": target,
        }


def batch_by_size(indices, num_tokens_fn, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
    """
    Yield mini-batches of indices bucketed by size. Batches may contain
    sequences of different lengths.
    """
    max_tokens = max_tokens if max_tokens is not None else -1
    max_sentences = max_sentences if max_sentences is not None else -1
    bsz_mult = required_batch_size_multiple

    def is_batch_full(batch, num_tokens):
        if len(batch) == 0:
            return False
        if max_sentences > 0 and len(batch) == max_sentences:
            return True
        if max_tokens > 0 and num_tokens > max_tokens:
            return True
        return False

    batches = []
    batch = []
    sample_len = 0
    sample_lens = []
    for idx in indices:
        sample_lens.append(num_tokens_fn(idx))
        sample_len = max(sample_len, sample_lens[-1])
        assert max_tokens <= 0 or sample_len <= max_tokens, (
            f"sentence at index {idx} of size {sample_len} exceeds max_tokens limit of {max_tokens}!"
        )
        num_tokens = (len(batch) + 1) * sample_len
        if is_batch_full(batch, num_tokens):
            mod_len = max(bsz_mult * (len(batch) // bsz_mult), len(batch) % bsz_mult)
            batches.append(batch[:mod_len])
            batch = batch[mod_len:]
            sample_lens = sample_lens[mod_len:]
            sample_len = max(sample_lens) if len(sample_lens) > 0 else 0
        batch.append(idx)
    if len(batch) > 0:
        batches.append(batch)
    return batches


class EpochBatchIterator:
    def __init__(self, dataset, batch_sampler, seed=1):
        self.dataset = dataset
        self.frozen_batches = batch_sampler
        self.seed = seed
        self.epoch = 1

    def next_epoch_itr(self, shuffle=True):
        batches = list(self.frozen_batches)
        if shuffle:
            with numpy_seed(self.seed + self.epoch):
                np.random.shuffle(batches)
        self.epoch += 1
        for batch in batches:
            yield self.dataset.collater([self.dataset[i] for i in batch])


class GroupedIterator:
    def __init__(self, iterable, chunk_size):
        self.itr = iterable
        self.chunk_size = chunk_size

    def __iter__(self):
        chunk = []
        for x in self.itr:
            chunk.append(x)
            if len(chunk) == self.chunk_size:
                yield chunk
                chunk = []
        if len(chunk) > 0:
            yield chunk


# ----------------------------------------------------------------------------
# modules


class SinusoidalPositionalEmbedding(nn.Module):
    """This module produces sinusoidal positional embeddings of any length.

    Padding symbols are ignored.
    """

    def __init__(self, embedding_dim, padding_idx, init_size=1024):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx if padding_idx is not None else 0
        self.weights = SinusoidalPositionalEmbedding.get_embedding(init_size, embedding_dim, padding_idx)
        self.register_buffer("_float_tensor", torch.FloatTensor(1))
        self.max_positions = int(1e5)

    @staticmethod
    def get_embedding(num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None):
        """Build sinusoidal embeddings.

        This matches the implementation in tensor2tensor, but differs slightly
        from the description in Section 3.5 of "Attention Is All You Need".
        """
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        if embedding_dim % 2 == 1:
            # zero pad
            emb = torch.cat([emb, torch.zeros(num_embeddings, 1)], dim=1)
        if padding_idx is not None:
            emb[padding_idx, :] = 0
        return emb

    def forward(self, input):
        bsz, seq_len = input.shape
        max_pos = self.padding_idx + 1 + seq_len
        if self.weights is None or max_pos > self.weights.size(0):
            # recompute/expand embeddings if needed
            self.weights = SinusoidalPositionalEmbedding.get_embedding(max_pos, self.embedding_dim, self.padding_idx)
        self.weights = self.weights.to(self._float_tensor)

        positions = make_positions(input, self.padding_idx)
        return self.weights.index_select(0, positions.view(-1)).view(bsz, seq_len, -1).detach()


def Embedding(num_embeddings, embedding_dim, padding_idx):
    m = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
    nn.init.normal_(m.weight, mean=0, std=embedding_dim ** -0.5)
    nn.init.constant_(m.weight[padding_idx], 0)
    return m


def Linear(in_features, out_features, bias=True):
    m = nn.Linear(in_features, out_features, bias)
    nn.init.xavier_uniform_(m.weight)
    if bias:
        nn.init.constant_(m.bias, 0.0)
    return m


def LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True):
    return torch.nn.LayerNorm(normalized_shape, eps, elementwise_affine)


class FairseqDropout(nn.Module):
    def __init__(self, p, module_name=None):
        super().__init__()
        self.p = p
        self.module_name = module_name
        self.apply_during_inference = False

    def forward(self, x, inplace: bool = False):
        if self.p > 0 and (self.training or self.apply_during_inference):
            return F.dropout(x, p=self.p, training=True, inplace=inplace)
        else:
            return x


class MultiheadAttention(nn.Module):
    """Multi-headed attention.

    See "Attention Is All You Need" for more details.
    """

    def __init__(self, embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0, bias=True,
                 self_attention=False, encoder_decoder_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.qkv_same_dim = self.kdim == embed_dim and self.vdim == embed_dim

        self.num_heads = num_heads
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)

        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim, "embed_dim must be divisible by num_heads"
        self.scaling = self.head_dim ** -0.5

        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention

        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

        self.bias_k = self.bias_v = None
        self.add_zero_attn = False

        self.reset_parameters()

    def reset_parameters(self):
        if self.qkv_same_dim:
            # Empirically observed the convergence to be much better with
            # the scaled initialization
            nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
            nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
            nn.init.xavier_uniform_(self.q_proj.weight, gain=1 / math.sqrt(2))
        else:
            nn.init.xavier_uniform_(self.k_proj.weight)
            nn.init.xavier_uniform_(self.v_proj.weight)
            nn.init.xavier_uniform_(self.q_proj.weight)

        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)

    def forward(self, query, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None):
        """Input shape: Time x Batch x Channel"""
        tgt_len, bsz, embed_dim = query.size()
        assert embed_dim == self.embed_dim
        assert key is not None and value is not None
        return F.multi_head_attention_forward(
            query,
            key,
            value,
            self.embed_dim,
            self.num_heads,
            torch.empty([0]),
            torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)),
            self.bias_k,
            self.bias_v,
            self.add_zero_attn,
            self.dropout_module.p,
            self.out_proj.weight,
            self.out_proj.bias,
            self.training or self.dropout_module.apply_during_inference,
            key_padding_mask.bool() if key_padding_mask is not None else None,
            need_weights,
            attn_mask,
            use_separate_proj_weight=True,
            q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight,
        )


class TransformerEncoderLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_dim = args.encoder_embed_dim
        self.self_attn = MultiheadAttention(self.embed_dim, args.encoder_attention_heads,
                                            dropout=args.attention_dropout, self_attention=True)
        self.self_attn_layer_norm = LayerNorm(self.embed_dim)
        self.dropout_module = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.activation_fn = F.relu
        self.activation_dropout_module = FairseqDropout(float(args.activation_dropout), module_name=self.__class__.__name__)
        self.normalize_before = args.encoder_normalize_before
        self.fc1 = Linear(self.embed_dim, args.encoder_ffn_embed_dim)
        self.fc2 = Linear(args.encoder_ffn_embed_dim, self.embed_dim)
        self.final_layer_norm = LayerNorm(self.embed_dim)

    def residual_connection(self, x, residual):
        return residual + x

    def forward(self, x, encoder_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor] = None):
        if attn_mask is not None:
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)

        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(
            query=x,
            key=x,
            value=x,
            key_padding_mask=encoder_padding_mask,
            need_weights=False,
            attn_mask=attn_mask,
        )
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


class TransformerDecoderLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_dim = args.decoder_embed_dim
        self.dropout_module = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.self_attn = MultiheadAttention(self.embed_dim, args.decoder_attention_heads,
                                            dropout=args.attention_dropout, self_attention=True)
        self.activation_fn = F.relu
        self.activation_dropout_module = FairseqDropout(float(args.activation_dropout), module_name=self.__class__.__name__)
        self.normalize_before = args.decoder_normalize_before

        self.self_attn_layer_norm = LayerNorm(self.embed_dim)

        self.encoder_attn = MultiheadAttention(self.embed_dim, args.decoder_attention_heads,
                                               kdim=args.encoder_embed_dim, vdim=args.encoder_embed_dim,
                                               dropout=args.attention_dropout, encoder_decoder_attention=True)
        self.encoder_attn_layer_norm = LayerNorm(self.embed_dim)

        self.fc1 = Linear(self.embed_dim, args.decoder_ffn_embed_dim)
        self.fc2 = Linear(args.decoder_ffn_embed_dim, self.embed_dim)

        self.final_layer_norm = LayerNorm(self.embed_dim)
        self.need_attn = True

    def residual_connection(self, x, residual):
        return residual + x

    def forward(self, x, encoder_out: Optional[Tensor] = None, encoder_padding_mask: Optional[Tensor] = None,
                self_attn_mask: Optional[Tensor] = None, self_attn_padding_mask: Optional[Tensor] = None,
                need_attn: bool = False):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        y = x
        x, attn = self.self_attn(
            query=x,
            key=y,
            value=y,
            key_padding_mask=self_attn_padding_mask,
            need_weights=False,
            attn_mask=self_attn_mask,
        )
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        if self.encoder_attn is not None and encoder_out is not None:
            residual = x
            if self.normalize_before:
                x = self.encoder_attn_layer_norm(x)
            x, attn = self.encoder_attn(
                query=x,
                key=encoder_out,
                value=encoder_out,
                key_padding_mask=encoder_padding_mask,
                need_weights=need_attn or (not self.training and self.need_attn),
            )
            x = self.dropout_module(x)
            x = self.residual_connection(x, residual)
            if not self.normalize_before:
                x = self.encoder_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)

        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, attn, None


class TransformerEncoder(nn.Module):
    def __init__(self, args, dictionary, embed_tokens):
        super().__init__()
        self.dictionary = dictionary
        self.dropout_module = FairseqDropout(args.dropout, module_name=self.__class__.__name__)

        embed_dim = embed_tokens.embedding_dim
        self.padding_idx = embed_tokens.padding_idx
        self.max_source_positions = args.max_source_positions

        self.embed_tokens = embed_tokens
        self.embed_scale = 1.0 if args.no_scale_embedding else math.sqrt(embed_dim)

        self.embed_positions = SinusoidalPositionalEmbedding(
            embed_dim, self.padding_idx, init_size=args.max_source_positions + self.padding_idx + 1
        )

        self.layers = nn.ModuleList([TransformerEncoderLayer(args) for i in range(args.encoder_layers)])
        self.num_layers = len(self.layers)

        if args.encoder_normalize_before:
            self.layer_norm = LayerNorm(embed_dim)
        else:
            self.layer_norm = None

    def forward_embedding(self, src_tokens):
        # embed tokens and positions
        x = embed = self.embed_scale * self.embed_tokens(src_tokens)
        if self.embed_positions is not None:
            x = embed + self.embed_positions(src_tokens)
        x = self.dropout_module(x)
        return x, embed

    def forward(self, src_tokens, src_lengths: Optional[torch.Tensor] = None):
        # compute padding mask
        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        has_pads = encoder_padding_mask.any()

        x, encoder_embedding = self.forward_embedding(src_tokens)

        # account for padding while computing the representation
        if has_pads:
            x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        # encoder layers
        for layer in self.layers:
            x = layer(x, encoder_padding_mask=encoder_padding_mask if has_pads else None)

        if self.layer_norm is not None:
            x = self.layer_norm(x)

        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [encoder_padding_mask],  # B x T
            "encoder_embedding": [encoder_embedding],  # B x T x C
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }


class TransformerDecoder(nn.Module):
    def __init__(self, args, dictionary, embed_tokens):
        super().__init__()
        self.dictionary = dictionary
        self._future_mask = torch.empty(0)

        self.dropout_module = FairseqDropout(args.dropout, module_name=self.__class__.__name__)
        self.share_input_output_embed = args.share_decoder_input_output_embed

        input_embed_dim = embed_tokens.embedding_dim
        embed_dim = args.decoder_embed_dim
        self.embed_dim = embed_dim

        self.padding_idx = embed_tokens.padding_idx
        self.max_target_positions = args.max_target_positions

        self.embed_tokens = embed_tokens

        self.embed_scale = 1.0 if args.no_scale_embedding else math.sqrt(embed_dim)

        self.embed_positions = SinusoidalPositionalEmbedding(
            embed_dim, self.padding_idx, init_size=args.max_target_positions + self.padding_idx + 1
        )

        self.layers = nn.ModuleList([TransformerDecoderLayer(args) for _ in range(args.decoder_layers)])
        self.num_layers = len(self.layers)

        if args.decoder_normalize_before:
            self.layer_norm = LayerNorm(embed_dim)
        else:
            self.layer_norm = None

        if self.share_input_output_embed:
            self.output_projection = nn.Linear(
                self.embed_tokens.weight.shape[1],
                self.embed_tokens.weight.shape[0],
                bias=False,
            )
            self.output_projection.weight = self.embed_tokens.weight
        else:
            self.output_projection = nn.Linear(self.embed_dim, len(dictionary), bias=False)
            nn.init.normal_(self.output_projection.weight, mean=0, std=self.embed_dim ** -0.5)

    def forward(self, prev_output_tokens, encoder_out: Optional[Dict[str, List[Tensor]]] = None,
                features_only: bool = False, src_lengths: Optional[Any] = None):
        x, extra = self.extract_features(prev_output_tokens, encoder_out=encoder_out)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def extract_features(self, prev_output_tokens, encoder_out: Optional[Dict[str, List[Tensor]]]):
        bs, slen = prev_output_tokens.size()

        enc: Optional[Tensor] = None
        padding_mask: Optional[Tensor] = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        # embed positions
        positions = self.embed_positions(prev_output_tokens)

        # embed tokens and positions
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x += positions
        x = self.dropout_module(x)

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        self_attn_padding_mask: Optional[Tensor] = None
        if prev_output_tokens.eq(self.padding_idx).any():
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)

        # decoder layers
        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        for idx, layer in enumerate(self.layers):
            self_attn_mask = self.buffered_future_mask(x)

            x, layer_attn, _ = layer(
                x,
                enc,
                padding_mask,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
            )
            inner_states.append(x)

        if self.layer_norm is not None:
            x = self.layer_norm(x)

        # T x B x C -> B x T x C
        x = x.transpose(0, 1)

        return x, {"attn": [attn], "inner_states": inner_states}

    def output_layer(self, features):
        """Project features to the vocabulary size."""
        return self.output_projection(features)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        # self._future_mask.device != tensor.device is not working in TorchScript. This is a workaround.
        if (
            self._future_mask.size(0) == 0
            or (not self._future_mask.device == tensor.device)
            or self._future_mask.size(0) < dim
        ):
            self._future_mask = torch.triu(fill_with_neg_inf(torch.zeros([dim, dim])), 1)
        self._future_mask = self._future_mask.to(tensor)
        return self._future_mask[:dim, :dim]


class TransformerModel(nn.Module):
    def __init__(self, args, encoder, decoder):
        super().__init__()
        self.args = args
        self.encoder = encoder
        self.decoder = decoder

    @classmethod
    def build_model(cls, args, task):
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary

        def build_embedding(dictionary, embed_dim):
            num_embeddings = len(dictionary)
            padding_idx = dictionary.pad()
            return Embedding(num_embeddings, embed_dim, padding_idx)

        if args.share_all_embeddings:
            if src_dict != tgt_dict:
                raise ValueError("--share-all-embeddings requires a joined dictionary")
            encoder_embed_tokens = build_embedding(src_dict, args.encoder_embed_dim)
            decoder_embed_tokens = encoder_embed_tokens
            args.share_decoder_input_output_embed = True
        else:
            encoder_embed_tokens = build_embedding(src_dict, args.encoder_embed_dim)
            decoder_embed_tokens = build_embedding(tgt_dict, args.decoder_embed_dim)

        encoder = TransformerEncoder(args, src_dict, encoder_embed_tokens)
        decoder = TransformerDecoder(args, tgt_dict, decoder_embed_tokens)
        return cls(args, encoder, decoder)

    def forward(self, src_tokens, src_lengths, prev_output_tokens):
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        decoder_out = self.decoder(prev_output_tokens, encoder_out=encoder_out)
        return decoder_out

    def get_normalized_probs(self, net_output, log_probs: bool, sample=None):
        logits = net_output[0]
        if log_probs:
            return log_softmax(logits, dim=-1)
        else:
            return F.softmax(logits.float(), dim=-1)

    def get_targets(self, sample, net_output):
        return sample["target"]


# ----------------------------------------------------------------------------
# criterion


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=None, reduce=True):
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    else:
        nll_loss = nll_loss.squeeze(-1)
        smooth_loss = smooth_loss.squeeze(-1)
    if reduce:
        nll_loss = nll_loss.sum()
        smooth_loss = smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


class LabelSmoothedCrossEntropyCriterion(nn.Module):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0):
        super().__init__()
        self.task = task
        self.padding_idx = task.target_dictionary.pad()
        self.sentence_avg = sentence_avg
        self.eps = label_smoothing
        self.ignore_prefix_size = ignore_prefix_size

    def forward(self, model, sample, reduce=True):
        """Compute the loss for the given sample.

        Returns a tuple with three elements:
        1) the loss
        2) the sample size, which is used as the denominator for the gradient
        3) logging outputs to display while training
        """
        net_output = model(**sample["net_input"])
        loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    def get_lprobs_and_target(self, model, net_output, sample):
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = model.get_targets(sample, net_output)
        if self.ignore_prefix_size > 0:
            lprobs = lprobs[:, self.ignore_prefix_size:, :].contiguous()
            target = target[:, self.ignore_prefix_size:].contiguous()
        return lprobs.view(-1, lprobs.size(-1)), target.view(-1)

    def compute_loss(self, model, net_output, sample, reduce=True):
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        loss, nll_loss = label_smoothed_nll_loss(
            lprobs,
            target,
            self.eps,
            ignore_index=self.padding_idx,
            reduce=reduce,
        )
        return loss, nll_loss


# ----------------------------------------------------------------------------
# optim: fp16 with an fp32 master copy, dynamic loss scaling, inverse_sqrt


class DynamicLossScaler(object):
    def __init__(self, init_scale=2.0 ** 15, scale_factor=2.0, scale_window=2000, tolerance=0.0, threshold=None,
                 min_loss_scale=1e-4):
        self.loss_scale = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.tolerance = tolerance
        self.threshold = threshold
        self._iter = 0
        self._last_overflow_iter = -1
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0
        self.min_loss_scale = min_loss_scale

    def scale(self, outputs):
        return self.loss_scale * outputs

    def update(self):
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1

    def _decrease_loss_scale(self):
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def check_overflow(self, grad_norm):
        # detect inf and nan
        if grad_norm == float("inf") or grad_norm != grad_norm:
            # overflow has occured
            prev_scale = self.loss_scale
            iter_since_rescale = self._iter - self._last_rescale_iter

            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
            if pct_overflow >= self.tolerance:
                self._decrease_loss_scale()
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0

            if self.loss_scale <= self.min_loss_scale:
                # Use FloatingPointError as an uncommon error that parent
                # functions can safely catch to stop training.
                self.loss_scale = prev_scale
                raise FloatingPointError(
                    (
                        "Minimum loss scale reached ({}). Your loss is probably exploding. "
                        "Try lowering the learning rate, using gradient clipping or "
                        "increasing the batch size."
                    ).format(self.min_loss_scale)
                )

            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


class FairseqAdam:
    """torch.optim.Adam on the flat fp32 parameters, with fairseq's optimizer interface."""

    def __init__(self, args, params):
        self.args = args
        self._optimizer = torch.optim.Adam(
            params,
            lr=args.lr[0],
            betas=eval(args.adam_betas),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
        )

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def params(self):
        """Return an iterable of the parameters held by the optimizer."""
        for param_group in self.param_groups:
            for p in param_group["params"]:
                yield p

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_lr(self):
        return self.param_groups[0]["lr"]

    def set_lr(self, lr):
        for param_group in self.param_groups:
            param_group["lr"] = lr

    def backward(self, loss):
        """Computes the sum of gradients of the given tensor w.r.t. graph leaves."""
        loss.backward()

    def multiply_grads(self, c):
        """Multiplies grads by a constant *c*."""
        for p in self.params:
            if p.grad is not None:
                if torch.is_tensor(c):
                    c = c.to(p.grad.device)
                p.grad.data.mul_(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """Clips gradient norm."""
        return clip_grad_norm_(self.params, max_norm, aggregate_norm_fn)

    def step(self, closure=None):
        self.optimizer.step(closure)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()


class FP16Optimizer(object):
    """
    Wrap an *optimizer* to support FP16 (mixed precision) training.
    """

    def __init__(self, args, params, fp32_optimizer, fp32_params):
        self.fp16_params = params
        self.fp32_optimizer = fp32_optimizer
        self.fp32_params = fp32_params
        self._multiply_factor = 1.0
        self._needs_sync = False

        if getattr(args, "fp16_scale_window", None) is None:
            if len(args.update_freq) > 1:
                raise ValueError("--fp16-scale-window must be given explicitly when using a custom --update-freq schedule")
            data_parallel_size = int(args.distributed_world_size)
            scale_window = int(2 ** 14 / data_parallel_size / args.update_freq[0])
        else:
            scale_window = args.fp16_scale_window

        self.scaler = DynamicLossScaler(
            init_scale=args.fp16_init_scale,
            scale_window=scale_window,
            tolerance=args.fp16_scale_tolerance,
            threshold=args.threshold_loss_scale,
            min_loss_scale=args.min_loss_scale,
        )
        self.min_loss_scale = args.min_loss_scale

    @staticmethod
    def build_fp32_params(args, params, flatten=True):
        # create FP32 copy of parameters and grads
        assert flatten
        total_param_size = sum(p.data.numel() for p in params)
        fp32_params = params[0].new(0).float().new(total_param_size)
        offset = 0
        for p in params:
            numel = p.data.numel()
            fp32_params[offset: offset + numel].copy_(p.data.view(-1))
            offset += numel
        fp32_params = torch.nn.Parameter(fp32_params)
        fp32_params.grad = fp32_params.data.new(total_param_size)
        return fp32_params

    @classmethod
    def build_optimizer(cls, args, params):
        """
        Args:
            args (argparse.Namespace): fairseq args
            params (iterable): iterable of parameters to optimize
        """
        fp32_params = cls.build_fp32_params(args, params, flatten=True)
        fp32_optimizer = FairseqAdam(args, [fp32_params])
        return cls(args, params, fp32_optimizer, fp32_params)

    @property
    def optimizer(self):
        return self.fp32_optimizer.optimizer

    @property
    def param_groups(self):
        return self.fp32_optimizer.param_groups

    def get_lr(self):
        return self.fp32_optimizer.get_lr()

    def set_lr(self, lr):
        self.fp32_optimizer.set_lr(lr)

    def state_dict(self):
        """Return the optimizer's state dict."""
        state_dict = self.fp32_optimizer.optimizer.state_dict()
        if self.scaler is not None:
            state_dict["loss_scale"] = self.scaler.loss_scale
        return state_dict

    def backward(self, loss):
        """Computes the sum of gradients of the given tensor w.r.t. graph leaves.

        Compared to :func:`fairseq.optim.FairseqOptimizer.backward`, this
        function additionally dynamically scales the loss to avoid gradient
        underflow.
        """
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()
        self._needs_sync = True

    def _sync_fp16_grads_to_fp32(self):
        if self._needs_sync:
            # copy FP16 grads to FP32
            offset = 0
            for p in self.fp16_params:
                if not p.requires_grad:
                    continue
                grad_data = p.grad.data if p.grad is not None else p.data.new_zeros(p.data.shape)
                numel = grad_data.numel()
                self.fp32_params.grad.data[offset: offset + numel].copy_(grad_data.view(-1))
                offset += numel
            self._needs_sync = False

    def _sync_fp32_params_to_fp16(self):
        # copy FP32 params back into FP16 model
        offset = 0
        for p in self.fp16_params:
            if not p.requires_grad:
                continue
            numel = p.data.numel()
            p.data.copy_(self.fp32_params.data[offset: offset + numel].view_as(p.data))
            offset += numel

    def _unscale_grads(self):
        if torch.is_tensor(self._multiply_factor) or self._multiply_factor != 1.0:
            self.fp32_optimizer.multiply_grads(self._multiply_factor)
            self._multiply_factor = 1.0

    def multiply_grads(self, c):
        """Multiplies grads by a constant ``c``."""
        self._multiply_factor *= c

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """Clips gradient norm and updates dynamic loss scaler."""
        self._sync_fp16_grads_to_fp32()

        grad_norm = self._multiply_factor * self.fp32_optimizer.clip_grad_norm(0, aggregate_norm_fn)

        if self.scaler is not None:
            if grad_norm > max_norm > 0.0:
                self._multiply_factor *= max_norm / grad_norm

            self.scaler.check_overflow(grad_norm)
        elif max_norm > 0.0:
            clip_coef = (max_norm / (grad_norm + 1e-6)).clamp_(max=1)
            self._multiply_factor *= clip_coef

        return grad_norm

    def step(self, closure=None):
        """Performs a single optimization step."""
        self._sync_fp16_grads_to_fp32()
        self._unscale_grads()
        self.fp32_optimizer.step(closure)

        if self.scaler is not None:
            self.scaler.update()

        self._sync_fp32_params_to_fp16()

    def zero_grad(self):
        """Clears the gradients of all optimized parameters."""
        for p in self.fp16_params:
            p.grad = None
        self.fp32_params.grad.zero_()
        self._needs_sync = False

        if self.scaler is not None:
            self._multiply_factor = 1.0 / float(self.scaler.loss_scale)


class InverseSquareRootSchedule(object):
    """Decay the LR based on the inverse square root of the update number.

    We also support a warmup phase where we linearly increase the learning rate
    from some initial learning rate (``--warmup-init-lr``) until the configured
    learning rate (``--lr``). Thereafter we decay proportional to the number of
    updates, with a decay factor set to align with the configured learning rate.
    """

    def __init__(self, args, optimizer):
        self.args = args
        self.optimizer = optimizer
        warmup_end_lr = args.lr[0]
        if args.warmup_init_lr < 0:
            args.warmup_init_lr = 0 if args.warmup_updates > 0 else warmup_end_lr

        # linearly warmup for the first args.warmup_updates
        self.lr_step = (warmup_end_lr - args.warmup_init_lr) / args.warmup_updates

        # then, decay prop. to the inverse square root of the update number
        self.decay_factor = warmup_end_lr * args.warmup_updates ** 0.5

        # initial learning rate
        self.lr = args.warmup_init_lr
        self.optimizer.set_lr(self.lr)

    def step_update(self, num_updates):
        """Update the learning rate after each update."""
        if num_updates < self.args.warmup_updates:
            self.lr = self.args.warmup_init_lr + num_updates * self.lr_step
        else:
            self.lr = self.decay_factor * num_updates ** -0.5
        self.optimizer.set_lr(self.lr)
        return self.lr


# ----------------------------------------------------------------------------
# task and trainer


class TranslationTask:
    def __init__(self, args, src_dict, tgt_dict):
        self.args = args
        self.src_dict = src_dict
        self.tgt_dict = tgt_dict
        self.datasets = {}

    @classmethod
    def setup_task(cls, args):
        d = Dictionary(args.vocab_size)
        d.pad_to_multiple_(8)
        logger.info("[{}] dictionary: {} types".format(args.source_lang, len(d)))
        logger.info("[{}] dictionary: {} types".format(args.target_lang, len(d)))
        return cls(args, d, d)

    @property
    def source_dictionary(self):
        return self.src_dict

    @property
    def target_dictionary(self):
        return self.tgt_dict

    def load_dataset(self, split):
        self.datasets[split] = RandomLanguagePairDataset(
            self.args.num_sentences, self.src_dict,
            max_source_positions=self.args.max_source_positions,
            max_target_positions=self.args.max_target_positions,
            seed=self.args.seed,
        )
        logger.info("{} {} {}-{} {} examples".format("synthetic", split, self.args.source_lang, self.args.target_lang,
                                                      len(self.datasets[split])))

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, required_batch_size_multiple=1, seed=1):
        # get indices ordered by example size
        with numpy_seed(seed):
            indices = dataset.ordered_indices()

        # create mini-batches with given size constraints
        batch_sampler = batch_by_size(indices, dataset.num_tokens, max_tokens=max_tokens, max_sentences=max_sentences,
                                      required_batch_size_multiple=required_batch_size_multiple)
        return EpochBatchIterator(dataset, batch_sampler, seed=seed)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        model.train()
        loss, sample_size, logging_output = criterion(model, sample)
        if ignore_grad:
            loss *= 0
        optimizer.backward(loss)
        return loss, sample_size, logging_output

    def optimizer_step(self, optimizer, model, update_num):
        optimizer.step()


class Trainer(object):
    def __init__(self, args, task, model, criterion):
        self.args = args
        self.task = task
        self.device = torch.device(args.device)

        self._criterion = criterion
        self._model = model
        if args.fp16:
            self._criterion = self._criterion.half()
            self._model = self._model.half()
        self._criterion = self._criterion.to(device=self.device)
        self._model = self._model.to(device=self.device)

        self._num_updates = 0
        self._optimizer = None
        self._lr_scheduler = None

    @property
    def model(self):
        return self._model

    @property
    def criterion(self):
        return self._criterion

    @property
    def optimizer(self):
        if self._optimizer is None:
            self._build_optimizer()
        return self._optimizer

    @property
    def lr_scheduler(self):
        if self._lr_scheduler is None:
            self._build_optimizer()  # this will initialize self._lr_scheduler
        return self._lr_scheduler

    def _build_optimizer(self):
        params = list(filter(lambda p: p.requires_grad, list(self.model.parameters()) + list(self.criterion.parameters())))
        if self.args.fp16:
            self._optimizer = FP16Optimizer.build_optimizer(self.args, params)
        else:
            self._optimizer = FairseqAdam(self.args, params)
        self._lr_scheduler = InverseSquareRootSchedule(self.args, self.optimizer)
        self._lr_scheduler.step_update(0)

    def get_num_updates(self):
        return self._num_updates

    def set_num_updates(self, num_updates):
        self._num_updates = num_updates
        self.lr_scheduler.step_update(num_updates)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def _prepare_sample(self, sample):
        if sample is None or len(sample) == 0:
            return None
        if self.device.type == "cuda":
            sample = move_to_cuda(sample, self.device)
        return sample

    def clip_grad_norm(self, clip_norm):
        return self.optimizer.clip_grad_norm(clip_norm)

    def train_step(self, samples):
        """Do forward, backward and parameter update."""
        self.model.train()
        self.criterion.train()
        self.zero_grad()

        logging_outputs, sample_size = [], 0
        for i, sample in enumerate(samples):
            sample = self._prepare_sample(sample)
            loss, sample_size_i, logging_output = self.task.train_step(
                sample=sample,
                model=self.model,
                criterion=self.criterion,
                optimizer=self.optimizer,
                update_num=self.get_num_updates(),
            )
            del loss

            logging_outputs.append(logging_output)
            sample_size += sample_size_i

        overflow = False
        try:
            # multiply gradients by (data_parallel_size / sample_size) since
            # DDP normalizes by the number of data parallel workers for
            # improved fp16 precision.
            self.optimizer.multiply_grads(1.0 / (sample_size or 1.0))

            # clip grads
            grad_norm = self.clip_grad_norm(self.args.clip_norm)

            # take an optimization step
            self.task.optimizer_step(self.optimizer, model=self.model, update_num=self.get_num_updates())

        except OverflowError as e:
            overflow = True
            logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {str(e)}")
            grad_norm = torch.tensor(0.0, device=self.device)
            self.zero_grad()

        if not overflow:
            self.set_num_updates(self.get_num_updates() + 1)

        # log stats
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        nll_loss_sum = sum(log.get("nll_loss", 0) for log in logging_outputs)
        return {
            "loss": float(loss_sum) / sample_size / math.log(2) if sample_size else 0.0,
            "nll_loss": float(nll_loss_sum) / ntokens / math.log(2) if ntokens else 0.0,
            "ntokens": ntokens,
            "nsentences": sum(log.get("nsentences", 0) for log in logging_outputs),
            "gnorm": float(grad_norm),
            "loss_scale": self.optimizer.scaler.loss_scale if self.args.fp16 else None,
            "lr": self.optimizer.get_lr(),
        }


# ----------------------------------------------------------------------------


def base_architecture(args):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", 512)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", 2048)
    args.encoder_layers = getattr(args, "encoder_layers", 6)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 8)
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", False)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", args.encoder_embed_dim)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", args.encoder_ffn_embed_dim)
    args.decoder_layers = getattr(args, "decoder_layers", 6)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 8)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", False)
    args.attention_dropout = getattr(args, "attention_dropout", 0.0)
    args.activation_dropout = getattr(args, "activation_dropout", 0.0)
    args.dropout = getattr(args, "dropout", 0.1)
    args.share_decoder_input_output_embed = getattr(args, "share_decoder_input_output_embed", False)
    args.share_all_embeddings = getattr(args, "share_all_embeddings", False)
    args.no_scale_embedding = getattr(args, "no_scale_embedding", False)


def transformer_wmt_en_de(args):
    base_architecture(args)


def transformer_wmt_en_de_prenorm(args):
    args.encoder_normalize_before = True
    args.decoder_normalize_before = True
    base_architecture(args)


ARCH_CONFIG_REGISTRY = {
    "transformer_wmt_en_de": transformer_wmt_en_de,
    "transformer_wmt_en_de_prenorm": transformer_wmt_en_de_prenorm,
}


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", "-a", default="transformer_wmt_en_de_prenorm", choices=ARCH_CONFIG_REGISTRY.keys())
    parser.add_argument("--source-lang", "-s", default="de")
    parser.add_argument("--target-lang", "-t", default="en")
    parser.add_argument("--vocab-size", type=int, default=32000, help="joined dictionary size")
    parser.add_argument("--num-sentences", type=int, default=40000, help="sentence pairs in the synthetic train split")
    parser.add_argument("--max-source-positions", type=int, default=1024)
    parser.add_argument("--max-target-positions", type=int, default=1024)
    parser.add_argument("--share-all-embeddings", action="store_true", default=True)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--criterion", default="label_smoothed_cross_entropy")
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--sentence-avg", action="store_true")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--adam-betas", default="(0.9, 0.98)")
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--clip-norm", type=float, default=0.0)
    parser.add_argument("--lr", type=lambda s: [float(x) for x in s.split(",")], default=[5e-4])
    parser.add_argument("--lr-scheduler", default="inverse_sqrt")
    parser.add_argument("--warmup-updates", type=int, default=4000)
    parser.add_argument("--warmup-init-lr", type=float, default=1e-07)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--batch-size", "--max-sentences", type=int, default=None, dest="max_sentences")
    parser.add_argument("--required-batch-size-multiple", type=int, default=8)
    parser.add_argument("--update-freq", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    parser.add_argument("--max-update", type=int, default=8)
    parser.add_argument("--fp16", action="store_true", default=True)
    parser.add_argument("--no-fp16", action="store_false", dest="fp16")
    parser.add_argument("--fp16-init-scale", type=int, default=2 ** 7)
    parser.add_argument("--fp16-scale-window", type=int, default=None)
    parser.add_argument("--fp16-scale-tolerance", type=float, default=0.0)
    parser.add_argument("--min-loss-scale", type=float, default=1e-4)
    parser.add_argument("--threshold-loss-scale", type=float, default=None)
    parser.add_argument("--distributed-world-size", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    return parser


def main(args):
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    task = TranslationTask.setup_task(args)
    task.load_dataset("train")

    model = TransformerModel.build_model(args, task)
    criterion = LabelSmoothedCrossEntropyCriterion(task, args.sentence_avg, args.label_smoothing)
    logger.info("model: {}".format(model.__class__.__name__))
    logger.info("criterion: {}".format(criterion.__class__.__name__))
    logger.info(
        "num. model params: {:,} (num. trained: {:,})".format(
            sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.parameters() if p.requires_grad),
        )
    )

    trainer = Trainer(args, task, model, criterion)
    logger.info("max tokens per GPU = {} and max sentences per GPU = {}".format(args.max_tokens, args.max_sentences))

    epoch_itr = task.get_batch_iterator(
        task.datasets["train"],
        max_tokens=args.max_tokens,
        max_sentences=args.max_sentences,
        required_batch_size_multiple=args.required_batch_size_multiple,
        seed=args.seed,
    )

    lr = trainer.lr_scheduler.step_update(0)
    train_meter_start = time.time()
    while trainer.get_num_updates() < args.max_update:
        itr = GroupedIterator(epoch_itr.next_epoch_itr(shuffle=True), args.update_freq[0])
        for i, samples in enumerate(itr):
            log_output = trainer.train_step(samples)
            num_updates = trainer.get_num_updates()
            if num_updates % args.log_interval == 0:
                logger.info(
                    "epoch {:03d} | loss {:.3f} | nll_loss {:.3f} | ntokens {} | nsentences {} | gnorm {:.3f} | "
                    "loss_scale {} | lr {:.4g} | num_updates {}".format(
                        epoch_itr.epoch - 1, log_output["loss"], log_output["nll_loss"], log_output["ntokens"],
                        log_output["nsentences"], log_output["gnorm"], log_output["loss_scale"], log_output["lr"],
                        num_updates,
                    )
                )
            if num_updates >= args.max_update:
                break
    logger.info("done training in {:.1f} seconds".format(time.time() - train_meter_start))


def cli_main():
    parser = get_parser()
    args = parser.parse_args()
    ARCH_CONFIG_REGISTRY[args.arch](args)
    main(args)


if __name__ == "__main__":
    cli_main()
