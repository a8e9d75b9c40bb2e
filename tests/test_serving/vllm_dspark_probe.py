"""Run in vLLM's own environment (.venv-serve) by test_dspark_vllm.py: load a dflash-ds DSpark export with vLLM's
loader and model class, and draft a block with vLLM's sequential Markov rule on given hidden states.

usage: python vllm_dspark_probe.py TARGET EXPORT INPUTS.pt OUT.pt

vLLM 0.32 serves DSpark on its V2 model runner only (Triton: GPU); its Qwen3DSparkForCausalLM is built and loads
the export through its own `load_weights` (vllm_probe_load.py says how, on a CPU). The drafting loop is
`DSparkSpeculator._sample_sequential` (and `_sample_sequential_topk`) at temperature 0, written out with the
model's own `compute_draft_logits`, `markov_embed`, `markov_bias`,
`apply_markov_bias_gathered` and `compute_confidence`.
"""

import sys

if __name__ == "__main__":
    import torch
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_probe_load import load_draft, use_target_head

    target, export, inputs_path, out_path = sys.argv[1:5]
    inputs = torch.load(inputs_path)
    model, shapes = load_draft(target, export, int(inputs["num_speculative_tokens"]), "Qwen3DSparkModel",
                               Qwen3DSparkForCausalLM)
    out = {"class": type(model).__name__, "params": shapes,
           "has_confidence_head": model.model.confidence_head is not None}
    with torch.no_grad():
        use_target_head(model, target)  # the draft head is the target's (load_dspark_model shares it)
        hidden, anchors = inputs["hidden"], inputs["anchor_ids"]  # [reqs, steps, H], [reqs]
        reqs, steps, _ = hidden.shape
        base = model.compute_draft_logits(hidden.flatten(0, 1)).view(reqs, steps, -1)
        for name, k in (("dense", None), ("topk", int(inputs["topk"]))):
            prev, tokens, logits, embeds = anchors.clone(), [], [], []
            if k is not None:
                values, index = base.topk(k, dim=-1)
                buf = torch.full_like(base, float("-inf"))
            for i in range(steps):
                embed = model.markov_embed(prev)
                embeds.append(embed)
                if k is None:  # _sample_sequential
                    z = base[:, i] + model.markov_bias(embed)
                else:  # _sample_sequential_topk
                    z = model.apply_markov_bias_gathered(embed, buf[:, i], values[:, i], index[:, i])
                prev = z.argmax(dim=-1)
                tokens.append(prev)
                logits.append(z.clone())
            out[f"{name}_tokens"] = torch.stack(tokens, 1)
            out[f"{name}_logits"] = torch.stack(logits, 1)
            if out["has_confidence_head"]:
                conf = model.compute_confidence(hidden.flatten(0, 1), torch.stack(embeds, 1).flatten(0, 1))
                out[f"{name}_confidence"] = conf.view(reqs, steps)
    torch.save(out, out_path)
