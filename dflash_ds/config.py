"""Run configuration: typed dataclasses are the one source of defaults.

A run is a YAML/JSON file plus command-line overrides (`--section.key value`).
Loading is strict: an unknown key is an error naming the closest valid key, and
every value is checked against its field's rule before any heavy work starts.
Reading files and overrides is in dflash_ds/config_parse.py, the rules in dflash_ds/config_rules.py
(both re-exported here). A drafter kind's own model.* and loss.* fields are declared in its module and added to
those sections by dflash_ds/config_kinds.py; this file names no kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# config_parse imports nothing from this module (no cycle); its helpers stay importable from here.
from dflash_ds.config_parse import (  # noqa: F401
    _apply,
    _coerce,
    _field_types,
    _unknown_key,
    class_field_docs,
    parse_overrides,
    read_config_file,
)
from dflash_ds.config_kinds import KindSection
from dflash_ds.config_rules import _RULES, validate  # noqa: F401


@dataclass
class DrafterConfig(KindSection, section="model"):
    """Shape of the drafter (docs/DESIGN.md §2); each drafter kind adds its own fields (config_kinds.py)."""

    num_layers: int = 5
    """Number of draft decoder layers (also the number of target layers read)."""
    block_size: int = 16
    """Tokens per block: the anchor plus block_size - 1 predicted tokens."""
    mask_token_id: int | None = None
    """Token id of MASK; None picks a reserved token of the target tokenizer."""
    target_layer_ids: list[int] | None = None
    """Target decoder layers whose outputs feed the drafter; None uses the default rule."""
    activation_checkpointing: bool | None = None
    """Recompute draft layers in backward instead of keeping their activations (a fourth more FLOPs and about a
    fifth of the memory of each layer recomputed); null = off on CPU, and on a GPU off when its free memory holds
    the step without it, else on for the fewest layers that let it fit (bench memory's formula,
    runtime/checkpointing.py)."""
    checkpoint_layers: int | None = None
    """With activation checkpointing on: how many draft layers are recomputed, the first ones (the last layers'
    activations are released first in backward); null = all when model.activation_checkpointing is true, the
    fewest that fit when it is null."""
    layer_types: list[str] | None = None
    """Per draft layer "full_attention" or "sliding_attention" (causal, windowed); null/empty = all full."""
    sliding_window: int | None = None
    """Window of the sliding layers in positions, counting the query itself (HF convention)."""
    num_attention_heads: int | None = None
    """Query heads per draft layer; null = the target's (Qwen3.6-27B 24; z-lab's 27B drafter has 32)."""
    num_key_value_heads: int | None = None
    """Key/value heads per draft layer (must divide the query heads); null = the target's."""
    head_dim: int | None = None
    """Width of one attention head; null = the target's (Qwen3.6-27B 256; z-lab's 27B drafter 128)."""
    intermediate_size: int | None = None
    """MLP width of each draft layer; null = the target's."""
    attention_backend: str = "auto"
    """Training attention: auto (flex_attention on CUDA, dense mask + SDPA on CPU), dense, or flex (CUDA only)."""
    init: str = "random"
    """A fresh drafter's weights: random (seeded by train.seed), or target: its layers start as the target's last
    layers, fc passing the last context layer through (models/target_layers_init.py; the draft layers need the
    target's widths; on SmolLM2-135M est_tau 1.26 instead of 1.19 after 400 steps, docs/QUALITY.md). Not read
    with --drafter or on a resume."""
    kind: str = "dflash"
    """dflash, or a kind registered in models/kinds.py: DFlash plus parts of its own, which its module describes
    with why its defaults (kinds.BUILTIN_MODULES; `dflash-ds init-drafter --help` lists the kinds). Its own model.*
    and loss.* fields follow each section's, their docs starting with its name (config_kinds.py); a kind may bring
    a recipe of its own (see `recipe`)."""


