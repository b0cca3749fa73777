"""torchrun worker for tests/test_loss_fsdp.py: the trainer's step (nanoareal.train_minibatch)
under FSDP2 (2 ranks, gloo) vs one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/support/fsdp_loss_worker.py OUT.pt

Every case runs train_minibatch on a `Policy` (a modeling.Model whose log-probs come from the
worker's own HF module, FSDP2-sharded or plain) with `Capture` as its optimizer, and rank 0 saves,
per case, the gradients of all parameters (full tensors) where the optimizer steps, the reported
values, and a reference computed in one process on one micro-batch holding the whole mini-batch
with `aggregate` (the mode formulas; no LossReduction involved). The zero-normaliser case also
runs the LossReduction contract itself: numerators the worker computes, passed to reduction({..}).
"""

from __future__ import annotations

import copy
import os
import random
import sys
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                os.path.dirname(os.path.abspath(__file__))]
from reference import (  # noqa: E402
    aggregate,
    build,
    policy_token_loss,
    surrogate_params,
    whole,
)

import loss as L  # noqa: E402
import modeling  # noqa: E402
import nanoareal as N  # noqa: E402

torch.set_num_threads(1)

VOCAB, DIVISOR, ENTROPY_COEF, KL_COEF = 32, 8.0, 0.01, 0.05
SURROGATE_OF_MODE = {  # every mode with a different surrogate, and every off-policy correction
    "token_mean": dict(policy_loss="ppo", eps_high=0.28, params={"dual_clip": 1.5},
                       correction="mask", correction_threshold=1.1),
    "seq_mean": dict(policy_loss="gspo", eps_low=0.02, eps_high=0.03),
    "prompt_mean": dict(policy_loss="cispo", correction="truncate", correction_threshold=1.1),
    "constant": dict(policy_loss="sapo", correction="behave"),
}
# name -> (data variant, mode, layout, gradient scaling)
CASES = {
    **{
        f"fsdp_{mode}_{scaling}": ("base", mode, "uneven_microbatches", scaling)
        for mode in L.MODES
        for scaling in ("divide_factor_1", "loss_times_world")
    },
    "fsdp_token_mean_one_microbatch_per_rank": ("base", "token_mean", "one_microbatch",
                                                "divide_factor_1"),
    "fsdp_prompt_mean_rank1_without_active_token": ("rank1_inactive", "prompt_mean",
                                                    "uneven_microbatches",
                                                    "divide_factor_1"),
    **{f"cp2_full_sequence_{mode}": ("base", mode, "cp_full_sequence",
                                     "manual_sum") for mode in L.MODES},
}
ZERO_CASE = "fsdp_seq_mean_zero_global_normalizer"
TOKEN_KEYS = ("loss_mask", "denom_mask", "advantages", "prox_logprobs", "behave_logprobs",
              "ref_logprobs",
              "loss_weight", "norm_weight", "seq_ids")


def make_sequences(variant: str) -> tuple[list[dict], int]:
    """The mini-batch (identical on every rank) and how many sequences rank 0 holds (the cut is
    mid-group)."""
    rng = random.Random(0)
    seqs = []
    for group, size in enumerate([3, 1, 2, 4, 2, 3]):
        for _ in range(size):
            n = rng.randint(1, 6)
            d = [0.0] * n if rng.random() < 0.12 else [1.0] * n
            seqs.append({
                "group": group, "prompt": [rng.randint(1, VOCAB - 1)
                                           for _ in range(rng.randint(2, 4))],
                "response": [rng.randint(1, VOCAB - 1) for _ in range(n)], "d": d,
                "m": [0.0 if (x > 0 and rng.random() < 0.15) else x for x in d],
                "advantage": rng.gauss(0.0, 1.0),
            })
    # groups 0..2 (6 sequences) + the first response of group 3: group 3 spans both ranks
    rank0_count = 7
    if variant == "rank1_inactive":
        for s in seqs[rank0_count:]:
            s["d"], s["m"] = [0.0] * len(s["d"]), [0.0] * len(s["m"])
    if variant == "all_inactive":
        for s in seqs:
            s["d"], s["m"] = [0.0] * len(s["d"]), [0.0] * len(s["m"])
    return seqs, rank0_count


