"""Run in vLLM's own environment (.venv-serve) by test_dspark_vllm.py: load a dflash-ds DSpark export with vLLM's
loader and model class, and draft a block with vLLM's sequential Markov rule on given hidden states.

usage: python vllm_dspark_probe.py TARGET EXPORT INPUTS.pt OUT.pt

vLLM 0.32 serves DSpark on its V2 model runner only (Triton: GPU), so the engine config is validated with a
copy of the export labelled DFlashDraftModel (the same backbone keys); the draft model config is then labelled
Qwen3DSparkModel again and `get_model` builds vLLM's Qwen3DSparkForCausalLM and loads the export through its
`load_weights` (which refuses an unexpected name, a misshapen tensor, and a parameter the checkpoint did not
fill). The drafting loop is `DSparkSpeculator._sample_sequential` (and `_sample_sequential_topk`) at
temperature 0, written out with the model's own `compute_draft_logits`, `markov_embed`, `markov_bias`,
`apply_markov_bias_gathered` and `compute_confidence`.
"""

import json
import os
import shutil
import socket
import sys
import tempfile

if __name__ == "__main__":
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    target, export, inputs_path, out_path = sys.argv[1:5]
    inputs = torch.load(inputs_path)
    plain = tempfile.mkdtemp()
    shutil.copy(os.path.join(export, "model.safetensors"), plain)
    cfg = json.load(open(os.path.join(export, "config.json")))
    cfg["architectures"] = ["DFlashDraftModel"]
    json.dump(cfg, open(os.path.join(plain, "config.json"), "w"))
    args = EngineArgs(model=target, dtype="float32", enforce_eager=True,
                      speculative_config={"method": "dflash", "model": plain,
                                          "num_speculative_tokens": int(inputs["num_speculative_tokens"])})
    vcfg = args.create_engine_config()
    draft_cfg = vcfg.speculative_config.draft_model_config
    draft_cfg.hf_config.architectures = ["Qwen3DSparkModel"]
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    loading = Qwen3DSparkForCausalLM.load_weights
    shapes = {}

    def recording(self, weights):
        """The parameters as built, before loading (the CPU path repacks some linear weights afterwards)."""
        shapes.update({n: tuple(p.shape) for n, p in self.named_parameters()})
        return loading(self, weights)

    Qwen3DSparkForCausalLM.load_weights = recording
    torch.accelerator.empty_cache = lambda: None  # the loader empties an accelerator cache: none on CPU
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with set_current_vllm_config(vcfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        model = get_model(vllm_config=vcfg, model_config=draft_cfg)
    shutil.rmtree(plain)
    out = {"class": type(model).__name__, "params": shapes,
           "has_confidence_head": model.model.confidence_head is not None}
    with torch.no_grad():
        # The draft head is the target's (load_dspark_model shares it): copy the target's LM head in.
        target_weights = load_file(os.path.join(target, "model.safetensors"))
        head = target_weights.get("lm_head.weight", target_weights.get("model.embed_tokens.weight"))
        model.lm_head.weight.copy_(head)
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)  # CPU: re-pack the new weight
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
