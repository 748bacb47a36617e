"""`sluice roofline --tp N`: one decode step of a tensor-parallel model, on one rank, plus its collectives.

What one rank reads is what parallel/sharding.py gives it: 1/N of every sharded matrix (q/k/v, o,
gate/up/down, the vocabulary rows of the embedding and the LM head), the norms and the row-parallel
biases whole, and 1/N of the KV cache -- or one whole KV head when there are fewer KV heads than
ranks (GQA replication). That is exactly `step_costs()` of `rank_config(cfg, N)`, the config the
ranks build their own Transformer from, so the roofline and the real ranks cannot drift apart.

Each rank then takes part in these collectives per decode step (B sequences, hidden size C), all on
the critical path: sluice does not overlap communication with compute, and a layer cannot start
before the previous branch's sum is complete.
    all-reduce (B, C)      after the vocabulary-parallel embedding                       1
    all-reduce (B, C)      after o (attention) and after down (MLP) in every layer       2 L
    all-reduce (B,) fp32   max of "row not finite" (parallel/sampling.py)                 1
    all-reduce (B,) fp32   max logit, for the temperature-scaled race                      1
    all-gather (B, 2) f64  race winner (value, id) of each rank                            1
That is the sampled path (temperature > 0, no filters). A greedy batch sends the first and an
all-gather of each rank's greedy winner (2 collectives), a batch mixing greedy and sampled rows 4;
top_k adds an all-gather of k values per row, top_p / min_p a few rounds more (parallel/filters.py).

Ring model, what NCCL runs for small messages: an all-reduce of n bytes over N ranks is a
reduce-scatter then an all-gather, 2(N-1) steps, each rank sending 2(N-1)/N * n bytes; an all-gather
of n bytes from each rank is N-1 steps, each rank sending (N-1) * n bytes. Time of one collective:

    t = overhead + steps * alpha + bytes sent per rank / beta

beta: the link's bandwidth in one direction; alpha: the latency of one ring step; overhead: the
fixed cost of one collective (launch, synchronisation). At batch 1 a Qwen3-32B all-reduce is 10 KiB:
0.04 us at NVLink's bandwidth against ~15 us of latency, so alpha and overhead decide the answer.
"""

from __future__ import annotations

import torch

from ..errors import ObservatoryError
from ..model.config import ModelConfig
from .costs import step_costs, totals

# name -> link bandwidth per direction (GB/s), latency of one ring step (us), fixed cost per collective (us).
# Latencies are NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, v2.2x): ring algorithm with the
# LL protocol, its choice for messages of a few KiB: baseLat 6.6 us per collective, hwLat per step
# 0.6 us over NVLink, 1.0 us over PCIe, 2.7 us over the network (InfiniBand / RoCE with RDMA).
# Plain TCP (gloo, no RDMA) is slower per step, tens of us: give --link-latency for it.
INTERCONNECTS = {
    "nvlink": {"label": "NVLink 4 through NVSwitch (H100/H200 HGX)", "GB_s": 450.0, "step_us": 0.6,
               "overhead_us": 6.6,
               "source": "NVIDIA H200 datasheet: NVLink 900 GB/s per GPU, both directions together, so 450 GB/s "
                         "each way; latency: NCCL tuning.cc ring/LL, 6.6 us per collective + 0.6 us per step"},
    "pcie": {"label": "PCIe 5.0 x16", "GB_s": 64.0, "step_us": 1.0, "overhead_us": 6.6,
             "source": "PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b coding = 63 GB/s each way (~64 quoted); latency: "
                       "NCCL tuning.cc ring/LL, 6.6 us per collective + 1.0 us per step"},
    "ethernet": {"label": "100 Gb Ethernet (RoCE, RDMA), one GPU per node", "GB_s": 12.5, "step_us": 2.7,
                 "overhead_us": 6.6,
                 "source": "100 Gbit/s = 12.5 GB/s each way; latency: NCCL tuning.cc ring/LL over the network, "
                           "6.6 us per collective + 2.7 us per step (RDMA; TCP is slower)"},
    "ethernet-400g": {"label": "400 Gb Ethernet (RoCE, RDMA), one GPU per node", "GB_s": 50.0, "step_us": 2.7,
                      "overhead_us": 6.6,
                      "source": "400 Gbit/s = 50 GB/s each way; latency: NCCL tuning.cc ring/LL over the network, "
                                "6.6 us per collective + 2.7 us per step"},
}
# HBM capacity of the --hardware rows (datasheets), to say whether a rank's share fits.
MEMORY_GB = {"h200": 141.0, "h100": 80.0, "a100": 80.0}


