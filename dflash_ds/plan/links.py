"""`plan --link-gbit-per-s`: what crosses the link between nodes, per layout, and the tokens/s it allows.

Two ways to place M nodes of G GPUs (M >= 2):

- per node (`--targets-per-node t`): every node runs t targets and G - t drafters; the hidden states stay on
  their node (`Layout.route`), but the drafters sit on every node, so their ZeRO collectives cross it;
- target nodes (`--num-target-ranks`, targets on the last Mt nodes): the drafters fill the other M - Mt nodes;
  every hidden state crosses, the ZeRO collectives only when the drafters span more than one node.

Bytes a node's NIC carries in its busiest direction (full duplex: in and out are separate), per real token:

- hidden states: W / E per token (W: `wire_bytes_per_token`, E: real / padded tokens, the records'
  padding_efficiency), into each drafter node: W / E / (M - Mt); out of each target node: W / E / Mt;
- ZeRO, per optimizer step and node, for a ring over the n drafter ranks (nodes contiguous on it, so one rank
  pair carries each node boundary, and each rank sends (n - 1)/n of the tensor to its successor per pass):
  Z = passes x (n - 1)/n x P x z (P the drafter's trainable parameters, z bytes per element: bf16 2, fp32 4);
  passes per step, as DeepSpeed 0.19 sends them: its ZeRO-1/2 reduce a gradient bucket with one all-reduce
  (use_multi_rank_bucket_allreduce, on by default: 2 passes) rather than a reduce-scatter, then all-gather
  the updated parameters (1 pass): ZeRO-0: 2, ZeRO-1: 3 (gradients reduced once, at the step), ZeRO-2: 2A + 1
  (reduced after every one of the A micro-batches a drafter accumulates: the stage-2 hooks), ZeRO-3: 3A
  (parameters gathered for forward and backward, gradients reduce-scattered, every micro-batch). Measured on
  two hosts at ZeRO-2, A = 1 (the other stages are read from DeepSpeed's code, not measured):
  1.98-2.01 MB sent per step and host for 3 x 1/2 x 328,576 x 4 B = 1.97 MB (BENCHMARKS.md).
  Per real token: Z / (n x A x B x E), B the token budget of a micro-batch;

The two kinds of traffic cost differently. The hidden states are pipelined: targets send ahead while the
drafters train (bridge queue), so they only bound the rate, at L / their bytes per token of the busiest NIC.
The ZeRO collectives are not: DeepSpeed runs them inside the drafter's step (ds_configs: overlap_comm off)
and every drafter waits for them, so their time adds to the step's. Per real token:

  predicted tokens/s = 1 / (max(1 / compute, hidden bytes / L) + ZeRO bytes / L)

(compute = min(T a, D b)). With overlap_comm on, the reduce-scatter would hide behind the backward and only
the all-gather after the step stay serial: this is the upper bound of the ZeRO cost.
L = 0.956 x the line rate: tbf and a NIC count whole 1514-byte Ethernet frames, each carrying 1448 bytes
of TCP payload (docs/BENCHMARKS.md, "Across hosts": measured 0.956 at 100 and 400 Mbit/s).
"""

from __future__ import annotations

import argparse
from typing import Any

from dflash_ds.errors import DFlashError