@dataclass
class LossConfig(KindSection, section="loss"):
    """The DFlash training loss (docs/DESIGN.md §3); each drafter kind adds its own fields (config_kinds.py)."""

    gamma: float = 7.0
    """Position decay w_k = exp(-(k-1)/gamma); larger weighs later positions more."""
    num_anchors: int = 512
    """Most anchor blocks sampled per sequence."""
    max_anchors_per_batch: int = 2048
    """Most anchor blocks per micro-batch, shared fairly among its sequences (0 = no cap); see docs/MEMORY.md."""
    chunk_blocks: int = 64
    """Blocks whose LM-head logits and loss are computed at once (peak memory ~ chunk_blocks x (block-1) x vocab)."""
    kl_weight: float = 0.0
    """Mix weight of soft-label KL to the target distribution (0 = hard labels only)."""
    kl_temperature: float = 1.0
    """Temperature applied to both distributions in the KL and LK terms (and the logged alpha)."""
    streak_weight: float = 0.0
    """Mix of streak-aware weights with the position weights (0 = position weights only, 1 = streak only)."""
    labels: str = "data"
    """Hard labels of the CE term: data (the data's next tokens) or target (the target's argmax at each position)."""
    lk: str = ""
    """LK loss on the acceptance rate alpha = sum min(p_drafter, p_target): "" (off), log (-log alpha), hybrid, or
    l1 (||p_drafter - p_target||_1 = 2 (1 - alpha): DeepSpec's term, 0.9 of it beside 0.1 CE)."""
    lk_weight: float = 1.0
    """Mix of the LK loss with the CE/KL term when lk is set: (1 - w) base + w LK (1 = LK alone, the paper's). LK
    alone trains the whole distribution: on the demo's uncertain target it gained 1.3 tau served with sampled
    drafts at T=1 (vLLM's non-default draft_sample_method probabilistic) and lost 0.7 served greedily; 0.5 was
    level with CE greedily (docs/QUALITY.md)."""
    lk_kl_scale: float = 1.0
    """Hybrid LK: scale c of the KL share w = c * exp(-d * alpha) (the rest, 1 - w, on 1 - alpha)."""
    lk_kl_decay: float = 1.0
    """Hybrid LK: decay d of the KL share w = c * exp(-d * alpha)."""
    position_weighting: str = "decay"
    """Position weights: decay (exp(-(k-1)/gamma)) or dpace (D-PACE: from the drafter's own confidence)."""
    dpace_alpha: float = 0.5
    """D-PACE smoothing: confidence q becomes (1 - dpace_alpha) * q + dpace_alpha."""

    @property
    def needs_last_hidden(self) -> bool:
        """Whether a term reads the target's distribution, i.e. the batch must carry its final hidden state."""
        return self.kl_weight > 0 or self.lk != "" or self.labels == "target"


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 6e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine floor)."""
    warmup_steps: int = 100
    """Linear warmup steps from 0 to the peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Gradient norm clipping threshold (0 disables)."""


@dataclass
class NoiseConfig:
    """Gaussian noise on the context features: linear warmup, then cosine from max to min."""

    max_std: float = 0.0
    """Peak noise std (0 disables noise)."""
    min_std: float = 0.0
    """Noise std at the last step."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to max_std."""


@dataclass
class DataConfig:
    """Batching of a prepared dataset (docs/DESIGN.md §4)."""

    path: str = ""
    """Prepared Arrow dataset folder (output of `dflash-ds prepare`)."""
    max_length: int = 2048
    """Longest sequence trained on (tokens)."""
    token_budget: int = 16384
    """Padded tokens per micro-batch."""
    num_buckets: int = 6
    """Length buckets up to max_length."""
    prefetch: int = 2
    """Batches prepared ahead by the loader thread."""
    val_fraction: float = 0.0
    """Fraction of the prepared rows held out for validation (chosen by train.seed, never trained on; 0 = none)."""
    val_path: str = ""
    """A separate prepared folder to validate on instead of data.val_fraction ("" = none)."""