def add_policy_logprobs(model, seqs: list[dict]) -> None:
    """pi_prox, pi_behave, pi_ref near the model's own logprobs (one sequence per forward, no
    packing)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor(s["prompt"] + s["response"])
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
            logp = logp[len(s["prompt"]) - 1 :]  # the response tokens
            n = len(s["response"])
            s["prox"] = logp + 0.15 * torch.randn(n, generator=gen)
            s["behave"] = s["prox"] + 0.15 * torch.randn(n, generator=gen)
            s["ref"] = logp + 0.2 * torch.randn(n, generator=gen)


def pack(seqs: list[dict], w: torch.Tensor, nw: torch.Tensor, index: list[int]) -> dict:
    """Pack whole sequences into one row; per-token tensors are aligned with the predicted token."""
    cols = {k: [] for k in ("input_ids", "position_ids", "targets", *TOKEN_KEYS)}
    for local, i in enumerate(index):
        s = seqs[i]
        ids, p, n = s["prompt"] + s["response"], len(s["prompt"]), len(s["response"])
        cols["input_ids"] += ids
        cols["position_ids"] += range(len(ids))
        cols["targets"] += ids[1:] + [0]
        before, after = [0.0] * (p - 1), [0.0]
        cols["loss_mask"] += before + s["m"] + after
        cols["denom_mask"] += before + s["d"] + after
        cols["advantages"] += [s["advantage"]] * len(ids)
        for key, src in (("prox_logprobs", "prox"), ("behave_logprobs", "behave"),
                         ("ref_logprobs", "ref")):
            cols[key] += before + s[src].tolist() + after
        cols["loss_weight"] += [float(w[i])] * len(ids)
        cols["norm_weight"] += [float(nw[i])] * len(ids)
        cols["seq_ids"] += [-1] * (p - 1) + [local] * n + [-1]
    long_keys = ("input_ids", "position_ids", "targets", "seq_ids")
    return {k: torch.tensor(v, dtype=torch.long if k in long_keys else torch.float32)
            for k, v in cols.items()}


def empty_microbatch() -> dict:
    mb = pack([{"prompt": [0], "response": [], "m": [], "d": [], "advantage": 0.0,
                "prox": torch.zeros(0), "behave": torch.zeros(0), "ref": torch.zeros(0)}],
              torch.zeros(1), torch.zeros(1), [0])
    return mb


def microbatches(seqs, w, nw, index: list[int], budget: int) -> list[dict]:
    """Token-budget micro-batches of whole sequences."""
    out, current, used = [], [], 0
    for i in index:
        n = len(seqs[i]["prompt"]) + len(seqs[i]["response"])
        if current and used + n > budget:
            out.append(pack(seqs, w, nw, current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        out.append(pack(seqs, w, nw, current))
    return out


def forward(model, mb, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) [T] of a packed micro-batch (a MicroBatch or a dict of its fields)
    by transformers' own forward, independent of nanoareal's attention: position_ids restart per
    sequence and use_cache=False, so transformers detects the packing."""
    mb = L.as_microbatch(mb)
    logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                   attention_mask=None, use_cache=False).logits[0].float()
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, mb.targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@dataclass
class Policy(modeling.Model):
    """The trainer's Model (gradient sync, trainable parameters: modeling.Model's own) around the
    worker's HF module, FSDP2-sharded or plain; its log-probs are `forward`'s."""

    def logprobs(self, mb, temperature: float, grad: bool = False, entropy_grad: bool = False):
        with torch.set_grad_enabled(grad):
            logp, entropy = forward(self.module, mb, temperature)
        return logp, entropy if entropy_grad else entropy.detach()


def trainer_model(module, defer_grad_sync: bool = False) -> Policy:
    return Policy(module, torch.device("cpu"), "transformers", defer_grad_sync=defer_grad_sync)


class Capture:
    """train_minibatch's optimizer: step() records every parameter's whole gradient (zeros where
    it has none; FSDP2's gathered: a collective, every rank in the same order), summed over the
    ranks by hand where `summed` (a plain module: the CP case's gradient reduction)."""

    def __init__(self, module, summed: bool = False):
        self.module, self.summed, self.grads = module, summed, None

    def step(self):
        self.grads = {}
        for name, p in self.module.named_parameters():
            g = whole(torch.zeros_like(p) if p.grad is None else p.grad).detach().clone()
            if self.summed:
                dist.all_reduce(g)
            self.grads[name] = g

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none=set_to_none)


def padded(mb: dict, values: torch.Tensor) -> torch.Tensor:
    seq = mb["seq_ids"]
    rows = [values[seq == i] for i in range(int(seq.max()) + 1)]
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])


