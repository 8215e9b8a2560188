#!/usr/bin/env python
"""Knowledge-graph embedding training in the manner of DGL-KE / PyKEEN's simpler loops.

Entity and relation tables are ``nn.Embedding(..., sparse=True)`` trained with
``torch.optim.SparseAdam``; a small dense projection MLP (applied to the relation
embedding before scoring) is trained with a dense ``Adam``. Each step scores a batch
of positive triples against ``--neg-size`` corrupted heads or tails drawn with
``torch.randint`` (alternating head-batch / tail-batch, as RotatE's reference code
does), weights the negatives by self-adversarial sampling (a detached softmax over
the negatives' scores) and optimises the logsigmoid loss (or a margin loss). After
each step the touched entity rows are renormalised in place under ``torch.no_grad()``
(``emb.weight.data[idx] = F.normalize(...)``, TransE's constraint). Every
``--eval-every`` steps a filtered-free link-prediction evaluation ranks each test
triple's tail against all entities, in chunks, under ``model.eval()`` and
``torch.no_grad()``.

    python kge_sparse_adam.py                          # RotatE, 200k entities x 256, batch 1024 x 256 negatives
    python kge_sparse_adam.py --model TransE --loss margin
    python kge_sparse_adam.py --device cpu --num-entities 20000 --batch-size 128 --neg-size 64
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class KGEModel(nn.Module):
    def __init__(self, model_name, num_entities, num_relations, hidden_dim, gamma, proj_hidden):
        super().__init__()
        self.model_name = model_name
        self.num_entities = num_entities
        self.hidden_dim = hidden_dim
        self.epsilon = 2.0
        self.gamma = nn.Parameter(torch.Tensor([gamma]), requires_grad=False)
        self.embedding_range = nn.Parameter(
            torch.Tensor([(self.gamma.item() + self.epsilon) / hidden_dim]), requires_grad=False)

        # RotatE: entities are complex (re, im halves), relations are phases
        self.entity_dim = hidden_dim * 2 if model_name == "RotatE" else hidden_dim
        self.relation_dim = hidden_dim

        self.entity_emb = nn.Embedding(num_entities, self.entity_dim, sparse=True)
        self.relation_emb = nn.Embedding(num_relations, self.relation_dim, sparse=True)
        nn.init.uniform_(self.entity_emb.weight, -self.embedding_range.item(), self.embedding_range.item())
        nn.init.uniform_(self.relation_emb.weight, -self.embedding_range.item(), self.embedding_range.item())

        # a small dense projection of the relation embedding (trained with the dense Adam)
        self.rel_proj = nn.Sequential(
            nn.Linear(self.relation_dim, proj_hidden),
            nn.ReLU(),
            nn.Linear(proj_hidden, self.relation_dim),
        )

    def relation(self, rel_idx):
        r = self.relation_emb(rel_idx)
        return r + self.rel_proj(r)

    def score(self, head, relation, tail, mode):
        if self.model_name == "TransE":
            if mode == "head-batch":
                s = head + (relation - tail)
            else:
                s = (head + relation) - tail
            return self.gamma.item() - torch.norm(s, p=1, dim=2)

        # RotatE
        pi = 3.14159265358979323846
        re_head, im_head = torch.chunk(head, 2, dim=2)
        re_tail, im_tail = torch.chunk(tail, 2, dim=2)
        phase_relation = relation / (self.embedding_range.item() / pi)
        re_relation = torch.cos(phase_relation)
        im_relation = torch.sin(phase_relation)
        if mode == "head-batch":
            re_score = re_relation * re_tail + im_relation * im_tail
            im_score = re_relation * im_tail - im_relation * re_tail
            re_score = re_score - re_head
            im_score = im_score - im_head
        else:
            re_score = re_head * re_relation - im_head * im_relation
            im_score = re_head * im_relation + im_head * re_relation
            re_score = re_score - re_tail
            im_score = im_score - im_tail
        score = torch.stack([re_score, im_score], dim=0)
        score = score.norm(dim=0)
        return self.gamma.item() - score.sum(dim=2)

    def forward(self, sample, mode="single"):
        if mode == "single":
            head = self.entity_emb(sample[:, 0]).unsqueeze(1)
            relation = self.relation(sample[:, 1]).unsqueeze(1)
            tail = self.entity_emb(sample[:, 2]).unsqueeze(1)
        elif mode == "head-batch":
            tail_part, head_part = sample
            batch_size, negative_sample_size = head_part.size(0), head_part.size(1)
            head = self.entity_emb(head_part.view(-1)).view(batch_size, negative_sample_size, -1)
            relation = self.relation(tail_part[:, 1]).unsqueeze(1)
            tail = self.entity_emb(tail_part[:, 2]).unsqueeze(1)
        elif mode == "tail-batch":
            head_part, tail_part = sample
            batch_size, negative_sample_size = tail_part.size(0), tail_part.size(1)
            head = self.entity_emb(head_part[:, 0]).unsqueeze(1)
            relation = self.relation(head_part[:, 1]).unsqueeze(1)
            tail = self.entity_emb(tail_part.view(-1)).view(batch_size, negative_sample_size, -1)
        else:
            raise ValueError(mode)
        return self.score(head, relation, tail, mode)


def make_triples(n, num_entities, num_relations, generator):
    h = torch.randint(0, num_entities, (n,), generator=generator)
    r = torch.randint(0, num_relations, (n,), generator=generator)
    t = torch.randint(0, num_entities, (n,), generator=generator)
    return torch.stack([h, r, t], dim=1)


def train_step(model, sparse_opt, dense_opt, positive, mode, args):
    model.train()
    sparse_opt.zero_grad()
    dense_opt.zero_grad()

    batch_size = positive.size(0)
    negative = torch.randint(0, args.num_entities, (batch_size, args.neg_size), device=positive.device)

    negative_score = model((positive, negative), mode=mode)
    positive_score = model(positive).squeeze(dim=1)

    if args.loss == "logsigmoid":
        if args.adversarial_temperature > 0:
            # self-adversarial negative sampling: the weights are not back-propagated
            negative_score = (F.softmax(negative_score * args.adversarial_temperature, dim=1).detach()
                              * F.logsigmoid(-negative_score)).sum(dim=1)
        else:
            negative_score = F.logsigmoid(-negative_score).mean(dim=1)
        positive_score = F.logsigmoid(positive_score)
        positive_sample_loss = -positive_score.mean()
        negative_sample_loss = -negative_score.mean()
        loss = (positive_sample_loss + negative_sample_loss) / 2
    else:
        weights = F.softmax(negative_score * args.adversarial_temperature, dim=1).detach()
        loss = (weights * F.relu(args.margin - positive_score.unsqueeze(1) + negative_score)).sum(dim=1).mean()

    if args.regularization > 0:
        # regularise the dense projection only (the sparse tables would get dense gradients)
        reg = sum(p.norm(p=2) ** 2 for p in model.rel_proj.parameters())
        loss = loss + args.regularization * reg

    loss.backward()
    sparse_opt.step()
    dense_opt.step()

    # renormalise the entity rows touched by this step, in place, outside autograd
    with torch.no_grad():
        idx = torch.cat([positive[:, 0], positive[:, 2], negative.view(-1)]).unique()
        model.entity_emb.weight.data[idx] = F.normalize(model.entity_emb.weight.data[idx], p=2, dim=-1)

    return loss.item()


@torch.no_grad()
def evaluate(model, test_triples, args):
    model.eval()
    ranks = []
    all_entities = torch.arange(args.num_entities, device=test_triples.device)
    for start in range(0, test_triples.size(0), args.test_batch_size):
        batch = test_triples[start:start + args.test_batch_size]
        b = batch.size(0)
        true_score = model(batch).squeeze(1)  # (b,)
        num_higher = torch.zeros(b, dtype=torch.long, device=batch.device)
        for c in range(0, args.num_entities, args.eval_chunk):
            cand = all_entities[c:c + args.eval_chunk]
            tails = cand.unsqueeze(0).repeat(b, 1)
            scores = model((batch, tails), mode="tail-batch")  # (b, chunk)
            num_higher += (scores > true_score.unsqueeze(1)).sum(dim=1)
        ranks.append(num_higher + 1)
    ranks = torch.cat(ranks).float()
    model.train()
    return {
        "MRR": (1.0 / ranks).mean().item(),
        "MR": ranks.mean().item(),
        "HITS@1": (ranks <= 1).float().mean().item(),
        "HITS@10": (ranks <= 10).float().mean().item(),
    }


def main():
    p = argparse.ArgumentParser(description="RotatE / TransE with sparse embeddings and SparseAdam on random triples")
    p.add_argument("--model", default="RotatE", choices=["RotatE", "TransE"])
    p.add_argument("--num-entities", type=int, default=200_000)
    p.add_argument("--num-relations", type=int, default=1_000)
    p.add_argument("--hidden-dim", type=int, default=128, help="RotatE: complex dim (entity rows are 2x this)")
    p.add_argument("--proj-hidden", type=int, default=512)
    p.add_argument("--gamma", type=float, default=12.0)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--neg-size", type=int, default=256)
    p.add_argument("--adversarial-temperature", type=float, default=1.0)
    p.add_argument("--loss", default="logsigmoid", choices=["logsigmoid", "margin"])
    p.add_argument("--margin", type=float, default=9.0)
    p.add_argument("--regularization", type=float, default=1e-6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--num-test", type=int, default=64)
    p.add_argument("--test-batch-size", type=int, default=16)
    p.add_argument("--eval-chunk", type=int, default=20_000)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.model == "TransE":
        args.hidden_dim *= 2  # same table width as RotatE's complex entities

    device = args.device
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    train_triples = make_triples(50 * args.batch_size, args.num_entities, args.num_relations, g)
    test_triples = make_triples(args.num_test, args.num_entities, args.num_relations, g).to(device)

    model = KGEModel(args.model, args.num_entities, args.num_relations, args.hidden_dim,
                     args.gamma, args.proj_hidden).to(device)

    sparse_params = list(model.entity_emb.parameters()) + list(model.relation_emb.parameters())
    sparse_opt = torch.optim.SparseAdam(sparse_params, lr=args.lr)
    dense_opt = torch.optim.Adam(model.rel_proj.parameters(), lr=args.lr)

    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{args.model}: {n_params / 1e6:.1f}M trainable parameters "
          f"({model.entity_emb.weight.numel() / 1e6:.1f}M entity, {model.relation_emb.weight.numel() / 1e6:.2f}M relation)")

    t0 = time.time()
    for step in range(1, args.steps + 1):
        perm = torch.randint(0, train_triples.size(0), (args.batch_size,), generator=g)
        positive = train_triples[perm].to(device, non_blocking=True)
        mode = "head-batch" if step % 2 == 0 else "tail-batch"
        loss = train_step(model, sparse_opt, dense_opt, positive, mode, args)
        if step % 5 == 0 or step == 1:
            print(f"step {step}: loss {loss:.4f} ({time.time() - t0:.1f}s)")
        if args.eval_every > 0 and step % args.eval_every == 0:
            metrics = evaluate(model, test_triples, args)
            print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
