"""Two layouts of one 2-host job over a shaped link, measured beside `dflash-ds plan --link-gbit-per-s`.

Two hosts of tests/hosts.py (network namespaces on one bridge), 2 ranks each, both eth0 shaped by tbf
(each host's egress: the link is limited both ways), the tiny target and configs/tiny.yaml:

- per node (`--targets-per-node 1`): h0 and h1 each run 1 drafter + 1 target; the hidden states stay on
  their host, the 2 drafters' ZeRO exchange crosses the link;
- target node (`--num-target-ranks 2`): h0 runs both drafters, h1 both targets; every hidden state crosses.

Per layout it reports the steady tokens/s (metrics.jsonl after the first --skip records: real tokens over
their windows) and the bytes each host sent on eth0 per optimizer step between two steps of the run
(`ip -s link`, so everything counts: hidden states, ZeRO, heartbeats, the store). Root is needed. Run:

    .venv/bin/python tests/bench_multihost.py --rate 100mbit --steps 60 --work /tmp/bml --json

runs both layouts unshaped (the compute limit), then at --rate, then prints `dflash-ds plan`'s command
and its prediction beside each measured figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "test_runtime")]

from hosts import Hosts, unavailable  # noqa: E402
from runtime_utils import REPO, env_for_children, make_dataset  # noqa: E402

LAYOUTS = {"per-node": ["--targets-per-node", "1"], "target-node": ["--num-target-ranks", "2"]}


def counters(hosts: Hosts, h: str) -> dict[str, int]:
    """eth0's byte counters on host `h` (tx: what it sent over the link)."""
    r = hosts.run(h, ["ip", "-j", "-s", "link", "show", "dev", hosts.ifname])
    stats = json.loads(r.stdout)[0]["stats64"]
    return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}


def _step(out: Path) -> int:
    """The highest step in the drafters' per-micro-batch records so far (-1 before the first)."""
    best = -1
    for f in (out / "records").glob("*.jsonl") if (out / "records").is_dir() else []:
        for line in f.read_text().splitlines():
            try:
                best = max(best, json.loads(line)["step"])
            except (ValueError, KeyError):
                pass  # a line being written
    return best


def steady(out: Path, skip: int, log_interval: int) -> dict[str, float]:
    """Tokens/s over metrics.jsonl's records after the first `skip`: real tokens / the windows they took."""
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"tok_per_sec"' in line]
    recs = recs[skip:]
    real = sum(r["real_tokens"] for r in recs)
    window = sum(r["real_tokens"] / r["tok_per_sec"] for r in recs)
    return {"tok_per_s": real / window, "padding_efficiency": real / sum(r["padded_tokens"] for r in recs),
            "records": len(recs), "tgt_batch_per_s": sum(r["tgt_batch_per_sec"] for r in recs) / len(recs),
            "real_tokens_per_step": real / (len(recs) * log_interval),
            "padded_tokens_per_step": sum(r["padded_tokens"] for r in recs) / (len(recs) * log_interval)}


def run_layout(name: str, args: argparse.Namespace, target: Path, data: Path) -> dict:
    """One 2-host run of layout `name`; its tokens/s and the bytes per step each host sent."""
    out = args.work / f"{name}-{args.rate}"
    shutil.rmtree(out, ignore_errors=True)  # a previous run's final checkpoint would be resumed
    with Hosts(2) as hosts:
        if args.rate != "none":
            for h in hosts.names:
                hosts.shape(h, "tbf", "rate", args.rate, "burst", "256kb", "latency", "200ms")
        env = hosts.env({**env_for_children(), "NNODES": "2", "NPROC": "2", "RDZV_HOST": "h0", "RDZV_PORT": "29400"})
        train = ["--config", str(REPO / "configs/tiny.yaml"), "--target", str(target), "--data", str(data),
                 "--output-dir", str(out), "--max-steps", str(args.steps), "--train.log_interval", str(args.log_interval),
                 "--train.save_interval", str(10 * args.steps), "--train.timeout_s", "300", "--no-wandb",
                 "--zero-stage", str(args.zero_stage), "--data.token_budget", str(args.token_budget),
                 *LAYOUTS[name]]
        logs = {h: open(args.work / f"{name}-{args.rate}-{h}.log", "w") for h in hosts.names}
        procs = {h: hosts.popen(h, ["bash", str(REPO / "launch/train_multinode.sh"), *train], cwd=args.work,
                                env=env, stdout=logs[h], stderr=subprocess.STDOUT) for h in hosts.names}
        marks: list[tuple[int, float, dict]] = []
        first, last = args.steps // 4, args.steps - args.steps // 8  # counters between these steps: steady state
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            step = _step(out)
            if len(marks) < 2 and step >= (first, last)[len(marks)]:
                marks.append((step, time.monotonic(), {h: counters(hosts, h) for h in hosts.names}))
            time.sleep(0.05)
        for f in logs.values():
            f.close()
        codes = {h: p.poll() for h, p in procs.items()}
    if any(c != 0 for c in codes.values()) or len(marks) < 2:
        raise SystemExit(f"{name}: the run failed or ended early ({codes}, {len(marks)} counter marks); logs in "
                         f"{args.work}")
    (s0, t0, c0), (s1, t1, c1) = marks
    sent = {h: (c1[h]["tx"] - c0[h]["tx"]) / (s1 - s0) for h in c0}
    return {"layout": name, "rate": args.rate, "flags": LAYOUTS[name], **steady(out, args.skip, args.log_interval),
            "bytes_sent_per_step": sent, "steps_per_s_between_marks": (s1 - s0) / (t1 - t0),
            "marks": [s0, s1]}