def reference(model, seqs, mode: str, cfg: dict) -> tuple[dict, dict]:
    """One process, one micro-batch, straight from the mode formulas: surrogate token loss ->
    `aggregate`."""
    model.zero_grad(set_to_none=True)
    mb = pack(seqs, torch.ones(len(seqs)), torch.ones(len(seqs)), list(range(len(seqs))))
    logp, entropy = forward(model, mb)
    token_loss, m = policy_token_loss(cfg, logp, mb["prox_logprobs"], mb["behave_logprobs"],
                                      mb["advantages"], mb["seq_ids"], mb["loss_mask"])
    groups = torch.tensor([s["group"] for s in seqs])
    d = padded(mb, mb["denom_mask"])
    policy = aggregate(padded(mb, token_loss), padded(mb, m), mode=mode, group_ids=groups,
                       denom_mask=d, divisor=DIVISOR)
    kl_token = L.kl_penalty(logp, mb["ref_logprobs"], "k3")
    ent = aggregate(padded(mb, entropy), padded(mb, mb["loss_mask"]), mode="token_mean",
                    group_ids=groups, denom_mask=d)
    kl = aggregate(padded(mb, kl_token), padded(mb, mb["loss_mask"]), mode="token_mean",
                   group_ids=groups, denom_mask=d)
    total = policy - ENTROPY_COEF * ent + KL_COEF * kl
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    values = {"policy": policy.item(), "entropy": ent.item(), "kl": kl.item(), "loss": total.item()}
    return grads, values


class AllReduceCounter:
    """Counts dist.all_reduce calls (loss.py looks it up at call time, so patching the module
    works)."""

    def __init__(self):
        self.count, self._orig = 0, dist.all_reduce

    def __enter__(self):
        def counted(*args, **kwargs):
            self.count += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


class Watched(L.LossReduction):
    """The trainer's reduction (its terms, group and cp_factor), as train_minibatch calls it,
    watched: the all_reduces its begin_step and reported() make. `times`: the micro-batch loss
    for backward times this (FSDP2 left averaging gradients: loss * world undoes it); `shards`:
    begin_step counts these micro-batches' normalizers instead of the step's (a CP rank's own
    share of the tokens)."""

    def __init__(self, reduction: L.LossReduction, times: int = 1, shards: list | None = None):
        super().__init__(reduction.terms, reduction.group, reduction.cp_factor)
        self.times, self.shards, self.calls = times, shards, {}

    def begin_step(self, microbatches: list) -> None:
        with AllReduceCounter() as counter:
            super().begin_step(microbatches if self.shards is None else self.shards)
        self.calls["begin_step"] = counter.count

    def __call__(self, numerators, stats=None):
        return super().__call__(numerators, stats) * self.times

    def reported(self) -> dict:
        with AllReduceCounter() as counter:
            out = super().reported()
        self.calls["reported"] = counter.count
        return out


def step(model: Policy, reduction: Watched, mbs: list, cfg, ranks, summed: bool = False) -> dict:
    """The trainer's step (N.train_minibatch) on `mbs`: the gradients where its optimizer steps,
    its reported values and counters, and the all_reduces of the reduction's two collectives."""
    capture = Capture(model.module, summed)
    counters, reported = N.train_minibatch(model, capture, reduction,
                                           [L.as_microbatch(mb) for mb in mbs], cfg, ranks)
    return {"grads": capture.grads, "reported": reported, "counters": counters,
            "begin_step_all_reduces": reduction.calls.get("begin_step"),
            "reported_all_reduces": reduction.calls.get("reported")}


