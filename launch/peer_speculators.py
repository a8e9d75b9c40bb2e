"""Glue for training vLLM's `speculators` (0.9.0) on dflash-ds's work, on CPU (docs/QUALITY.md "A peer trainer").

Runs in the peer's own environment (torch 2.13 CPU, transformers 5.19, speculators; not dflash-ds's). No peer code
is copied here; each subcommand stands in for a step the peer does with a GPU:

  rows PREPARED OUT.jsonl           dflash-ds prepared rows -> the peer's pre-tokenized rows (input_ids, loss_mask),
                                    so `speculators prepare-data` needs no vLLM render server and sees the same tokens
  hidden-states TARGET DATA IDS     the files vLLM's extract_hidden_states + ExampleHiddenStatesConnector write
                                    (DATA/hidden_states/hs_<i>.safetensors: token_ids, hidden_states [seq, n + 1, H]),
                                    computed with HF: that connector needs pinned memory, which vLLM's CPU build lacks
  epochs DATA STEPS SEED RATIO [TOKENS]
                                    epochs that end the peer's run at exactly STEPS (it runs one more step in every
                                    epoch after --max-steps) of TOKENS-token batches (default 2048)
  train ARGS...                     `speculators train ARGS` on CPU (its trainer moves to device 0 and synchronizes
                                    an accelerator)
  to-export PEER_CKPT SHAPE OUT     a peer checkpoint -> dflash-ds's export layout (for `dflash-ds eval`), checked
                                    against an export of the same shape
"""
import json
import sys
from pathlib import Path

import torch


def rows(prepared: str, out: str) -> None:
    """Write dflash-ds's prepared rows as the peer's pre-tokenized JSONL."""
    from datasets import load_from_disk

    ds = load_from_disk(prepared)
    tokens = loss = 0
    with open(out, "w", encoding="utf-8") as f:
        for row in ds:
            ids, mask = [int(x) for x in row["input_ids"]], [int(x) for x in row["loss_mask"]]
            tokens, loss = tokens + len(ids), loss + sum(mask)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    print(f"{len(ds)} rows, {tokens:,} tokens, {loss:,} loss tokens -> {out}")


def hidden_states(target: str, data: str, ids: str) -> None:
    """The target's hidden states of every row, as the peer's FileTransfer reads them."""
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    layers = model.model.layers
    # vLLM's aux id a is the input of decoder layer a, i.e. layer a-1's output; the last entry is the final
    # layer's output before the norm (the peer's verifier_last_hidden_states).
    taken = [int(a) - 1 for a in ids.split(",")] + [len(layers) - 1]
    ds = load_from_disk(data)
    out = Path(data) / "hidden_states"
    out.mkdir(exist_ok=True)
    for i, row in enumerate(ds):
        tokens = torch.as_tensor(row["input_ids"]).long()
        outputs: dict[int, torch.Tensor] = {}
        hooks = [layers[j].register_forward_hook(
            lambda _m, _a, o, j=j: outputs.__setitem__(j, o[0] if isinstance(o, tuple) else o)) for j in taken]
        with torch.no_grad():
            model.model(input_ids=tokens[None])
        for hook in hooks:
            hook.remove()
        states = torch.stack([outputs[j][0] for j in taken], dim=1).contiguous()
        save_file({"hidden_states": states, "token_ids": tokens}, str(out / f"hs_{i}.safetensors"))
    print(f"{len(ds)} rows, decoder layers {taken} -> {out}")


def epochs(data: str, steps: str, seed: str, ratio: str, batch_tokens: str = "2048") -> None:
    """Print the epochs whose packed batches (of BATCH_TOKENS, the peer's --total-seq-len) first reach STEPS (the
    peer's own sampler)."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = list(load_from_disk(data)["seq_len"])
    lengths = lengths[: int(len(lengths) * float(ratio))]
    total = n = 0
    while total < int(steps):
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=int(batch_tokens), lengths=lengths,
                                                     num_replicas=1, rank=0, seed=int(seed))
        sampler.set_epoch(n)
        total, n = total + len(sampler), n + 1
    print(n)


def train(*args: str) -> None:
    """`speculators train` with the device pointed at the CPU."""
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"            # trainer.py: self.model.to(self.local_rank), 0 = cuda:0
    if not torch.accelerator.is_available():          # trainer.py _StepTimer.mark: torch.accelerator.synchronize()
        torch.accelerator.synchronize = lambda *a, **k: None
    from speculators.cli import app

    sys.argv = ["speculators", "train", *args]
    app()


def to_export(peer: str, shape: str, out: str) -> None:
    """Write a peer checkpoint's weights under the config of a dflash-ds export of the same shape."""
    from safetensors.torch import load_file, save_file

    peer_dir, shape_dir, out_dir = Path(peer), Path(shape), Path(out)
    pc = json.loads((peer_dir / "config.json").read_text())
    zc = json.loads((shape_dir / "config.json").read_text())
    tl = pc["transformer_layer_config"]
    # speculators' converter: z-lab reads hidden_states[id + 1], speculators the layer id.
    pairs = {"target_layer_ids": ([a - 1 for a in pc["aux_hidden_state_layer_ids"]],
                                  zc["dflash_config"]["target_layer_ids"]),
             "mask_token_id": (pc["mask_token_id"], zc["dflash_config"]["mask_token_id"]),
             "block_size": (pc["block_size"], zc["block_size"]),
             **{k: (tl[k], zc[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
                                            "num_attention_heads", "num_key_value_heads", "layer_types", "vocab_size",
                                            "rms_norm_eps")}}
    differ = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if differ:
        sys.exit(f"the shapes differ (peer, dflash-ds): {differ}")
    weights, reference = load_file(str(peer_dir / "model.safetensors")), load_file(str(shape_dir / "model.safetensors"))
    body = {k: v.float().contiguous() for k, v in weights.items() if k in reference}
    if set(reference) - set(body) or any(body[k].shape != reference[k].shape for k in body):
        sys.exit(f"the peer checkpoint lacks or reshapes {sorted(set(reference) - set(body))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    zc.pop("dflash_ds_training", None)
    zc["converted_from"] = {"speculators_checkpoint": str(peer_dir), "dropped": sorted(set(weights) - set(body))}
    (out_dir / "config.json").write_text(json.dumps(zc, indent=2))
    save_file(body, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    print(f"{len(body)} tensors -> {out_dir}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    {"rows": rows, "hidden-states": hidden_states, "epochs": epochs, "train": train,
     "to-export": to_export}[command](*rest)
