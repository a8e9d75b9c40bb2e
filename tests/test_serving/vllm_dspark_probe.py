"""Run in vLLM's own environment (.venv-serve) by test_dspark_vllm.py: take the speculative config dflash-ds's
VLLMServer passes for a DSpark export (the export unmodified) through vLLM's config path, build the target and the
draft with vLLM's own DSpark loader, and draft a block with vLLM's sequential Markov rule on given hidden states.

usage: python vllm_dspark_probe.py TARGET INPUTS.pt OUT.pt   (INPUTS["speculative_config"]: the server's)

What runs, on a CPU: `EngineArgs(speculative_config=...).create_engine_config()` in full (the method and
architecture resolution, the DSpark checks, `num_lookahead_tokens` from `sample_from_anchor`) except the V1 model
runner's refusal of DSpark, lifted (vllm_probe_load.engine_config: vLLM serves DSpark on its V2 runner only,
Triton: a GPU); then `get_model` builds the target and `load_dspark_model` (what `DSparkSpeculator.load_draft_model`
calls) builds `Qwen3DSparkForCausalLM`, loads the export through its `load_weights` and shares the target's
embedding and LM head. What does not run: the speculator itself and its Triton kernels; the drafting loop is
`DSparkSpeculator._sample_sequential` (and `_sample_sequential_topk`) at temperature 0, written out with the
model's own `compute_draft_logits`, `markov_embed`, `markov_bias`, `apply_markov_bias_gathered` and
`compute_confidence`.
"""

import sys

if __name__ == "__main__":
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    from vllm_probe_load import engine_config, single_rank

    target, inputs_path, out_path = sys.argv[1:4]
    inputs = torch.load(inputs_path)
    vcfg = engine_config(target, inputs["speculative_config"], "dspark speculative decoding")
    spec = vcfg.speculative_config
    out = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
           "architectures": list(spec.draft_model_config.architectures),
           "num_lookahead_tokens": vcfg.num_lookahead_tokens,
           "sample_from_anchor": getattr(spec.draft_model_config.hf_config, "sample_from_anchor", True)}
    loading, shapes = Qwen3DSparkForCausalLM.load_weights, {}

    def recording(self, weights):  # the parameters as built, before the CPU path repacks some linear weights
        shapes.update({n: tuple(p.shape) for n, p in self.named_parameters()})
        return loading(self, weights)

    Qwen3DSparkForCausalLM.load_weights = recording
    with set_current_vllm_config(vcfg):
        single_rank()
        target_model = get_model(vllm_config=vcfg)
        model = load_dspark_model(target_model, vcfg)
    out.update({"class": type(model).__name__, "params": shapes,
                "has_confidence_head": model.model.confidence_head is not None,
                "shares_target_head": model.lm_head is target_model.lm_head})
    with torch.no_grad():
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