def contract(module, objective, mbs: list) -> dict:
    """The LossReduction contract itself under FSDP2, outside the trainer's step (which skips a
    step with nothing to learn): every micro-batch's forward and backward, the numerators the
    worker's own (a REINFORCE policy term, the entropy and the KL terms), the gradients and the
    reported values."""
    reduction = objective.reduction
    module.zero_grad(set_to_none=True)
    reduction.begin_step(mbs)
    for mb in map(L.as_microbatch, mbs):
        logp, entropy = forward(module, mb)
        kl = L.kl_penalty(logp, mb.ref_logprobs, "k3")
        reduction({"policy": L.masked_sum(-mb.advantages * logp, mb.loss_mask, mb.loss_weight),
                   "entropy": L.masked_sum(entropy, mb.loss_mask),
                   "kl": L.masked_sum(kl, mb.loss_mask)}).backward()
    grads = {n: whole(torch.zeros_like(p) if p.grad is None else p.grad).detach().clone()
             for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return {"grads": grads, "reported": reduction.reported()}


def run_case(models: dict, seqs, rank0_count: int, mode: str, layout: str, scaling: str,
             zero: bool = False) -> dict:
    """One case: the trainer's step on this rank's micro-batches; `zero` (a mini-batch without an
    active token): also the contract's own backward of it (`contract`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = SURROGATE_OF_MODE[mode]
    # mode weights from the WHOLE mini-batch's metadata, before any split (rule 2 of loss.py's
    # contract)
    denom = torch.tensor([sum(s["d"]) for s in seqs], dtype=torch.float64)
    w, nw = L.response_weights(mode, denom, torch.tensor([s["group"] for s in seqs]), DIVISOR)
    # CP=2: every CP rank computes the loss of the gathered full sequences
    if layout == "cp_full_sequence":
        module, mine, cp_factor = models["plain"], list(range(len(seqs))), world
    else:
        module, cp_factor = models[scaling], 1
        mine = list(range(rank0_count)) if rank == 0 else list(range(rank0_count, len(seqs)))
    budget = 10_000 if layout == "one_microbatch" else 14
    mbs = microbatches(seqs, w, nw, mine, budget)
    n = torch.tensor([len(mbs)])
    # FSDP2 all-gathers per forward: equal counts on every rank
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    n_real = len(mbs)
    mbs += [empty_microbatch() for _ in range(int(n) - len(mbs))]

    flags = {k: v for k, v in cfg.items() if k != "params"}
    objective = build(mode, DIVISOR, cp_factor, entropy_coef=ENTROPY_COEF,
                      kl_coef=KL_COEF, **flags)
    if layout == "cp_full_sequence":
        # the trainer's rule 5: the CP group's first rank counts every token of the step once
        # (train_minibatch), cp_factor in Z; the gradient reduction over the CP group is a sum
        ranks = N.Ranks(rank, world, cp_rank=rank, cp_size=world)
        model = trainer_model(module)
        result = step(model, Watched(objective.reduction), mbs, objective.cfg, ranks, summed=True)

        def half(mb):
            mid = len(mb["loss_mask"]) // 2
            return slice(0, mid) if rank == 0 else slice(mid, None)
        # the contract's: each CP rank's normalizers from its own half of the tokens, each once
        halves = [{k: mb[k][half(mb)] for k in TOKEN_KEYS} for mb in mbs]
        result["halves"] = step(model, Watched(objective.reduction, shards=halves), mbs,
                                objective.cfg, N.Ranks(), summed=True)
    else:
        # FSDP2 summing (divide factor 1), reduce-scattered once a step as the trainer defers it;
        # or FSDP2 averaging every backward, undone by loss * world
        times = world if scaling == "loss_times_world" else 1
        model = trainer_model(module, defer_grad_sync=scaling == "divide_factor_1")
        result = step(model, Watched(objective.reduction, times=times), mbs, objective.cfg,
                      N.Ranks())
    if zero:
        result["contract"] = contract(module, objective, mbs)
    counts = [None] * world
    dist.all_gather_object(counts, (n_real, len(mbs)))
    result["microbatches"] = counts
    return result


def make_episodes(seed: int = 3) -> list[dict]:
    """Episodes for make_sequences' groups: policy turns and environment spans alternate, so every
    response has interior masked spans (m = d = 0 there; pi_behave exists for sampled tokens only,
    so it is junk on the environment's); some end in an environment span."""
    rng = random.Random(seed)
    seqs = []
    for group, size in enumerate([3, 1, 2, 4, 2, 3]):
        prompt = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(2, 4))]
        for _ in range(size):
            mask = []
            for turn in range(rng.randint(1, 3)):
                mask += [1.0] * rng.randint(1, 3) + [0.0] * rng.randint(0 if turn else 1, 3)
            seqs.append({"group": group, "prompt": prompt, "m": mask, "d": mask,
                         "response": [rng.randint(1, VOCAB - 1) for _ in mask],
                         "advantage": rng.gauss(0.0, 1.0)})
    return seqs


