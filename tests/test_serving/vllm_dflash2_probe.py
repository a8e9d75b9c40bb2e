"""Run in vLLM's own environment (.venv-serve) by test_dflash2_vllm.py: load a dflash-ds DFlash2 export with
vLLM's loader and model class, and run vLLM's convolution, candidate head and selector on given inputs.

usage: python vllm_dflash2_probe.py TARGET EXPORT INPUTS.pt OUT.pt

vLLM's DFlash2Qwen3ForCausalLM is built and loads the export through its own `load_weights`
(vllm_probe_load.py says how, on a CPU).
"""

import sys

if __name__ == "__main__":
    import torch
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    from vllm_probe_load import load_draft, use_target_head

    target, export, inputs_path, out_path = sys.argv[1:5]
    inputs = torch.load(inputs_path)
    model, shapes = load_draft(target, export, int(inputs["num_speculative_tokens"]), "DFlash2DraftModel",
                               DFlash2Qwen3ForCausalLM)
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
        use_target_head(model, target)  # the draft head is the target's; then vLLM's candidate head and selector
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