@dataclass
class TrainConfig:
    """Steps, logging, checkpoints."""

    max_steps: int = 1000
    """Optimizer steps to run."""
    seed: int = 0
    """Seed of data order, anchors, noise and init."""
    output_dir: str = "runs/dflash"
    """Run folder: metrics.jsonl, checkpoints, exports."""
    umask: str = "0o027"
    """Permission mask of every file and folder the ranks write (checkpoints, metrics.jsonl, records, exports, exit
    records, W&B's files), set as each rank starts: 0o027 = the group may read, others nothing; 0o077 = the owner
    only; 0o022 = every user of the machine may read. Octal, as a string: "027" or 0o027 (a bare 027 is a number)."""
    log_interval: int = 10
    """Steps between metric records."""
    save_interval: int = 500
    """Steps between checkpoints (a final one is always written)."""
    keep_last: int = 3
    """Checkpoints kept on disk."""
    resume: str = "auto"
    """auto (latest complete checkpoint if any), none, or a checkpoint path."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage 0..3 (picks ds_configs/zero{N}.json)."""
    ds_config: str = ""
    """Explicit DeepSpeed JSON (overrides zero_stage)."""
    dtype: str = "auto"
    """Compute dtype: auto (bf16 on GPU, fp32 on CPU), fast (bf16 on GPU and on a CPU with native bf16, fp32 on
    other CPUs), bf16 or fp32. On a CPU with native bf16 (AVX512-BF16 or AMX) bf16 runs the target forward ~1.9x
    faster and the whole colocated step ~1.85x (SmolLM2-135M, 2 cores: docs/THROUGHPUT_CPU.md); the trainer says so
    at start-up when it runs fp32 there. Without it (AVX2 only) torch emulates bf16, ~6x slower than fp32, and the
    trainer warns when bf16 is asked for there. Each rank decides `fast` for its own device: a CPU job's hosts
    must agree."""
    feature_cache: bool | None = None
    """Colocated runs: keep the target's features (the layers the drafter reads, in the target's dtype) in
    <output_dir>/feature_cache as the first epoch computes them, and read them back instead of running the target
    from the second epoch on (runtime/feature_cache.py). Keyed to the target (config and sampled weights), the
    prepared data, the layers read and the dtype: a run with another key is refused, naming what changed. null = on
    for a colocated CPU run that sees a row twice (exact: the cache holds what the target produced, bf16 or fp32);
    true = also on a GPU; false = off. On SmolLM2 on 2 CPU cores a cached step took 0.42 of a computed one in bf16
    (docs/THROUGHPUT_CPU.md)."""
    feature_cache_gb: float = 16.0
    """Most disk the feature cache takes (GB, 1e9 bytes); rows past it, in row order, are recomputed every epoch
    (0 = off). A token takes layers x hidden x 2 bytes in bf16, x 4 in fp32 (+ hidden x 2 or 4 with a KL / LK
    loss): SmolLM2-135M with 2 drafter layers 2,304 in bf16 (16 GB: ~7 M tokens), 4,608 in fp32 (~3.5 M); Qwen3-8B
    with 5 layers 40,960 in bf16 (16 GB: ~390 K tokens; 2 M tokens would take 82 GB)."""
    fuse: bool | None = None
    """Compile the drafter step's elementwise work with torch.compile (the loss's per-chunk passes over the
    [chunk x block x vocabulary] logits, the layers' norms, RoPE and SwiGLU, a kind's own such parts;
    components/fusion.py): null = on CUDA, eager on CPU; true = on CPU too; false = eager everywhere. Each
    compiled function adds 1-2 graphs (seconds each to compile)."""
    compile_cache: bool = True
    """Keep what torch compiles (flex_attention, the fused functions: minutes of compiling on a GPU) in
    <output_dir>/compile_cache, written by the leader after each checkpoint and loaded by every training rank at
    start: a restart on another node, or after /tmp was wiped, compiles nothing again (runtime/compile_cache.py).
    A few MB; false leaves only torch's per-machine cache."""
    target_attention: str = "auto"
    """Attention kernels of the frozen target's forward: auto (transformers' choice, sdpa on most models), sdpa,
    eager, flash_attention_2 / flash_attention_3 (pip install flash-attn), flex_attention. Logged at start-up."""
    target_hub_kernels: bool = False
    """Let transformers swap some of the target's layers for kernels fetched from the Hugging Face Hub at load
    time (the `kernels` package: e.g. kernels-community/rotary for the rotary embedding, a few % of the target
    forward). Needs network or a cached copy on every rank and runs third-party code; off by default."""
    timeout_s: float = 300.0
    """Timeout of blocking receives and collectives (seconds)."""
    startup_timeout_s: float = 900.0
    """Timeout of the start-up handshake (model loading, DeepSpeed init, first-run op builds)."""
    bridge_timeout_s: float = 1800.0
    """Timeout of hidden-state transfers between target and drafter ranks (seconds). Covers the longest a
    target may wait with a batch in flight: a checkpoint (a Qwen3.6-27B drafter rank writes 1.84 B x 16 B
    = 29 GB of ZeRO states: about 150 s at 200 MB/s) plus a step that compiles (tens of seconds per graph)."""
    heartbeat_timeout_s: float = 60.0
    """A rank whose heartbeat stalls this long is reported lost and the job exits."""
    global_batch: int = 0
    """Micro-batches per optimizer step over all drafters (0: the checkpoint's when resuming, else one per
    drafter rank). Each drafter accumulates global_batch / D of them, so D can change between runs."""
    launcher_grace_s: float = 60.0
    """A rank whose launcher (torchrun agent, deepspeed launcher) is gone stops, checkpointing if the
    drafters can still agree; after this many seconds it exits regardless."""
    max_bad_steps: int = 5
    """Consecutive steps with a non-finite loss or grad norm before the run stops with an error."""
    stop_at: int = 0
    """If > 0: stop at this step with a checkpoint, keeping max_steps' schedules (staged runs)."""
    est_tau_rows: int = 4
    """Rows of each drafter's first micro-batch walked for est_tau (greedy decoding walked over the response,
    the acceptance length greedy serving sees) every est_tau_interval steps, before that batch trains
    (0 = off). One no-grad forward with a block at every response position: about 51 GFLOP per response
    token at Qwen3-8B shapes (H 4096, 5 drafter layers, block 16, V 151,936: 30.9 in the layers, 18.7 in
    the LM head, ~1.3 in attention), 76 TFLOP for a row of 1,500 response tokens. A micro-step of a
    16k-token budget trains max_anchors_per_batch 2,048 blocks forward and backward: 3 x 2,048 x 51 GFLOP
    = 313 TFLOP (379 with activation checkpointing). 4 rows every 25 steps: 306 / (25 x 313) = 3.9% of
    a drafter's training work at one micro-step a step (3.2% with checkpointing; 1,900-token responses
    5.0% / 4.1%; fewer with accumulation). Measured on the demo: docs/QUALITY.md."""
    est_tau_interval: int = 25
    """Steps between est_tau walks (at each step whose number is a multiple); records in between carry the
    pooled figure of the last walks (est_tau_window)."""
    est_tau_window: int = 64
    """Rows over all drafters a record's est_tau pools: the last ceil(64 / (est_tau_rows x drafters)) walks
    (8 on 2 drafters, 2 on 8). A record's est_tau is the training tau of the last est_tau_interval steps
    (uniform anchors over every row they trained on: current, thousands of blocks) scaled by the pooled walks'
    ratio of walked accepted drafts to uniform ones on the walked rows, 1 + (tau - 1) x (walked - 1) /
    (tau of the walked rows - 1); the walks' own mean is est_tau_walked. The ratio is what the walks are for: one
    response's walk varies by ~40% of the mean (0.39 on the demo's 478 rows) and the pool spans the
    drafter's last ~200 steps on 2 drafters (50 on 8), so the walks' own mean is noisy and lags, while the
    ratio moves little (hard rows are hard by both counts). Demo: est_tau 3.76 at step 300 against 3.97
    served on all the training prompts with that step's weights (est_tau_walked 3.49), at most 4.3% between
    records (docs/QUALITY.md). Under a noise schedule the training tau is of noised features, so est_tau
    reads low while noise is on. A resumed run reads its walks back from records/walks{d}.jsonl."""
    eval_interval: int = 0
    """Steps between evaluations on the validation split (data.val_fraction or data.val_path; 0 = never):
    val_est_tau and val_tau in that step's record, the best val_est_tau kept as checkpoints/best."""
    eval_batches: int = 16
    """Validation batches per evaluation over all drafters (the same batches every time; 0 = the whole split)."""