def run_episode_case(model, seqs: list[dict], mode: str, budget: int = 22) -> dict:
    """The trainer's step on packing.py's micro-batches of this rank's groups (ranks split at a
    group; the budget cuts through groups), each episode's policy_mask carried by its Completion,
    its reduction build_loss's; `model` the HF module (FSDP2-sharded, or plain in one process)."""
    import packing
    from rollout import Completion, Sample
    rank, world = dist.get_rank(), dist.get_world_size()
    cut = next(i for i, s in enumerate(seqs) if s["group"] == 3) if world > 1 else len(seqs)
    first = 0 if rank == 0 else cut
    samples = [Sample(s["group"], s["prompt"], Completion(s["response"], torch.where(
        torch.tensor(s["m"]) > 0, s["behave"], -7.0).tolist(), "stop", [int(x) for x in s["m"]]),
        advantage=s["advantage"]) for s in (seqs[:cut] if rank == 0 else seqs[cut:])]
    mbs = packing.even_out(packing.pack_microbatches(samples, mode, DIVISOR, budget,
                                                     share_prompts=False))
    cfg = SURROGATE_OF_MODE[mode]
    objective = build(mode, DIVISOR, entropy_coef=ENTROPY_COEF,
                      kl_coef=KL_COEF, **{k: v for k, v in cfg.items() if k != "params"})
    batches = []
    for mb in mbs:
        given = {}
        for key, src in (("prox_logprobs", "prox"), ("ref_logprobs", "ref")):
            given[key] = torch.zeros(len(mb.targets))
            for j in mb.seq_ids[mb.seq_ids >= 0].unique().tolist():  # an index into `samples`
                given[key][mb.seq_ids == j] = seqs[first + j][src].float()
        batches.append(replace(mb, **given))
    result = step(trainer_model(model, defer_grad_sync=True), Watched(objective.reduction),
                  batches, objective.cfg, N.Ranks())
    counts = [None] * world
    dist.all_gather_object(counts, [len(mb.seq_ids[mb.seq_ids >= 0].unique()) for mb in mbs])
    return {"grads": result["grads"], "reported": result["reported"],
            "samples_per_microbatch": counts}


def m2po_case() -> dict:
    """Each rank holds a different number of tokens; the mask must be the one of the concatenation.
    """
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    T = 211 if rank == 0 else 137
    prox = -torch.rand(T, generator=gen, dtype=torch.float64)
    behave = prox + 0.3 * torch.randn(T, generator=gen, dtype=torch.float64)
    loss_mask = (torch.rand(T, generator=gen) > 0.2).double()
    new = L.m2po_mask(prox, behave, loss_mask, threshold=0.03)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"prox": prox, "behave": behave, "loss_mask": loss_mask,
                                      "new": new})
    return {k: torch.cat([g[k] for g in gathered]) for k in gathered[0]}


def main(out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    base = LlamaForCausalLM(config).float()
    mesh = init_device_mesh("cpu", (world,))
    models = {"plain": copy.deepcopy(base)}
    for scaling in ("divide_factor_1", "loss_times_world"):
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if scaling == "divide_factor_1":
            modeling.sum_gradients(model)
        models[scaling] = model

    data = {}
    for variant in ("base", "rank1_inactive", "all_inactive"):
        seqs, rank0_count = make_sequences(variant)
        add_policy_logprobs(base, seqs)
        data[variant] = (seqs, rank0_count)

    results = {"cases": {}}
    for name, (variant, mode, layout, scaling) in CASES.items():
        seqs, rank0_count = data[variant]
        case = SURROGATE_OF_MODE[mode]
        with surrogate_params(case["policy_loss"], case.get("params", {})):
            result = run_case(models, seqs, rank0_count, mode, layout, scaling)
            if rank == 0:
                result["ref_grads"], result["ref_reported"] = reference(base, seqs, mode, case)
        results["cases"][name] = result
    seqs, rank0_count = data["all_inactive"]
    results["cases"][ZERO_CASE] = run_case(models, seqs, rank0_count, "seq_mean",
                                           "uneven_microbatches", "divide_factor_1", zero=True)
    results["m2po"] = m2po_case()
    episodes = make_episodes()
    add_policy_logprobs(base, episodes)
    for mode in L.MODES:
        case = SURROGATE_OF_MODE[mode]
        with surrogate_params(case["policy_loss"], case.get("params", {})):
            result = run_episode_case(models["divide_factor_1"], episodes, mode)
            if rank == 0:
                result["ref_grads"], result["ref_reported"] = reference(base, episodes, mode, case)
        results["cases"][f"episodes_{mode}"] = result
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # then exit without interpreter teardown, as nanoareal.py does (a rare gloo abort there)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