def rank_costs(cfg: ModelConfig, tp: int, batch: int, context: int, dtype: torch.dtype) -> dict[str, dict]:
    """step_costs() of one rank of `tp`: its shard of every matrix, its KV heads, its vocabulary rows.
    tp=1 is the single-process step itself (any architecture; N>1 must be shardable)."""
    if tp == 1:
        return step_costs(cfg, batch, context, dtype)
    from ..parallel.sharding import rank_config  # raises ConfigError naming what does not divide
    return step_costs(rank_config(cfg, tp), batch, context, dtype)


def interconnect(name: str | None, bandwidth_GB_s: float | None = None, step_us: float | None = None,
                 overhead_us: float | None = None) -> dict:
    """A link preset with the user's overrides applied, each override noted in `source`."""
    name = name or "nvlink"
    if name not in INTERCONNECTS:
        raise ObservatoryError(f"--interconnect must be one of {', '.join(INTERCONNECTS)}, got {name!r}")
    link = {"name": name, **INTERCONNECTS[name]}
    for key, value, flag, unit in (("GB_s", bandwidth_GB_s, "--link-bandwidth", "GB/s"),
                                   ("step_us", step_us, "--link-latency", "us per step"),
                                   ("overhead_us", overhead_us, "--collective-overhead", "us")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
            raise ObservatoryError(f"{flag} must be a finite number >= 0, got {value!r}")
        if key == "GB_s" and value == 0:
            raise ObservatoryError(f"{flag} must be above 0 GB/s, got {value!r}")
        link[key] = float(value)
        link["source"] += f"; {flag} {value:g} {unit} given"
    return link


def collective(kind: str, nbytes: int, tp: int, link: dict) -> dict:
    """One all-reduce ('all_reduce', n bytes per rank in and out) or all-gather ('all_gather', n bytes
    from each rank) on a ring of `tp` ranks: steps, bytes each rank sends, time in microseconds."""
    if tp == 1:
        return {"steps": 0, "sent_bytes": 0.0, "us": 0.0}
    steps, sent = {"all_reduce": (2 * (tp - 1), 2 * (tp - 1) / tp * nbytes),
                   "all_gather": (tp - 1, (tp - 1) * nbytes)}[kind]
    us = link["overhead_us"] + steps * link["step_us"] + sent / (link["GB_s"] * 1e3)  # GB/s = 1e3 bytes/us
    return {"steps": steps, "sent_bytes": sent, "us": us}


def step_collectives(cfg: ModelConfig, tp: int, batch: int, dtype: torch.dtype, link: dict) -> list[dict]:
    """The collectives of one decode step (module docstring), each with its count and cost."""
    act = batch * cfg.hidden_size * dtype.itemsize  # activations travel in the model's dtype
    rows = [("embedding all-reduce (B, hidden)", "all_reduce", act, 1),
            ("attention o all-reduce (B, hidden)", "all_reduce", act, cfg.num_layers),
            ("MLP down all-reduce (B, hidden)", "all_reduce", act, cfg.num_layers),
            ("sampler: non-finite max (B,) fp32", "all_reduce", batch * 4, 1),
            ("sampler: max logit (B,) fp32", "all_reduce", batch * 4, 1),
            ("sampler: race winner (B, 2) fp64", "all_gather", batch * 16, 1)]
    out = []
    for what, kind, nbytes, count in rows:
        c = collective(kind, nbytes, tp, link)
        out.append({"what": what, "kind": kind, "bytes": nbytes, "count": count, "steps": c["steps"],
                    "sent_bytes_each": c["sent_bytes"], "us_each": c["us"], "sent_bytes": count * c["sent_bytes"],
                    "us": count * c["us"]})
    return out


def per_token(costs: dict[str, dict], collectives: list[dict], bandwidth: float, flops: float) -> dict:
    """The step's time on one rank split into weights read, KV read, logits read, compute and
    communication (ms): step = max(memory, compute) + communication, nothing overlapped."""
    tot = totals(costs)
    kv, logits = costs["attention"]["read_bytes"], costs["sampling"]["read_bytes"]
    weights = tot["read_bytes"] - kv - logits
    t_mem, t_compute = tot["read_bytes"] / bandwidth, tot["flops"] / flops
    comm_ms = sum(c["us"] for c in collectives) / 1e3
    step_ms = max(t_mem, t_compute) * 1e3 + comm_ms
    return {"weights_bytes": weights, "kv_bytes": kv, "logits_bytes": logits, "flops": tot["flops"],
            "weights_ms": weights / bandwidth * 1e3, "kv_ms": kv / bandwidth * 1e3,
            "logits_ms": logits / bandwidth * 1e3, "memory_ms": t_mem * 1e3, "compute_ms": t_compute * 1e3,
            "bound": "compute" if t_compute > t_mem else "memory",
            "communication_bytes": sum(c["sent_bytes"] for c in collectives),
            "collectives": sum(c["count"] for c in collectives), "communication_ms": comm_ms,
            "step_ms": step_ms, "communication_share": comm_ms / step_ms if step_ms else 0.0}


def parallel_section(cfg: ModelConfig, tp: int, batch: int, context: int, dtype: torch.dtype, hw: dict,
                     link: dict, costs: dict[str, dict]) -> dict:
    """The "parallel" part of a roofline: per-rank latency split, collectives, and the 1-GPU step."""
    bw, fl = hw["GB_s"] * 1e9, hw["GFLOP_s"] * 1e9
    coll = step_collectives(cfg, tp, batch, dtype, link)
    rank = per_token(costs, coll, bw, fl)
    resident = totals(costs)["param_bytes"] + costs["attention"]["read_bytes"]
    whole = step_costs(cfg, batch, context, dtype)
    one_resident = totals(whole)["param_bytes"] + whole["attention"]["read_bytes"]
    one = per_token(whole, [], bw, fl) if tp > 1 else rank
    out = {"tp": tp, "interconnect": link, "collectives": coll, "per_token": rank,
           "tokens_per_s": batch / (rank["step_ms"] / 1e3), "single_gpu_step_ms": one["step_ms"],
           "speedup_vs_one_gpu": one["step_ms"] / rank["step_ms"], "rank_resident_bytes": resident,
           "single_gpu_resident_bytes": one_resident, "notes": []}
    cap = MEMORY_GB.get(hw["name"])
    if cap is not None:
        out["rank_memory_GB"] = cap
        if resident > cap * 1e9:
            out["notes"].append(f"each rank holds {resident / 1e9:,.1f} GB of weights and KV cache, more than "
                                f"the {cap:g} GB of one {hw['name']}: it does not fit (predicted anyway)")
        if tp > 1 and one_resident > cap * 1e9:
            out["notes"].append(f"the whole model and KV cache ({one_resident / 1e9:,.1f} GB) do not fit on one "
                                f"{hw['name']} ({cap:g} GB): the one-GPU time is what it would take if they did")
    if tp > 1 and cfg.num_kv_heads < tp:
        out["notes"].append(f"{cfg.num_kv_heads} KV heads over {tp} ranks: each KV head is replicated on "
                            f"{tp // cfg.num_kv_heads} ranks, so each rank reads 1/{cfg.num_kv_heads} of the KV "
                            f"cache, not 1/{tp}")
    return out