PAYLOAD_FRACTION = 1448 / 1514  # TCP payload per 1500-byte-MTU frame (timestamps on): 0.956


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the inter-node link estimate."""
    parser.add_argument("--link-gbit-per-s", type=float, default=None,
                        help="each node's inter-node NIC line rate in Gbit/s (needs --nodes >= 2 and the rates): "
                             "compares targets on every node (--targets-per-node) with targets on whole nodes "
                             "(hidden states cross), each at min(compute, link) tok/s; payload = 0.956 x line rate "
                             "(1500-byte MTU framing, measured in docs/BENCHMARKS.md 'Across hosts'). Qwen3-8B, 2 "
                             "nodes x 8 GPUs, a = b = 7,000, 16k-token micro-batches: targets on every node send 5.5 "
                             "GB of ZeRO-2 per step over each NIC (3 x 7/8 x 1.05e9 x 2 B) and reach 46,794 / 50,985 "
                             "/ 53,375 tok/s at 100 / 200 / 400 Gbit/s; targets on one node (49,168 B/token cross) "
                             "stay at the compute's 56,000")
    parser.add_argument("--drafter-params", type=float, default=None,
                        help="the drafter's trainable parameters, which its ZeRO collectives move (default: the "
                             "memory model's Psi, 1.05e9 at Qwen3-8B with 5 layers)")
    parser.add_argument("--zero-bytes", type=int, default=None,
                        help="bytes per gradient/parameter element in the ZeRO collectives (default --dtype-bytes; "
                             "4 for fp32 training, as on CPU)")
    parser.add_argument("--micro-steps", type=int, default=1,
                        help="micro-batches each drafter accumulates per optimizer step (global_batch / drafters)")
    parser.add_argument("--padding-efficiency", type=float, default=1.0,
                        help="real / padded tokens (the records' padding_efficiency): padding crosses the link "
                             "too, tokens/s counts real tokens")


def zero_passes(stage: int, micro_steps: int) -> int:
    """Passes of (n - 1)/n x P x z bytes per optimizer step that the drafters' ZeRO stage makes."""
    return {0: 2, 1: 3, 2: 2 * micro_steps + 1, 3: 3 * micro_steps}[stage]


def _layout(name: str, flag: str, reps: int, drafters: int, drafter_nodes: int, target_nodes: int, a: float,
            b: float, rate: float, hidden_crosses: bool, zero: dict[str, Any]) -> dict[str, Any]:
    """One layout: compute limit, bytes per real token over the busiest NIC direction, link limit, prediction."""
    compute = min(reps * a, drafters * b)
    n = drafters
    zero_step = zero["passes"] * (n - 1) / n * zero["params"] * zero["bytes"] if drafter_nodes > 1 else 0.0
    step_tokens = n * zero["micro_steps"] * zero["token_budget"] * zero["efficiency"]
    zero_tok = zero_step / step_tokens
    wire = zero["wire"] / zero["efficiency"] if hidden_crosses else 0.0
    into_drafter_node = wire / drafter_nodes + zero_tok
    out_of_target_node = wire / target_nodes if hidden_crosses else 0.0
    hidden_busiest = max(wire / drafter_nodes, out_of_target_node)
    busiest = max(into_drafter_node, out_of_target_node)
    link = rate / busiest if busiest else None
    # pipelined hidden states bound the rate; the ZeRO collectives add their time to every step
    pipelined = max(1 / compute, hidden_busiest / rate)
    tok = 1 / (pipelined + zero_tok / rate)
    bound = "compute" if pipelined == 1 / compute else "link (hidden states)"
    return {"layout": name, "flag": flag, "replicas": reps, "drafter_ranks": drafters, "drafter_nodes": drafter_nodes,
            "compute_tok_per_s": compute, "hidden_bytes_per_token": wire, "zero_bytes_per_step": zero_step,
            "tokens_per_step": step_tokens, "zero_bytes_per_token": zero_tok, "busiest_bytes_per_token": busiest,
            "link_tok_per_s": link, "tok_per_s": tok, "bound": bound + (" + ZeRO" if zero_tok else "")}


