"""Shared by the probes that run in vLLM's own environment (vllm_dflash2_probe.py, vllm_dspark_probe.py): build a
drafter export with vLLM's model class and loader on the CPU.

vLLM 0.32's config check refuses a DFlash2 or DSpark drafter on the V1 model runner (its V2 runner needs Triton,
absent on CPU). `load_draft` (DFlash2) validates the engine config with a copy of the export labelled
DFlashDraftModel (the same backbone keys); the draft model config is then labelled `architecture` again and
`get_model` builds vLLM's class and loads the export through its `load_weights` (which refuses an unexpected name, a
misshapen tensor, and a parameter the checkpoint did not fill). `engine_config` (DSpark) instead lifts exactly that
one refusal and runs the rest of vLLM's config path on the unmodified export.
"""

import json
import os
import shutil
import socket
import tempfile


def load_draft(target: str, export: str, num_speculative_tokens: int, architecture: str, model_cls):
    """vLLM's `model_cls` built from `export` for `target`; and the shapes of its parameters as built, before
    loading (the CPU path repacks some linear weights afterwards)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    plain = tempfile.mkdtemp()
    shutil.copy(os.path.join(export, "model.safetensors"), plain)
    cfg = json.load(open(os.path.join(export, "config.json")))
    cfg["architectures"] = ["DFlashDraftModel"]
    json.dump(cfg, open(os.path.join(plain, "config.json"), "w"))
    args = EngineArgs(model=target, dtype="float32", enforce_eager=True,
                      speculative_config={"method": "dflash", "model": plain,
                                          "num_speculative_tokens": num_speculative_tokens})
    vcfg = args.create_engine_config()
    draft_cfg = vcfg.speculative_config.draft_model_config
    draft_cfg.hf_config.architectures = [architecture]
    loading = model_cls.load_weights
    shapes = {}

    def recording(self, weights):
        shapes.update({n: tuple(p.shape) for n, p in self.named_parameters()})
        return loading(self, weights)

    model_cls.load_weights = recording
    with set_current_vllm_config(vcfg):
        single_rank()
        model = get_model(vllm_config=vcfg, model_config=draft_cfg)
    shutil.rmtree(plain)
    return model, shapes


def engine_config(target: str, speculative_config: dict, v2_only_feature: str):
    """vLLM's engine config for `target` with `speculative_config` as given (the export unmodified), the V1 model
    runner's refusal of `v2_only_feature` lifted in this process (the one check a CPU cannot pass), every other kept."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    refusals = VllmConfig._get_v1_model_runner_unsupported_features
    lifted = []

    def all_but_one(self):
        found = refusals(self)
        lifted.extend(f for f in found if f == v2_only_feature)
        return [f for f in found if f != v2_only_feature]

    # For the rest of the process: vLLM's DSpark loader validates a copy of the config again (dataclass replace).
    VllmConfig._get_v1_model_runner_unsupported_features = all_but_one
    vcfg = EngineArgs(model=target, dtype="float32", enforce_eager=True,
                      speculative_config=dict(speculative_config)).create_engine_config()
    assert lifted, f"vLLM no longer refuses {v2_only_feature!r} on V1: the lift is stale"
    return vcfg


def single_rank():
    """vLLM's distributed state for one CPU rank (gloo on a free loopback port); use inside
    set_current_vllm_config."""
    import torch
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    torch.accelerator.empty_cache = lambda: None  # the loader empties an accelerator cache: none on CPU
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)


def use_target_head(model, target: str) -> None:
    """Copy the target's LM head into the draft model's (the engines share it) and re-pack it for the CPU path."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(target, "model.safetensors"))
    model.lm_head.weight.copy_(weights.get("lm_head.weight", weights.get("model.embed_tokens.weight")))
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
