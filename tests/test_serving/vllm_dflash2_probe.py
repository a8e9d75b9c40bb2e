"""Run in vLLM's own environment (.venv-serve) by test_dflash2_vllm.py: load a dflash-ds DFlash2 export with
vLLM's loader and model class, and run vLLM's convolution, candidate head and selector on given inputs.

usage: python vllm_dflash2_probe.py TARGET EXPORT INPUTS.pt OUT.pt

vLLM 0.32's config check refuses a DFlash2 drafter on the V1 model runner (its V2 runner needs Triton,
absent on CPU), so the engine config is validated with a copy of the export labelled DFlashDraftModel;
the draft model config is then labelled DFlash2DraftModel again and `get_model` builds vLLM's
DFlash2Qwen3ForCausalLM and loads the export through its `load_weights` (which refuses an unexpected
name, a misshapen tensor, and a parameter the checkpoint did not fill).
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
    draft_cfg.hf_config.architectures = ["DFlash2DraftModel"]
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    loading = DFlash2Qwen3ForCausalLM.load_weights
    shapes = {}

    def recording(self, weights):
        """The parameters as built, before loading (the CPU path repacks some linear weights afterwards)."""
        shapes.update({n: tuple(p.shape) for n, p in self.named_parameters()})
        return loading(self, weights)

    DFlash2Qwen3ForCausalLM.load_weights = recording
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
    out = {"class": type(model).__name__,
           "params": shapes}
    with torch.no_grad():
        convs = {}
        for i, layer in enumerate(model.model.layers):
            for side in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, side)
                pre, delta = conv.prepare(inputs["conv_x"])
                convs[f"{i}.{side}"] = (pre, conv.finish(inputs["conv_y"], delta))
        out["convs"] = convs
        # The draft head is the target's: copy its LM head in, then vLLM's candidate head and selector.
        target_weights = load_file(os.path.join(target, "model.safetensors"))
        head = target_weights.get("lm_head.weight", target_weights.get("model.embed_tokens.weight"))
        model.lm_head.weight.copy_(head)
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)  # CPU: re-pack the new weight
        hidden = inputs["hidden"]  # [reqs, steps, H]
        reqs, steps, _ = hidden.shape
        ids, unary = model.compute_candidates(hidden.flatten(0, 1))
        ids, unary = ids.view(reqs, steps, -1), unary.view(reqs, steps, -1)
        scores = model.model.candidate_selector(ids, unary, hidden, inputs["anchor_ids"])
        # The walk as `_selector_walk_kernel` runs it at temperature 0: row `previous` (0 at the first step),
        # argmax over the K, the chosen index becomes `previous`.
        tokens = torch.zeros(reqs, steps, dtype=torch.long)
        for r in range(reqs):
            previous = 0
            for step in range(steps):
                index = int(torch.argmax(scores[r, step, previous]))
                tokens[r, step] = ids[r, step, index]
                previous = index
        out.update(candidate_ids=ids, unary=unary, scores=scores, tokens=tokens)
    torch.save(out, out_path)