def multinode(args: argparse.Namespace, p: dict[str, Any], a: float | None, b: float | None, k: int) -> dict | None:
    """Both layouts at `--link-gbit-per-s` (None without the flag); `p` is plan()'s dict so far."""
    if args.link_gbit_per_s is None:
        return None
    if args.link_gbit_per_s <= 0 or args.micro_steps < 1 or not 0 < args.padding_efficiency <= 1:
        raise DFlashError("--link-gbit-per-s must be > 0, --micro-steps >= 1, --padding-efficiency in (0, 1]")
    if args.nodes < 2 or a is None or p["split"] is None:
        raise DFlashError("--link-gbit-per-s needs --nodes >= 2 and the rates (--target-tok-per-s and "
                          "--drafter-tok-per-s, or --from-bench)")
    params = args.drafter_params or (p["colocated"]["memory"].get("drafter") or {}).get("params")
    if not params:
        raise DFlashError("the drafter's parameter count is unknown here: give --drafter-params")
    rate = args.link_gbit_per_s * 1e9 / 8 * PAYLOAD_FRACTION
    zero = {"stage": args.zero_stage, "passes": zero_passes(args.zero_stage, args.micro_steps), "params": params,
            "bytes": args.zero_bytes or args.dtype_bytes, "micro_steps": args.micro_steps,
            "token_budget": args.token_budget, "efficiency": args.padding_efficiency,
            "wire": p["wire_bytes_per_token"]["total"]}
    m, g = args.nodes, args.gpus // args.nodes
    layouts = [_layout("per node", f"--targets-per-node {o['targets_per_node']}", o["replicas"], o["drafter_ranks"],
                       m, m, a, b, rate, False, zero)
               for o in p["split"]["options"] if o["targets_per_node"]]
    for mt in range(1, m):
        layouts.append(_layout("target nodes", f"--num-target-ranks {mt * g} ({mt} node(s))", mt * g // k,
                               (m - mt) * g, m - mt, mt, a, b, rate, True, zero))
    best = {name: max((o for o in layouts if o["layout"] == name), key=lambda o: o["tok_per_s"], default=None)
            for name in ("per node", "target nodes")}
    # a tie goes to per node: no hidden state leaves its node
    # (no per-node option when a target replica fills a node)
    winner = max((o for o in best.values() if o), key=lambda o: (o["tok_per_s"], o["layout"] == "per node"))
    return {"line_gbit_per_s": args.link_gbit_per_s, "payload_bytes_per_s": rate, "zero": zero,
            "layouts": layouts, "best": best, "winner": winner}


def lines(p: dict[str, Any]) -> list[str]:
    """The link estimate as text, arithmetic shown."""
    mn = p.get("multinode")
    if not mn:
        return []
    z = mn["zero"]
    out = [f"inter-node link: {mn['line_gbit_per_s']:g} Gbit/s line, payload 0.956 x = "
           f"{mn['payload_bytes_per_s'] / 1e9:,.3f} GB/s per NIC and direction",
           f"  ZeRO-{z['stage']} per step: {z['passes']} pass(es) x (n-1)/n x {z['params']:,.0f} params x "
           f"{z['bytes']} B, n drafter ranks; step tokens = n x {z['micro_steps']} x {z['token_budget']:,} x "
           f"{z['efficiency']:g}; hidden states {z['wire']:,} / {z['efficiency']:g} B per real token",
           "  layout        flag                                compute    hidden B/tok  ZeRO B/tok  link tok/s  "
           "predicted  bound (+ ZeRO: its time adds)"]
    for o in mn["layouts"]:  # the per-node splits other than the best are in --json
        if o["layout"] == "per node" and o is not mn["best"]["per node"]:
            continue
        mark = " <-" if o is mn["best"][o["layout"]] else ""
        link = f"{o['link_tok_per_s']:>10,.0f}" if o["link_tok_per_s"] else f"{'-':>10}"
        out.append(f"  {o['layout']:<13} {o['flag']:<34} {o['compute_tok_per_s']:>8,.0f} "
                   f"{o['hidden_bytes_per_token']:>13,.0f} {o['zero_bytes_per_token']:>11,.0f} {link}  "
                   f"{o['tok_per_s']:>9,.0f}  {o['bound']}{mark}")
    win = mn["winner"]
    out.append(f"  across nodes: {win['layout']} ({win['flag']}), {win['tok_per_s']:,.0f} tok/s")
    return out