@dataclass
class TopologyConfig:
    """Which ranks run the target and which train the drafter."""

    num_target_ranks: int = 1
    """Target ranks in the whole job (the last ranks: drafters take the first), unless targets_per_node is set."""
    targets_per_node: int = 0
    """If > 0: the last N local ranks of every node are targets, each node's targets feeding only its drafters."""
    target_parallel: int = 1
    """Ranks that hold one copy of the target between them (tensor parallel, transformers' tp_plan): consecutive
    target ranks on one node form a replica, its first rank sends the hidden states. 1 = every target rank holds
    the whole target. Pick it with `dflash-ds plan` (docs/MEMORY.md "Targets larger than one GPU")."""
    colocate: bool = False
    """Every rank loads the frozen target and trains the drafter (target forward, then the drafter step, on the
    same GPU; all ranks in the ZeRO group, no bridge). One GPU works. num_target_ranks and targets_per_node are
    not used."""
    sequence_parallel: int = 1
    """Drafter ranks that split each batch's sequences between them (Ulysses: each holds 1/N of the context
    positions and of the anchor blocks, attention exchanges heads; distributed/sequence_parallel.py). N consecutive
    ranks form a group that trains one batch together: D ranks train D/N batches per micro-step, ZeRO still spans
    all D. N must divide D and the drafter's key/value heads. Fed by target ranks, a target computes each sequence
    once and sends each rank of the group only its 1/N of the context; colocated, every rank of a group runs the
    whole target forward. For sequences one rank cannot hold: `dflash-ds plan --seq-len L` gives the smallest N
    (docs/MEMORY.md "Sequence parallelism"). DFlash drafters for now (issue 56); the losses that read the target's
    distribution (KL / LK / target labels) run too: each rank reads the final hidden at its own label positions
    (whole on a colocated rank; sent cut like the context, each rank fetching its rows from the group's)."""
    colocate_overlap: bool = False
    """Colocated only: compute the next batch's target forward on a side thread (its own CUDA stream on GPU)
    while the drafter step runs. Off by default: see docs/BENCHMARKS.md "Colocated training"."""


