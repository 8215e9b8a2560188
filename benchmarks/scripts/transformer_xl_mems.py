# Transformer-XL language model, in the style of kimiyoung/transformer-xl (pytorch/mem_transformer.py,
# pytorch/train.py, pytorch/data_utils.py): MemTransformerLM with RelPartialLearnableMultiHeadAttn
# (r_w_bias / r_r_bias, _rel_shift by zero padding and view), a recurrence memory `mems` (one tensor per
# layer) carried from step to step detached, an LMOrderedIterator over a token stream, and
# NVIDIA DeepLearningExamples' fp16 habits (torch.cuda.amp autocast + GradScaler, clipping after unscale_).
"""
The model's forward is `model(data, target, *mems)` and returns `[loss] + new_mems`; the training loop
keeps `mems = ret[1:]` for the next step and resets `mems = tuple()` at each epoch's start. Every
`--eval-interval` steps an evaluation pass runs in `model.eval()` under `torch.no_grad()` with a
different tgt_len / mem_len (`model.reset_length`), as train.py's evaluate() does.

Data is random: a token stream of --n-tokens-data tokens of a --n-token vocabulary.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------------------- data_utils.py
class LMOrderedIterator(object):
    def __init__(self, data, bsz, bptt, device='cpu', ext_len=None):
        """data -- LongTensor -- the LongTensor is strictly ordered"""
        self.bsz = bsz
        self.bptt = bptt
        self.ext_len = ext_len if ext_len is not None else 0
        self.device = device
        # Work out how cleanly we can divide the dataset into bsz parts.
        self.n_step = data.size(0) // bsz
        # Trim off any extra elements that wouldn't cleanly fit (remainders).
        data = data.narrow(0, 0, self.n_step * bsz)
        # Evenly divide the data across the bsz batches.
        self.data = data.view(bsz, -1).t().contiguous().to(device)
        # Number of mini-batches
        self.n_batch = (self.n_step + self.bptt - 1) // self.bptt

    def get_batch(self, i, bptt=None):
        if bptt is None:
            bptt = self.bptt
        seq_len = min(bptt, self.data.size(0) - 1 - i)
        end_idx = i + seq_len
        beg_idx = max(0, i - self.ext_len)
        data = self.data[beg_idx:end_idx]
        target = self.data[i + 1:i + 1 + seq_len]
        return data, target, seq_len

    def get_fixlen_iter(self, start=0):
        for i in range(start, self.data.size(0) - 1, self.bptt):
            yield self.get_batch(i)

    def __iter__(self):
        return self.get_fixlen_iter()


# ---------------------------------------------------------------------------------- mem_transformer.py
class PositionalEmbedding(nn.Module):
    def __init__(self, demb):
        super(PositionalEmbedding, self).__init__()
        self.demb = demb
        inv_freq = 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, pos_seq, bsz=None):
        sinusoid_inp = torch.ger(pos_seq, self.inv_freq)
        pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)
        if bsz is not None:
            return pos_emb[:, None, :].expand(-1, bsz, -1)
        else:
            return pos_emb[:, None, :]


class PositionwiseFF(nn.Module):
    def __init__(self, d_model, d_inner, dropout, pre_lnorm=False):
        super(PositionwiseFF, self).__init__()
        self.d_model = d_model
        self.d_inner = d_inner
        self.dropout = dropout
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner), nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(d_inner, d_model),
            nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.pre_lnorm = pre_lnorm

    def forward(self, inp):
        if self.pre_lnorm:
            core_out = self.CoreNet(self.layer_norm(inp))
            output = core_out + inp
        else:
            core_out = self.CoreNet(inp)
            output = self.layer_norm(inp + core_out)
        return output


class RelMultiHeadAttn(nn.Module):
    def __init__(self, n_head, d_model, d_head, dropout, dropatt=0,
                 tgt_len=None, ext_len=None, mem_len=None, pre_lnorm=False):
        super(RelMultiHeadAttn, self).__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.d_head = d_head
        self.dropout = dropout
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head ** 0.5)
        self.pre_lnorm = pre_lnorm

    def _rel_shift(self, x, zero_triu=False):
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1)
        x_padded = x_padded.view(x.size(1) + 1, x.size(0), *x.size()[2:])
        x = x_padded[1:].view_as(x)
        if zero_triu:
            ones = torch.ones((x.size(0), x.size(1)))
            x = x * torch.tril(ones, x.size(1) - x.size(0))[:, :, None, None]
        return x

    def forward(self, w, r, attn_mask=None, mems=None):
        raise NotImplementedError


class RelPartialLearnableMultiHeadAttn(RelMultiHeadAttn):
    def __init__(self, *args, **kwargs):
        super(RelPartialLearnableMultiHeadAttn, self).__init__(*args, **kwargs)
        self.r_net = nn.Linear(self.d_model, self.n_head * self.d_head, bias=False)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask=None, mems=None):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        if mems is not None:
            cat = torch.cat([mems, w], 0)
            if self.pre_lnorm:
                w_heads = self.qkv_net(self.layer_norm(cat))
            else:
                w_heads = self.qkv_net(cat)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
            w_head_q = w_head_q[-qlen:]
        else:
            if self.pre_lnorm:
                w_heads = self.qkv_net(self.layer_norm(w))
            else:
                w_heads = self.qkv_net(w)
            r_head_k = self.r_net(r)
            w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
        klen = w_head_k.size(0)

        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)  # qlen x bsz x n_head x d_head
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)  # qlen x bsz x n_head x d_head
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)  # qlen x bsz x n_head x d_head
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)       # qlen x n_head x d_head

        #### compute attention score
        rw_head_q = w_head_q + r_w_bias                                  # qlen x bsz x n_head x d_head
        AC = torch.einsum('ibnd,jbnd->ijbn', (rw_head_q, w_head_k))      # qlen x klen x bsz x n_head
        rr_head_q = w_head_q + r_r_bias
        BD = torch.einsum('ibnd,jnd->ijbn', (rr_head_q, r_head_k))       # qlen x klen x bsz x n_head
        BD = self._rel_shift(BD)

        # [qlen x klen x bsz x n_head]
        attn_score = AC + BD
        attn_score.mul_(self.scale)

        #### compute attention probability
        if attn_mask is not None and attn_mask.any().item():
            if attn_mask.dim() == 2:
                attn_score = attn_score.float().masked_fill(
                    attn_mask[None, :, :, None], -float('inf')).type_as(attn_score)
            elif attn_mask.dim() == 3:
                attn_score = attn_score.float().masked_fill(
                    attn_mask[:, :, :, None], -float('inf')).type_as(attn_score)

        # [qlen x klen x bsz x n_head]
        attn_prob = F.softmax(attn_score, dim=1)
        attn_prob = self.dropatt(attn_prob)

        #### compute attention vector
        attn_vec = torch.einsum('ijbn,jbnd->ibnd', (attn_prob, w_head_v))

        # [qlen x bsz x n_head x d_head]
        attn_vec = attn_vec.contiguous().view(
            attn_vec.size(0), attn_vec.size(1), self.n_head * self.d_head)

        ##### linear projection
        attn_out = self.o_net(attn_vec)
        attn_out = self.drop(attn_out)

        if self.pre_lnorm:
            output = w + attn_out
        else:
            output = self.layer_norm(w + attn_out)
        return output


class RelPartialLearnableDecoderLayer(nn.Module):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, **kwargs):
        super(RelPartialLearnableDecoderLayer, self).__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head, dropout, **kwargs)
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout, pre_lnorm=kwargs.get('pre_lnorm'))

    def forward(self, dec_inp, r, r_w_bias, r_r_bias, dec_attn_mask=None, mems=None):
        output = self.dec_attn(dec_inp, r, r_w_bias, r_r_bias, attn_mask=dec_attn_mask, mems=mems)
        output = self.pos_ff(output)
        return output


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """The n_clusters == 0 path of the original (no cutoffs): one projection, one output layer."""

    def __init__(self, n_token, d_embed, d_proj):
        super(ProjectedAdaptiveLogSoftmax, self).__init__()
        self.n_token = n_token
        self.out_projs = nn.ParameterList()
        if d_proj != d_embed:
            self.out_projs.append(nn.Parameter(torch.Tensor(d_proj, d_embed)))
        else:
            self.out_projs.append(None)
        self.out_layers = nn.ModuleList([nn.Linear(d_embed, n_token)])

    def _compute_logit(self, hidden, weight, bias, proj):
        if proj is None:
            logit = F.linear(hidden, weight, bias=bias)
        else:
            proj_hid = F.linear(hidden, proj.t().contiguous())
            logit = F.linear(proj_hid, weight, bias=bias)
        return logit

    def forward(self, hidden, target, keep_order=False):
        if hidden.size(0) != target.size(0):
            raise RuntimeError('Input and target should have the same size in the batch dimension.')
        logit = self._compute_logit(hidden, self.out_layers[0].weight, self.out_layers[0].bias, self.out_projs[0])
        nll = -F.log_softmax(logit, dim=-1).gather(1, target.unsqueeze(1)).squeeze(1)
        return nll


class AdaptiveEmbedding(nn.Module):
    """div_val == 1, no cutoffs: one embedding, scaled by sqrt(d_proj)."""

    def __init__(self, n_token, d_embed, d_proj):
        super(AdaptiveEmbedding, self).__init__()
        self.n_token = n_token
        self.d_embed = d_embed
        self.d_proj = d_proj
        self.emb_scale = d_proj ** 0.5
        self.emb_layers = nn.ModuleList([nn.Embedding(n_token, d_embed)])
        self.emb_projs = nn.ParameterList()
        if d_proj != d_embed:
            self.emb_projs.append(nn.Parameter(torch.Tensor(d_proj, d_embed)))

    def forward(self, inp):
        embed = self.emb_layers[0](inp)
        if self.d_proj != self.d_embed:
            embed = F.linear(embed, self.emb_projs[0])
        embed.mul_(self.emb_scale)
        return embed


class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer, n_head, d_model, d_head, d_inner,
                 dropout, dropatt, tie_weight=True, d_embed=None,
                 pre_lnorm=False, tgt_len=None, ext_len=None, mem_len=None,
                 same_length=False, clamp_len=-1):
        super(MemTransformerLM, self).__init__()
        self.n_token = n_token
        d_embed = d_model if d_embed is None else d_embed
        self.d_embed = d_embed
        self.d_model = d_model
        self.n_head = n_head
        self.d_head = d_head
        self.word_emb = AdaptiveEmbedding(n_token, d_embed, d_model)
        self.drop = nn.Dropout(dropout)
        self.n_layer = n_layer
        self.tgt_len = tgt_len
        self.mem_len = mem_len
        self.ext_len = ext_len
        self.max_klen = tgt_len + ext_len + mem_len
        self.layers = nn.ModuleList()
        for i in range(n_layer):
            self.layers.append(
                RelPartialLearnableDecoderLayer(
                    n_head, d_model, d_head, d_inner, dropout,
                    tgt_len=tgt_len, ext_len=ext_len, mem_len=mem_len,
                    dropatt=dropatt, pre_lnorm=pre_lnorm)
            )
        self.crit = ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_model)
        if tie_weight:
            self.crit.out_layers[0].weight = self.word_emb.emb_layers[0].weight
        self.same_length = same_length
        self.clamp_len = clamp_len
        self._create_params()

    def _create_params(self):
        self.pos_emb = PositionalEmbedding(self.d_model)
        self.r_w_bias = nn.Parameter(torch.Tensor(self.n_head, self.d_head))
        self.r_r_bias = nn.Parameter(torch.Tensor(self.n_head, self.d_head))

    def reset_length(self, tgt_len, ext_len, mem_len):
        self.tgt_len = tgt_len
        self.mem_len = mem_len
        self.ext_len = ext_len

    def init_mems(self):
        if self.mem_len > 0:
            mems = []
            param = next(self.parameters())
            for i in range(self.n_layer + 1):
                empty = torch.empty(0, dtype=param.dtype, device=param.device)
                mems.append(empty)
            return mems
        else:
            return None

    def _update_mems(self, hids, mems, qlen, mlen):
        # does not deal with None
        if mems is None:
            return None
        # mems is not None
        assert len(hids) == len(mems), 'len(hids) != len(mems)'
        # There are `mlen + qlen` steps that can be cached into mems
        # For the next step, the last `ext_len` of the `qlen` tokens
        # will be used as the extended context. Hence, we only cache
        # the tokens from `mlen + qlen - self.ext_len - self.mem_len`
        # to `mlen + qlen - self.ext_len`.
        with torch.no_grad():
            new_mems = []
            end_idx = mlen + max(0, qlen - 0 - self.ext_len)
            beg_idx = max(0, end_idx - self.mem_len)
            for i in range(len(hids)):
                cat = torch.cat([mems[i], hids[i]], dim=0)
                new_mems.append(cat[beg_idx:end_idx].detach())
        return new_mems

    def _forward(self, dec_inp, mems=None):
        qlen, bsz = dec_inp.size()
        word_emb = self.word_emb(dec_inp)
        mlen = mems[0].size(0) if mems is not None else 0
        klen = mlen + qlen
        if self.same_length:
            all_ones = word_emb.new_ones(qlen, klen)
            mask_len = klen - self.mem_len
            if mask_len > 0:
                mask_shift_len = qlen - mask_len
            else:
                mask_shift_len = qlen
            dec_attn_mask = (torch.triu(all_ones, 1 + mlen)
                             + torch.tril(all_ones, -mask_shift_len)).bool()[:, :, None]  # -1
        else:
            dec_attn_mask = torch.triu(
                word_emb.new_ones(qlen, klen), diagonal=1 + mlen).bool()[:, :, None]

        hids = []
        pos_seq = torch.arange(klen - 1, -1, -1.0, device=word_emb.device, dtype=word_emb.dtype)
        if self.clamp_len > 0:
            pos_seq.clamp_(max=self.clamp_len)
        pos_emb = self.pos_emb(pos_seq)

        core_out = self.drop(word_emb)
        pos_emb = self.drop(pos_emb)

        hids.append(core_out)
        for i, layer in enumerate(self.layers):
            mems_i = None if mems is None else mems[i]
            core_out = layer(core_out, pos_emb, self.r_w_bias, self.r_r_bias,
                             dec_attn_mask=dec_attn_mask, mems=mems_i)
            hids.append(core_out)

        core_out = self.drop(core_out)
        new_mems = self._update_mems(hids, mems, mlen, qlen)
        return core_out, new_mems

    def forward(self, data, target, *mems):
        # nn.DataParallel does not allow size(0) tensors to be broadcasted.
        # So, have to initialize size(0) mems inside the model forward.
        # Moreover, have to return new_mems to allow nn.DataParallel to piece
        # them together.
        if not mems:
            mems = self.init_mems()
        tgt_len = target.size(0)
        hidden, new_mems = self._forward(data, mems=mems)
        pred_hid = hidden[-tgt_len:]
        loss = self.crit(pred_hid.reshape(-1, pred_hid.size(-1)), target.reshape(-1))
        loss = loss.view(tgt_len, -1)
        if new_mems is None:
            return [loss]
        else:
            return [loss] + new_mems


def weights_init(m, init_std=0.02, proj_init_std=0.01):
    classname = m.__class__.__name__
    if classname.find('Linear') != -1:
        if hasattr(m, 'weight') and m.weight is not None:
            nn.init.normal_(m.weight, 0.0, init_std)
        if hasattr(m, 'bias') and m.bias is not None:
            nn.init.constant_(m.bias, 0.0)
    elif classname.find('AdaptiveEmbedding') != -1:
        if hasattr(m, 'emb_projs'):
            for i in range(len(m.emb_projs)):
                if m.emb_projs[i] is not None:
                    nn.init.normal_(m.emb_projs[i], 0.0, proj_init_std)
    elif classname.find('Embedding') != -1:
        if hasattr(m, 'weight'):
            nn.init.normal_(m.weight, 0.0, init_std)
    elif classname.find('LayerNorm') != -1:
        if hasattr(m, 'weight'):
            nn.init.normal_(m.weight, 1.0, init_std)
        if hasattr(m, 'bias') and m.bias is not None:
            nn.init.constant_(m.bias, 0.0)
    elif classname.find('TransformerLM') != -1:
        if hasattr(m, 'r_w_bias'):
            nn.init.normal_(m.r_w_bias, 0.0, init_std)
        if hasattr(m, 'r_r_bias'):
            nn.init.normal_(m.r_r_bias, 0.0, init_std)


# --------------------------------------------------------------------------------------------- train.py
def get_args():
    p = argparse.ArgumentParser(description='PyTorch Transformer Language Model (transformer-xl style)')
    p.add_argument('--device', default='cuda')
    p.add_argument('--n_token', '--n-token', type=int, default=10000)
    p.add_argument('--n-tokens-data', type=int, default=200000, help='length of the random token stream')
    p.add_argument('--n_layer', '--n-layer', type=int, default=4)
    p.add_argument('--n_head', '--n-head', type=int, default=4)
    p.add_argument('--d_head', '--d-head', type=int, default=32)
    p.add_argument('--d_model', '--d-model', type=int, default=128)
    p.add_argument('--d_inner', '--d-inner', type=int, default=512)
    p.add_argument('--dropout', type=float, default=0.1)
    p.add_argument('--dropatt', type=float, default=0.0)
    p.add_argument('--lr', type=float, default=0.00025)
    p.add_argument('--eta_min', type=float, default=0.0)
    p.add_argument('--clip', type=float, default=0.25)
    p.add_argument('--warmup_step', type=int, default=0)
    p.add_argument('--batch_size', '--batch-size', type=int, default=8)
    p.add_argument('--tgt_len', '--tgt-len', type=int, default=64)
    p.add_argument('--eval_tgt_len', '--eval-tgt-len', type=int, default=32)
    p.add_argument('--ext_len', type=int, default=0)
    p.add_argument('--mem_len', '--mem-len', type=int, default=64)
    p.add_argument('--clamp_len', type=int, default=-1)
    p.add_argument('--pre_lnorm', action='store_true')
    p.add_argument('--max_step', '--max-step', type=int, default=1000, help='cosine schedule length')
    p.add_argument('--max-steps', type=int, default=8, help='stop after this many optimizer steps')
    p.add_argument('--epochs', type=int, default=2)
    p.add_argument('--steps-per-epoch', type=int, default=4, help='truncate each epoch (the stream is long)')
    p.add_argument('--eval-interval', type=int, default=3)
    p.add_argument('--max_eval_steps', type=int, default=2)
    p.add_argument('--fp16', action=argparse.BooleanOptionalAction, default=True)
    return p.parse_args()


def main():
    args = get_args()
    torch.manual_seed(1111)
    device = torch.device(args.device)
    use_amp = args.fp16 and device.type == 'cuda'

    stream = torch.randint(0, args.n_token, (args.n_tokens_data,), dtype=torch.long)
    n_val = args.n_tokens_data // 10
    tr_iter = LMOrderedIterator(stream[n_val:], args.batch_size, args.tgt_len, device=device, ext_len=args.ext_len)
    va_iter = LMOrderedIterator(stream[:n_val], args.batch_size, args.eval_tgt_len, device=device,
                                ext_len=args.ext_len)

    model = MemTransformerLM(args.n_token, args.n_layer, args.n_head, args.d_model, args.d_head, args.d_inner,
                             args.dropout, args.dropatt, tie_weight=True, d_embed=args.d_model,
                             pre_lnorm=args.pre_lnorm, tgt_len=args.tgt_len, ext_len=args.ext_len,
                             mem_len=args.mem_len, clamp_len=args.clamp_len)
    model.apply(weights_init)
    model.word_emb.apply(weights_init)  # ensure embedding init is not overridden by out_layer in case of weight sharing
    model = model.to(device)
    args.n_all_param = sum([p.nelement() for p in model.parameters()])
    print('#params = {}'.format(args.n_all_param))

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.max_step, eta_min=args.eta_min)
    scaler = torch.cuda.amp.GradScaler(enabled=use_amp)

    def evaluate(eval_iter):
        # Turn on evaluation mode which disables dropout.
        model.eval()
        # If the model does not use memory at all, make the ext_len longer.
        # Otherwise, make the mem_len longer and keep the ext_len the same.
        if args.mem_len == 0:
            model.reset_length(args.eval_tgt_len, args.ext_len + args.tgt_len - args.eval_tgt_len, args.mem_len)
        else:
            model.reset_length(args.eval_tgt_len, args.ext_len, args.mem_len + args.tgt_len - args.eval_tgt_len)
        total_len, total_loss = 0, 0.
        with torch.no_grad():
            mems = tuple()
            for i, (data, target, seq_len) in enumerate(eval_iter):
                if args.max_eval_steps > 0 and i >= args.max_eval_steps:
                    break
                with torch.cuda.amp.autocast(enabled=use_amp):
                    ret = model(data, target, *mems)
                loss, mems = ret[0], ret[1:]
                loss = loss.mean()
                total_loss += seq_len * loss.float().item()
                total_len += seq_len
        # Switch back to the training mode
        model.reset_length(args.tgt_len, args.ext_len, args.mem_len)
        model.train()
        return total_loss / total_len

    train_step = 0
    log_start = time.time()
    done = False
    for epoch in range(1, args.epochs + 1):
        model.train()
        mems = tuple()
        train_loss = 0.
        for batch, (data, target, seq_len) in enumerate(tr_iter):
            if batch >= args.steps_per_epoch:
                break
            model.zero_grad()
            with torch.cuda.amp.autocast(enabled=use_amp):
                ret = model(data, target, *mems)
                loss, mems = ret[0], ret[1:]
                loss = loss.float().mean().type_as(loss)
            scaler.scale(loss).backward()
            train_loss += loss.float().item()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()

            # step-wise learning rate annealing
            train_step += 1
            if train_step < args.warmup_step:
                curr_lr = args.lr * train_step / args.warmup_step
                optimizer.param_groups[0]['lr'] = curr_lr
            else:
                scheduler.step()

            print('| epoch {:3d} step {:>6d} | {:>3d} batches | lr {:.3g} | ms/batch {:5.2f} | loss {:5.2f} '
                  '| mems {} x {}'.format(epoch, train_step, batch + 1, optimizer.param_groups[0]['lr'],
                                          (time.time() - log_start) * 1000, train_loss / (batch + 1),
                                          len(mems), tuple(mems[0].shape)))
            log_start = time.time()

            if train_step % args.eval_interval == 0:
                val_loss = evaluate(va_iter)
                print('| Eval at step {:>8d} | valid loss {:5.2f} | valid ppl {:9.3f}'.format(
                    train_step, val_loss, math.exp(min(val_loss, 50))))

            if train_step >= args.max_steps:
                done = True
                break
        if done:
            break

    if device.type == 'cuda':
        print('max memory allocated: %.1f MiB' % (torch.cuda.max_memory_allocated() / 2**20))


if __name__ == '__main__':
    main()