def main() -> int:
    """Build the tiny target and data once, run the layouts, print one line (or JSON) per layout."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tbf rate on both hosts' eth0 ('none': unshaped)")
    parser.add_argument("--layouts", default="per-node,target-node", help="comma list of per-node, target-node")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=2, help="metrics records left out as warm-up")
    parser.add_argument("--log-interval", type=int, default=5, help="train.log_interval")
    parser.add_argument("--token-budget", type=int, default=2048, help="data.token_budget (tokens per micro-batch)")
    parser.add_argument("--zero-stage", type=int, default=2, help="train.zero_stage")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_multihost"), help="target, data, runs, logs")
    parser.add_argument("--no-unshaped", action="store_true",
                        help="skip the unshaped runs (the compute limit) and the prediction beside the shaped runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(f"bench_multihost: {why}", file=sys.stderr)
        return 2
    from dflash_ds.tiny.target import make_tiny_target

    args.work.mkdir(parents=True, exist_ok=True)
    target = args.work / "target"
    if not (target / "config.json").exists():
        make_tiny_target(target, layers=6)
    data = args.work / "prepared"
    if not data.exists():
        make_dataset(target, data, n=512, max_length=256, block_size=8)
    rate = args.rate
    results = []
    for shaped in ([rate] if args.no_unshaped else ["none", rate]) if rate != "none" else ["none"]:
        args.rate = shaped
        for name in args.layouts.split(","):
            r = run_layout(name, args, target, data)
            results.append(r)
            print(json.dumps(r) if args.json else
                  f"{name:<12} {shaped:>8}  {r['tok_per_s']:>8,.0f} tok/s  padding eff {r['padding_efficiency']:.3f}  "
                  f"sent/step h0 {r['bytes_sent_per_step']['h0']:,.0f} B, h1 {r['bytes_sent_per_step']['h1']:,.0f} B",
                  flush=True)
    if rate != "none" and not args.no_unshaped:
        predict(args, target, rate, results)
    return 0


def _gbit(rate: str) -> float:
    """A tc rate ('100mbit', '1gbit') in Gbit/s."""
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise SystemExit(f"--rate {rate}: give it in kbit, mbit or gbit")


def predict(args: argparse.Namespace, target: Path, rate: str, results: list[dict]) -> None:
    """`dflash-ds plan` at the shaped rate beside each shaped run's tokens/s.

    Compute limit: the same layout's unshaped run (its link, a veth, runs far above the shaped rates), split
    as a = b = C / 2 over its 2 targets and 2 drafters (4 ranks share 2 cores here: per-rank rates are not
    independent, and the layouts' unshaped rates differ). Token budget and padding: what its batches held. The
    tiny config trains without KL (loss.kl_weight 0): no final hidden state crosses, 2 x 128 x 4 + 16 B/token."""
    base = {r["layout"]: r for r in results if r["rate"] == "none"}
    import contextlib
    import io

    from dflash_ds.cli import main as cli

    for r in (r for r in results if r["rate"] == rate):
        c = base[r["layout"]]["tok_per_s"]
        argv = ["plan", "--gpus", "4", "--nodes", "2", "--target", str(target), "--drafter-layers", "2",
                "--dtype-bytes", "4", "--no-last-hidden", "--zero-stage", str(args.zero_stage), "--target-tok-per-s", f"{c / 2:.0f}",
                "--drafter-tok-per-s", f"{c / 2:.0f}", "--token-budget", f"{r['padded_tokens_per_step'] / 2:.0f}",
                "--padding-efficiency", f"{r['padding_efficiency']:.3f}", "--link-gbit-per-s", f"{_gbit(rate):g}"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cli([*argv, "--json"])
        mn = json.loads(buf.getvalue())["multinode"]
        p = mn["best"]["per node" if r["layout"] == "per-node" else "target nodes"]
        print("dflash-ds " + " ".join(argv))
        print(f"{r['layout']:<12} {rate}: predicted {p['tok_per_s']:,.0f} tok/s ({p['bound']}; hidden "
              f"{p['hidden_bytes_per_token']:,.0f} B/tok, ZeRO {p['zero_bytes_per_step']:,.0f} B/step), measured "
              f"{r['tok_per_s']:,.0f} ({r['tok_per_s'] / p['tok_per_s']:.2f}x); unshaped {c:,.0f}", flush=True)

if __name__ == "__main__":
    sys.exit(main())