@dataclass
class WandbConfig:
    """Weights & Biases mirroring of metrics.jsonl."""

    enabled: bool = True
    """Log to W&B (a missing package or failed init only warns)."""
    project: str = "dflash-ds"
    """W&B project."""
    run_name: str = ""
    """W&B run name (default: the output folder's name)."""


@dataclass
class Config:
    """A whole run."""

    recipe: str = "auto"
    """Defaults of the drafter kind, applied under the file and the flags (a field either sets wins): auto (the
    kind's own, if it has one: its KindSpec's `recipe_name` and `recipe` in its module, e.g. DeepSpec's objective),
    none (the plain defaults below), or the kind's recipe by name. Rank 0 prints the recipe in force and each of its
    fields the run departs from."""
    target: str = ""
    """Local HF folder of the frozen target model."""
    drafter: str = ""
    """Optional exported drafter folder to start from; its config.json fixes the shape (model.* set otherwise: an error)."""
    model: DrafterConfig = field(default_factory=DrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Defaults, then the drafter kind's recipe (config_recipe.py), then the file, then the overrides; strict and
    validated."""
    from dflash_ds.config_recipe import with_recipe

    from_file = read_config_file(path) if path else {}
    over = (parse_overrides(overrides) if isinstance(overrides, list) else overrides) if overrides else {}

    def build(recipe: dict[str, Any]) -> Config:
        cfg = Config()
        for layer in (recipe, from_file, over):  # the kind's recipe, then what the run sets
            _apply(cfg, layer)
        return cfg

    return validate(with_recipe(build))


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of a config (for saving next to checkpoints and W&B)."""
    return dataclasses.asdict(cfg)


def field_docs(cls: type = Config) -> dict[str, str]:
    """Dotted field name -> its one-line doc, read from the docstrings beside the fields."""
    return class_field_docs(cls)
